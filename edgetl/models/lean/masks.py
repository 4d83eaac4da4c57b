"""1-bit masks: a bool tensor in, ceil(numel / 8) packed bytes out, and back (ReLU6 masks of the lean layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgetl.cost import numel as _numel
from edgetl.models.lean.layout import from_memory_order, memory_flat


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor in, a flat uint8 tensor of ceil(numel / 8) bytes out (bit i of byte j = element 8j+i)."""
    return pack_mask_(mask.reshape(-1).to(torch.uint8, copy=True))


def pack_mask_(mask: torch.Tensor) -> torch.Tensor:
    """``pack_mask`` that consumes its bool/uint8 argument as scratch, in its memory order (a
    channels-last mask pixel by pixel: ``unpack_as(..., channels_last=True)`` reads it back)."""
    flat = memory_flat(mask)
    pad = (-flat.numel()) % 8
    flat = F.pad(flat.view(torch.uint8), (0, pad)) if pad else flat.view(torch.uint8)
    # folded in place (no temporary): the scratch is this function's own
    return _top_bytes(flat.view(torch.int64).mul_(_GATHER)).contiguous()


# Bit 8i of a little-endian int64 group of 8 bytes (its byte i, 0 or 1) times
# sum_i 2^(56 - 7i) lands at bit 56 + i. Every other product term (byte i times 2^(56 - 7j),
# i != j) falls at its own position below bit 56 or past bit 63 (wrapped away), so no carry
# reaches the top byte: it is the packed byte, bit i = byte i.
_GATHER = sum(1 << (56 - 7 * i) for i in range(8))  # 0x0102040810204080


def _fold_bits(flat: torch.Tensor) -> torch.Tensor:
    """Pack contiguous 0/1 bytes (uint8 or bool, a multiple of 8) 8 to a byte: a strided view
    into one temporary the size of ``flat`` (the product; ``flat`` is left as it is).

    One int64 multiply per 8 bytes (one kernel, where three shift-ors took six and a
    temporary of the same size), vectorised: 2-3x faster than multiplying by powers of two
    and summing each group (on CPU).
    """
    return _top_bytes(flat.view(torch.int64) * _GATHER)


def _top_bytes(x: torch.Tensor) -> torch.Tensor:
    """The highest byte of each int64 of ``x`` (little-endian: byte 7 of 8), a strided view."""
    return x.view(torch.uint8)[7::8]


def unpack_mask(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of ``pack_mask``: the packed bytes and the original shape in, a bool tensor out."""
    return unpack_as(packed, shape, unpack_table(torch.bool, packed.device))


def unpack_table(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A (256, 8) table in ``dtype``: row j holds the bits of byte j as 0 and 1, bit i in
    column i (the order of ``pack_mask``). Built where it is used (2048 values), so it
    is never a hidden persistent buffer."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    # the shifts 0..7 are the codes' first 8: a view, not a second arange (one kernel fewer)
    return torch.bitwise_right_shift(codes.unsqueeze(1), codes[:8]).bitwise_and_(1).to(dtype)


def unpack_as(packed: torch.Tensor, shape, table: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """``unpack_mask`` as 0 and 1 in the table's dtype, ready to multiply a gradient in
    place: one gather of 8-value rows, with int32 row indices (4 bytes a packed byte) the
    only temporary. About 2x faster than shifting bits and casting them, and never
    ``grad * bool_mask``, which on CPU casts the mask inside the kernel to a hidden
    full-size copy (memory no tensor meter sees) and runs 3-5x slower. ``channels_last``:
    the bits were packed from a channels-last tensor in its memory order
    (``edgetl.models.lean.layout.memory_flat``); the mask comes back laid out so."""
    rows = table.index_select(0, packed.int())
    numel = _numel(shape)
    if rows.numel() != numel:  # padding to cut (whole bytes need no cut: two view ops fewer)
        rows = rows.view(-1)[:numel]
    return from_memory_order(rows, shape, channels_last)


def mask_bytes(numel: int) -> int:
    return (int(numel) + 7) // 8
