"""The meta tracer (issue #42, item 5b): its state is its own, streamed segments are single
leaves, and the flow recorder it reports to does not depend on the order hooks run in."""

from __future__ import annotations

import copy

import torch
from torch import nn

from edgetl.memory.flow import trace_flow
from edgetl.memory.trace import MetaTracer, meta_copy, trace_network
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.models.stream import apply_streams, mark_shapes_only, segments_of

RES = 64
SPEC = BackboneSpec(width=0.35, num_classes=10)


def _nets():
    """A lean Rep-Net and the same network with every segment streamed sample by sample."""
    plain = build_network(SPEC, "repnet", lean=LeanOptions(pool=2), device="meta")
    streamed = copy.deepcopy(plain)
    segments = segments_of(len(plain.features), tuple(plain.side.taps))
    apply_streams(streamed, {a: (b, 1) for a, b in segments})
    return plain, streamed, segments


def _leaves(trace):
    return [(leaf.name, leaf.block, leaf.part, leaf.in_shape, leaf.out_shape) for leaf in trace.leaves]


def test_a_streaming_segment_is_one_leaf_where_its_blocks_were():
    plain, streamed, segments = _nets()
    expected, seen = [], set()
    for name, block, part, _, _ in _leaves(trace_network(plain, RES, 4)):
        start = next((a for a, b in segments if a <= block < b), None) if part == "backbone" else None
        if start is not None:
            if start not in seen:  # its blocks are not seen
                expected.append((f"streams.{start}", start, "backbone"))
                seen.add(start)
        elif not (name == "pool" and segments[-1][1] == len(plain.features)):  # the last segment's tail
            expected.append((name, block, part))
    trace = trace_network(streamed, RES, 4)
    assert [(name, block, part) for name, block, part, _, _ in _leaves(trace)] == expected
    assert len(expected) == 33 and len(segments) == 12
    assert [(b.index, b.name) for b in trace.blocks] == [(a, f"features.{a}:{b}") for a, b in segments] + [(19, "head")]


def test_a_segment_at_most_its_micro_batch_runs_its_blocks_as_they_are():
    plain, streamed, _ = _nets()
    a, b = trace_network(plain, RES, 1), trace_network(streamed, RES, 1)
    assert _leaves(b) == _leaves(a) and b.blocks == a.blocks
    assert len(a.leaves) == 74 and len(a.blocks) == 20


def test_the_head_is_block_len_features_and_skips_are_the_architectures():
    trace = trace_network(build_network(SPEC, "repnet", device="meta"), RES, 2)
    assert [b.index for b in trace.blocks] == list(range(20)) and trace.blocks[-1].name == "head"
    # MobileNetV2's residual blocks: stride 1 and as many channels out as in (Sandler et al. 2018)
    assert [b.index for b in trace.blocks if b.has_skip] == [3, 5, 6, 8, 9, 10, 12, 13, 15, 16]
    assert all(b.has_skip == (b.in_shape == b.out_shape) for b in trace.blocks[1:-2])


def test_the_tracer_writes_nothing_onto_the_modules_and_removes_its_hooks():
    _, streamed, _ = _nets()
    meta = meta_copy(streamed).eval()
    mark_shapes_only(meta)
    before = {name: set(vars(m)) for name, m in meta.named_modules()}
    with MetaTracer(meta, dict(meta.named_modules())) as tracer:
        trace = tracer.run(torch.empty(4, 3, RES, RES, device="meta"))
        assert any(m._forward_hooks for m in meta.modules())
    assert len(trace.leaves) == 33 and tracer.context == [] and tracer._streaming == {}
    assert {name: set(vars(m)) for name, m in meta.named_modules()} == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in meta.modules())


def test_the_flow_is_the_same_whichever_hook_runs_first(monkeypatch):
    """The recorder is told of each leaf by the tracer, so its own hooks may run before the
    tracer's (with the hooks as closures, a leaf had to be traced before the recorder saw it)."""
    _, streamed, _ = _nets()

    def flow_of(batch):
        flow = trace_flow(streamed, RES, batch)
        return ([(o.name, o.block, o.part, o.inputs, o.output, o.func) for o in flow.ops],
                [(v.storage, v.nbytes, v.shape) for v in flow.values], sorted(flow.holds.items()))

    expected = {batch: flow_of(batch) for batch in (1, 4)}
    register = nn.Module.register_forward_hook
    monkeypatch.setattr(nn.Module, "register_forward_hook",
                        lambda self, hook, **kw: register(self, hook, prepend=True, **kw))
    for batch in (1, 4):
        assert flow_of(batch) == expected[batch]
    assert len(expected[4][0]) == 43 and len(expected[1][0]) == 94
