"""Streamed frozen segments (issue #14): the backbone runs on micro-batches, forward and
backward, with the unstreamed results and exactly the memory the accounting predicts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from edgetl.cost import CallShape, Setting
from edgetl.errors import ConfigError
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import Schedule, fit_schedule, prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import FrozenConvBNAct, frozen
from edgetl.models.side import LeanOptions, build_network
from edgetl.models.stream import apply_streams, segments_of
from edgetl.step import Step, set_train_mode

RES, CLASSES = 64, 10
SPEC = BackboneSpec(width=0.35, num_classes=CLASSES)
PRUNED = BackboneSpec(width=0.35, num_classes=CLASSES, hidden={1: 11, 2: 10, 3: 40, 4: 40})


def _grads(net, x, y):
    torch.manual_seed(1)  # the classifier's dropout
    set_train_mode(net, "fold")
    net.zero_grad(set_to_none=True)
    out = net(x)
    nn.functional.cross_entropy(out, y).backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("spec", [SPEC, PRUNED], ids=["unpruned", "pruned"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_streamed_gradients_equal_the_unstreamed_network(spec, m):
    torch.manual_seed(0)
    plain = build_network(spec, "repnet", lean=LeanOptions(pool=2))
    streamed = copy.deepcopy(plain)
    taps = tuple(streamed.side.taps)
    apply_streams(streamed, {a: (b, m) for a, b in segments_of(len(streamed.features), taps)})
    assert streamed.state_dict().keys() == plain.state_dict().keys()
    x, y = torch.randn(5, 3, RES, RES), torch.randint(0, CLASSES, (5,))
    out_a, grads_a = _grads(plain, x, y)
    out_b, grads_b = _grads(streamed, x, y)
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any(n.startswith("side.") for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation streams too
        plain.eval()
        streamed.eval()
        torch.testing.assert_close(streamed(x), plain(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["bias", "repnet+bias"])
def test_streamed_gradients_of_biases_inside_the_segments_equal_the_unstreamed(mode):
    """Parameters inside a segment (every BN bias) get their gradients summed over micro-batches."""
    torch.manual_seed(0)
    plain = build_network(SPEC, mode, lean=LeanOptions(pool=2))
    streamed = copy.deepcopy(plain)
    taps = tuple(streamed.side.taps) if streamed.side is not None else ()
    apply_streams(streamed, {a: (b, 1) for a, b in segments_of(len(streamed.features), taps)})
    x, y = torch.randn(4, 3, RES, RES), torch.randint(0, CLASSES, (4,))
    _, grads_a = _grads(plain, x, y)
    _, grads_b = _grads(streamed, x, y)
    assert any(n.startswith("features.") for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode, batch, m", [("repnet", 4, 1), ("repnet", 5, 2), ("bias", 4, 1),
                                            ("bias", 5, 3)])
def test_a_streamed_step_is_predicted_exactly(mode, batch, m):
    """Bias-only TinyTL-B streams its whole backbone (every BN bias trains inside it)."""
    torch.manual_seed(0)
    net = build_network(SPEC, mode, lean=LeanOptions(pool=2, stream=m))
    schedule = prepare_step(net, resolution=RES, batch_size=batch)
    assert schedule.streams and net.streams is not None
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=batch).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=batch, steps=2)
    unstreamed = build_network(SPEC, mode, lean=LeanOptions(pool=2), device="meta")
    prepare_step(unstreamed, resolution=RES, batch_size=batch)
    assert predicted < runtime_report(unstreamed, mode=mode, resolution=RES, batch_size=batch).total_bytes


def test_a_micro_batch_of_the_whole_batch_is_todays_runtime():
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2, stream=4), device="meta")
    schedule = prepare_step(net, resolution=RES, batch_size=4)
    assert schedule.streams == {} and net.streams is None
    plain = build_network(SPEC, "repnet", lean=LeanOptions(pool=2), device="meta")
    prepare_step(plain, resolution=RES, batch_size=4)
    assert (runtime_report(net, mode="repnet", resolution=RES, batch_size=4).total_bytes
            == runtime_report(plain, mode="repnet", resolution=RES, batch_size=4).total_bytes)


def test_streaming_is_data_in_the_schedule():
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2, stream=2), device="meta")
    schedule = fit_schedule(net, resolution=RES, batch_size=4)
    assert net.streams is None  # fitting leaves the network alone
    taps = tuple(net.side.taps)
    assert schedule.streams == {a: (b, 2) for a, b in segments_of(len(net.features), taps)}
    data = json.loads(json.dumps(schedule.to_dict()))
    assert Schedule.from_dict(data) == schedule
    del data["streamed_segments"]
    assert Schedule.from_dict(data).streams == {}


def test_segments_end_where_the_side_network_reads_or_writes():
    """The first side module reads the image, not its tap block's input: blocks 0-2 are one."""
    assert segments_of(19, (2, 4, 7, 11, 14, 17)) == (
        (0, 3), (3, 4), (4, 5), (5, 7), (7, 8), (8, 11), (11, 12), (12, 14), (14, 15),
        (15, 17), (17, 18), (18, 19))
    assert segments_of(19, ()) == ((0, 19),)


