"""Which streamed segments recompute: the fewest found that keep the peak of recomputing every
segment whose saved bytes exceed its input, for the paper configuration at 224 px, batch 8."""

from __future__ import annotations

import dataclasses

import pytest

from edgetl.bench import METHODS, build_method, pruned_hidden
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import apply_schedule, prepare_step
from edgetl.step import Step

RES, BATCH, CLASSES = 224, 8, 102
# the segments of two or three blocks (5-6, 8-10, 12-13, 15-16), whose masks outweigh the
# input a recompute keeps: the set recomputed before it was shrunk
EVERY = (5, 8, 12, 15)


@pytest.mark.parametrize("step, chosen, peak", [
    (Step.plain(), (8,), 16_829_423),  # benchmarks/stream_figures_224.md, "+ recompute"
    # the update inside backward lowers the other moments: every segment is needed there
    (Step.plain(step_in_backward=True, fused=True), EVERY, 14_893_719),
], ids=["plain", "update-in-backward"])
def test_the_paper_configuration_recomputes_the_fewest_segments_at_the_same_peak(step, chosen, peak):
    method = METHODS["repnet-pruned-pool2-bf16-int8-stream"]
    net = build_method(method, width=1.0, num_classes=CLASSES, device="meta",
                       hidden=pruned_hidden(1.0, CLASSES))
    schedule = prepare_step(net, resolution=RES, batch_size=BATCH, step=step)
    assert schedule.recompute == chosen

    def peak_with(again: tuple[int, ...]) -> int:
        apply_schedule(net, dataclasses.replace(schedule, recompute=again))
        return runtime_report(net, mode=method.mode, resolution=RES, batch_size=BATCH, step=step).total_bytes

    assert peak_with(chosen) == peak_with(EVERY) == peak
    for start in chosen:  # none of the chosen can leave: each one dropped raises the peak
        assert peak_with(tuple(a for a in chosen if a != start)) > peak


@pytest.mark.parametrize("step, taken", [
    (Step.plain(), 8),
    (Step.plain(step_in_backward=True, fused=True), 5),  # the 15 MB configuration: blocks 17-18 stay chunked
], ids=["plain", "update-in-backward"])
def test_convs_inside_streamed_segments_take_whole_weights_where_the_peak_stays(step, taken):
    """The schedule's last pass: each chunkable 1x1 conv inside a streamed segment (the segment is
    one leaf to the simulation, so no other pass scores them) converts its weight whole where the
    whole step keeps the peak of every one chunked; each one left chunked would raise it. Fewer
    ops a step (one conv per micro-batch for a matrix product per chunk and sample)."""
    from edgetl.memory.meter import count_step_ops
    from edgetl.models.lean import FrozenConvBNAct

    method = METHODS["repnet-pruned-pool2-bf16-int8-stream"]
    net = build_method(method, width=1.0, num_classes=CLASSES, device="meta", hidden=pruned_hidden(1.0, CLASSES))
    schedule = prepare_step(net, resolution=RES, batch_size=BATCH, step=step)
    chunkable = [n for n, m in net.named_modules() if isinstance(m, FrozenConvBNAct) and m.chunkable]
    assert len(schedule.whole_weight) == taken and set(schedule.whole_weight) <= set(chunkable) and len(chunkable) == 8

    def run(whole: tuple[str, ...]) -> tuple[int, int]:
        apply_schedule(net, dataclasses.replace(schedule, whole_weight=whole))
        peak = runtime_report(net, mode=method.mode, resolution=RES, batch_size=BATCH, step=step).total_bytes
        return peak, count_step_ops(net, resolution=RES, batch_size=BATCH, step=step).total

    (peak, ops), (chunked_peak, chunked_ops) = run(schedule.whole_weight), run(())
    assert peak == chunked_peak and ops < chunked_ops
    for name in set(chunkable) - set(schedule.whole_weight):
        assert run((*schedule.whole_weight, name))[0] > peak, name


@pytest.mark.parametrize("step, taken, simulations", [
    (Step.plain(), 8, 1),  # all eight at once
    # the first five in four (all, 7, 5, 6), then the last three left in three more
    (Step.plain(step_in_backward=True, fused=True), 5, 7),
], ids=["plain", "update-in-backward"])
def test_the_whole_weight_search_is_the_greedy_pass_in_fewer_simulations(step, taken, simulations, monkeypatch):
    """The convs inside streamed segments that take whole weights are the ones a greedy pass in
    module order takes, one simulated step per conv (written out here, with the runtime report),
    found in fewer simulations: the longest run of convs that keeps the peak at a time."""
    from edgetl.memory import schedule as fitting
    from edgetl.models.lean import FrozenConvBNAct

    counted = []
    simulate = fitting.simulate

    def counting(*args, **kwargs):
        counted.append(kwargs.get("flow") is not None)  # the whole-weight pass hands its one trace
        return simulate(*args, **kwargs)

    monkeypatch.setattr(fitting, "simulate", counting)
    method = METHODS["repnet-pruned-pool2-bf16-int8-stream"]
    net = build_method(method, width=1.0, num_classes=CLASSES, device="meta", hidden=pruned_hidden(1.0, CLASSES))
    schedule = prepare_step(net, resolution=RES, batch_size=BATCH, step=step)
    assert len(schedule.whole_weight) == taken and sum(counted) == simulations

    def peak(whole: list[str]) -> int:
        apply_schedule(net, dataclasses.replace(schedule, whole_weight=tuple(whole)))
        return runtime_report(net, mode=method.mode, resolution=RES, batch_size=BATCH, step=step).total_bytes

    chunked, greedy = peak([]), []
    for name, m in net.named_modules():
        if isinstance(m, FrozenConvBNAct) and m.chunkable and peak([*greedy, name]) <= chunked:
            greedy.append(name)
    assert tuple(sorted(greedy)) == schedule.whole_weight
