"""Streamed frozen segments (issue #14): a frozen, BN-folded run of backbone blocks executed
on micro-batches of m samples, forward and backward, with the results of the whole batch
(up to float rounding: a kernel may sum in another order at another batch size; gradients
agree to about 1e-6 relative, ``tests/test_stream.py``).

A frozen backbone with folded BN has no dependency between the samples of a batch, so a
segment of blocks can run sample group by sample group and write into a batch-sized output.
Batch-sized tensors then exist only at the segment's ends; inside it, a block's input,
expanded hidden map and output exist for m samples at a time. Segments end wherever the
side network reads or writes a batch-level tensor (the output of every tap block, and the
input of every tap block but the first, whose side module reads the image: the side
modules' BN uses batch statistics, so they stay whole-batch), see ``segments_of``. The
last segment ends with the global pool, the first may start with the uint8 batch's
normalisation (``edgetl.models.lean.InputNorm``).

How one segment runs (``_StreamFn``):

* forward: for each micro-batch, the blocks run with autograd on a fresh entry node
  (``_Entry``: the micro-batch's rows of the input, seen as the output of a node that
  holds nothing, so no graph keeps the batch-sized input alive). The micro-batch output is
  copied into the batch-sized output and dropped; only its gradient edge is kept, and with
  it whatever the lean layers save (1-bit masks): the same bytes as the whole batch saves.
* where the step schedule says so (``StreamedSegment.hold_weights``), each frozen conv that
  converts its stored weight per call (int8, or a float dtype other than the activations')
  converts it once per pass over the micro-batches and every micro-batch uses that copy.
* backward: micro-batch by micro-batch in reverse, ``torch.autograd.grad`` from the kept
  output edge to the entry edge (and the segment's trainable parameters, e.g. BN biases in
  bias-only TinyTL-B), written into the batch-sized input gradient; each micro-batch's
  graph, masks included, is freed as soon as it has run.

Without autograd (evaluation) the blocks simply run micro-batch by micro-batch. m = B is
no streaming at all: the segment then runs its blocks as the unstreamed network does.

The runtime accounting (``edgetl.memory.runtime``) treats a segment as one leaf whose cost
is measured by running the segment itself on the meta device under the storage meter
(``edgetl.memory.leaf``): what the simulation predicts is what this code allocates, by
construction.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.autograd import Function
from torch.autograd.graph import get_gradient_edge

from edgetl.compat import release
from edgetl.cost import CallShape, Execution, Setting, configured_copy
from edgetl.errors import ConfigError
from edgetl.models.lean import by_micro_batch
from edgetl.models.lean.frozen import FrozenConvBNAct
from edgetl.models.lean.layout import empty_as, is_channels_last

# Before torch 2.9 (pytorch PR #160098) a GradientEdge does not own its node: the edge of a
# custom Function's output names the node through the Function's context, which holds it
# weakly, so once the output tensor is dropped the node is freed under the edge (backward
# from it then crashes). There a kept edge is taken from a view of the output instead: the
# view's node is a built-in one the edge does own, it saves no tensor, and it owns the
# output's node through its own edge. Newer torch keeps such a token itself; there the view
# is not made, so op counts and memory do not change.
_EDGE_OWNS_NODE = release(torch.__version__) >= (2, 9)


def owned_gradient_edge(t: torch.Tensor):
    """``get_gradient_edge(t)`` that stays valid after ``t`` is dropped, on every torch."""
    return get_gradient_edge(t if _EDGE_OWNS_NODE else t.view_as(t))


@contextlib.contextmanager
def _not_requiring_grad(params):
    """The segment's trainable parameters seen as constants for a forward whose graph nothing
    keeps (a recomputed segment's first pass runs without autograd): a lean layer then saves
    nothing for backward, e.g. a frozen conv with a trainable bias packs no activation mask
    (its ``needs_input_grad`` reads ``requires_grad``, not the grad mode)."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextlib.contextmanager
def _held_weights(segment: "StreamedSegment"):
    """While a segment runs its micro-batches (``hold_weights``): each frozen conv that
    converts its weight per call converts it once here, and every micro-batch uses that copy
    (the same values); the copies go when the loop ends."""
    layers = segment.holding_layers() if segment.hold_weights else []
    try:
        for layer in layers:
            layer.held = layer.dequantized_weight()
        yield
    finally:  # also when a conversion failed part way: no layer keeps a held weight
        for layer in layers:
            vars(layer).pop("held", None)  # back to the class's None


@contextlib.contextmanager
def _whole_micro_batches(segment: "StreamedSegment"):
    """While a segment runs its micro-batches (``whole_micro_batch``): each masked frozen conv
    in it packs its activation mask and runs its masked backward on the whole micro-batch
    (its settings "mask_chunk" and "backward", ``FrozenConvBNAct``), not sample by sample;
    the layers' own choices come back when the loop ends."""
    layers = segment.masked_layers() if segment.whole_micro_batch else []
    before = [layer.execution for layer in layers]
    try:
        for layer in layers:
            every = {**layer.execution.get(None, {}), "backward": "whole_batch", "mask_chunk": segment.micro_batch}
            layer.execution = {**layer.execution, None: every}
        yield
    finally:
        for layer, execution in zip(layers, before):
            layer.execution = execution


class _Entry(Function):
    """A micro-batch's rows as a graph input that holds nothing (its backward never runs:
    the gradient is taken at its edge)."""

    @staticmethod
    def forward(ctx, rows, anchor):
        # an alias keeps every stride: ``view_as`` would renumber a 1-sample batch's, and a
        # channels-last micro-batch of one would then read as contiguous to the convs
        return torch.ops.aten.alias(rows)

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - the engine stops at the captured edge
        return g, None


class _StreamFn(Function):
    @staticmethod
    def forward(ctx, x, segment: "StreamedSegment", *params):
        n, m = x.shape[0], segment.micro_batch
        ctx.in_shape, ctx.in_dtype, ctx.in_channels_last = tuple(x.shape), x.dtype, is_channels_last(x)
        if segment.recompute:  # keep the input only; backward runs each micro-batch again
            # nothing of this pass is kept, so no layer saves (packs masks): neither for the input
            # (a view of a tensor that requires grad does, even without autograd) nor for the
            # segment's trainable parameters
            with _not_requiring_grad(params), _held_weights(segment):  # no masks: nothing to pack
                out = by_micro_batch(x.detach(), m, segment.run)
            ctx.save_for_backward(x)
            ctx.segment, ctx.params, ctx.edges = segment, params, None
            return out
        # 0 bytes: makes every entry a graph node (float: a uint8 batch cannot require grad)
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        out = None
        edges = []
        with torch.enable_grad(), _held_weights(segment), _whole_micro_batches(segment):
            for i in range(0, n, m):
                entry = _Entry.apply(segment.enter(x[i:i + m].detach()), anchor)
                y = segment.run_blocks(entry)
                if out is None:
                    out = empty_as(y, (n, *y.shape[1:]))
                out[i:i + m].copy_(y.detach())
                # the entry's node is owned by the graph the output's edge keeps alive
                edges.append((owned_gradient_edge(y), get_gradient_edge(entry), y.shape[0]))
                del entry, y
        ctx.edges, ctx.params, ctx.segment = edges, params, segment
        return out

    @staticmethod
    def backward(ctx, gy):
        edges, params = ctx.edges, ctx.params
        need_x = ctx.needs_input_grad[0]
        gx = empty_as(gy, ctx.in_shape, dtype=ctx.in_dtype, channels_last=ctx.in_channels_last) if need_x else None
        gps = [torch.zeros_like(p) for p in params]
        if edges is None:  # recompute: each micro-batch's forward again, then its backward
            x, = ctx.saved_tensors
            m = ctx.segment.micro_batch
            edges = [(None, None, min(m, x.shape[0] - i)) for i in range(0, x.shape[0], m)]
        stop = ctx.in_shape[0]
        # converted once for every micro-batch's backward (and forward again)
        with _held_weights(ctx.segment), _whole_micro_batches(ctx.segment):
            for out_edge, in_edge, rows in reversed(edges):
                start = stop - rows
                if out_edge is None:
                    with torch.enable_grad():
                        in_edge = ctx.segment.enter(x[start:stop].detach())
                        if need_x:
                            in_edge = in_edge.detach().requires_grad_()
                        out_edge = ctx.segment.run_blocks(in_edge)
                inputs = ([in_edge] if need_x else []) + list(params)
                grads = torch.autograd.grad([out_edge], inputs, grad_outputs=[gy[start:stop]],
                                            allow_unused=True)
                del out_edge, in_edge
                if need_x:
                    gx[start:stop].copy_(grads[0])
                    grads = grads[1:]
                used = [(acc, g) for acc, g in zip(gps, grads) if g is not None]
                if used:  # one op for every parameter (bias-only: one per BN bias), the same sums
                    torch._foreach_add_([acc for acc, _ in used], [g for _, g in used])
                del grads, used
                stop = start
        ctx.edges = None
        return (gx, None, *gps)


class StreamedSegment(nn.Module):
    """Blocks ``start..stop-1`` of ``net.features`` run on micro-batches of ``micro_batch``.

    The blocks stay registered where they are (``features``): a segment holds them in a
    plain tuple, so state_dict keys, checkpoints and export do not change. For the
    accounting a segment is one leaf (it has no registered children).
    """

    accounting_kind = "streamed_segment"

    def __init__(self, blocks: list[nn.Module], start: int, micro_batch: int, tail: nn.Module | None = None,
                 head: nn.Module | None = None, recompute: bool = False):
        super().__init__()
        if micro_batch < 1:
            raise ConfigError(f"micro-batch {micro_batch} is not allowed; allowed: an integer >= 1")
        self._blocks = tuple(blocks)
        # the network's global pool when this segment ends the backbone: then only the
        # pooled (batch x channels) tensor and its gradient are batch-sized, not the last
        # block's map (``EdgeNet.forward`` skips its own pool)
        self._tail = (tail,) if tail is not None else ()
        # the network's input normalisation when this segment starts the backbone and the
        # batch stays uint8 (``edgetl.models.lean.InputNorm``): applied to each micro-batch
        self._head = (head,) if head is not None else ()
        # keep the batch-sized input instead of what the blocks save (1-bit masks), and run
        # each micro-batch's forward again in backward (``LeanOptions.recompute``)
        self.recompute = bool(recompute)
        self.start, self.stop = start, start + len(blocks)
        self.micro_batch = int(micro_batch)
        # tracing on meta needs only the output's shape: the blocks run once on one sample
        # and the output is made batch-sized (``mark_shapes_only``)
        self.shapes_only = False
        # the step schedule's choices (``edgetl.cost.Tunable``): settings "weights" and "convs",
        # see ``settings``
        self.execution: dict = {}

    def masked_layers(self) -> list[nn.Module]:
        """The frozen convs in the segment that keep an activation mask, where a micro-batch
        of more than one sample can pack it and run its masked backward at once."""
        if self.micro_batch < 2:
            return []
        return [m for b in self._blocks for m in b.modules() if isinstance(m, FrozenConvBNAct) and m.act]

    @property
    def whole_micro_batch(self) -> bool:
        """Whether the masked frozen convs inside run each micro-batch at once
        (``_whole_micro_batches``): a mask packed and a masked backward per conv and
        micro-batch, where sample by sample took one per sample (the schedule's setting
        "convs": "whole_micro_batch"; the more memory, the micro-batch's masked copies)."""
        return self.execution.get(None, {}).get("convs") == "whole_micro_batch"

    def holding_layers(self) -> list[nn.Module]:
        """The layers whose converted weights ``hold_weights`` holds (``converts_weight``)."""
        return [m for b in self._blocks for m in b.modules() if getattr(m, "converts_weight", False)]

    @property
    def hold_weights(self) -> bool:
        """Whether each frozen conv that converts its stored weight per call (int8, or a float
        dtype other than the activations') converts it once per pass over the micro-batches
        and holds it (``_held_weights``): fewer ops and the same values, with the converted
        weights alive through the loop (the schedule's setting "weights": "held")."""
        return self.execution.get(None, {}).get("weights") == "held"

    def settings(self, call: CallShape) -> tuple[Setting, ...]:
        """The execution settings of this call (``edgetl.cost.Tunable``), in the forward and
        the backward (which runs the forward again where the segment recomputes): "weights",
        converted per micro-batch (the default) or held across them; "convs", the masked
        frozen convs inside sample by sample (the default) or a micro-batch at a time."""
        out = []
        if self.holding_layers():
            out.append(Setting("weights", ("per_micro_batch", "held"), "both", every_shape=True))
        if self.masked_layers() and call.output_requires_grad:
            out.append(Setting("convs", ("per_sample", "whole_micro_batch"), "both", every_shape=True))
        return tuple(out)

    def configured(self, choice: Execution) -> "StreamedSegment":
        """A shallow copy of this segment (its blocks shared) whose ``execution`` is ``choice``."""
        return configured_copy(self, choice)

    @property
    def tail(self) -> nn.Module | None:
        return self._tail[0] if self._tail else None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """A micro-batch as the first block takes it (normalised, when the batch is uint8)."""
        return self._head[0](x) if self._head else x

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of the input through the segment: entered, then its blocks."""
        return self.run_blocks(self.enter(x))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self._blocks + self._tail:
            x = block(x)
        return x

    def trainable(self) -> list[nn.Parameter]:
        return [p for b in self._blocks for p in b.parameters() if p.requires_grad]

    def runtime_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this leaf's backward produces (the accounting's)."""
        return self.trainable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.micro_batch >= n:
            return self.run(x)
        if self.shapes_only:  # one sample gives the shape (a big batch's masks would cost minutes on meta)
            one = self.run(x[:1])
            return empty_as(one, (n, *one.shape[1:]))
        params = self.trainable()
        if torch.is_grad_enabled() and (x.requires_grad or params):
            return _StreamFn.apply(x, self, *params)
        with _held_weights(self):  # no backward here (a segment reading the image, or evaluation)
            return by_micro_batch(x, self.micro_batch, self.run)

    @property
    def repeats_every(self) -> int:
        """Samples after which the segment's work repeats (its micro-batch): the runtime
        accounting measures a large batch at two and three micro-batches and extrapolates
        (``edgetl.memory.leaf.measured_cost``)."""
        return self.micro_batch

    def extra_repr(self) -> str:
        tail = f", then {type(self.tail).__name__}" if self._tail else ""
        again = ", recompute" if self.recompute else ""
        chosen = ", hold_weights" if self.hold_weights else ""
        chosen += ", whole_micro_batch" if self.whole_micro_batch else ""
        return f"features[{self.start}:{self.stop}]{tail}, micro_batch={self.micro_batch}{again}{chosen}"


@functools.lru_cache(maxsize=None)
def segments_of(num_blocks: int, taps: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Maximal runs of backbone blocks with no batch-level boundary inside: each segment ends
    at a tap block's output (the side network adds to it) and every tap block after the first
    starts one (the side network reads its input); the first side module reads the image,
    so the blocks before the first tap run in one segment with it."""
    cuts = sorted({0, num_blocks, *taps[1:], *(t + 1 for t in taps)})
    return tuple((a, b) for a, b in zip(cuts, cuts[1:]) if a < b)


def mark_shapes_only(net: nn.Module) -> None:
    """For a meta copy that is only traced forward, never backward: the modules that can skip
    work whose values nothing reads do (a streamed segment its micro-batch loop: the trace sees
    it as one leaf and never looks inside; a frozen conv its ReLU6 mask; a compressed conv its
    compression; a lean ReLU6 its mask and clamp; a lean side tail all but its 1x1 conv)."""
    for module in net.modules():
        if hasattr(module, "shapes_only"):
            module.shapes_only = True


def check_streamable(net: nn.Module) -> None:
    """Streaming needs samples that do not depend on each other: BN folded or frozen in eval."""
    for name, m in net.features.named_modules():
        if getattr(m, "bn_mode", "fold") == "batch":
            raise ConfigError(f"streaming needs BN folded (features.{name} uses bn=batch); "
                              "use --bn fold or do not stream")


def apply_streams(net: nn.Module, segments: dict[int, tuple[int, int]], recompute=()) -> None:
    """Stream ``net``'s backbone: ``segments`` maps a first block to (stop block, micro-batch);
    the segments whose first block is in ``recompute`` keep their input and run forward
    again in backward instead of keeping what their blocks save.

    Segments must be runs of ``segments_of`` (no batch-level boundary inside). An empty
    mapping removes streaming."""
    norm = net.input_norm
    image_pool = _image_pool(net)
    if not segments:
        net.streams = None
        if image_pool is not None:
            image_pool.set_input(norm, None)
        return
    check_streamable(net)
    taps = tuple(getattr(net.side, "taps", ())) if net.side is not None else ()
    allowed = {a: b for a, b in segments_of(len(net.features), taps)}
    unknown = sorted(set(recompute) - set(segments))
    if unknown:
        raise ConfigError(f"features[{unknown[0]}:] recomputes but is not a streamed segment")
    built = {}
    for start, (stop, m) in sorted(segments.items()):
        if allowed.get(start) != stop:
            raise ConfigError(f"features[{start}:{stop}] is not a streamable segment of this network; "
                              f"allowed: {', '.join(f'{a}:{b}' for a, b in allowed.items())}")
        tail = net.pool if stop == len(net.features) else None
        head = norm if start == 0 else None
        built[str(start)] = StreamedSegment(list(net.features[start:stop]), start, m, tail, head,
                                            start in recompute)
        if start == 0 and image_pool is not None:
            image_pool.set_input(norm, m)  # the side reads the image micro-batch by micro-batch too
    net.streams = nn.ModuleDict(built)


def _image_pool(net: nn.Module):
    """The side network's pool of the image when it takes a uint8 batch (``ImagePool``)."""
    side = net.side
    pool = getattr(side.blocks[0], "pre_pool", None) if side is not None else None
    return pool if hasattr(pool, "set_input") else None
