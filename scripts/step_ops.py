"""Aten ops per training step, and the kernels among them (launches on a GPU: views, allocations
and profiler records left out, ``edgetl.memory.meter.StepOps``), one sample at a time against the
fitted schedule, beside stock Rep-Net's step. Counted on the meta device: seconds, no data.

    python scripts/step_ops.py --batch-size 32 --resolution 224 [--json benchmarks/step_ops_224.json]

The table is printed; ``--json`` also saves the rows (docs/lean-runtime.md renders its table
from the committed file, scripts/render_docs.py). ``--sources N`` also prints, for each fitted
step, the N lines of edgetl's code that dispatch the most of its ops (what to fold next):

    python scripts/step_ops.py --batch-size 8 --methods repnet-lean-cl-fused --sources 15
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetl.bench import METHODS, build_method, pruned_hidden
from edgetl.io import atomic_text_json
from edgetl.memory.meter import count_step_ops, meta_step
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import Schedule, apply_schedule, prepare_step
from edgetl.metaop import meta_call
from edgetl.units import MB

EDGETL = Path(__file__).resolve().parents[1] / "edgetl"


class _Sources(TorchDispatchMode):
    """Each dispatched op by the two innermost lines of edgetl's code on the Python stack, the
    innermost first (a helper, then its caller). The autograd engine's own ops (a gradient
    accumulated or summed) are the backward call's line; "autograd" where the engine runs them
    off the Python stack (its device threads on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(str(EDGETL))]
        where = " < ".join(f"{Path(f.filename).relative_to(EDGETL.parent)}:{f.lineno}"
                           for f in reversed(frames[-2:])) or "autograd"
        self.lines[(where, func.overloadpacket.__name__)] += 1
        return meta_call(func, args, kwargs or {})


def op_sources(net: torch.nn.Module, *, resolution: int, batch_size: int) -> collections.Counter:
    """The ops of the plain step ``count_step_ops`` counts (``meta_step``), by (source line, op
    name)."""
    _, _, run = meta_step(net, resolution=resolution, batch_size=batch_size)
    mode = _Sources()
    with mode:
        run()
    return mode.lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=102)
    p.add_argument("--methods", default="repnet-stock,repnet-lean,repnet-pruned,repnet-pruned-pool2-bf16-int8")
    p.add_argument("--json", type=Path, help="also save the rows as JSON")
    p.add_argument("--sources", type=int, default=0, metavar="N",
                   help="also print the N source lines that dispatch the most ops of each fitted step")
    a = p.parse_args()
    if a.sources < 0:
        print(f"step_ops.py: --sources: {a.sources} is negative; allowed: 0 (none) or more lines", file=sys.stderr)
        raise SystemExit(2)
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
        if a.sources:
            lines = op_sources(net, resolution=a.resolution, batch_size=a.batch_size)
            print(f"\n{method.label}, {schedules[-1][0]}: the {a.sources} lines dispatching the most of its "
                  f"{sum(lines.values()):,} ops")
            for (where, op), count in lines.most_common(a.sources):
                print(f"  {count:6,}  {op:<28} {where}")
            print()
    if a.json is not None:
        atomic_text_json(a.json, {"resolution": a.resolution, "batch_size": a.batch_size,
                                  "num_classes": a.num_classes, "torch": torch.__version__, "rows": saved})
        print(f"saved {a.json}")


if __name__ == "__main__":
    main()
