"""Shape tracing: a network in, its leaf layers in execution order (with shapes) out.

The forward pass runs on the meta device, so a 224 px MobileNetV2 traces in well under
a second with no real compute. Each leaf records which block it belongs to (backbone
block index, the side module attached to a tap block, or the head) so accountings can
be summed per block.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from edgetl.metaop import MetaMemo
from edgetl.models.backbone import HEAD_BLOCK, EdgeNet
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


def meta_copy(net: nn.Module) -> nn.Module:
    """A deep copy of ``net`` whose parameters and buffers are on the meta device (same
    shapes, dtypes and trainability; grads left out), made without copying their data:
    ``copy.deepcopy(net).to("meta")`` without the transient full copy of the weights."""
    return copy.deepcopy(net, meta_tensors([*net.parameters(), *net.buffers()]))


def meta_tensors(tensors) -> dict[int, torch.Tensor]:
    """The id of each tensor -> an empty meta tensor of its shape and dtype (a parameter stays
    a parameter of the same trainability): the deepcopy memo that makes a copy's tensors meta."""
    memo: dict[int, torch.Tensor] = {}
    for t in tensors:
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
        else:
            memo[id(t)] = torch.empty_like(t, device="meta")
    return memo


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
               leaves: list[Leaf] | None = None, run=None) -> Trace:
    """``trace_network`` of a meta copy made already (shapes only): its hooks are removed
    again. ``originals``: the modules each leaf names, by name. ``leaves``: a list to fill as
    the forward goes (an observer of the same forward reads it); ``run(meta, x)``: runs the
    forward (default: under no_grad), for an observer that registers hooks of its own after
    these, so a leaf is recorded here before the observer's forward hook sees it.
    """
    leaves = leaves if leaves is not None else []
    blocks: list[BlockInfo] = []
    context: list[tuple[int, str]] = []
    handles = []
    # inside a streamed segment (one leaf for the accounting) its blocks are not seen
    streaming = {"depth": 0}

    def enter(index: int, part: str):
        def hook(module, args):
            if not streaming["depth"]:
                context.append((index, part))

        return hook

    def leave(index: int, name: str, track: bool):
        def hook(module, args, output):
            if streaming["depth"]:
                return
            context.pop()
            if track:
                x = _first_tensor(args)
                blocks.append(
                    BlockInfo(
                        index=index,
                        name=name,
                        in_shape=tuple(x.shape),
                        out_shape=tuple(output.shape),
                        has_skip=bool(getattr(module, "use_res_connect", False)),
                    )
                )

        return hook

    def record(name: str):
        def hook(module, args, output):
            if streaming["depth"] or not getattr(module, "_streamed", True):
                return  # inside a streamed segment, or a segment that ran its blocks as they are
            index, part = context[-1] if context else (HEAD_BLOCK, "head")
            if getattr(module, "_streamed", False):  # its own context is closed by now
                index, part = module.start, "backbone"
            weight = getattr(module, "weight", None)
            bias = getattr(module, "bias", None)
            leaves.append(
                Leaf(
                    name=name,
                    kind=leaf_kind(module),
                    block=index,
                    part=part,
                    in_shape=tuple(_first_tensor(args).shape),
                    out_shape=tuple(output.shape),
                    groups=int(getattr(module, "groups", 1)),
                    weight_trainable=isinstance(weight, torch.Tensor) and weight.requires_grad,
                    bias_trainable=isinstance(bias, torch.Tensor) and bias.requires_grad,
                    module=originals[name],
                )
            )

        return hook

    def stream_enter(segment, args):
        if _first_tensor(args).shape[0] > segment.micro_batch:  # else it runs its blocks as they are
            context.append((segment.start, "backbone"))
            streaming["depth"] += 1
            segment._traced = True

    def stream_leave(segment, args, output):
        segment._streamed = getattr(segment, "_traced", False)  # read by record, which runs next
        if segment._streamed:
            segment._traced = False
            streaming["depth"] -= 1
            context.pop()
            blocks.append(BlockInfo(index=segment.start, name=f"features.{segment.start}:{segment.stop}",
                                    in_shape=tuple(_first_tensor(args).shape),
                                    out_shape=tuple(output.shape), has_skip=False))

    for i, block in enumerate(meta.features):
        handles.append(block.register_forward_pre_hook(enter(i, "backbone")))
        handles.append(block.register_forward_hook(leave(i, f"features.{i}", True)))
    if meta.side is not None:
        for tap, module in zip(meta.side.taps, meta.side.blocks):
            handles.append(module.register_forward_pre_hook(enter(tap, "side")))
            handles.append(module.register_forward_hook(leave(tap, "side", False)))
    for segment in (meta.streams.values() if meta.streams is not None else ()):
        handles.append(segment.register_forward_pre_hook(stream_enter))
        handles.append(segment.register_forward_hook(stream_leave))
    for name, module in meta.named_modules():
        if len(list(module.children())) == 0:
            handles.append(module.register_forward_hook(record(name)))

    x = torch.empty(batch_size, 3, resolution, resolution, device="meta",
                    dtype=meta.input_dtype)
    try:
        with MetaMemo():
            if run is not None:
                out = run(meta, x)
            else:
                with torch.no_grad():
                    out = meta(x)
    finally:
        for h in handles:
            h.remove()
    blocks.append(
        BlockInfo(
            index=HEAD_BLOCK,
            name="head",
            in_shape=blocks[-1].out_shape,
            out_shape=tuple(out.shape),
            has_skip=False,
        )
    )
    trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in meta.parameters() if not p.requires_grad)
    return Trace(leaves, blocks, tuple(x.shape), trainable, frozen)
