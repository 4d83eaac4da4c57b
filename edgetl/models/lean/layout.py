"""Memory layouts: the lean layers keep whichever layout reaches them, plain (NCHW) or
channels-last (NHWC in memory, ``LeanOptions.channels_last``), and never copy a tensor to
change it. Every tensor they make is laid out like the one it comes from, and what they
store in memory order (1-bit masks, a max pool's window codes) is read back in the order
it was written."""

from __future__ import annotations

import torch


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-d tensor is laid out channels-last and not also plainly contiguous (a map of
    one channel, or of one pixel, is both: its two orders are the same)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def layout_of(t: torch.Tensor) -> torch.memory_format:
    """``torch.channels_last`` for a channels-last tensor, else ``torch.contiguous_format``."""
    return torch.channels_last if is_channels_last(t) else torch.contiguous_format


def empty_as(like: torch.Tensor, shape, *, dtype: torch.dtype | None = None, channels_last: bool | None = None
             ) -> torch.Tensor:
    """A new tensor of ``shape`` on ``like``'s device, in ``dtype`` (``like``'s by default),
    laid out as ``like`` is (or channels-last where ``channels_last`` says so); a shape that
    is not 4-d is plain."""
    cl = is_channels_last(like) if channels_last is None else channels_last
    layout = torch.channels_last if cl and len(shape) == 4 else torch.contiguous_format
    return torch.empty(tuple(shape), dtype=dtype or like.dtype, device=like.device, memory_format=layout)


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values flat in memory order: a view of a contiguous or channels-last tensor
    (``reshape(-1)`` of a channels-last tensor would copy it into NCHW order)."""
    if is_channels_last(t):
        return _restrided(t, (t.numel(),), (1,), lambda: t.permute(0, 2, 3, 1).reshape(-1))
    return t.reshape(-1)


def from_memory_order(t: torch.Tensor, shape, channels_last: bool) -> torch.Tensor:
    """The inverse of ``memory_flat``: a flat tensor viewed as ``shape`` (NCHW), read in the
    order a channels-last tensor of that shape lays its values out where ``channels_last``."""
    if not channels_last:
        return t.view(shape)
    n, c, h, w = shape
    if t.is_contiguous() and t.numel() == n * c * h * w:
        return _restrided(t, (n, c, h, w), (h * w * c, 1, w * c, c), lambda: t.view(n, h, w, c).permute(0, 3, 1, 2))
    return t.view(n, h, w, c).permute(0, 3, 1, 2)


def rows_of_channels(t: torch.Tensor) -> torch.Tensor:
    """An (n, c, h, w) tensor as its (n * h * w, c) matrix of pixels: a view of a channels-last
    tensor (of another, a copy: to read only)."""
    if is_channels_last(t):
        return _rows(t, lambda: t.permute(0, 2, 3, 1).view(-1, t.shape[1]))
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def rows_into(t: torch.Tensor) -> torch.Tensor:
    """``rows_of_channels`` of a channels-last tensor (or a slice of its channels) to write into
    (``out=``): always a view; a tensor laid out otherwise is an error, never a copy that a
    result would be written into and lost."""
    if is_channels_last(t):
        return _rows(t, lambda: t.permute(0, 2, 3, 1).view(-1, t.shape[1]))
    return t.permute(0, 2, 3, 1).view(-1, t.shape[1])


def _rows(t: torch.Tensor, two_views) -> torch.Tensor:
    """The (n * h * w, c) rows of a channels-last ``t`` (its strides (h w c, 1, w c, c))."""
    n, c, h, w = t.shape
    return _restrided(t, (n * h * w, c), (c, 1), two_views)


def _restrided(t: torch.Tensor, size, stride, two_views) -> torch.Tensor:
    """A view of ``t``'s memory as ``size`` and ``stride``, its own storage offset kept, in one
    op (``as_strided``) where ``two_views`` takes two (a permute and a view): the same tensor,
    one dispatch fewer. The caller has checked that ``t``'s layout makes it that view. Where
    autograd would record it (grad enabled, ``t`` requiring grad) it is ``two_views``: an
    ``as_strided`` backward allocates a gradient as large as ``t``'s whole storage."""
    if torch.is_grad_enabled() and t.requires_grad:
        return two_views()
    return t.as_strided(size, stride)


def transposed_matrix(weight: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """A 1x1 conv's (out, in, 1, 1) weight as its transposed (in, out) matrix, or that matrix
    expanded to (``batch``, in, out) for a batched product: a view in one op (a reshape, a
    transpose and an expand take up to three); any layout of a 1x1 weight is that view."""
    o, i = weight.shape[:2]
    if batch is None:
        return _restrided(weight, (i, o), (weight.stride(1), weight.stride(0)), lambda: weight.reshape(o, i).t())
    return _restrided(weight, (batch, i, o), (0, weight.stride(1), weight.stride(0)),
                      lambda: weight.reshape(o, i).t().expand(batch, -1, -1))