def test_streaming_needs_folded_bn():
    with pytest.raises(ConfigError, match="needs bn fold"):
        LeanOptions(bn="batch", stream=1)
    with pytest.raises(ConfigError, match=r"stream: -1 is not allowed; allowed: an integer in \[0, 65536\]"):
        LeanOptions(stream=-1)
    net = build_network(SPEC, "repnet", lean=LeanOptions(bn="batch"), device="meta")
    with pytest.raises(ConfigError, match="needs BN folded"):
        apply_streams(net, {0: (3, 1)})
    net = build_network(SPEC, "repnet", lean=LeanOptions(stream=1), device="meta")
    with pytest.raises(ConfigError, match="needs bn fold"):
        fit_schedule(net, resolution=RES, batch_size=4, step=Step(bn="batch"))
    with pytest.raises(ConfigError, match="not a streamable segment"):
        apply_streams(net, {0: (2, 1)})


def test_recipe_and_cli_refuse_streaming_with_batch_statistics(tmp_path, capsys):
    from edgetl.cli import main
    from edgetl.recipe import ModelConfig

    with pytest.raises(ConfigError, match="model.stream: 1 needs model.bn fold"):
        ModelConfig(mode="repnet", bn="batch", stream=1).check("model")

    code = main(["profile", "--accounting", "runtime", "--width", "0.35", "--resolution", "64",
                 "--bn", "batch", "--stream", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "needs bn fold" in err and len(err.strip().splitlines()) == 1


def test_profile_prints_the_streamed_segments(capsys):
    from edgetl.cli import main

    code = main(["profile", "--accounting", "runtime", "--width", "0.35", "--resolution", "64",
                 "--batch-size", "4", "--num-classes", "10", "--stream", "1", "--measure"])
    out = capsys.readouterr().out
    assert code == 0
    assert "backbone streamed in micro-batches of 1 (segments 0:3 3:4 4:5" in out
    assert "prediction vs measured: +0.0%" in out
    assert "held" not in out  # fp32 weights under fp32 activations: nothing is converted


def test_profile_prints_the_segments_that_hold_converted_weights(capsys):
    from edgetl.cli import main

    code = main(["profile", "--accounting", "runtime", "--width", "0.35", "--resolution", "64",
                 "--batch-size", "4", "--num-classes", "10", "--stream", "1", "--precision", "bf16",
                 "--frozen-weights", "int8", "--uint8-input", "--recompute", "--measure"])
    out = capsys.readouterr().out
    assert code == 0
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(
        pool=1, stream=1, precision="bf16", frozen_weights="int8", uint8_input=True, recompute=True))
    schedule = prepare_step(net, resolution=RES, batch_size=4)
    held = [f"{s.start}:{s.stop}" for s in net.streams.values() if s.hold_weights]
    assert held and len(schedule.settings) == len(held)
    assert f"; converted weights held across micro-batches: {' '.join(held)})" in out
    assert "prediction vs measured: +0.0%" in out


def test_profile_prints_the_segments_whose_convs_run_a_micro_batch_at_a_time(capsys):
    from edgetl.cli import main

    code = main(["profile", "--accounting", "runtime", "--width", "0.35", "--resolution", "64",
                 "--batch-size", "8", "--num-classes", "10", "--stream", "4", "--measure"])
    out = capsys.readouterr().out
    assert code == 0
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2, stream=4))
    prepare_step(net, resolution=RES, batch_size=8)
    whole = [f"{s.start}:{s.stop}" for s in net.streams.values() if s.whole_micro_batch]
    assert 0 < len(whole) < len(net.streams)  # the largest maps' segments keep the peak sample by sample
    assert f"; masked convs a micro-batch at a time: {' '.join(whole)})" in out
    assert "prediction vs measured: +0.0%" in out


