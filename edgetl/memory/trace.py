"""Shape tracing: a network in, its leaf layers in execution order (with shapes) out.

The forward pass runs on the meta device, so a 224 px MobileNetV2 traces in well under
a second with no real compute. Each leaf records which block it belongs to (backbone
block index, the side module attached to a tap block, or the head) so accountings can
be summed per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from edgetl.metaop import MetaMemo
import edgetl.models.archs as archs
from edgetl.models.backbone import EdgeNet
from edgetl.twin import meta_copy
from edgetl.models.stream import mark_shapes_only

KINDS = {
    "conv": (nn.Conv1d, nn.Conv2d, nn.Conv3d),
    "linear": (nn.Linear,),
    "bn": (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm),
    "relu": (nn.ReLU, nn.ReLU6, nn.LeakyReLU),
    "smooth_act": (nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.SiLU, nn.GELU, nn.Hardsigmoid),
}


def leaf_kind(module: nn.Module) -> str:
    """Accounting kind of a leaf module; "free" for layers that cost nothing (pool, dropout...)."""
    for kind, types in KINDS.items():
        if isinstance(module, types):
            return kind
    kind = getattr(module, "accounting_kind", None)
    return kind if kind is not None else "free"


@dataclass
class Leaf:
    """One leaf layer call, in execution order."""

    name: str
    kind: str
    block: int
    part: str  # "backbone", "side" or "head"
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    groups: int = 1
    weight_trainable: bool = False
    bias_trainable: bool = False
    module: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def in_numel(self) -> int:
        return _numel(self.in_shape)

    @property
    def out_numel(self) -> int:
        return _numel(self.out_shape)


@dataclass
class BlockInfo:
    index: int
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    has_skip: bool


@dataclass
class Trace:
    leaves: list[Leaf]
    blocks: list[BlockInfo]
    input_shape: tuple[int, ...]
    trainable_params: int
    frozen_params: int

    def block(self, index: int) -> BlockInfo:
        for b in self.blocks:
            if b.index == index:
                return b
        raise KeyError(index)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _first_tensor(args) -> torch.Tensor:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("leaf called without a tensor input")


def trace_network(net: EdgeNet, resolution: int, batch_size: int = 1) -> Trace:
    """Run ``net`` on a meta tensor and record its leaf layers in execution order.

    The network is deep-copied to the meta device; ``net`` itself is not touched.
    Trainability (requires_grad) is read from ``net``.
    """
    # eval(): shapes are the same, and BN accepts 1x1 maps at batch 1
    meta = meta_copy(net).eval()
    mark_shapes_only(meta)
    return trace_meta(meta, dict(net.named_modules()), resolution, batch_size)


def trace_meta(meta: EdgeNet, originals: dict[str, nn.Module], resolution: int, batch_size: int,
               observer: TraceObserver | None = None) -> Trace:
    """``trace_network`` of a meta copy made already (shapes only), by a ``MetaTracer`` whose
    hooks are removed again. ``originals``: the modules each leaf names, by name."""
    x = torch.empty(batch_size, 3, resolution, resolution, device="meta", dtype=meta.input_dtype,
                    memory_format=meta.input_memory_format)
    with MetaTracer(meta, originals, observer) as tracer:
        return tracer.run(x)


class TraceObserver(Protocol):
    """Another view of the forward a ``MetaTracer`` traces (``edgetl.memory.flow``'s recorder)."""

    def run(self, meta: EdgeNet, x: torch.Tensor) -> torch.Tensor:
        """Run ``meta`` on ``x`` (under whatever the observer needs); returns the logits."""

    def leaf(self, leaf: Leaf, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """A leaf call, just recorded by the tracer as ``leaf``; ``module`` is the meta module."""


class MetaTracer:
    """Records the leaf calls and blocks of one forward of a meta network through forward hooks.

    A context manager: entering registers its bound-method hooks, leaving removes them. All
    its state is its own (nothing is written onto the modules): ``context`` the open
    (block, part) calls, ``leaves`` and ``blocks`` the records so far, ``_streaming`` which
    open streamed segments stream at this call. A streamed segment that streams is one leaf
    for the accounting: the blocks it runs are not seen.

    Args:
        meta: the network, on meta (shapes only).
        originals: the modules each leaf names, by name.
        observer: told of each leaf as it is recorded, and runs the forward (``TraceObserver``).
    """

    def __init__(self, meta: EdgeNet, originals: dict[str, nn.Module],
                 observer: TraceObserver | None = None) -> None:
        self.meta = meta
        self.originals = originals
        self.observer = observer
        self.arch = archs.get(meta.spec.arch)
        self.head = len(meta.features)  # the head's block number
        self.context: list[tuple[int, str]] = []
        self.leaves: list[Leaf] = []
        self.blocks: list[BlockInfo] = []
        self._streaming: dict[int, bool] = {}  # id(segment) -> streams at this call (open segments)
        self._calls: dict[int, tuple[int, str, str | None]] = {}  # id -> block, part, name (None: no BlockInfo)
        self._names: dict[int, str] = {}  # id(leaf module) -> its name
        self._handles: list = []

    def __enter__(self) -> MetaTracer:
        meta = self.meta
        for i, block in enumerate(meta.features):
            self._watch(block, (i, "backbone", self.arch.block_name(i)))
        if meta.side is not None:
            for tap, module in zip(meta.side.taps, meta.side.blocks):
                self._watch(module, (tap, "side", None))
        segments = {id(s) for s in (meta.streams.values() if meta.streams is not None else ())}
        for name, module in meta.named_modules():
            if len(list(module.children())) == 0:
                self._names[id(module)] = name
                if id(module) in segments:
                    self._hook(module, self._segment_enter, self._segment_leave)
                else:
                    self._handles.append(module.register_forward_hook(self._record))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def run(self, x: torch.Tensor) -> Trace:
        """One forward of the meta network on ``x`` (under no_grad, or as the observer runs it)."""
        with MetaMemo():
            if self.observer is not None:
                out = self.observer.run(self.meta, x)
            else:
                with torch.no_grad():
                    out = self.meta(x)
        self.blocks.append(BlockInfo(index=self.head, name="head", in_shape=self.blocks[-1].out_shape,
                                     out_shape=tuple(out.shape), has_skip=False))
        trainable = sum(p.numel() for p in self.meta.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.meta.parameters() if not p.requires_grad)
        return Trace(self.leaves, self.blocks, tuple(x.shape), trainable, frozen)

    def _hook(self, module: nn.Module, pre, post) -> None:
        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _watch(self, module: nn.Module, call: tuple[int, str, str | None]) -> None:
        self._calls[id(module)] = call
        self._hook(module, self._enter, self._leave)

    def _streamed_now(self) -> bool:
        """Inside a streamed segment that streams: its blocks are not seen."""
        return any(self._streaming.values())

    # ---- hooks

    def _enter(self, module: nn.Module, args) -> None:
        if not self._streamed_now():
            self.context.append(self._calls[id(module)][:2])

    def _leave(self, module: nn.Module, args, output) -> None:
        if self._streamed_now():
            return
        self.context.pop()
        index, _, name = self._calls[id(module)]
        if name is not None:
            self.blocks.append(BlockInfo(index=index, name=name, in_shape=tuple(_first_tensor(args).shape),
                                         out_shape=tuple(output.shape), has_skip=bool(self.arch.has_skip(module))))

    def _segment_enter(self, segment: nn.Module, args) -> None:
        # a segment at most its micro-batch long runs its blocks as they are (seen as blocks)
        streams = _first_tensor(args).shape[0] > segment.micro_batch
        self._streaming[id(segment)] = streams
        if streams:
            self.context.append((segment.start, "backbone"))

    def _segment_leave(self, segment: nn.Module, args, output) -> None:
        if not self._streaming.pop(id(segment)):
            return
        self.context.pop()
        self.blocks.append(BlockInfo(index=segment.start, name=f"features.{segment.start}:{segment.stop}",
                                     in_shape=tuple(_first_tensor(args).shape),
                                     out_shape=tuple(output.shape), has_skip=False))
        self._add(segment, args, output, segment.start, "backbone")

    def _record(self, module: nn.Module, args, output) -> None:
        if not self._streamed_now():
            self._add(module, args, output, *(self.context[-1] if self.context else (self.head, "head")))

    def _add(self, module: nn.Module, args, output, index: int, part: str) -> None:
        """Record the leaf call of ``module`` in block ``index``, then tell the observer."""
        name = self._names[id(module)]
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        leaf = Leaf(
            name=name,
            kind=leaf_kind(module),
            block=index,
            part=part,
            in_shape=tuple(_first_tensor(args).shape),
            out_shape=tuple(output.shape),
            groups=int(getattr(module, "groups", 1)),
            weight_trainable=isinstance(weight, torch.Tensor) and weight.requires_grad,
            bias_trainable=isinstance(bias, torch.Tensor) and bias.requires_grad,
            module=self.originals[name],
        )
        self.leaves.append(leaf)
        if self.observer is not None:
            self.observer.leaf(leaf, module, args, output)
