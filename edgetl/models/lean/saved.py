"""Measuring: a forward in, the bytes it saved for backward out (``saved_tensors_hooks``); the
prediction to compare it with is ``edgetl.memory.rules.predicted_saved_bytes``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


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
