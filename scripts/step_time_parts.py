"""Where a CPU training step's time goes, and how fast a row could get: each method's step timed
(interleaved, as the bench times it), then profiled (torch.profiler, self time by aten op) to
split the step into its convolution kernels (convolutions, and the matrix products a chunked
1x1 conv or the classifier runs) and everything else (BN, activations, masks, casts, the
optimizer, Python). The convolution kernels are the same in a stock and a lean step, so
``reference step / row's convolution time`` bounds the row's speed-up over the reference however
little the rest costs; a streamed row is bounded by its twin's step over its own convolution time.
Stock rows are also run channels-last (``--channels-last``, stock Rep-Net by default: the network
and its batch converted, as an expert would run stock PyTorch on a CPU): faster convolution
kernels, the same for a lean runtime that ran them, so that row's bound is the lean step's too.

    python scripts/step_time_parts.py --json benchmarks/step_time_parts_224.json

One thread, OpenMP's passive waiting and freed memory held for the next step (``edgetl.heap``),
as the program sets them on a 2-core machine; run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (the program's policy)

import torch  # noqa: E402

from edgetl.bench import METHODS, REFERENCE, cpu_name, cpu_trainers, interleaved_step_times  # noqa: E402
from edgetl.heap import hold_freed_memory  # noqa: E402
from edgetl.io import atomic_text_json  # noqa: E402

DEFAULT_METHODS = ("repnet-stock,repnet-lean,repnet-pruned-pool2,repnet-pruned-pool2-bf16-int8,"
                   "repnet-pruned-pool2-bf16-int8-stream,bias-lean,bias-lean-stream,repnet-lean-cl,"
                   "repnet-pruned-pool2-cl")
CONV_OPS = ("conv", "mm")  # aten op names holding these: convolutions, and matrix products


def is_conv_kernel(name: str) -> bool:
    """Whether an aten op (``aten::...``) runs a convolution or a matrix product."""
    op = name.removeprefix("aten::")
    return name.startswith("aten::") and any(key in op for key in CONV_OPS)


def split_self_time(events) -> tuple[float, float]:
    """(convolution kernels, everything) self CPU time in seconds of a profiler's averaged events."""
    conv = sum(e.self_cpu_time_total for e in events if is_conv_kernel(e.key))
    total = sum(e.self_cpu_time_total for e in events)
    return conv / 1e6, total / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-classes", type=int, default=102)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each method (interleaved)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profiled", type=int, default=3, help="profiled steps of each method")
    p.add_argument("--channels-last", default=REFERENCE,
                   help="stock methods (no lean runtime) also run channels-last, comma-separated; '' for none")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    methods = a.methods.split(",")
    channels_last = [m for m in a.channels_last.split(",") if m]
    for name in channels_last:
        if name not in METHODS or METHODS[name].lean is not None:
            print(f"step_time_parts.py: --channels-last: {name!r} is not a stock method; allowed: "
                  f"{', '.join(n for n, m in METHODS.items() if m.lean is None)}", file=sys.stderr)
            raise SystemExit(2)
    torch.set_num_threads(1)
    heap = hold_freed_memory()  # the program's heap policy too (edgetl.heap)
    trainers = cpu_trainers(methods, resolution=a.resolution, batch_size=a.batch_size,
                            num_classes=a.num_classes)  # pruned rows with the paper's pruning, as the bench's
    if channels_last:
        twins = cpu_trainers(channels_last, resolution=a.resolution, batch_size=a.batch_size,
                             num_classes=a.num_classes)
        trainers.update({channels_last_name(name): to_channels_last(t) for name, t in twins.items()})
    times = interleaved_step_times(trainers, steps=a.steps, warmup=a.warmup)
    rows = {}
    for name, trainer in trainers.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(a.profiled):
                trainer.step()
        conv, total = split_self_time(prof.key_averages())
        step = statistics.median(times[name])
        share = conv / total
        rows[name] = {"label": label(name), "step_s": step, "steps_s": times[name],
                      "profiled_self_s": total / a.profiled, "conv_share": share, "conv_s": step * share}
    reference = rows[REFERENCE]["step_s"] if REFERENCE in rows else None
    for name, r in rows.items():
        twin = METHODS[name].unstreamed if name in METHODS else None
        r["vs_reference"] = None if reference is None else reference / r["step_s"]
        r["vs_reference_bound"] = None if reference is None else reference / r["conv_s"]
        r["vs_twin"] = rows[twin]["step_s"] / r["step_s"] if twin in rows else None
        r["vs_twin_bound"] = rows[twin]["step_s"] / r["conv_s"] if twin in rows else None
    data = {"cpu": cpu_name(), "machine": platform.machine(), "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "heap": heap, "torch": torch.__version__,
            "resolution": a.resolution, "batch_size": a.batch_size, "num_classes": a.num_classes,
            "steps": a.steps, "warmup": a.warmup, "profiled": a.profiled, "rows": rows}
    print(render(data))
    if a.json is not None:
        atomic_text_json(a.json, data)


CHANNELS_LAST = "@channels-last"


def channels_last_name(name: str) -> str:
    return name + CHANNELS_LAST


def label(name: str) -> str:
    """A row's label: the method's, or the method's run channels-last."""
    if name.endswith(CHANNELS_LAST):
        return METHODS[name.removesuffix(CHANNELS_LAST)].label + ", channels-last"
    return METHODS[name].label


def to_channels_last(trainer):
    """A trainer of a stock network whose parameters, buffers and batch are channels-last
    (the optimizer's parameters stay the same objects; its state is made at the first step)."""
    trainer.net.to_channels_last()
    trainer.image = trainer.image.contiguous(memory_format=torch.channels_last)
    return trainer


def render(data: dict) -> str:
    """The markdown table of a result (docs/bench.md renders it from the committed file)."""
    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    lines = [f"| method ({data['resolution']} px, batch {data['batch_size']}) | step ms | convolution kernels ms "
             f"(share) | rest ms | speed vs {REFERENCE} | at most (the rest at 0) | speed vs unstreamed twin | "
             "at most |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"].values():
        lines.append(f"| {r['label']} | {r['step_s'] * 1e3:.0f} | {r['conv_s'] * 1e3:.0f} ({r['conv_share']:.0%}) | "
                     f"{(r['step_s'] - r['conv_s']) * 1e3:.0f} | {x(r['vs_reference'])} | "
                     f"{x(r['vs_reference_bound'])} | {x(r['vs_twin'])} | {x(r['vs_twin_bound'])} |")
    heap = f"heap: {data['heap']}, " if data.get("heap") else ""
    lines.append(f"\n{data['cpu']}; {data['threads']} thread(s), OMP_WAIT_POLICY={data['omp_wait_policy']}, {heap}"
                 f"torch {data['torch']}; the median of {data['steps']} interleaved steps after {data['warmup']}, "
                 f"{data['profiled']} profiled.")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
