"""Streamed frozen segments at 224 px (issue #14): predicted and measured peak of one training
step for each configuration of the issue, unstreamed (micro-batch = batch), by 2 and by 1.

    python scripts/stream_figures.py              # markdown table on stdout (a few minutes, CPU)

Measured: ``edgetl.memory.meter.measure_training_peak`` (live tensor bytes over 2 real steps);
predicted: ``edgetl.memory.runtime.runtime_report`` of the same network, its schedule fitted.
"""

from __future__ import annotations

import argparse
import time

from edgetl.bench import PAPER_PRUNING, pruned_hidden
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.units import MB

HALF = dict(precision="bf16", frozen_weights="int8")
CONFIGS = [  # label, mode, lean options, pruned
    ("paper configuration (pruned, k=2), fp32", "repnet", dict(pool=2), True),
    ("paper configuration (pruned, k=2), bf16 + int8", "repnet", dict(pool=2, **HALF), True),
    ("unpruned Rep-Net, fp32", "repnet", dict(pool=1), False),
    ("unpruned Rep-Net, bf16 + int8", "repnet", dict(pool=1, **HALF), False),
    ("bias-only TinyTL-B, bf16 + int8", "bias", dict(pool=1, **HALF), False),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=102)
    p.add_argument("--micro-batches", default="8,2,1", help="micro-batches to run (the batch: unstreamed)")
    a = p.parse_args()
    hidden = pruned_hidden(1.0, a.num_classes)
    print(f"pruned: blocks {sorted(PAPER_PRUNING)} keep {hidden} hidden channels")
    print("| configuration | micro-batch | predicted MB | measured MB | measured - predicted (B) | s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, mode, lean, pruned in CONFIGS:
        for m in (int(x) for x in a.micro_batches.split(",")):
            start = time.perf_counter()
            spec = BackboneSpec(width=1.0, num_classes=a.num_classes, hidden=hidden if pruned else {})
            stream = m if m < a.batch_size else 0
            net = build_network(spec, mode, lean=LeanOptions(**lean, stream=stream))
            prepare_step(net, resolution=a.resolution, batch_size=a.batch_size)
            predicted = runtime_report(net, mode=mode, resolution=a.resolution, batch_size=a.batch_size).total_bytes
            measured = measure_training_peak(net, resolution=a.resolution, batch_size=a.batch_size, steps=2)
            shown = "unstreamed" if not stream else str(m)
            print(f"| {label} | {shown} | {predicted / MB:.2f} | {measured / MB:.2f} | {measured - predicted} "
                  f"| {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
