"""Pooling that saves nothing: average pools, the uint8 input normalisation and the side
network's image pool, none of which keep a tensor for backward."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from edgetl.errors import ConfigError
from edgetl.imagenet import IMAGENET_MEAN, IMAGENET_STD
from edgetl.cost import repeated
from edgetl.models.lean.layout import empty_as, is_channels_last, layout_of


class _AvgPoolFn(Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.conf = (k, tuple(x.shape), x.dtype, is_channels_last(x))
        return F.avg_pool2d(x, k)

    @staticmethod
    def backward(ctx, gy):
        k, shape, dtype, channels_last = ctx.conf
        n, c, h, w = shape
        hp, wp = gy.shape[-2:]
        # Every cell of a k x k window gets the window's gradient / k^2 (floor mode: the rows
        # and columns no window covers get 0), written straight into grad_input by a
        # broadcast copy. No full-size temporary on any device: avg_pool2d_backward would
        # need a stand-in for the input, and its CUDA kernel makes that contiguous (issue 17).
        covered = (hp * k, wp * k) == (h, w)
        if covered:  # laid out as the input (channels-last or not)
            gx = empty_as(gy, shape, dtype=dtype, channels_last=channels_last)
        elif channels_last:
            gx = empty_as(gy, shape, dtype=dtype, channels_last=True).zero_()
        else:
            gx = gy.new_zeros(shape, dtype=dtype)
        windows = gx[:, :, :hp * k, :wp * k].unflatten(3, (wp, k)).unflatten(2, (hp, k))
        windows.copy_(gy[:, :, :, None, :, None].expand(n, c, hp, k, wp, k))
        return gx.div_(k * k), None


class LeanAvgPool2d(nn.AvgPool2d):
    """nn.AvgPool2d(k) (stride k, floor mode) that saves nothing for backward (stock saves its input)."""

    def __init__(self, kernel_size: int):
        super().__init__(kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AvgPoolFn.apply(x, self.kernel_size)

def by_micro_batch(x: torch.Tensor, m: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` over ``m`` rows of ``x`` at a time, each part copied into one batch-sized output
    (allocated once the first part shows its shape) and dropped."""
    n = x.shape[0]
    out = None
    for i in repeated(range(0, n, m)):
        part = fn(x[i:i + m])
        if out is None:
            out = empty_as(part, (n, *part.shape[1:]))
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

    shapes_only = False  # a meta copy only traced forward (``mark_shapes_only``): no per-sample loop

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
        out = empty_as(x, x.shape, dtype=self.out_dtype)  # laid out as the batch
        if self.shapes_only:
            return out
        for i in repeated(range(x.shape[0])):
            out[i:i + 1].copy_(x[i:i + 1].float().div_(255).sub_(self.mean).div_(self.std))
        return out


class ImagePool(LeanAvgPool2d):
    """The side network's pool of the image; a uint8 image is normalised (``norm``) and pooled
    ``micro_batch`` samples at a time into the batch-sized pooled map, so no normalised
    batch-sized image exists (``edgetl.models.stream.apply_streams`` sets both)."""

    shapes_only = False  # a meta copy only traced forward (``mark_shapes_only``): one micro-batch

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
        if self.shapes_only:  # one sample gives the shape (a big batch's loop would cost minutes on meta)
            one = F.avg_pool2d(norm.normalize(x[:1]), self.kernel_size)
            return empty_as(one, (x.shape[0], *one.shape[1:]))
        return by_micro_batch(x, self.micro_batch or x.shape[0],
                              lambda rows: F.avg_pool2d(norm.normalize(rows), self.kernel_size))


class _GlobalPoolFn(Function):
    @staticmethod
    def forward(ctx, x, out_dtype):
        ctx.conf = (tuple(x.shape), x.dtype, layout_of(x))
        return x.mean((2, 3), keepdim=True, dtype=out_dtype)

    @staticmethod
    def backward(ctx, gy):
        shape, dtype, layout = ctx.conf
        g = (gy / (shape[2] * shape[3])).to(dtype)
        return g.expand(shape).contiguous(memory_format=layout), None


class LeanGlobalAvgPool(nn.AdaptiveAvgPool2d):
    """Global average pool to 1x1 computed (and returned) in ``out_dtype``; saves nothing."""

    def __init__(self, out_dtype: torch.dtype = torch.float32):
        super().__init__(1)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GlobalPoolFn.apply(x, self.out_dtype)