def test_a_segment_cost_is_not_shared_by_networks_of_other_channels():
    """Pruned and unpruned segments take inputs of the same shape: their measured costs differ."""
    costs = []
    for spec in (SPEC, PRUNED):
        net = build_network(spec, "repnet", lean=LeanOptions(pool=2, stream=1), device="meta")
        prepare_step(net, resolution=RES, batch_size=4)
        costs.append(runtime_report(net, mode="repnet", resolution=RES, batch_size=4).total_bytes)
        fresh = build_network(spec, "repnet", lean=LeanOptions(pool=2, stream=1))
        prepare_step(fresh, resolution=RES, batch_size=4)
        assert costs[-1] == measure_training_peak(fresh, resolution=RES, batch_size=4, steps=2)
    assert costs[0] != costs[1]


@pytest.mark.parametrize("mode, batch, m", [("repnet", 13, 2), ("repnet", 12, 3), ("bias", 9, 1)])
def test_a_big_batch_is_measured_at_two_small_ones_and_still_exact(mode, batch, m):
    """q >= 4 full micro-batches: the cost extrapolated from 2 and 3 equals the measurement."""
    torch.manual_seed(0)
    net = build_network(SPEC, mode, lean=LeanOptions(pool=2, stream=m, precision="bf16", frozen_weights="int8"))
    prepare_step(net, resolution=RES, batch_size=batch)
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=batch).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=batch, steps=2)


def test_a_segment_whose_temporaries_settle_after_three_periods_is_extrapolated_exactly(monkeypatch):
    """bf16 + int8 segments of the last blocks: their forward temporaries differ at 2 and 3
    samples and agree from 3 on. The cost at a big batch is extrapolated from the first two
    periods that agree, and equals the segment measured at that batch (every sample run); a
    segment that has not settled below ``_SETTLE_PERIODS`` is ``_declining``'s."""
    from edgetl.memory import leaf

    checked = []

    def periodic(sig, module, shape, period, args):
        got = original(sig, module, shape, period, args)
        whole = leaf.measure(module, sig, shape, *args)[0]
        assert got == whole, (shape, got, whole)
        two, three, four = (leaf._cached(sig, module, (k * period, *shape[1:]), *args).forward_temp_bytes
                            for k in (2, 3, 4))
        checked.append("at once" if two == three else "at 3" if three == four else "later")
        return got

    original = leaf._periodic
    monkeypatch.setattr(leaf, "_periodic", periodic)
    monkeypatch.setattr(leaf, "_CACHE", {})
    net = build_network(PRUNED, "repnet", lean=LeanOptions(pool=2, stream=1, precision="bf16", frozen_weights="int8"),
                        device="meta")
    prepare_step(net, resolution=RES, batch_size=12)
    assert {"at once", "at 3"} <= set(checked)  # "later": 3 and 4 differ (settled later, or declining)


