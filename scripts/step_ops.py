"""Aten ops per training step, and the kernels among them (launches on a GPU: views, allocations
and profiler records left out, ``edgetl.memory.meter.StepOps``), one sample at a time against the
fitted schedule, beside stock Rep-Net's step. Counted on the meta device: seconds, no data.

    python scripts/step_ops.py --batch-size 32 --resolution 224 [--json benchmarks/step_ops_224.json]

The table is printed; ``--json`` also saves the rows (docs/lean-runtime.md renders its table
from the committed file, scripts/render_docs.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from edgetl.bench import METHODS, build_method, pruned_hidden
from edgetl.io import atomic_text_json
from edgetl.memory.meter import count_step_ops
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import Schedule, apply_schedule, prepare_step
from edgetl.units import MB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=102)
    p.add_argument("--methods", default="repnet-stock,repnet-lean,repnet-pruned,repnet-pruned-pool2-bf16-int8")
    p.add_argument("--json", type=Path, help="also save the rows as JSON")
    a = p.parse_args()
    saved = []
    print("| method | schedule | forward ops | backward ops | optimizer ops | ops/step | kernels/step | "
          "predicted peak MB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in a.methods.split(","):
        method = METHODS[name]
        net = build_method(method, width=1.0, num_classes=a.num_classes, device="meta",
                           hidden=pruned_hidden(1.0, a.num_classes) if method.pruned else None)
        fitted = prepare_step(net, resolution=a.resolution, batch_size=a.batch_size)
        schedules = ((("one sample at a time", Schedule(a.batch_size, a.resolution)), ("fitted", fitted))
                     if method.lean is not None else (("no schedule", fitted),))
        rows = []
        for label, schedule in schedules:
            apply_schedule(net, schedule)
            ops = count_step_ops(net, resolution=a.resolution, batch_size=a.batch_size)
            peak = runtime_report(net, mode=method.mode, resolution=a.resolution,
                                  batch_size=a.batch_size).total_bytes
            rows.append(f"| {method.label} | {label} | {ops.forward:,} | {ops.backward:,} | "
                        f"{ops.optimizer:,} | {ops.total:,} | {ops.kernel_total:,} | {peak / MB:.2f} |")
            saved.append({"method": name, "label": method.label, "schedule": label, "forward": ops.forward,
                          "backward": ops.backward, "optimizer": ops.optimizer, "total": ops.total,
                          "kernels": list(ops.kernels), "kernel_total": ops.kernel_total,
                          "predicted_bytes": peak})
        print("\n".join(rows), flush=True)
    if a.json is not None:
        atomic_text_json(a.json, {"resolution": a.resolution, "batch_size": a.batch_size,
                                  "num_classes": a.num_classes, "torch": torch.__version__, "rows": saved})
        print(f"saved {a.json}")


if __name__ == "__main__":
    main()
