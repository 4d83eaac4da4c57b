"""Lean runtime layers: stock conv/BN/ReLU6 modules in, modules that save only what backward needs out.

DESIGN 4. Every layer here is a ``torch.autograd.Function`` whose forward is exact and
whose saved-for-backward tensors are chosen by hand:

    module              saved for backward (when a backward through it is needed)
    PooledConv2d        its input average-pooled by k (k=1: the exact input); small maps
                        pool less or not at all (effective_pool)
    LeanAvgPool2d       nothing (only the input shape)
    LeanGlobalAvgPool   nothing
    FrozenConvBNAct     fold / eval BN: a 1-bit ReLU6 mask (nothing without activation);
                        batch BN in training: the conv output + per-channel mean, invstd
    LeanSideTail        BN1's input + per-channel batch stats (conv2's input, the ReLU
                        mask and BN2's input are recomputed in backward)

Saved-bytes contract, for the runtime accounting (edgetl/memory/runtime.py):
every lean module has a class attribute ``saved_rule`` (a short name of the rule above)
and a method ``saved_bytes(in_shape, out_shape) -> int``: the bytes of *new* storage it
saves for backward for one call with those shapes, assuming a backward through it is
needed (its input requires grad or one of its parameters trains). Parameters and buffers
it keeps a reference to are not counted (they are already counted as parameters). When
no backward is needed (e.g. frozen layers before the first side tap, or under
``torch.no_grad``) it saves 0. ``predicted_saved_bytes`` sums the rule over a real
forward; ``count_saved_bytes`` measures the same thing with ``saved_tensors_hooks``;
tests check that the two agree to the byte.

Runtime-accounting contract: every lean leaf also has ``runtime_cost(...) -> LayerCost``
(see edgetl/memory/runtime.py): saved bytes plus the largest forward and backward
temporaries, derived from the allocations its code makes (dequantised weights, cast
copies, mask construction, per-sample masked gradients, upsampled pooled inputs).
tests/test_lean_runtime.py checks the whole step against the meter to the byte. Keep
the two in step when changing a forward or backward here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.nn.grad import conv2d_input, conv2d_weight

from edgetl.errors import CapabilityError, ConfigError
from edgetl.imagenet import IMAGENET_MEAN, IMAGENET_STD
from edgetl.memory.cost import LayerCost, dtype_bytes as _dtype_bytes, numel as _numel, over as _over

POOLS = (1, 2, 4)
# A conv input is stored pooled only while the pooled map keeps at least this many cells
# on each side (see ``effective_pool``).
MIN_POOLED_SIDE = 4
BN_MODES = ("fold", "batch")
WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
# fp32 values per chunk when an int8 weight is dequantised into a half one: the fp32 copy of
# the widest frozen conv (1280 x 320) alone would be 1.6 MB at the streamed step's peak
DEQUANT_CHUNK = 1 << 16
ACT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------- 1-bit masks


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor in, a flat uint8 tensor of ceil(numel / 8) bytes out (bit i of byte j = element 8j+i)."""
    return pack_mask_(mask.reshape(-1).to(torch.uint8, copy=True))


def pack_mask_(mask: torch.Tensor) -> torch.Tensor:
    """``pack_mask`` that consumes its bool/uint8 argument as scratch."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    flat = F.pad(flat.view(torch.uint8), (0, pad)) if pad else flat.view(torch.uint8)
    return _fold_bits_(flat).contiguous()


def _fold_bits_(flat: torch.Tensor) -> torch.Tensor:
    """Pack contiguous 0/1 bytes (a multiple of 8, overwritten) 8 to a byte: a strided view.

    Each group of 8 bytes, read as one little-endian int64, holds its element i at bit
    8i; three shift-ors move bits 8i to bits i of the lowest byte, which is returned.
    One temporary the size of ``flat`` (the shifted copy); vectorised int64 work, 2-3x
    faster than multiplying by powers of two and summing each group (on CPU).
    """
    x = flat.view(torch.int64)
    for shift in (7, 14, 28):
        x |= x >> shift
    return flat.view(-1, 8)[:, 0]


def unpack_mask(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of ``pack_mask``: the packed bytes and the original shape in, a bool tensor out."""
    return unpack_as(packed, shape, unpack_table(torch.bool, packed.device))


