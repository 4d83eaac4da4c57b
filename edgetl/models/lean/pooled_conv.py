"""Pooled conv: an nn.Conv2d in, a conv that keeps its input average-pooled by k for backward out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.nn.grad import conv2d_weight

from edgetl.errors import ConfigError
from edgetl.models.lean.convgrad import conv_input_grad
from edgetl.models.lean.layout import empty_as
from edgetl.options import POOLS

# A conv input is stored pooled only while the pooled map keeps at least this many cells
# on each side (see ``effective_pool``).
MIN_POOLED_SIDE = 4


def effective_pool(k: int, hw: tuple[int, int]) -> int:
    """The pool factor a conv input of spatial size ``hw`` is really stored with, for a requested k.

    The largest factor in POOLS, at most k, that leaves the pooled map at least
    MIN_POOLED_SIDE cells on each side; 1 (exact) when none does. Barley & Fröning note
    pooling "could also be selectively disabled on a per-layer basis"; here small maps
    are where it must be: pooling a 4x4 map to 2x2 (or 2x2 to 1x1) under a 5x5 kernel
    leaves the weight gradient a cosine of 0.57-0.64 from exact on real side activations
    (Fashion-MNIST, 64 px), against 0.77-0.91 for the 8x8 maps, while saving 1.4 kB an
    image (tests/test_lean.py); pooling them cost 2.8 points of fine-tuning accuracy. The
    big early maps, which hold nearly all the stored bytes, still pool.
    """
    side = min(hw)
    for factor in sorted((f for f in POOLS if f <= k), reverse=True):
        if side // factor >= MIN_POOLED_SIDE:
            return factor
    return 1


def pool_for_save(x: torch.Tensor, k: int) -> torch.Tensor:
    """The compressed copy of a conv input kept for backward: ``x`` average-pooled by k.

    ceil_mode keeps a partial cell at the bottom/right edge when H or W is not divisible
    by k; count_include_pad=False makes that cell the mean of its real elements only.
    """
    if k == 1:
        return x
    return F.avg_pool2d(x, k, k, ceil_mode=True, count_include_pad=False)


def inflate_saved(saved: torch.Tensor, k: int, hw: tuple[int, int]) -> torch.Tensor:
    """Nearest-upsample a pooled input by k and crop it to the original (H, W).

    The result is one (N, C, H, W) tensor, contiguous or channels-last as ``saved`` is, written by broadcast copies: no
    k-times intermediate (repeat_interleave), and no cropped view handed to the weight
    gradient's kernel, which on CUDA would copy it contiguous again (issue #17 item 5).
    """
    if k == 1:
        return saved
    h, w = hw
    n, c = saved.shape[:2]
    out = empty_as(saved, (n, c, h, w))  # laid out as the saved input (channels-last or not)
    hf, wf = h // k, w // k  # whole k x k cells; a partial last row/column of cells follows
    rh, rw = h - hf * k, w - wf * k
    out[:, :, :hf * k, :wf * k].unflatten(3, (wf, k)).unflatten(2, (hf, k)).copy_(
        saved[:, :, :hf, None, :wf, None].expand(n, c, hf, k, wf, k))
    if rh:
        out[:, :, hf * k:, :wf * k].unflatten(3, (wf, k)).copy_(
            saved[:, :, hf:hf + 1, :wf, None].expand(n, c, rh, wf, k))
    if rw:
        out[:, :, :hf * k, wf * k:].unflatten(2, (hf, k)).copy_(
            saved[:, :, :hf, None, wf:wf + 1].expand(n, c, hf, k, rw))
    if rh and rw:
        out[:, :, hf * k:, wf * k:].copy_(saved[:, :, hf:hf + 1, wf:wf + 1].expand(n, c, rh, rw))
    return out


def _is_pointwise(w_shape, stride, padding, dilation) -> bool:
    return (
        tuple(w_shape[-2:]) == (1, 1)
        and tuple(stride) == (1, 1)
        and tuple(padding) == (0, 0)
        and tuple(dilation) == (1, 1)
    )


def pooled_grad_weight(
    saved: torch.Tensor,
    in_hw: tuple[int, int],
    w_shape,
    grad_output: torch.Tensor,
    stride,
    padding,
    dilation,
    groups: int,
    k: int,
) -> torch.Tensor:
    """grad_weight of a conv from its pooled input (``pool_for_save(x, k)``).

    This is the only place where the pooled-activation approximation enters: the true
    input x is replaced by the nearest-upsampled, cropped pooled input. For k=1 the result
    is exact. For a 1x1 stride-1 conv, sum_{h,w} gy[h,w] * up(z)[h,w] equals
    sum_{cells} z[cell] * (sum of gy over the cell), so grad_output is sum-pooled instead
    of upsampling the input (same value, k^2 less work and memory).
    """
    if k == 1:
        return conv2d_weight(saved, w_shape, grad_output, stride, padding, dilation, groups)
    if _is_pointwise(w_shape, stride, padding, dilation):
        g = F.avg_pool2d(grad_output, k, k, ceil_mode=True, divisor_override=1)
        return conv2d_weight(saved, w_shape, g, 1, 0, 1, groups)
    x = inflate_saved(saved, k, in_hw)
    return conv2d_weight(x, w_shape, grad_output, stride, padding, dilation, groups)


class _PooledConv2dFn(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, k):
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.conf = (stride, padding, dilation, groups, k, tuple(x.shape))
        ctx.has_bias = bias is not None
        saved = pool_for_save(x, k) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(saved, weight)
        return y

    @staticmethod
    def backward(ctx, gy):
        saved, weight = ctx.saved_tensors
        stride, padding, dilation, groups, k, in_shape = ctx.conf
        gx = gw = gb = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.sum((0, 2, 3))  # first: the accounting counts parameter gradients from the start
        if ctx.needs_input_grad[0]:
            # exact: the input gradient needs only the weight
            gx = conv_input_grad(in_shape, weight, gy, stride, padding, dilation, groups)
        if ctx.needs_input_grad[1]:
            gw = pooled_grad_weight(
                saved, in_shape[-2:], weight.shape, gy, stride, padding, dilation, groups, k
            )
        return gx, gw, gb, None, None, None, None, None


class PooledConv2d(nn.Conv2d):
    """nn.Conv2d with an exact forward that keeps its input average-pooled by ``pool`` for backward.

    grad_input is exact; grad_weight is recomputed from the upsampled pooled input (see
    ``pooled_grad_weight``). ``pool`` is the requested factor; an input whose pooled map
    would be small is stored with a smaller one (``pool_for``, ``effective_pool``).
    Same parameters and state_dict keys as nn.Conv2d.
    """

    def __init__(self, *args, pool: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            raise ConfigError("PooledConv2d supports numeric zero padding only")
        self.pool = _check_pool(pool)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, pool: int = 2) -> "PooledConv2d":
        new = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
            pool=pool,
        )
        new.load_state_dict(conv.state_dict())
        new.weight.requires_grad_(conv.weight.requires_grad)
        if conv.bias is not None:
            new.bias.requires_grad_(conv.bias.requires_grad)
        return new

    def pool_for(self, in_shape) -> int:
        """The factor an input of this shape is stored with (``effective_pool`` of ``pool``)."""
        return effective_pool(self.pool, tuple(in_shape[-2:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PooledConv2dFn.apply(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
            self.pool_for(x.shape),
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", pool={self.pool}"


def _check_pool(pool: int) -> int:
    if pool not in POOLS:
        raise ConfigError(f"activation pool must be one of {POOLS}, got {pool!r}")
    return int(pool)


def grad_weight_cosine(
    conv: nn.Conv2d, x: torch.Tensor, k: int, grad_output: torch.Tensor | None = None, seed: int = 0
) -> float:
    """Cosine similarity between a conv's exact grad_weight and the one pooled storage by k gives.

    Args:
        conv: the conv (its weight and geometry are used; it is not modified).
        x: a conv input batch.
        k: pool factor.
        grad_output: the output gradient; white noise from ``seed`` when omitted.
    """
    with torch.no_grad():
        y = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        if grad_output is None:
            gen = torch.Generator(device=x.device).manual_seed(seed)
            grad_output = torch.randn(y.shape, generator=gen, device=x.device, dtype=x.dtype)
        args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        exact = conv2d_weight(x, conv.weight.shape, grad_output, *args)
        approx = pooled_grad_weight(
            pool_for_save(x, k), tuple(x.shape[-2:]), conv.weight.shape, grad_output, *args, k
        )
        return float(F.cosine_similarity(exact.flatten(), approx.flatten(), dim=0))