def test_a_segment_whose_temporaries_decline_is_measured_whole_once_per_layout(monkeypatch):
    """bf16 + int8 segments whose forward temporaries fall in a straight line past 8 samples (an
    early moment of fixed size, then the last pass's): a batch measured whole tells the floor
    (above the line) or bounds it (on the line), and later batches of the layout are
    extrapolated from that; a batch past where the line falls below zero is extrapolated from
    the floor measured at that smaller batch. Every cost equals the segment measured at its
    batch (every sample run), in an order that takes each way: measured, measured smaller,
    bounded by a bigger batch, above a floor on the line, on the floor."""
    from edgetl.memory import leaf

    declining = []

    def spy(sig, module, shape, period, args, costs):
        declining.append((sig, module, shape[1:], period, args))
        return original(sig, module, shape, period, args, costs)

    original = leaf._declining
    monkeypatch.setattr(leaf, "_declining", spy)
    monkeypatch.setattr(leaf, "_CACHE", {})
    monkeypatch.setattr(leaf, "_WHOLE", {})
    net = build_network(PRUNED, "repnet", lean=LeanOptions(pool=2, stream=1, precision="bf16", frozen_weights="int8"),
                        device="meta")
    prepare_step(net, resolution=RES, batch_size=12)
    layouts = {(sig.key, inner, period, args): (sig, module, inner, period, args)
               for sig, module, inner, period, args in declining}
    assert layouts  # the pruned network has declining segments at 64 px
    ways = set()
    for sig, module, inner, period, args in layouts.values():
        layout = (sig.key, inner, period, 0, *args)
        for n in (60, 30, 200, 100, 0, 240):  # 0: forget what was measured whole, then 240
            if n == 0:
                leaf._WHOLE.pop(layout, None)
                continue
            shape = (n * period, *inner)
            before = list(leaf._WHOLE.get(layout, ()))
            got = leaf._periodic(sig, module, shape, period, args)
            whole = leaf.measure(module, sig, shape, *args)[0]
            assert got == whole, (inner, n, got, whole)
            line = leaf._cached(sig, module, (2 * period, *inner), *args).forward_temp_bytes - (n - 2) * (
                leaf._cached(sig, module, (2 * period, *inner), *args).forward_temp_bytes
                - leaf._cached(sig, module, (3 * period, *inner), *args).forward_temp_bytes)
            added = leaf._WHOLE.get(layout, [])[len(before):]
            ways.add(("measured" if added[0][0] == n else "measured at a smaller batch past the line") if added
                     else "on the line" if got.forward_temp_bytes == line else "on the floor")
    assert ways == {"measured", "measured at a smaller batch past the line", "on the line", "on the floor"}


@pytest.mark.parametrize("mode", ["repnet", "bias"])
@pytest.mark.parametrize("m", [1, 2])
def test_recomputed_segments_give_the_streamed_results_bit_for_bit(mode, m):
    """A recomputing segment runs each micro-batch's forward again in backward: the same
    masks, so the same gradients as keeping them."""
    torch.manual_seed(0)
    kept = build_network(SPEC, mode, lean=LeanOptions(pool=2, precision="bf16", frozen_weights="int8"))
    again = copy.deepcopy(kept)
    taps = tuple(kept.side.taps) if kept.side is not None else ()
    segments = {a: (b, m) for a, b in segments_of(len(kept.features), taps)}
    apply_streams(kept, segments)
    apply_streams(again, segments, recompute=tuple(segments))
    assert all(s.recompute for s in again.streams.values())
    x, y = torch.randn(5, 3, RES, RES).to(torch.bfloat16), torch.randint(0, CLASSES, (5,))
    out_a, grads_a = _grads(kept, x, y)
    out_b, grads_b = _grads(again, x, y)
    assert torch.equal(out_b, out_a)
    for name in grads_a:
        assert torch.equal(grads_b[name], grads_a[name]), name


@pytest.mark.parametrize("mode", ["repnet", "bias", "repnet+bias"])
def test_a_recomputed_segment_packs_no_mask_before_backward(mode, monkeypatch):
    """A recomputed segment's first pass keeps nothing, so its layers pack no activation mask
    there: not for a segment input that requires grad (a view of it still does without
    autograd), nor for a BN bias that trains inside (a frozen conv masks when any input
    requires grad, whatever the grad mode); the biases require grad again afterwards."""
    torch.manual_seed(0)
    kept = build_network(SPEC, mode, lean=LeanOptions(pool=2))
    again = copy.deepcopy(kept)
    taps = tuple(kept.side.taps) if kept.side is not None else ()
    segments = {a: (b, 1) for a, b in segments_of(len(kept.features), taps)}
    apply_streams(kept, segments)
    apply_streams(again, segments, recompute=tuple(segments))
    convs = [mod for mod in kept.features.modules() if isinstance(mod, FrozenConvBNAct)]
    masked = sum(1 for mod in convs if mod.act)
    x = torch.randn(3, 3, RES, RES)
    build = frozen._clamped_mask  # every mask of 0 < y < 6 is built here, then packed
    samples = []
    monkeypatch.setattr(frozen, "_clamped_mask", lambda y, upper: samples.append(y.shape[0]) or build(y, upper))
    masked_samples = {}
    for name, net in (("kept", kept), ("again", again)):
        set_train_mode(net, "fold")
        samples.clear()
        net(x)
        masked_samples[name] = sum(samples)
    if mode == "repnet":  # the first segment (blocks 0-2) reads the image and trains nothing: no backward
        masked -= sum(1 for mod in kept.features[:3].modules() if isinstance(mod, FrozenConvBNAct) and mod.act)
    # the twin that keeps its masks: each of the 3 samples masked once per ReLU6 conv kept for backward
    assert masked_samples["kept"] == 3 * masked
    assert masked_samples["again"] == 0
    assert [p.requires_grad for p in again.features.parameters()] == [mode != "repnet"] * len(convs)


