"""How a training step's speed survives a busy machine (issue #43 item 4): step times of an
unstreamed and a streamed lean Rep-Net step under each OpenMP wait policy, alone and while
other processes keep every core busy; JSON out.

Each measurement runs in its own process, because OpenMP reads ``OMP_WAIT_POLICY`` once, when
torch loads. The competitors are plain Python busy loops, one per core (the issue's probe: a
second process keeping both cores busy). torch keeps its default thread count (one per core).

    python scripts/busy_cores.py --json benchmarks/busy_cores.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name -> the OpenMP environment of the timed process ({}: none set, torch's default)
POLICIES = {
    "default": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}
OPENMP = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
METHODS = ("repnet-lean", "repnet-lean-stream")


def _child(args) -> None:
    """Time ``args.steps`` steps of each method, interleaved, after ``args.warmup`` rounds."""
    import torch

    from edgetl.bench import cpu_trainers, interleaved_step_times

    trainers = cpu_trainers(METHODS, resolution=args.resolution, batch_size=args.batch_size,
                            num_classes=args.num_classes, width=args.width)
    times = interleaved_step_times(trainers, steps=args.steps, warmup=args.warmup)
    print(json.dumps({"threads": torch.get_num_threads(), "seconds": times}))


def _measure(args, name: str, busy: bool) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k not in OPENMP}, **POLICIES[name]}
    competitors = []
    if busy:
        competitors = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count())]
        time.sleep(0.5)
    try:
        argv = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--resolution", str(args.resolution), "--batch-size", str(args.batch_size),
                "--width", str(args.width), "--num-classes", str(args.num_classes)]
        start = time.perf_counter()
        out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - start
    finally:
        for p in competitors:
            p.kill()
            p.wait()
    result = json.loads(out.strip().splitlines()[-1])
    return {"policy": name, "busy_processes": len(competitors), "threads": result["threads"],
            "wall_s": round(wall, 2),
            "median_step_s": {m: round(statistics.median(s), 4) for m, s in result["seconds"].items()},
            "step_s": {m: [round(x, 4) for x in s] for m, s in result["seconds"].items()}}


def _cpu() -> str:
    from edgetl.bench import cpu_name

    return cpu_name()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--width", type=float, default=0.35)
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--rounds", type=int, default=1, help="measure every policy this many times")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return 0
    # rounds: the spinning policies' slowdown on a busy machine comes and goes from run to run
    rows = [{"round": r + 1, **_measure(args, name, busy)}
            for r in range(args.rounds) for busy in (False, True) for name in args.policies]
    for row in rows:
        steps = "  ".join(f"{m} {s * 1000:8.1f} ms" for m, s in row["median_step_s"].items())
        print(f"round {row['round']}  {row['policy']:>24}  busy processes {row['busy_processes']}  {steps}  ({row['wall_s']} s)")
    result = {"command": "python scripts/busy_cores.py " + " ".join(sys.argv[1:]), "cpu": _cpu(),
              "cores": os.cpu_count(), "resolution": args.resolution, "batch_size": args.batch_size,
              "width": args.width, "steps": args.steps, "warmup": args.warmup, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
