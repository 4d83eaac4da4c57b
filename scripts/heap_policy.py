"""What the program's heap policy (``edgetl.heap``: glibc keeps freed memory for the next step) does
to CPU training steps: each method's step timed with glibc's default and with the policy, run
step after step alone (as ``edgetl finetune`` runs it) and round-robin with the other methods (as
the bench times them), each setting in a process of its own. Beside each time, the kernel's count
of the page faults a step took (``getrusage``: a second instrument, not a clock) and the process's
peak resident memory (the policy must not raise it).

    python scripts/heap_policy.py --json benchmarks/heap_policy.json

One thread and OpenMP's passive waiting, as the program sets them on a 2-core machine; run it
with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

METHODS = "repnet-stock,repnet-lean,repnet-pruned-pool2-bf16-int8,repnet-pruned-pool2-bf16-int8-stream"
SHAPES = ((224, 8, 1.0), (64, 32, 0.35))  # the bench's shape; the demo's (MobileNetV2 0.35 at 64 px)
POLICIES = ("default", "held")
SCHEDULES = ("alone", "interleaved")


def child(setting: dict) -> dict:
    """One process's measurement: ``setting``'s methods timed under its policy and schedule."""
    import resource

    import torch

    from edgetl.bench import cpu_trainers
    from edgetl.heap import heap_policy, hold_freed_memory

    if setting["policy"] == "held":
        hold_freed_memory()
    torch.set_num_threads(1)
    trainers = cpu_trainers(setting["methods"], resolution=setting["resolution"],
                            batch_size=setting["batch_size"], num_classes=10, width=setting["width"])
    times: dict[str, list[float]] = {name: [] for name in trainers}
    faults: dict[str, list[int]] = {name: [] for name in trainers}
    for _ in range(setting["warmup"] + setting["steps"]):
        for name, trainer in trainers.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times[name].append(trainer.step())
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    warm = setting["warmup"]
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"heap": heap_policy(),
            "rows": {name: {"step_s": statistics.median(times[name][warm:]), "steps_s": times[name][warm:],
                            "faults_per_step": statistics.median(faults[name][warm:]), "maxrss_bytes": maxrss}
                     for name in trainers}}


def measure(setting: dict) -> dict:
    """``setting`` measured: alone, each method in a process of its own (what a finetune run is: a
    process's earlier steps of another network would shape glibc's thresholds); interleaved, all in
    one, round-robin."""
    from edgetl.heap import USER_TUNING

    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    for name in USER_TUNING:  # glibc's default in the default runs, not a tuning of the caller's
        env.pop(name, None)
    groups = [[m] for m in setting["methods"]] if setting["schedule"] == "alone" else [setting["methods"]]
    runs = []
    for methods in groups:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(dict(setting, methods=methods))],
                             env=env, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return {"heap": runs[0]["heap"], "rows": {k: v for run in runs for k, v in run["rows"].items()}}


def render(data: dict) -> str:
    """The markdown table of a result (docs/bench.md renders it from the committed file)."""
    lines = ["| shape | method | schedule | step ms, default | step ms, held | speed-up | page faults a step, "
             "default | held | peak resident MB, default | held |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in data["shapes"]:
        for schedule in SCHEDULES:
            runs = {p: shape["runs"][f"{p}/{schedule}"] for p in POLICIES}
            for name in runs["default"]["rows"]:
                d, h = runs["default"]["rows"][name], runs["held"]["rows"][name]
                lines.append(f"| {shape['label']} | {name} | {schedule} | {d['step_s'] * 1e3:.0f} | "
                             f"{h['step_s'] * 1e3:.0f} | {d['step_s'] / h['step_s']:.2f}x | "
                             f"{d['faults_per_step']:,.0f} | {h['faults_per_step']:,.0f} | "
                             f"{d['maxrss_bytes'] / 1e6:.0f} | {h['maxrss_bytes'] / 1e6:.0f} |")
    held = data["shapes"][0]["runs"]["held/alone"]["heap"]
    lines.append(f"\n{data['cpu']}; 1 thread, OMP_WAIT_POLICY=PASSIVE, torch {data['torch']}; held: {held}; the "
                 f"median of {data['steps']} steps after {data['warmup']}; alone: each method in a process of its own; "
                 "peak resident memory: the process's (interleaved: all its methods'), building included.")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    import torch

    from edgetl.bench import cpu_name
    from edgetl.io import atomic_text_json

    shapes = []
    for resolution, batch_size, width in SHAPES:
        runs = {}
        for schedule in SCHEDULES:
            for policy in POLICIES:
                setting = {"policy": policy, "schedule": schedule, "methods": a.methods.split(","),
                           "resolution": resolution, "batch_size": batch_size, "width": width,
                           "steps": a.steps, "warmup": a.warmup}
                runs[f"{policy}/{schedule}"] = measure(setting)
                print(f"{resolution} px, batch {batch_size}: {policy}, {schedule} done", file=sys.stderr, flush=True)
        shapes.append({"label": f"MobileNetV2 {width:g}, {resolution} px, batch {batch_size}", "resolution": resolution,
                       "batch_size": batch_size, "width": width, "runs": runs})
    data = {"cpu": cpu_name(), "machine": platform.machine(), "torch": torch.__version__, "steps": a.steps,
            "warmup": a.warmup, "command": "python scripts/heap_policy.py " + " ".join(sys.argv[1:]),
            "shapes": shapes}
    print(render(data))
    if a.json is not None:
        atomic_text_json(a.json, data)


if __name__ == "__main__":
    main()
