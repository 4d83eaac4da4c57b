"""Masked ReLU: a tensor nothing else saved in, the same tensor clamped in place out, keeping
only a packed 1-bit mask for backward (ReLU6 with ``upper=6``, ReLU with ``upper=None``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function

from edgetl.models.lean.fused import clamp_pack_, fusable
from edgetl.models.lean.frozen import _act_mask, _masked
from edgetl.models.lean.layout import is_channels_last


class _MaskedReLUFn(Function):
    @staticmethod
    def forward(ctx, y, upper, chunk, shapes_only=False, kernels="aten"):
        kernels = "fused" if kernels == "fused" and fusable(y) else "aten"  # fused: where it packs as torch's ops do
        ctx.shape, ctx.channels_last, ctx.kernels = tuple(y.shape), is_channels_last(y), kernels
        ctx.mark_dirty(y)
        if shapes_only:  # a meta trace: the same tensor back, no values
            return y
        if ctx.needs_input_grad[0] and kernels == "fused":  # clamped and packed in one pass
            ctx.save_for_backward(clamp_pack_(y, upper))
            return y
        y = y.clamp_(0, upper) if upper is not None else y.clamp_(min=0)
        if ctx.needs_input_grad[0]:  # the mask of the clamped output (``_act_mask``)
            ctx.save_for_backward(_act_mask(y, chunk, upper))
        return y

    @staticmethod
    def backward(ctx, gy):
        (packed,) = ctx.saved_tensors
        return _masked(gy, packed, ctx.shape, ctx.kernels, ctx.channels_last), None, None, None, None


class LeanReLU(nn.Module):
    """ReLU (``upper=None``) or ReLU clamped at ``upper`` in place, keeping only a packed 1-bit
    mask of 0 < y (< upper); stock in-place ReLU keeps its output, ReLU6 a clone of its input.

    The mask is built one sample at a time where each sample's bits fill whole bytes
    (``edgetl.models.lean.frozen._act_mask``); the backward multiplies the unpacked mask into
    grad_output. Its input must be a tensor nothing else saved: a conv's output, or the sum
    of a residual block's last conv and its shortcut (``LeanResidualBlock``).
    """

    inplace = True  # the runtime trace reads this: the output is the input's storage
    shapes_only = False  # a meta copy only traced forward (``mark_shapes_only``): no mask, no clamp
    mask_kernels = "aten"  # or "fused" (``edgetl.models.lean.fused``; ``set_mask_kernels``)

    def __init__(self, upper: float | None = None):
        super().__init__()
        self.upper = None if upper is None else float(upper)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return _MaskedReLUFn.apply(y, self.upper, 1, self.shapes_only, self.mask_kernels)

    def extra_repr(self) -> str:
        return f"upper={self.upper}"


class LeanReLU6(LeanReLU):
    """``LeanReLU(6)``: the class MobileNetV2's lean full network has always held (tests and
    readers replace it by ``nn.ReLU6`` by type)."""

    def __init__(self):
        super().__init__(6.0)