def unpack_table(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A (256, 8) table in ``dtype``: row j holds the bits of byte j as 0 and 1, bit i in
    column i (the order of ``pack_mask``). Built where it is used (2048 values), so it
    is never a hidden persistent buffer."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    return torch.bitwise_right_shift(codes.unsqueeze(1), shifts).bitwise_and_(1).to(dtype)


UNPACK_TABLE_BUILD = 256 + 8 + 256 * 8  # bytes alive next to the table while it is built


def unpack_as(packed: torch.Tensor, shape, table: torch.Tensor) -> torch.Tensor:
    """``unpack_mask`` as 0 and 1 in the table's dtype, ready to multiply a gradient in
    place: one gather of 8-value rows, with int32 row indices (4 bytes a packed byte) the
    only temporary. About 2x faster than shifting bits and casting them, and never
    ``grad * bool_mask``, which on CPU casts the mask inside the kernel to a hidden
    full-size copy (memory no tensor meter sees) and runs 3-5x slower."""
    rows = table.index_select(0, packed.int())
    return rows.view(-1)[: _numel(shape)].view(shape)


def mask_bytes(numel: int) -> int:
    return (int(numel) + 7) // 8


def _pack_phases(numel: int) -> list[int]:
    """Bytes alive (the bool mask included) while ``pack_mask_`` runs on a fresh mask."""
    padded = numel + (-numel) % 8
    if padded != numel:  # a padded copy, its shifted copy, then the packed bytes
        return [numel + 2 * padded, numel + padded + mask_bytes(numel)]
    return [2 * numel, numel + mask_bytes(numel)]


# --------------------------------------------------------------------------- pooled conv


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

    The result is one contiguous (N, C, H, W) tensor written by broadcast copies: no
    k-times intermediate (repeat_interleave), and no cropped view handed to the weight
    gradient's kernel, which on CUDA would copy it contiguous again (issue #17 item 5).
    """
    if k == 1:
        return saved
    h, w = hw
    n, c = saved.shape[:2]
    out = saved.new_empty((n, c, h, w))
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
            gx = conv2d_input(in_shape, weight, gy, stride, padding, dilation, groups)
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

    saved_rule = "pooled_input"

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

    def saved_bytes(self, in_shape, out_shape) -> int:
        if not self.weight.requires_grad:
            return 0
        n, c, h, w = in_shape
        k = self.pool_for(in_shape)
        return n * c * (-(-h // k)) * (-(-w // k)) * self.weight.element_size()

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, input_requires_grad,
                     output_requires_grad, in_bytes=None) -> LayerCost:
        """Runtime accounting rule (edgetl.memory.runtime): the pooled input is kept.

        Backward: the bias gradient (first: the accounting counts parameter gradients
        from the start of a layer's backward), conv2d_input (a 1-element dummy input, then
        grad_input), then grad_weight: from the input upsampled back to its (H, W) (one contiguous copy), from
        sum-pooled grad_output for a pointwise conv, or from the exact input at k=1.
        """
        grad = output_requires_grad
        e = self.weight.element_size()
        k = self.pool_for(in_shape)
        trains = self.weight.requires_grad
        if not grad:
            return LayerCost()
        saved = self.saved_bytes(in_shape, out_shape) if trains and k > 1 else 0
        gx = _numel(in_shape) * e if input_requires_grad else 0
        gw = self.weight.numel() * e if trains else 0
        gb = self.bias.numel() * e if self.bias is not None and self.bias.requires_grad else 0
        phases = [gb + gx + (e if gx else 0), gb + gx]
        if trains:
            if k == 1:
                scratch = 0
            elif _is_pointwise(self.weight.shape, self.stride, self.padding, self.dilation):
                n, c, h, w = out_shape
                scratch = n * c * (-(-h // k)) * (-(-w // k)) * e
            else:
                scratch = _numel(in_shape) * e
            phases.append(gb + gx + scratch + e + gw)
        return LayerCost(saves_input=trains and k == 1, saved_new_bytes=saved,
                         backward_temp_bytes=_over(phases, gx + gw + gb))

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


# --------------------------------------------------------------------------- pooling that saves nothing


class _AvgPoolFn(Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.conf = (k, tuple(x.shape), x.dtype)
        return F.avg_pool2d(x, k)

    @staticmethod
    def backward(ctx, gy):
        k, shape, dtype = ctx.conf
        n, c, h, w = shape
        hp, wp = gy.shape[-2:]
        # Every cell of a k x k window gets the window's gradient / k^2 (floor mode: the rows
        # and columns no window covers get 0), written straight into grad_input by a
        # broadcast copy. No full-size temporary on any device: avg_pool2d_backward would
        # need a stand-in for the input, and its CUDA kernel makes that contiguous (issue 17).
        covered = (hp * k, wp * k) == (h, w)
        gx = gy.new_empty(shape, dtype=dtype) if covered else gy.new_zeros(shape, dtype=dtype)
        windows = gx[:, :, :hp * k, :wp * k].unflatten(3, (wp, k)).unflatten(2, (hp, k))
        windows.copy_(gy[:, :, :, None, :, None].expand(n, c, hp, k, wp, k))
        return gx.div_(k * k), None


class LeanAvgPool2d(nn.AvgPool2d):
    """nn.AvgPool2d(k) (stride k, floor mode) that saves nothing for backward (stock saves its input)."""

    saved_rule = "none"

    def __init__(self, kernel_size: int):
        super().__init__(kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AvgPoolFn.apply(x, self.kernel_size)

    def saved_bytes(self, in_shape, out_shape) -> int:
        return 0

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, input_requires_grad,
                     output_requires_grad, in_bytes=None) -> LayerCost:
        # backward writes grad_input directly: nothing beyond it
        return LayerCost()


def by_micro_batch(x: torch.Tensor, m: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` over ``m`` rows of ``x`` at a time, each part copied into one batch-sized output
    (allocated once the first part shows its shape) and dropped."""
    n = x.shape[0]
    out = None
    for i in range(0, n, m):
        part = fn(x[i:i + m])
        if out is None:
            out = part.new_empty((n, *part.shape[1:]))
        out[i:i + part.shape[0]].copy_(part)
        del part
    return out


class InputNorm(nn.Module):
    """uint8 images (0-255, NCHW) in, the loaders' normalised batch out in ``out_dtype``
    (issue #14 item 2): the same values as torchvision's ``ToTensor`` + ``Normalize`` and a
    cast, bit for bit (``x.float() / 255``, then ``- mean``, ``/ std`` in fp32).

    The batch then stays uint8 (1 byte a value) until a micro-batch of the first streamed
    segment, or the side network's image pool, needs it. A half output is filled one sample
    at a time through an fp32 sample. A float batch (already normalised: export, a caller's
    own tensors) passes through unchanged. The statistics are non-persistent buffers, so
    checkpoints and the exported model, whose input stays the normalised float batch the
    preprocessing metadata describes, do not change."""

    saved_rule = "none"

    def __init__(self, mean=None, std=None, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean or IMAGENET_MEAN).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std or IMAGENET_STD).view(1, -1, 1, 1), persistent=False)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` without module hooks: for callers that are one leaf of the accounting."""
        if x.dtype != torch.uint8:
            return x
        if self.out_dtype == torch.float32:
            return x.float().div_(255).sub_(self.mean).div_(self.std)
        out = torch.empty(x.shape, dtype=self.out_dtype, device=x.device)
        for i in range(x.shape[0]):
            out[i:i + 1].copy_(x[i:i + 1].float().div_(255).sub_(self.mean).div_(self.std))
        return out

    def sample_temp_bytes(self, in_shape) -> int:
        """The fp32 sample a half output is filled through (0 for an fp32 output)."""
        return 0 if self.out_dtype == torch.float32 else _numel(in_shape[1:]) * 4

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, input_requires_grad,
                     output_requires_grad, in_bytes=None) -> LayerCost:
        return LayerCost(forward_temp_bytes=self.sample_temp_bytes(in_shape) if in_bytes == 1 else 0,
                         grad_input=False)


class ImagePool(LeanAvgPool2d):
    """The side network's pool of the image; a uint8 image is normalised (``norm``) and pooled
    ``micro_batch`` samples at a time into the batch-sized pooled map, so no normalised
    batch-sized image exists (``edgetl.models.stream.apply_streams`` sets both)."""

    def __init__(self, kernel_size: int):
        super().__init__(kernel_size)
        self._norm: tuple[InputNorm, ...] = ()
        self.micro_batch: int | None = None

    def set_input(self, norm: InputNorm | None, micro_batch: int | None) -> None:
        self._norm = (norm,) if norm is not None else ()
        self.micro_batch = micro_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            return super().forward(x)
        if not self._norm:
            raise ConfigError("a uint8 image reached the side network's image pool without its normalisation")
        norm = self._norm[0]
        return by_micro_batch(x, self.micro_batch or x.shape[0],
                              lambda rows: F.avg_pool2d(norm.normalize(rows), self.kernel_size))

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, input_requires_grad,
                     output_requires_grad, in_bytes=None) -> LayerCost:
        if in_bytes != 1:
            return super().runtime_cost(in_shape=in_shape, out_shape=out_shape, act_bytes=act_bytes,
                                        input_requires_grad=input_requires_grad,
                                        output_requires_grad=output_requires_grad, in_bytes=in_bytes)
        n, norm = int(in_shape[0]), self._norm[0]
        m = min(self.micro_batch or n, n)
        # one micro-batch normalised (through its fp32 sample), then its pooled rows
        rows = _numel((m, *in_shape[1:])) * act_bytes
        phases = [rows + norm.sample_temp_bytes(in_shape), rows + _numel((m, *out_shape[1:])) * act_bytes]
        return LayerCost(forward_temp_bytes=max(phases), grad_input=False)


class _GlobalPoolFn(Function):
    @staticmethod
    def forward(ctx, x, out_dtype):
        ctx.conf = (tuple(x.shape), x.dtype)
        return x.mean((2, 3), keepdim=True, dtype=out_dtype)

    @staticmethod
    def backward(ctx, gy):
        shape, dtype = ctx.conf
        g = (gy / (shape[2] * shape[3])).to(dtype)
        return g.expand(shape).contiguous(), None


class LeanGlobalAvgPool(nn.AdaptiveAvgPool2d):
    """Global average pool to 1x1 computed (and returned) in ``out_dtype``; saves nothing."""

    saved_rule = "none"

    def __init__(self, out_dtype: torch.dtype = torch.float32):
        super().__init__(1)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GlobalPoolFn.apply(x, self.out_dtype)

    def saved_bytes(self, in_shape, out_shape) -> int:
        return 0

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, input_requires_grad,
                     output_requires_grad, in_bytes=None) -> LayerCost:
        in_bytes = in_bytes or act_bytes
        nc = int(in_shape[0]) * int(in_shape[1])
        gx = _numel(in_shape) * in_bytes if input_requires_grad else 0
        # backward: gy / (H*W) in fp32, cast to the input dtype, then expanded into grad_input
        phases = [nc * 4 + (nc * in_bytes if in_bytes != 4 else 0), nc * in_bytes + gx]
        return LayerCost(backward_temp_bytes=_over(phases, gx))


# --------------------------------------------------------------------------- frozen backbone


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight in, (int8 codes, fp32 scale per channel) out.

    Dequantised weight = codes * scale; each element is off by at most scale / 2.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=tuple(range(1, w.dim())))
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    view = (-1,) + (1,) * (w.dim() - 1)
    codes = torch.round(w / scale.view(view)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def _bn_scale(bn: nn.BatchNorm2d) -> torch.Tensor:
    return bn.weight.detach().float() * torch.rsqrt(bn.running_var.float() + bn.eps)


class FrozenConvBNAct(nn.Module):
    """A frozen conv (+ BN, + optional ReLU6) that never saves its input.

    grad_input comes from the weight alone (``conv2d_input``). With ``bn="fold"`` the BN
    (eval statistics) is folded into the conv's weight and bias and the only thing saved
    is a 1-bit ReLU6 mask. With ``bn="batch"`` the BN uses batch statistics in training
    (and updates its running statistics), which forces keeping the conv output (BN's
    backward needs it) plus per-channel mean and invstd; the ReLU6 mask is recomputed from
    them. The frozen weight is stored as fp32, fp16 or per-output-channel int8 and
    dequantised per call into the activation dtype (a large 1x1 weight a chunk at a time,
    ``chunked``, unless the schedule allows it whole). The only trainable parameter allowed
    is ``bias`` (the BN beta, folded or not), for the "repnet+bias" mode.
    """

    saved_rule = "relu6_mask|batch_bn_output"

    def __init__(
        self,
        conv: nn.Conv2d,
        bn: nn.BatchNorm2d,
        act: bool,
        *,
        bn_mode: str = "fold",
        weight_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if conv.weight.requires_grad or (conv.bias is not None and conv.bias.requires_grad):
            raise ConfigError("the lean backbone needs frozen conv weights (modes full/bn+last cannot use it)")
        if bn.weight.requires_grad:
            raise ConfigError("the lean backbone needs frozen BN scales (mode bn+last cannot use it)")
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ConfigError("the lean backbone supports numeric zero padding only")
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = conv.kernel_size
        self.pointwise = conv.groups == 1 and _is_pointwise(conv.weight.shape, conv.stride, conv.padding, conv.dilation)
        self.act = bool(act)
        # output shapes whose masked backward runs on the whole batch at once (faster; one
        # masked copy of grad_output per sample more): set by
        # edgetl.memory.schedule.apply_schedule, where the step's peak allows it
        self.whole_batch_shapes: frozenset[tuple[int, ...]] = frozenset()
        # output shape -> samples per chunk while the forward packs the ReLU6 mask (1 when
        # absent: the least memory, the most kernel launches); set by apply_schedule too
        self.mask_chunks: dict[tuple[int, ...], int] = {}
        # convert the stored weight whole per call (fewer, larger kernels) rather than a
        # chunk at a time (``chunked``, the default where it applies): set by apply_schedule
        # too, where the step's peak allows it
        self.whole_weight = False
        self.bn_mode = bn_mode
        self.act_dtype = act_dtype
        weight = conv.weight.detach().float()
        conv_bias = conv.bias.detach().float() if conv.bias is not None else torch.zeros_like(bn.running_mean, dtype=torch.float32)
        beta = bn.bias.detach().float()
        if bn_mode == "fold":
            scale = _bn_scale(bn)
            weight = weight * scale.view(-1, 1, 1, 1)
            bias = beta + (conv_bias - bn.running_mean.float()) * scale
        else:
            if conv.bias is not None:
                raise ConfigError("bn='batch' expects a conv without bias before the BN")
            bias = beta
            self.register_buffer("bn_weight", bn.weight.detach().float().clone())
            self.register_buffer("running_mean", bn.running_mean.detach().float().clone())
            self.register_buffer("running_var", bn.running_var.detach().float().clone())
            self.register_buffer("num_batches_tracked", bn.num_batches_tracked.detach().clone())
            self.eps, self.momentum = bn.eps, bn.momentum
        self.bias = nn.Parameter(bias.clone(), requires_grad=bn.bias.requires_grad)
        self.weight_dtype = weight_dtype
        if weight_dtype == torch.int8:
            codes, scale = quantize_int8(weight)
            self.register_buffer("weight", codes)
            self.register_buffer("weight_scale", scale)
        else:
            self.register_buffer("weight", weight.to(weight_dtype))
            self.weight_scale = None

    accounting_kind = "lean_frozen_conv"

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.act_dtype
        if self.weight_scale is None:
            return self.weight.to(dtype)
        scale = self.weight_scale.view(-1, 1, 1, 1)
        if dtype == torch.float32:  # one fp32 buffer, scaled in place (same values as codes * scale)
            return self.weight.float().mul_(scale)
        # a half weight: dequantised a few output channels at a time through a small fp32
        # chunk (the same values as the whole weight in fp32 cast at once)
        out = torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device)
        rows = self._dequant_rows()
        for i in range(0, out.shape[0], rows):
            out[i:i + rows].copy_(self.weight[i:i + rows].float().mul_(scale[i:i + rows]))
        return out

    def _dequant_rows(self) -> int:
        """Output channels dequantised at a time into a half weight (``DEQUANT_CHUNK`` values)."""
        per_row = self.weight[0].numel()
        return max(1, min(self.weight.shape[0], DEQUANT_CHUNK // per_row))

    @property
    def chunked(self) -> bool:
        """Whether this conv runs on its weight a chunk at a time (``chunkable``, and the
        schedule did not allow the whole weight for it: ``whole_weight``)."""
        return not self.whole_weight and self.chunkable

    @property
    def chunkable(self) -> bool:
        """Whether this conv can run on its weight a chunk at a time and never hold it whole
        in the activation dtype: a 1x1 conv whose stored weight (int8, or a float dtype other
        than the activations') needs converting and is larger than one chunk. Its forward
        computes ``DEQUANT_CHUNK`` weights' worth of output channels at a time, its
        grad_input as many input channels at a time (each with the full sum over the other
        side, so no partial sums are rounded), one matrix product per sample written into
        the batch-sized result. Only where a chunk (int8: its fp32 and act-dtype copies)
        peaks below converting the whole weight (int8 under a half dtype: the whole half
        weight plus its fp32 chunk), i.e. above one chunk; a smaller weight is converted
        whole once per call, as before. That compares the conversions alone, which is what
        matters inside a streamed segment's small micro-batches; where a batch-sized output
        sits next to the weight, the whole weight (held with it) can be the smaller one, and
        the schedule chooses per conv (``whole_weight``)."""
        if not (self.pointwise and self.weight.dtype != self.act_dtype):
            return False
        a = _dtype_bytes(self.act_dtype)
        return max(self.row_chunk_peak(a), self.col_chunk_peak(a)) < self._dequant_bytes(a)[1]

    @staticmethod
    def _chunk_size(other: int) -> int:
        """Rows (or columns) of a chunk: ``DEQUANT_CHUNK`` weights, at least one row."""
        return max(1, DEQUANT_CHUNK // other)

    def weight_chunk(self, rows: slice, cols: slice, dtype: torch.dtype) -> torch.Tensor:
        """``weight[rows, cols]`` of a 1x1 conv as a contiguous (rows, cols) matrix in ``dtype``:
        int8 dequantised through an fp32 chunk (the values of ``dequantized_weight``)."""
        w = self.weight[rows, cols].to(torch.float32 if self.weight_scale is not None else dtype,
                                      memory_format=torch.contiguous_format)
        if self.weight_scale is not None:
            w.mul_(self.weight_scale[rows].view(-1, 1, 1, 1))
            if dtype != torch.float32:
                w = w.to(dtype)
        return w.view(w.shape[0], w.shape[1])

    def chunk_peak_bytes(self, values: int, dtype_bytes: int) -> int:
        """Peak bytes while ``weight_chunk`` converts ``values`` weights into the act dtype."""
        if self.weight_scale is not None and dtype_bytes != 4:
            return values * (4 + dtype_bytes)
        return values * dtype_bytes

    def row_chunk_peak(self, dtype_bytes: int) -> int:
        rows = min(self.out_channels, self._chunk_size(self.in_channels))
        return self.chunk_peak_bytes(rows * self.in_channels, dtype_bytes)

    def col_chunk_peak(self, dtype_bytes: int) -> int:
        cols = min(self.in_channels, self._chunk_size(self.out_channels))
        return self.chunk_peak_bytes(self.out_channels * cols, dtype_bytes)

    def pointwise_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The 1x1 conv of ``x`` (in the act dtype), a chunk of output channels at a time.
        ``x`` is contiguous here (every producer's output is); the cost rule counts no copy."""
        n, _, h, w = x.shape
        y = torch.empty((n, self.out_channels, h, w), dtype=x.dtype, device=x.device)
        xs = x.reshape(n, self.in_channels, h * w)
        step = self._chunk_size(self.in_channels)
        for i in range(0, self.out_channels, step):
            wc = self.weight_chunk(slice(i, i + step), slice(None), x.dtype)
            for s in range(n):
                torch.mm(wc, xs[s], out=y[s, i:i + wc.shape[0]].view(wc.shape[0], h * w))
            del wc
        return y

    def pointwise_grad_input(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """W^T @ g of a 1x1 conv written into ``out`` (samples of ``g``, same count), a chunk
        of input channels at a time."""
        n, _, h, w = g.shape
        gs = g.reshape(n, self.out_channels, h * w)
        step = self._chunk_size(self.out_channels)
        for j in range(0, self.in_channels, step):
            wc = self.weight_chunk(slice(None), slice(j, j + step), g.dtype)
            for s in range(n):
                torch.mm(wc.t(), gs[s], out=out[s, j:j + wc.shape[1]].view(wc.shape[1], h * w))
            del wc

    def _uses_batch_stats(self) -> bool:
        return self.bn_mode == "batch" and self.training

    def mask_chunk(self, out_shape) -> int:
        """Samples per chunk with which the forward packs this output shape's ReLU6 mask."""
        shape = tuple(int(d) for d in out_shape)
        return max(1, min(self.mask_chunks.get(shape, 1), shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        momentum = 0.0
        if self._uses_batch_stats():
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        return _FrozenConvFn.apply(x, self.bias, self, momentum)

    def saved_bytes(self, in_shape, out_shape) -> int:
        if self._uses_batch_stats():
            return _numel(out_shape) * _dtype_bytes(self.act_dtype) + 2 * int(out_shape[1]) * 4
        return mask_bytes(_numel(out_shape)) if self.act else 0

    def _dequant_bytes(self, dtype_bytes: int) -> tuple[int, int]:
        """(bytes of the dequantised weight, peak bytes while dequantising) in the act dtype."""
        w = self.weight.numel()
        if self.weight_scale is not None:  # int8: one fp32 buffer scaled in place, or a half
            if dtype_bytes == 4:           # weight filled through an fp32 chunk
                return w * 4, w * 4
            # the fp32 chunk of ``_dequant_rows`` rows, sized from the shape (no tensor op:
            # ``chunkable`` asks this on the forward's path)
            per_row = w // int(self.weight.shape[0])
            rows = max(1, min(int(self.weight.shape[0]), DEQUANT_CHUNK // per_row))
            return w * dtype_bytes, w * dtype_bytes + rows * per_row * 4
        if self.weight.dtype == self.act_dtype:
            return 0, 0
        return w * dtype_bytes, w * dtype_bytes

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, input_requires_grad,
                     output_requires_grad, in_bytes=None) -> LayerCost:
        """Runtime accounting rule (edgetl.memory.runtime), mirroring ``_FrozenConvFn``.

        Forward: the dequantised weight and a cast copy of the input live during the conv;
        fold mode builds the ReLU6 mask from two byte-per-element comparisons and packs it
        in place; batch mode keeps a copy of the conv output plus per-channel statistics.
        Backward: the unpack table and its int32 row indices, the mask unpacked into the
        act dtype (grad_output is multiplied into it in place), the dequantised weight
        again, conv2d_input's 1-element dummy input (not for 1x1 convs run sample by
        sample: W^T @ g is written into grad_input), grad_input in the act dtype and,
        when the input came in another dtype, its cast. A ``chunked`` conv never holds its
        dequantised weight: forward and backward each hold one chunk of it (its fp32 and
        act-dtype copies) next to the batch-sized output or grad_input instead.
        """
        a = _dtype_bytes(self.act_dtype)
        b = in_bytes or a
        grad = output_requires_grad
        nin, nout, c = _numel(in_shape), _numel(out_shape), int(out_shape[1])
        big_y = nout * a
        dq, dq_peak = (0, 0) if self.chunked else self._dequant_bytes(a)
        xc = nin * a if b != a else 0
        phases = [xc + big_y + self.row_chunk_peak(a)] if self.chunked else [dq_peak, dq + xc + big_y]
        saved_new = 0
        batch = self._uses_batch_stats()
        small = c * a if a != 4 else 0  # a per-channel vector cast to the act dtype
        if self.bn_mode == "fold":
            phases.append(big_y + small)
        elif batch:
            yf = nout * 4 if a != 4 else 0
            phases.append(big_y + yf + 2 * c * 4)  # var_mean of an fp32 view of y
            phases.append(big_y + 4 * c * 4)  # var, mean, var + eps, invstd
            if grad:
                saved_new = big_y + 2 * c * 4  # the BN input + mean, invstd
                phases.append(big_y + saved_new + c * 4 + 4 * c * 4 + small)
            else:
                phases.append(big_y + 2 * c * 4 + 4 * c * 4 + small)
        else:  # batch BN in eval mode: running statistics
            phases.append(big_y + 5 * c * 4 + small)
        if self.act and grad and not batch:
            saved_new = mask_bytes(nout)
            if _sample_aligned(out_shape):  # one chunk of samples' comparisons at a time
                per = nout // int(out_shape[0]) * self.mask_chunk(out_shape)
                phases.append(big_y + saved_new + 2 * per)  # two comparisons, then a shifted copy
            else:
                phases.append(big_y + 2 * nout)  # y > 0 and y < 6, and-ed in place
                phases += [big_y + p for p in _pack_phases(nout)]
        if not grad:
            return LayerCost(forward_temp_bytes=_over(phases, big_y))
        fwd = _over(phases, big_y + saved_new)

        gx_in = nin * b if input_requires_grad else 0
        gbias = c * 4 if self.bias.requires_grad else 0
        g = nout * a
        tab = 256 * 8 * a  # unpack_table
        bw: list[int] = [0]
        if not batch and mask_backward_per_sample(self, input_requires_grad, out_shape):
            n = int(out_shape[0])
            gxa, po, pi = nin * a, nout // n, nin // n  # grad_input in the act dtype; one sample
            sc = c * a if self.bn_mode == "batch" else 0
            if sc:
                bw += [gbias + gxa + 3 * c * 4, gbias + gxa + c * 4 + sc]
            if not self.chunked:
                bw.append(gbias + gxa + sc + dq_peak)
            base = gbias + gxa + sc + dq
            bw.append(base + UNPACK_TABLE_BUILD + tab)
            base += tab
            bw.append(base + po // 2 + po * a)  # one sample's int32 row indices, its unpacked mask
            if gbias:
                bw.append(base + po * a + c * 4)
            if self.chunked:  # one chunk of input channels' weights at a time
                bw.append(base + po * a + self.col_chunk_peak(a))
            elif not self.pointwise:  # conv2d_input's dummy input + its result (1x1: W^T @ g into grad_input)
                bw.append(base + po * a + a + pi * a)
            if b != a:
                bw.append(gbias + gxa + nin * b)
            return LayerCost(saved_new_bytes=saved_new, forward_temp_bytes=fwd,
                             backward_temp_bytes=_over(bw, gx_in + gbias))
        if batch:
            held = 0
            if self.act:
                bw += [5 * c * 4, g + 2 * nout + small, nout + g]  # y*scale+shift, keep mask, gy*keep
                held = g
            if a != 4:
                bw.append(held + 2 * nout * 4 + nout * 4 + gbias)  # fp32 gy, y, grad
                bw.append(nout * 4 + g + gbias)
                gc = g
            else:
                bw.append(held + nout * 4 + gbias)
                gc = nout * 4
        else:
            gc = 0
            if self.act:
                # the table, int32 row indices, the unpacked mask (then gy in place)
                bw += [UNPACK_TABLE_BUILD + tab, tab + 4 * mask_bytes(nout) + g]
                gc = g
            if self.bn_mode == "batch":  # eval: gy * a fixed scale
                bw += [gc + 3 * c * 4, gc + g + c * 4 + small]
                gc = g
            bw.append(gc + gbias)
        if input_requires_grad and self.chunked:  # grad_input, then a chunk of weights at a time
            bw.append(gc + gbias + nin * a + self.col_chunk_peak(a))
        elif input_requires_grad:
            bw += [gc + gbias + dq_peak, gc + gbias + dq + a + nin * a]
        if input_requires_grad and b != a:
            bw.append(gbias + nin * a + nin * b)
        return LayerCost(saved_new_bytes=saved_new, forward_temp_bytes=fwd,
                         backward_temp_bytes=_over(bw, gx_in + gbias))

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"groups={self.groups}, act={'relu6' if self.act else None}, bn={self.bn_mode}, "
            f"weight={self.weight_dtype}, act_dtype={self.act_dtype}"
        )


def _scale_shift(m: FrozenConvBNAct, mean: torch.Tensor, invstd: torch.Tensor, beta: torch.Tensor):
    scale = m.bn_weight * invstd
    return scale, beta.float() - mean * scale


class _FrozenConvFn(Function):
    @staticmethod
    def forward(ctx, x, bias, m: FrozenConvBNAct, momentum):
        act = m.act_dtype
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if m.chunked:
            y = m.pointwise_forward(x.to(act))
        else:
            w = m.dequantized_weight(act)
            y = F.conv2d(x.to(act), w, None, m.stride, m.padding, m.dilation, m.groups)
            del w
        c = (1, -1, 1, 1)
        saved: tuple = ()
        if m.bn_mode == "fold":
            y.add_(bias.to(act).view(c))
        elif m._uses_batch_stats():
            n = y.numel() // y.shape[1]
            if n <= 1:
                raise ValueError("batch BN needs more than 1 value per channel")
            var, mean = torch.var_mean(y.float(), dim=(0, 2, 3), correction=0)
            invstd = torch.rsqrt(var + m.eps)
            m.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            m.running_var.mul_(1 - momentum).add_(var * (n / (n - 1)), alpha=momentum)
            if need:
                saved = (y.clone(), mean, invstd)  # the BN input, before it is overwritten below
            scale, shift = _scale_shift(m, mean, invstd, bias)
            y.mul_(scale.to(act).view(c)).add_(shift.to(act).view(c))
        else:
            invstd = torch.rsqrt(m.running_var + m.eps)
            scale, shift = _scale_shift(m, m.running_mean, invstd, bias)
            y.mul_(scale.to(act).view(c)).add_(shift.to(act).view(c))
        if m.act:
            if need and not saved:
                saved = (_relu6_mask(y, m.mask_chunk(y.shape)),)
            y.clamp_(0, 6)
        ctx.m, ctx.in_shape, ctx.in_dtype, ctx.out_shape = m, tuple(x.shape), x.dtype, tuple(y.shape)
        ctx.kind = "batch" if (saved and len(saved) == 3) else ("mask" if saved else "none")
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, gy):
        m = ctx.m
        act = m.act_dtype
        c = (1, -1, 1, 1)
        gy = gy.to(act)
        gbias = None
        if _per_sample(ctx):
            return _per_sample_backward(ctx, gy)
        if ctx.kind == "batch":
            y, mean, invstd = ctx.saved_tensors
            if m.act:
                scale, shift = _scale_shift(m, mean, invstd, m.bias.detach())
                out = y * scale.to(act).view(c)
                out.add_(shift.to(act).view(c))
                del scale, shift
                keep = out > 0
                keep &= out < 6
                del out
                gy = keep.view(torch.uint8).to(act).mul_(gy)  # not gy * keep: see unpack_as
                del keep
            g_conv, _, gbias = torch.ops.aten.native_batch_norm_backward(
                gy.float(), y.float(), m.bn_weight, None, None, mean, invstd, True, m.eps,
                [ctx.needs_input_grad[0], False, ctx.needs_input_grad[1]],
            )
            gy = None
            g_conv = g_conv.to(act) if g_conv is not None else None
        else:
            if ctx.kind == "mask":
                (packed,) = ctx.saved_tensors
                gy = unpack_as(packed, ctx.out_shape, unpack_table(act, gy.device)).mul_(gy)
            if m.bn_mode == "batch":  # eval mode: a fixed per-channel scale
                scale = m.bn_weight * torch.rsqrt(m.running_var + m.eps)
                g_conv = gy * scale.to(act).view(c)
            else:
                g_conv = gy
            if ctx.needs_input_grad[1]:
                # accumulates in fp32 without a visible fp32 copy of gy
                gbias = gy.sum((0, 2, 3), dtype=torch.float32)
        del gy
        gx = None
        if ctx.needs_input_grad[0]:
            if m.chunked:
                gx = torch.empty(ctx.in_shape, dtype=act, device=g_conv.device)
                m.pointwise_grad_input(g_conv, gx)
                del g_conv
            else:
                w = m.dequantized_weight(act)
                gx = conv2d_input(ctx.in_shape, w, g_conv, m.stride, m.padding, m.dilation, m.groups)
                del w, g_conv
            gx = gx.to(ctx.in_dtype)
        return gx, gbias, None, None


def _sample_aligned(shape) -> bool:
    """More than one sample, and each sample's mask fills whole bytes."""
    n = int(shape[0])
    return n > 1 and (_numel(shape) // n) % 8 == 0


def _relu6_mask(y: torch.Tensor, chunk: int = 1) -> torch.Tensor:
    """The packed mask of 0 < y < 6, built ``chunk`` samples at a time when the bytes align
    (the byte-per-element comparisons of a whole batch would sit next to y; chunks of
    several samples launch fewer kernels where the step's peak allows them, issue #17)."""
    if not _sample_aligned(y.shape):
        mask = y > 0
        mask &= y < 6
        return pack_mask_(mask)
    n = y.shape[0]
    step = y.numel() // n // 8
    packed = torch.empty(n * step, dtype=torch.uint8, device=y.device)
    for i in range(0, n, chunk):
        part = y[i : i + chunk]
        mask = part > 0
        mask &= part < 6
        packed[i * step : (i + part.shape[0]) * step] = _fold_bits_(mask.reshape(-1).view(torch.uint8))
        del mask
    return packed


def mask_forward_chunked(m: "FrozenConvBNAct", output_requires_grad: bool, out_shape) -> bool:
    """Whether the forward packs this output's ReLU6 mask in chunks of samples (``mask_chunk``)."""
    return (m.act and output_requires_grad and not m._uses_batch_stats()
            and _sample_aligned(out_shape))


def mask_backward_per_sample(m: "FrozenConvBNAct", needs_input_grad: bool, out_shape) -> bool:
    """Whether the masked backward runs sample by sample: each sample's mask fills whole
    bytes, and the whole batch was not allowed for this shape (``whole_batch_shapes``)."""
    return (m.act and needs_input_grad and _sample_aligned(out_shape)
            and tuple(int(d) for d in out_shape) not in m.whole_batch_shapes)


def _per_sample(ctx) -> bool:
    return ctx.kind == "mask" and mask_backward_per_sample(ctx.m, ctx.needs_input_grad[0], ctx.out_shape)


def _per_sample_backward(ctx, gy):
    """Masked backward one sample at a time: only one sample's unpacked mask and masked
    grad_output exist at once (a whole-batch masked copy would coexist with grad_output
    and grad_input). The default; layers whose whole-batch backward stays within the
    step's peak run ``_FrozenConvFn.backward``'s whole-batch path instead
    (``edgetl.memory.schedule``)."""
    m = ctx.m
    act = m.act_dtype
    (packed,) = ctx.saved_tensors
    n = ctx.out_shape[0]
    one_out, one_in = (1,) + tuple(ctx.out_shape[1:]), (1,) + tuple(ctx.in_shape[1:])
    step = _numel(one_out) // 8
    gbias = torch.zeros(m.out_channels, dtype=torch.float32, device=gy.device) if ctx.needs_input_grad[1] else None
    gx = torch.empty(ctx.in_shape, dtype=act, device=gy.device)
    scale = None
    if m.bn_mode == "batch":  # eval mode: a fixed per-channel scale
        scale = (m.bn_weight * torch.rsqrt(m.running_var + m.eps)).to(act).view(1, -1, 1, 1)
    w = None if m.chunked else m.dequantized_weight(act)
    table = unpack_table(act, gy.device)
    # a 1x1 conv's grad_input is W^T @ grad_output, written straight into gx: no result
    # to copy, and no batch-1 conv backward (which falls to a slow kernel on CPU)
    wt = w.view(m.out_channels, m.in_channels).t() if m.pointwise and w is not None else None
    for i in range(n):
        g = unpack_as(packed[i * step : (i + 1) * step], one_out, table).mul_(gy[i : i + 1])
        if gbias is not None:
            gbias.add_(g.sum((0, 2, 3), dtype=torch.float32))
        if scale is not None:
            g.mul_(scale)
        if w is None:  # the weight a chunk of input channels at a time (``chunked``)
            m.pointwise_grad_input(g, gx[i : i + 1])
        elif wt is not None:
            torch.mm(wt, g.reshape(m.out_channels, -1), out=gx[i].view(m.in_channels, -1))
        else:
            gx[i : i + 1] = conv2d_input(one_in, w, g, m.stride, m.padding, m.dilation, m.groups)
        del g
    del w, wt, table
    return gx.to(ctx.in_dtype), gbias, None, None


def check_act_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """Fail with CapabilityError if conv forward/backward in ``dtype`` does not run on ``device``."""
    try:
        x = torch.ones(1, 2, 4, 4, dtype=dtype, device=device)
        w = torch.ones(2, 1, 3, 3, dtype=dtype, device=device)
        y = F.conv2d(x, w, None, 1, 1, 1, 2)
        conv2d_input(x.shape, w, y, 1, 1, 1, 2)
    except (RuntimeError, NotImplementedError) as exc:
        raise CapabilityError(
            f"{dtype} convolution is not supported on {device} by this torch build "
            f"({str(exc).splitlines()[0]}); choose act_dtype fp32 or another device"
        ) from None


def _resolve(name_or_dtype, table: dict, what: str) -> torch.dtype:
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype in table.values():
            return name_or_dtype
    elif name_or_dtype in table:
        return table[name_or_dtype]
    raise ConfigError(f"unknown {what} {name_or_dtype!r}; allowed: {', '.join(table)}")


def _lean_cna(cna: nn.Sequential, **kw) -> nn.Sequential:
    """torchvision Conv2dNormActivation (conv, BN, ReLU6) -> Sequential(FrozenConvBNAct)."""
    conv, bn = cna[0], cna[1]
    act = len(cna) > 2
    if act and not isinstance(cna[2], nn.ReLU6):
        raise ConfigError(f"lean backbone supports ReLU6 activations only, found {type(cna[2]).__name__}")
    return nn.Sequential(FrozenConvBNAct(conv, bn, act, **kw))


def leanify_backbone(
    net: nn.Module,
    *,
    bn: str = "fold",
    weight_dtype: str | torch.dtype = "fp32",
    act_dtype: str | torch.dtype = "fp32",
) -> nn.Module:
    """Convert a built EdgeNet's frozen features to lean layers, in place; returns ``net``.

    Each torchvision Conv2dNormActivation becomes ``Sequential(FrozenConvBNAct)`` and each
    project conv + BN a ``FrozenConvBNAct`` without activation, so block indices, the
    InvertedResidual skip adds (which save nothing) and the side taps are unchanged.
    ``net.pool`` becomes a ``LeanGlobalAvgPool`` returning fp32 (stock adaptive pooling
    saves its input). The side network and classifier are not touched; with
    ``act_dtype`` other than fp32 the side modules must be lean ones (they cast their
    input to fp32), see ``edgetl.models.lean_side``.

    Args:
        net: an EdgeNet whose feature conv weights and BN scales are frozen.
        bn: "fold" (eval statistics folded into the conv) or "batch" (batch statistics in
            training mode, running statistics updated; keeps the BN input for backward).
        weight_dtype: storage of the frozen weights: "fp32", "fp16" or "int8".
        act_dtype: dtype of backbone activations: "fp32", "bf16" or "fp16".

    Raises:
        CapabilityError: the activation dtype's convolutions do not run on this device.
        ConfigError: an unknown option, or trainable conv weights / BN scales.
    """
    from torchvision.models.mobilenetv2 import InvertedResidual

    if bn not in BN_MODES:
        raise ConfigError(f"unknown bn mode {bn!r}; allowed: {', '.join(BN_MODES)}")
    wdt = _resolve(weight_dtype, WEIGHT_DTYPES, "weight_dtype")
    adt = _resolve(act_dtype, ACT_DTYPES, "act_dtype")
    device = next(net.features.parameters()).device
    if adt != torch.float32:
        check_act_dtype(adt, device)
        side = getattr(net, "side", None)
        if side is not None and not all(getattr(b, "lean", False) for b in side.blocks):
            raise ConfigError(
                "act_dtype other than fp32 needs lean side modules: convert with "
                "edgetl.models.lean_side.lean_side_from_stock first"
            )
    kw = dict(bn_mode=bn, weight_dtype=wdt, act_dtype=adt)
    features = net.features
    for i, block in enumerate(features):
        if isinstance(block, InvertedResidual):
            layers = list(block.conv)
            new = [_lean_cna(layer, **kw) if isinstance(layer, nn.Sequential) else layer for layer in layers[:-2]]
            project, project_bn = layers[-2], layers[-1]
            if not (isinstance(project, nn.Conv2d) and isinstance(project_bn, nn.BatchNorm2d)):
                raise ConfigError(f"features[{i}] is not a torchvision InvertedResidual layout")
            new.append(FrozenConvBNAct(project, project_bn, False, **kw))
            block.conv = nn.Sequential(*new)
        elif isinstance(block, nn.Sequential) and isinstance(block[0], nn.Conv2d):
            features[i] = _lean_cna(block, **kw)
        else:
            raise ConfigError(f"features[{i}] ({type(block).__name__}) has no lean replacement")
    net.pool = LeanGlobalAvgPool(torch.float32)
    side = getattr(net, "side", None)
    if side is not None:
        for b in side.blocks:
            if getattr(b, "lean", False):
                b.out_dtype = adt
    # the batch can be fed in the activation dtype (the stem casts otherwise): the meter
    # and the runtime accounting build their batch in this dtype
    net.input_dtype = adt
    return net


# --------------------------------------------------------------------------- measuring


@dataclass
class SavedBytes:
    """Result of ``count_saved_bytes``: unique storage bytes saved for backward."""

    bytes: int = 0
    tensors: int = 0


@contextlib.contextmanager
def count_saved_bytes(*exclude: nn.Module) -> Iterator[SavedBytes]:
    """Count the bytes of distinct storages saved for backward inside the block.

    Parameters and buffers of the ``exclude`` modules are not counted (they are held
    anyway). Storages are counted once however many ops save them.
    """
    ignore = {
        t.untyped_storage().data_ptr()
        for m in exclude
        for t in list(m.parameters()) + list(m.buffers())
    }
    seen: dict[int, int] = {}
    result = SavedBytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in ignore and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result.bytes = sum(seen.values())
    result.tensors = len(seen)


def predicted_saved_bytes(model: nn.Module, run: Callable[[], object]) -> dict[str, int]:
    """Run ``run()`` (a forward of ``model``) and sum each lean module's ``saved_bytes`` rule.

    Returns module name -> predicted bytes, for every module with a ``saved_bytes`` method
    that was called with a backward needed (an input requiring grad or a trainable
    parameter of its own); a module called several times is summed.
    """
    out: dict[str, int] = {}
    handles = []

    def hook(name):
        def fn(module, args, output):
            needs = torch.is_grad_enabled() and (
                any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                or any(p.requires_grad for p in module.parameters(recurse=False))
                or getattr(module, "needs_backward", lambda: False)()
            )
            if needs:
                x = next(a for a in args if isinstance(a, torch.Tensor))
                out[name] = out.get(name, 0) + module.saved_bytes(tuple(x.shape), tuple(output.shape))

        return fn

    for name, module in model.named_modules():
        if callable(getattr(module, "saved_bytes", None)):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return out
