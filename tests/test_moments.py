"""The runtime simulation moment by moment, not only at its peak.

For every leaf module of a training step the simulation records the total bytes while the
leaf's forward runs (``_Result.forward_moments``). Here the meter's peak during each of
those calls, in the second real step, must be the same number. A peak test only sees the
one moment that happens to be highest; this one also sees the moments a later change may
lift to the top (it found the side network's cast input held through its tail, and
``side_in`` released one segment too late in the simulation).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from edgetl.memory.meter import StorageMeter, measure_training_peak
from edgetl.memory.runtime import simulate
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step

TINY = BackboneSpec(width=0.35, num_classes=10)
PAPER = BackboneSpec(num_classes=102, hidden={1: 22, 2: 21, 3: 77, 4: 77})  # 0.3/0.78/0.46/0.46
HALF = dict(precision="bf16", frozen_weights="int8")

CASES = {  # id: spec, mode, lean options, step options, resolution, batch
    "tiny-unstreamed-fp32": (TINY, "repnet", dict(pool=1), {}, 64, 4),
    # unstreamed, every large 1x1 weight whole but the 320 -> 1280 conv's (chunked: its own rule)
    "bias-64-unstreamed-half": (BackboneSpec(num_classes=102), "bias", dict(pool=1, **HALF), {}, 64, 2),
    "tiny-by2-uint8-half": (TINY, "repnet", dict(pool=2, stream=2, uint8_input=True, **HALF), {}, 64, 5),
    "tiny-bias-by1-recompute": (TINY, "bias", dict(pool=1, stream=1, uint8_input=True, recompute=True, **HALF),
                                {}, 64, 3),
    "paper-224-all-levers": (PAPER, "repnet", dict(pool=2, stream=1, uint8_input=True, recompute=True, **HALF),
                             dict(step_in_backward=True, fused=True), 224, 8),
}


def measured_forward_moments(net, modules, step: Step, resolution: int, batch_size: int) -> dict:
    """Module -> the meter's peak during each of its forward calls over two real steps."""
    seen: dict = {m: [] for m in modules}
    outer: list[int] = []

    def pre(module, args):
        meter = _get_current_dispatch_mode()
        assert isinstance(meter, StorageMeter)
        outer.append(meter.peak_bytes)
        meter.peak_bytes = meter.current_bytes

    def post(module, args, output):
        meter = _get_current_dispatch_mode()
        seen[module].append(meter.peak_bytes)
        meter.peak_bytes = max(outer.pop(), meter.peak_bytes)

    handles = [h for m in modules for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        measure_training_peak(net, resolution=resolution, batch_size=batch_size, steps=2, step=step)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_forward_moment_matches_the_meter(case):
    spec, mode, lean, step_options, resolution, batch = CASES[case]
    torch.manual_seed(0)
    net = build_network(spec, mode, lean=LeanOptions(**lean))
    step = Step.plain(**step_options)
    prepare_step(net, resolution=resolution, batch_size=batch, step=step)
    result = simulate(net, resolution=resolution, batch_size=batch, step=step)
    predicted = {result.layer_args[i][0]: total for i, (total, _) in result.forward_moments.items()}
    measured = measured_forward_moments(net, list(predicted), step, resolution, batch)
    assert len(predicted) >= 3
    wrong = {}
    for module, total in predicted.items():
        calls = measured[module]
        assert len(calls) == 2, (type(module).__name__, len(calls))  # once a step
        if calls[1] != total:
            wrong[type(module).__name__ + f"@{list(predicted).index(module)}"] = (total, calls[1])
    assert not wrong, wrong