@pytest.mark.parametrize("mode, batch, m, uint8", [("repnet", 4, 1, True), ("repnet", 5, 2, False),
                                                   ("bias", 4, 1, True), ("bias", 13, 3, False)])
def test_recompute_is_chosen_where_it_lowers_the_peak_and_predicted_exactly(mode, batch, m, uint8):
    torch.manual_seed(0)
    lean = dict(pool=2, stream=m, precision="bf16", frozen_weights="int8", uint8_input=uint8)
    net = build_network(SPEC, mode, lean=LeanOptions(**lean, recompute=True))
    schedule = prepare_step(net, resolution=RES, batch_size=batch)
    assert schedule.recompute and Schedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule
    assert {s.start for s in net.streams.values() if s.recompute} == set(schedule.recompute)
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=batch).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=batch, steps=2)
    plain = build_network(SPEC, mode, lean=LeanOptions(**lean), device="meta")
    prepare_step(plain, resolution=RES, batch_size=batch)
    assert predicted < runtime_report(plain, mode=mode, resolution=RES, batch_size=batch).total_bytes


HELD = {None: {"weights": "held"}}


@pytest.mark.parametrize("mode", ["repnet", "bias"])
@pytest.mark.parametrize("m, recompute", [(1, False), (2, False), (1, True)])
def test_held_weights_give_the_per_micro_batch_results_bit_for_bit(mode, m, recompute, monkeypatch):
    """A segment that holds its converted int8 weights across micro-batches computes with the
    same values: the same outputs and gradients, bit for bit; each of its converting convs
    converts once per pass (forward, backward) instead of once per micro-batch and pass; and
    nothing is left held afterwards."""
    torch.manual_seed(0)
    per_batch = build_network(SPEC, mode, lean=LeanOptions(pool=2, precision="bf16", frozen_weights="int8"))
    held = copy.deepcopy(per_batch)
    taps = tuple(per_batch.side.taps) if per_batch.side is not None else ()
    segments = {a: (b, m) for a, b in segments_of(len(per_batch.features), taps)}
    again = tuple(segments) if recompute else ()
    apply_streams(per_batch, segments, recompute=again)
    apply_streams(held, segments, recompute=again)
    holding = [seg for seg in held.streams.values() if seg.holding_layers()]
    assert len(holding) > len(held.streams) // 2  # the rest: only chunked convs, no whole conversion
    for seg in held.streams.values():
        settings = {s.name: s for s in seg.settings(CallShape((5, 3, RES, RES), (5, 1, 1, 1), True, True))}
        assert settings.get("weights") == (Setting("weights", ("per_micro_batch", "held"), "both", every_shape=True)
                                           if seg in holding else None)
        seg.execution = HELD
    assert all(s.hold_weights for s in held.streams.values())
    assert not any(s.hold_weights for s in per_batch.streams.values())
    converted = []
    convert = FrozenConvBNAct.dequantized_weight
    monkeypatch.setattr(FrozenConvBNAct, "dequantized_weight",
                        lambda self, dtype=None: (self.held is None and converted.append(id(self)))
                        or convert(self, dtype))  # counts the conversions, not the held weight's reuses
    x, y = torch.randn(5, 3, RES, RES).to(torch.bfloat16), torch.randint(0, CLASSES, (5,))
    counts = []
    for net in (per_batch, held):
        converted.clear()
        out, grads = _grads(net, x, y)
        counts.append(len(converted))
        if net is per_batch:
            out_a, grads_a = out, grads
    assert torch.equal(out, out_a) and grads.keys() == grads_a.keys()
    for name in grads_a:
        assert torch.equal(grads[name], grads_a[name]), name
    layers = [layer for seg in held.streams.values() for layer in seg.holding_layers()]
    passes = [2 if seg.start > 0 or mode == "bias" else 1 for seg in held.streams.values()  # no backward
              for _ in seg.holding_layers()]  # into the image-reading first segment of repnet: held too
    assert counts[1] == sum(passes) and counts[0] > counts[1]
    assert all(layer.held is None and "held" not in vars(layer) for layer in layers)


