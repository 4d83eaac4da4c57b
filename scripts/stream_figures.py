"""Streamed frozen segments at 224 px (issue #14): predicted and measured peak of one training
step for each configuration of the issue, unstreamed (micro-batch = batch), streamed by 2 and
by 1, then with each further lever that costs no accuracy added in turn: the batch kept as
uint8 pixels (``--uint8-input``), segments that recompute their forward in backward
(``--recompute``), and the update inside backward with fused optimizer kernels
(``--step-in-backward --fused``).

    python scripts/stream_figures.py              # markdown table on stdout (CPU, ~5 minutes)

Measured: ``edgetl.memory.meter.measure_training_peak`` (live tensor bytes over 2 real steps);
predicted: ``edgetl.memory.runtime.runtime_report`` of the same network, its schedule fitted.
"""

from __future__ import annotations

import argparse
import time

from edgetl.bench import pruned_hidden
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step
from edgetl.units import MB

HALF = dict(precision="bf16", frozen_weights="int8")
CONFIGS = [  # label, mode, lean options, pruned, target MB
    ("paper configuration (pruned, k=2), fp32", "repnet", dict(pool=2), True, 25),
    ("paper configuration (pruned, k=2), bf16 + int8", "repnet", dict(pool=2, **HALF), True, 15),
    ("unpruned Rep-Net, fp32", "repnet", dict(pool=1), False, None),
    ("unpruned Rep-Net, bf16 + int8", "repnet", dict(pool=1, **HALF), False, 20.1),
    ("bias-only TinyTL-B, bf16 + int8", "bias", dict(pool=1, **HALF), False, 12),
]
# variant label, micro-batch (0: the batch), lean options added, step options
VARIANTS = [
    ("unstreamed", 0, {}, {}),
    ("streamed by 2", 2, {}, {}),
    ("streamed by 1", 1, {}, {}),
    ("by 1 + uint8 batch", 1, dict(uint8_input=True), {}),
    ("+ recompute", 1, dict(uint8_input=True, recompute=True), {}),
    ("+ update in backward, fused", 1, dict(uint8_input=True, recompute=True),
     dict(step_in_backward=True, fused=True)),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=102)
    p.add_argument("--no-measure", dest="measure", action="store_false", help="predict only (seconds)")
    a = p.parse_args()
    hidden = pruned_hidden(1.0, a.num_classes)
    print(f"pruned: blocks {sorted(hidden)} keep {hidden} hidden channels")
    print("| configuration | target MB | step | predicted MB | measured MB | measured - predicted (B) | s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for label, mode, lean, pruned, target in CONFIGS:
        for name, m, extra, step_options in VARIANTS:
            start = time.perf_counter()
            spec = BackboneSpec(width=1.0, num_classes=a.num_classes, hidden=hidden if pruned else {})
            net = build_network(spec, mode, lean=LeanOptions(**lean, **extra, stream=m),
                                device=None if a.measure else "meta")
            step = Step.plain(**step_options)
            prepare_step(net, resolution=a.resolution, batch_size=a.batch_size, step=step)
            predicted = runtime_report(net, mode=mode, resolution=a.resolution, batch_size=a.batch_size,
                                       step=step).total_bytes
            measured = (measure_training_peak(net, resolution=a.resolution, batch_size=a.batch_size, steps=2,
                                              step=step) if a.measure else None)
            shown = "—" if measured is None else f"{measured / MB:.2f}"
            diff = "—" if measured is None else str(measured - predicted)
            print(f"| {label} | {target or '—'} | {name} | {predicted / MB:.2f} | {shown} | {diff} "
                  f"| {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
