"""Measuring: a forward in, the bytes it saved for backward out (measured, or predicted by each module's rule)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

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