def test_a_conversion_that_fails_while_holding_leaves_no_weight_held(monkeypatch):
    """A segment's third conversion fails (out of memory, say): the two converted before are
    not left held, where a later call outside the loop would use them."""
    from edgetl.models import stream

    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2, precision="bf16", frozen_weights="int8"),
                        device="meta")
    apply_streams(net, {a: (b, 1) for a, b in segments_of(len(net.features), tuple(net.side.taps))})
    seg = next(s for s in net.streams.values() if len(s.holding_layers()) >= 3)
    seg.execution = HELD
    convert, calls = FrozenConvBNAct.dequantized_weight, []

    def failing(self, dtype=None):
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return convert(self, dtype)

    monkeypatch.setattr(FrozenConvBNAct, "dequantized_weight", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        with stream._held_weights(seg):
            pass
    assert len(calls) == 3 and all("held" not in vars(layer) for layer in seg.holding_layers())


def test_held_weights_are_fitted_within_the_peak_and_predicted_exactly():
    """The schedule holds a segment's converted weights where its forward and backward stay
    within the step's peak: the peak is the one without any held, predicted = measured to the
    byte, fewer ops a step; the choice is stored with the schedule ("settings") and loads.
    Bias-only TinyTL-B streams its whole backbone as one segment: holding every converted
    weight there would raise the peak, so it is not held."""
    from edgetl.memory.meter import count_step_ops

    torch.manual_seed(0)
    lean = LeanOptions(pool=2, stream=1, precision="bf16", frozen_weights="int8", uint8_input=True, recompute=True)
    bias = build_network(SPEC, "bias", lean=lean, device="meta")
    assert not prepare_step(bias, resolution=RES, batch_size=4).settings
    (whole,) = bias.streams.values()
    peak = runtime_report(bias, mode="bias", resolution=RES, batch_size=4).total_bytes
    whole.execution = HELD
    assert runtime_report(bias, mode="bias", resolution=RES, batch_size=4).total_bytes > peak
    mode = "repnet"
    net = build_network(SPEC, mode, lean=lean)
    schedule = prepare_step(net, resolution=RES, batch_size=4)
    held = {name for name, by_shape in schedule.settings.items() if by_shape == HELD}
    assert held and held <= {f"streams.{s.start}" for s in net.streams.values()}
    assert {f"streams.{s.start}" for s in net.streams.values() if s.hold_weights} == held
    assert Schedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=4).total_bytes
    assert predicted == measure_training_peak(copy.deepcopy(net), resolution=RES, batch_size=4, steps=2)
    ops = count_step_ops(net, resolution=RES, batch_size=4)
    for seg in net.streams.values():
        seg.execution = {}
    assert runtime_report(net, mode=mode, resolution=RES, batch_size=4).total_bytes == predicted
    assert count_step_ops(net, resolution=RES, batch_size=4).total > ops.total


def test_recompute_needs_streaming():
    with pytest.raises(ConfigError, match=r"recompute needs stream >= 1 \(it applies to streamed segments\)"):
        LeanOptions(recompute=True)
    net = build_network(SPEC, "repnet", lean=LeanOptions(stream=1), device="meta")
    with pytest.raises(ConfigError, match="recomputes but is not a streamed segment"):
        apply_streams(net, {0: (3, 1)}, recompute=(3,))


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.mark.parametrize("owns", [True, False], ids=["torch>=2.9", "older torch"])
def test_a_kept_edge_owns_its_node_after_the_output_is_dropped(owns, monkeypatch):
    """Before torch 2.9 a GradientEdge to a custom Function's output does not keep the node
    alive (streaming segfaulted on the Jetson's torch 2.5): there the edge is taken from a
    view, whose built-in node the edge owns. Both paths give the gradient, on any torch."""
    import gc

    from edgetl.models import stream

    if owns and not stream._EDGE_OWNS_NODE:
        pytest.skip(f"torch {torch.__version__}: the bare edge's node is freed under it (backward segfaults), "
                    "the crash the view prevents")
    monkeypatch.setattr(stream, "_EDGE_OWNS_NODE", owns)
    x = torch.randn(3, 4, requires_grad=True)
    out = _Double.apply(x * 1)
    edge = stream.owned_gradient_edge(out)
    assert isinstance(edge.node, torch.autograd.function.BackwardCFunction) == owns
    del out
    gc.collect()
    (g,) = torch.autograd.grad([edge], [x], grad_outputs=[torch.ones(3, 4)])
    torch.testing.assert_close(g, torch.full((3, 4), 2.0))


