"""edgetl plan's storage ladders (Rep-Net, bias-only, lean full) and the plans of the bias and
full modes, on the tiny backbone of tests/test_plan.py (a file of their own, so the test
processes of ``make test`` share the plan tests)."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

import pytest

from edgetl.memory.runtime import runtime_report
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.plan import (
    HALF_DTYPES,
    PlanImpossible,
    Storage,
    _Evaluator,
    _stored_pools_of,
    half_precision,
    load_plan,
    storage_ladder,
    verify_plan,
)
from tests.test_plan import LEVERS, MB, RES, TINY, step_of, tiny_plan


def _steps(ladder) -> list[tuple[str, object]]:
    """The lever each ladder step pulls: (dimension, new value)."""
    out = []
    for a, b in zip(ladder, ladder[1:]):
        changed = [(f.name, getattr(b, f.name)) for f in dataclasses.fields(Storage)
                   if getattr(a, f.name) != getattr(b, f.name)]
        assert len(changed) == 1, (a, b)  # one dimension at a time
        out.append(changed[0])
    return out


def test_ladder_goes_one_dimension_at_a_time():
    ladder = storage_ladder(half="bf16")
    assert ladder[0] == Storage(1, "fp32", "fp32")
    assert ladder[-1] == Storage(4, "bf16", "int8", 1, recompute=True, fused=True, step_in_backward=True)
    # streaming first, then recomputing streamed segments: they cost no accuracy (issue #14);
    # then the optimizer's levers (issue #30), fused kernels before the update inside backward
    assert _steps(ladder) == [("stream", 1), ("recompute", True), ("fused", True), ("step_in_backward", True),
                              ("frozen_weights", "fp16"), ("frozen_weights", "int8"), ("precision", "bf16"),
                              ("pool", 2), ("pool", 4)]
    assert {s.stream for s in storage_ladder(stream=0)} == {0}
    assert {s.stream for s in storage_ladder(stream=2)} == {2}
    assert storage_ladder()[-1].precision == half_precision() in HALF_DTYPES
    fixed = storage_ladder(precision="fp32", pool=2)
    assert {s.precision for s in fixed} == {"fp32"} and {s.pool for s in fixed} == {2}
    assert _steps(fixed) == [("stream", 1), ("recompute", True), ("fused", True), ("step_in_backward", True),
                             ("frozen_weights", "fp16"), ("frozen_weights", "int8")]


def test_half_is_fp16_where_the_cpu_runs_it():
    import torch

    from edgetl.errors import CapabilityError
    from edgetl.models.lean import check_act_dtype

    try:
        check_act_dtype(torch.float16, "cpu")
        expected = "fp16"
    except CapabilityError:
        expected = "bf16"
    assert half_precision() == expected
    assert tiny_plan(20 * MB, precision="half").chosen.precision == expected


def test_ladder_order_is_the_measured_cost_per_byte():
    """The ladder pulls the storage levers in the order of points lost per MB saved that
    benchmarks/levers_accuracy.json measured; a lever that saves nothing at 224 px, batch 8
    (pooling there) has no measured cost per byte and goes last, smaller k first."""
    data = json.loads(LEVERS.read_text())
    base = "fp32/fp32/pool1"
    mean = {c: statistics.mean(r["best_acc1"] for r in runs.values()) for c, runs in data["results"].items()}

    def cost(config):
        saved = (data["peaks"][base]["paper"] - data["peaks"][config]["paper"]) / MB
        return (mean[base] - mean[config]) / saved if saved > 0 else None

    # the study's one-lever rows (activations / frozen weights / pool), grouped by lever;
    # a lever measured with both half dtypes costs the worse of the two
    rows = {("frozen_weights", "fp16"): ["fp32/fp16/pool1"], ("frozen_weights", "int8"): ["fp32/int8/pool1"],
            ("precision", "half"): ["bf16/fp32/pool1", "fp16/fp32/pool1"],
            ("pool", 2): ["fp32/fp32/pool2"], ("pool", 4): ["fp32/fp32/pool4"]}
    lever_cost = {}
    for lever, configs in rows.items():
        costs = [c for c in map(cost, configs) if c is not None]
        lever_cost[lever] = max(costs) if costs else None
    assert lever_cost[("pool", 2)] is None and lever_cost[("pool", 4)] is None
    measured = sorted(rows, key=lambda lv: (lever_cost[lv] is None, lever_cost[lv] or 0.0,
                                             lv[1] if lv[0] == "pool" else 0))
    spec = BackboneSpec(width=1.0, num_classes=102)
    ladder = storage_ladder(stored_pools=_stored_pools_of(spec, 224))
    steps = [("precision", "half") if step[0] == "precision" else step for step in _steps(ladder)]
    # no accuracy cost at all: the gradients are the same; then the optimizer's levers (the
    # update the same up to float rounding, then the same weights)
    assert steps[:4] == [("stream", 1), ("recompute", True), ("fused", True), ("step_in_backward", True)]
    assert steps[4:] == measured


def test_ladder_totals_fall_at_224px_batch_8():
    """plan bisects the ladder: for the stock configuration (MobileNetV2 1.0, 102 classes,
    224 px, batch 8) every dtype step lowers the predicted total; pooling does not move
    this unpruned network's peak (a forward temporary), so a pool step may only keep it, and
    recomputing is applied only where it lowers the peak, so it may only keep it too; nor
    do the optimizer's levers lower a peak that is not in the update or in backward."""
    spec = BackboneSpec(width=1.0, num_classes=102)
    ev = _Evaluator(spec, 224)
    ladder = storage_ladder(stored_pools=_stored_pools_of(spec, 224))
    totals = [ev.total({}, s, 8) for s in ladder]
    for (lever, _), before, after in zip(_steps(ladder), totals, totals[1:]):
        if lever in ("pool", "recompute", "fused", "step_in_backward"):
            assert after <= before
        else:
            assert after < before, (lever, before, after)


