"""Lean max pool: an nn.MaxPool2d in, a max pool that keeps, per output, only which cell of its
window held the maximum (4 bits for a window of at most 16 cells, two codes a byte)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from edgetl.cost import repeated
from edgetl.errors import ConfigError
from edgetl.models.lean.layout import empty_as, is_channels_last, memory_flat


def _square(value, what: str) -> int:
    if isinstance(value, (tuple, list)):
        if len(set(value)) != 1:
            raise ConfigError(f"the lean max pool supports square windows only ({what} {tuple(value)})")
        value = value[0]
    return int(value)


def code_bits(kernel_size: int) -> int:
    """Bits per stored window offset: 4 for at most 16 cells (two codes a byte), else 8."""
    return 4 if kernel_size * kernel_size <= 16 else 8


def code_bytes(numel: int, kernel_size: int) -> int:
    """Bytes of the codes of ``numel`` outputs, per sample (``LeanMaxPool2d`` packs a sample
    at a time, so a sample's odd count takes a whole last byte)."""
    return (numel + 1) // 2 if code_bits(kernel_size) == 4 else numel


def _window_starts(in_w: int, out_hw: tuple[int, int], k: int, s: int, p: int, device) -> torch.Tensor:
    """Flat input index of each output's window corner (row oh*s - p, column ow*s - p; it may
    lie in the padding, i.e. be negative or wrap, as only offsets from it are taken)."""
    oh, ow = out_hw
    rows = torch.arange(oh, dtype=torch.int64, device=device).mul_(s).sub_(p).mul_(in_w)
    cols = torch.arange(ow, dtype=torch.int64, device=device).mul_(s).sub_(p)
    return (rows.view(-1, 1) + cols.view(1, -1)).view(-1)


class _MaxPoolFn(Function):
    @staticmethod
    def forward(ctx, x, k, s, p, shapes_only):
        if shapes_only or not ctx.needs_input_grad[0]:
            return F.max_pool2d(x, k, s, p)
        n, c, h, w = x.shape
        out_hw = ((h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1)
        per = c * out_hw[0] * out_hw[1]
        four = code_bits(k) == 4
        y = empty_as(x, (n, c, *out_hw))  # laid out as x (channels-last or not)
        codes = torch.empty((n, code_bytes(per, k)), dtype=torch.uint8, device=x.device)
        starts = _window_starts(w, out_hw, k, s, p, x.device)
        # torch's int64 indices (8 bytes an output) exist a sample at a time; the offset
        # inside the window, row r and column c from its corner, is kept as r * k + c
        for i in repeated(range(n)):
            yi, idx = F.max_pool2d(x[i:i + 1], k, s, p, return_indices=True)
            y[i:i + 1].copy_(yi)
            del yi
            off = idx.sub_(starts.view(out_hw))          # r * w + c
            rows = off.div(w, rounding_mode="floor")
            off.sub_(rows.mul_(w - k))                    # r * k + c
            del rows
            code = memory_flat(off).to(torch.uint8)       # in memory order (channels-last: pixel by pixel)
            del off, idx
            if four:
                dst = codes[i]
                dst.copy_(code[0::2])
                high = code[1::2]
                dst[:high.numel()].bitwise_or_(torch.bitwise_left_shift(high, 4))
                del high
            else:
                codes[i].copy_(code)
            del code
        ctx.conf = (k, s, p, (n, c, h, w), x.dtype, out_hw, is_channels_last(x))
        ctx.save_for_backward(codes)
        return y

    @staticmethod
    def backward(ctx, gy):
        (codes,) = ctx.saved_tensors
        k, s, p, shape, dtype, out_hw, channels_last = ctx.conf
        n, c, h, w = shape
        per = c * out_hw[0] * out_hw[1]
        if channels_last:
            gx = empty_as(gy, shape, channels_last=True).zero_()
        else:
            gx = torch.zeros(shape, dtype=gy.dtype, device=gy.device)
        starts = _window_starts(w, out_hw, k, s, p, gy.device)
        for i in repeated(range(n)):
            if code_bits(k) == 4:
                packed = codes[i]
                code = torch.empty(2 * packed.numel(), dtype=torch.uint8, device=gy.device)
                torch.bitwise_and(packed, 15, out=code[0::2])
                torch.bitwise_right_shift(packed, 4, out=code[1::2])
                code = code[:per]
            else:
                code = codes[i]
            idx = code.to(torch.int64)
            del code
            rows = idx.div(k, rounding_mode="floor")
            idx.add_(rows.mul_(w - k))                     # r * w + c
            del rows
            idx = (idx.view(-1, c).t() if channels_last else idx.view(c, -1)).add_(starts)
            # the same sums in the same order as torch's max_pool2d backward (per channel,
            # outputs in order), so the gradient is autograd's bit for bit
            gx[i].view(c, h * w).scatter_add_(1, idx, gy[i].reshape(c, -1))
            del idx
        return gx.to(dtype), None, None, None, None


class LeanMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (square window, no dilation, floor mode) that keeps, for backward, only the
    offset of each output's maximum inside its window: 4 bits for a 3x3 window (two codes a
    byte), against stock's whole input plus int64 indices (8 bytes an output). Backward
    rebuilds the indices a sample at a time and scatters grad_output: the same gradient as
    autograd's."""

    shapes_only = False  # a meta copy only traced forward (``mark_shapes_only``): no codes

    def __init__(self, kernel_size: int, stride: int | None = None, padding: int = 0):
        super().__init__(_square(kernel_size, "kernel"), _square(stride if stride is not None else kernel_size,
                                                                  "stride"), _square(padding, "padding"))

    @classmethod
    def from_pool(cls, pool: nn.MaxPool2d) -> "LeanMaxPool2d":
        if _square(pool.dilation, "dilation") != 1 or pool.ceil_mode or pool.return_indices:
            raise ConfigError("the lean max pool supports dilation 1, floor mode and no returned indices "
                              f"(got {pool})")
        return cls(pool.kernel_size, pool.stride, pool.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaxPoolFn.apply(x, self.kernel_size, self.stride, self.padding, self.shapes_only)