@pytest.mark.parametrize("mode, batch, m", [("repnet", 5, 2), ("bias", 4, 1)])
def test_streaming_as_on_older_torch_is_exact_too(mode, batch, m, monkeypatch):
    """The older-torch edges (a view per micro-batch): same gradients as unstreamed, and the
    step predicted exactly (the segment cost is measured through the same code)."""
    from edgetl.memory import leaf
    from edgetl.models import stream

    monkeypatch.setattr(stream, "_EDGE_OWNS_NODE", False)
    monkeypatch.setattr(leaf, "_CACHE", {})  # measure the segments through the view path
    torch.manual_seed(0)
    plain = build_network(SPEC, mode, lean=LeanOptions(pool=2))
    streamed = copy.deepcopy(plain)
    taps = tuple(streamed.side.taps) if streamed.side is not None else ()
    apply_streams(streamed, {a: (b, m) for a, b in segments_of(len(streamed.features), taps)})
    x, y = torch.randn(batch, 3, RES, RES), torch.randint(0, CLASSES, (batch,))
    _, grads_a = _grads(plain, x, y)
    _, grads_b = _grads(streamed, x, y)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
    net = build_network(SPEC, mode, lean=LeanOptions(pool=2, stream=m))
    prepare_step(net, resolution=RES, batch_size=batch)
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=batch).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=batch, steps=2)


@pytest.mark.parametrize("recompute", [False, True])
def test_whole_micro_batches_give_the_per_sample_results_with_fewer_ops(recompute):
    """A segment whose masked frozen convs run each micro-batch at once (setting "convs":
    "whole_micro_batch") computes the same step: the same outputs bit for bit (the masks are
    the same bits, packed in one chunk), gradients to rounding; it dispatches fewer ops; the
    convs' own choices are back when it is done; and predicted = measured with it."""
    from edgetl.memory.meter import count_step_ops

    torch.manual_seed(0)
    per_sample = build_network(SPEC, "repnet", lean=LeanOptions(pool=2))
    whole = copy.deepcopy(per_sample)
    taps = tuple(per_sample.side.taps)
    segments = {a: (b, 3) for a, b in segments_of(len(per_sample.features), taps)}
    again = tuple(segments) if recompute else ()
    apply_streams(per_sample, segments, recompute=again)
    apply_streams(whole, segments, recompute=again)
    call = CallShape((7, 3, RES, RES), (7, 1, 1, 1), True, True)
    for seg in whole.streams.values():
        assert ("convs" in {s.name for s in seg.settings(call)}) == bool(seg.masked_layers())
        seg.execution = {None: {"convs": "whole_micro_batch"}}
    assert sum(bool(seg.masked_layers()) for seg in whole.streams.values()) >= len(segments) - 1
    before = {n: dict(m.execution) for n, m in whole.named_modules() if isinstance(m, FrozenConvBNAct)}
    x, y = torch.randn(7, 3, RES, RES), torch.randint(0, CLASSES, (7,))  # 3 + 3 + 1: a partial micro-batch
    out_a, grads_a = _grads(per_sample, x, y)
    out_b, grads_b = _grads(whole, x, y)
    assert torch.equal(out_a, out_b) and grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
    assert before == {n: dict(m.execution) for n, m in whole.named_modules() if isinstance(m, FrozenConvBNAct)}
    ops = [count_step_ops(net, resolution=RES, batch_size=7).total for net in (per_sample, whole)]
    assert ops[1] < ops[0]
    predicted = runtime_report(whole, mode="repnet", resolution=RES, batch_size=7).total_bytes
    assert measure_training_peak(whole, resolution=RES, batch_size=7) == predicted