def test_ladder_skips_a_pool_factor_that_stores_like_the_smaller_one():
    # at 64 px the side conv inputs are 8, 8, 4, 2, 2, 1 pixels: k=4 stores like k=2
    tiny_64 = {1: [1] * 6, 2: [2, 2, 1, 1, 1, 1], 4: [2, 2, 1, 1, 1, 1]}
    assert [s.pool for s in storage_ladder(stored_pools=tiny_64.__getitem__)][-1] == 2
    at_224 = {1: [1] * 6, 2: [2, 2, 2, 1, 1, 1], 4: [4, 4, 2, 1, 1, 1]}
    assert [s.pool for s in storage_ladder(stored_pools=at_224.__getitem__)][-2:] == [2, 4]


def mode_total(mode: str, storage: Storage, batch: int = 8) -> int:
    """Independent runtime accounting of a planned bias or full configuration on TINY."""
    from edgetl.memory.schedule import prepare_step

    lean = LeanOptions(pool=storage.pool, bn="fold", frozen_weights=storage.frozen_weights,
                       precision=storage.precision, stream=storage.stream, storage=storage.conv_storage,
                       uint8_input=storage.uint8_input, recompute=storage.recompute)
    net = build_network(dataclasses.replace(TINY, num_classes=102), mode, device="meta", lean=lean)
    step = step_of(storage)
    prepare_step(net, resolution=RES, batch_size=batch, step=step)
    return runtime_report(net, mode=mode, resolution=RES, batch_size=batch, step=step).total_bytes


def test_full_plans_the_least_coarse_storage_that_fits_and_is_monotone():
    """Lean full fine-tuning's ladder is exact -> fused kernels -> update inside backward ->
    pool2 -> pool4; a larger budget never stores coarser."""
    ladder = storage_ladder(mode="full")
    assert _steps(ladder) == [("fused", True), ("step_in_backward", True), ("conv_storage", "pool2"),
                              ("conv_storage", "pool4")]
    totals = [mode_total("full", s) for s in ladder]
    # at 64 px the peak is in backward, not in the update: fused kernels alone save nothing
    assert totals[0] == totals[1] > totals[2] > totals[3] > totals[4]
    chosen = []
    for budget in (totals[4], totals[3], totals[0] - 1, totals[0]):
        result = tiny_plan(budget, mode="full")
        c = result.chosen
        assert (c.mode, c.kept, c.precision, c.frozen_weights, c.stream) == ("full", {}, "fp32", "fp32", 0)
        assert result.predicted_bytes == mode_total("full", c.storage) <= budget
        chosen.append(ladder.index(c.storage))
    assert chosen == [4, 3, 2, 0]  # one short of the exact total: the first rung that saves
    with pytest.raises(PlanImpossible, match=re.escape("mode full | storage pool4 | batch 8 | fused | update")):
        tiny_plan(totals[4] - 1, mode="full")


def test_bias_plans_stream_and_storage_but_never_pool_or_prune():
    ladder = storage_ladder(mode="bias", half="bf16")
    assert {s.pool for s in ladder} == {1} and ladder[1].stream == 1
    exact = mode_total("bias", ladder[0])
    result = tiny_plan(exact - 1, mode="bias")
    c = result.chosen
    assert c.mode == "bias" and c.kept == {} and c.pool == 1 and c.stream >= 1  # streaming comes first
    assert result.predicted_bytes == mode_total("bias", c.storage) <= exact - 1
    assert tiny_plan(exact, mode="bias").chosen.storage == ladder[0]


# full: the update inside backward with fused kernels; bias: streamed by 1
@pytest.mark.parametrize("mode, rung", [("full", 2), ("bias", 1)])
def test_mode_plans_verify_round_trip_and_reach_finetune(mode, rung, tmp_path):
    from edgetl.cli import build_parser
    from edgetl.cli.finetune import recipe_from_args

    ladder = storage_ladder(mode=mode, half="bf16")
    result = tiny_plan(mode_total(mode, ladder[rung]), mode=mode)
    c = result.chosen
    assert (c.fused, c.step_in_backward, c.stream >= ladder[rung].stream) == (
        ladder[rung].fused, ladder[rung].step_in_backward, True)
    assert verify_plan(result, steps=2) == result.predicted_bytes
    path = tmp_path / "plan.yaml"
    result.save(path)
    assert load_plan(path).to_dict() == result.to_dict()
    args = build_parser(only="finetune").parse_args(
        ["finetune", "--recipe", "fashion_mnist", "--plan", str(path), "--set", f"data.resolution={RES}",
         "-o", str(tmp_path / "run")])
    recipe = recipe_from_args(args).recipe
    c = result.chosen
    assert (recipe.model.mode, recipe.model.runtime, recipe.model.storage) == (mode, "lean", c.conv_storage)
    assert (recipe.model.stream, recipe.train.batch_size) == (c.stream, c.batch_size)


@pytest.mark.parametrize("kw, needle", [
    (dict(mode="last"), "mode 'last' is not planned; allowed: repnet, bias, full"),
    (dict(mode="full", precision="bf16"), "precision bf16 is not allowed with mode full"),
    (dict(mode="full", stream=1), "stream 1 is not allowed with mode full"),
    (dict(mode="bias", pool=2), "pool 2 is not allowed with mode bias"),
    (dict(mode="full", blocks=[2]), "planned for mode repnet only"),
])
def test_mode_bad_input_is_one_line(kw, needle):
    from edgetl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        tiny_plan(100 * MB, **kw)
    assert needle in str(info.value) and "\n" not in str(info.value)
