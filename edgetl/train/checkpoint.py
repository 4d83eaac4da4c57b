"""Checkpoints: a model, optimizer and progress in, ``last.pt`` / ``best.pt`` out, and read back.

Plain dicts (``CHECKPOINT_FORMAT``) loadable with ``weights_only=True``; upper bounds of
their size for the disk check; the recipe keys a resume may change.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgetl.errors import DataError
from edgetl.io import atomic_torch_save, load_torch_file, tensor_bytes, tensors_in
from edgetl.train.distributed import unwrap
from edgetl.train.rng import rng_state

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.train")

CHECKPOINT_FORMAT = "edgetl-checkpoint/1"
LAST, BEST = "last.pt", "best.pt"
# Recipe keys that may change between a run and its resume without changing the result.
# Streaming, recomputing and a uint8 batch change where the bytes go, not what is computed.
RESUME_MAY_CHANGE = ("data.root", "data.download", "data.on_bad_image", "train.workers", "train.cuda_graph",
                     "model.stream", "model.uint8_input", "model.recompute")
# settings added after checkpoints were first written: one that a checkpoint lacks ran as this
ADDED_SETTINGS = {"optim.foreach": False, "model.stream": 0, "model.uint8_input": False,
                  "model.recompute": False, "optim.fused": False, "model.channels_last": False}
# Upper bounds of what torch.save adds to the tensor data: zip headers, 64-byte alignment and
# pickled key names per tensor (about 330 B measured), the pickle, recipe and RNG states.
FILE_BYTES_PER_TENSOR = 512
FILE_BYTES_FIXED = 64 * 1024


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Read an edgetl checkpoint with ``weights_only=True``; one-line DataError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint {path} does not exist")
    ckpt = load_torch_file(path, "an edgetl checkpoint", map_location=map_location)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise DataError(f"{path} is not an edgetl checkpoint (format {CHECKPOINT_FORMAT})")
    return ckpt


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _recipe_differences(saved: dict, current: dict) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    for key, value in ADDED_SETTINGS.items():
        a.setdefault(key, value)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUME_MAY_CHANGE)


def saved_file_bytes(tensors) -> int:
    """Upper bound of the size of a torch.save file holding ``tensors`` (nested dicts/lists)."""
    count = sum(1 for _ in tensors_in(tensors))
    return tensor_bytes(tensors) + FILE_BYTES_PER_TENSOR * count + FILE_BYTES_FIXED


def optimizer_state_shapes(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Empty (meta) tensors shaped like the state the optimizer will hold after its first step.

    Adam/AdamW: two moments like each parameter and a scalar step; SGD: a momentum buffer when
    momentum is on. Other optimizers are assumed to hold two moments (an upper bound for most).
    """
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(optimizer, torch.optim.SGD):
                moments, step = (1 if group.get("momentum") else 0), False
            else:
                moments, step = 2, True
            out += [torch.empty_like(p, device="meta") for _ in range(moments)]
            if step:
                out.append(torch.empty((), dtype=torch.float32, device="meta"))
    return out


def _meta_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def checkpoint_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int = 1) -> int:
    """Upper bound of the size of ``last.pt`` (optimizer given) or ``best.pt`` (weights only)."""
    size = saved_file_bytes(unwrap(model).state_dict())
    if optimizer is not None:
        state = optimizer_state_shapes(optimizer)
        rank_state = {"rng": rng_state(), "sums": torch.zeros(3, dtype=torch.float64)}
        size += _meta_bytes(state) + FILE_BYTES_PER_TENSOR * len(state)
        size += world_size * (saved_file_bytes(rank_state) - FILE_BYTES_FIXED)
    return size


def best_checkpoint(ckpt: dict) -> dict:
    """best.pt from a last.pt dict: the weights and where they come from, no optimizer state."""
    keys = ("format", "model", "epoch", "step_in_epoch", "global_step", "best_acc1", "best_epoch",
            "world_size", "recipe")
    return {k: ckpt[k] for k in keys}


def _restore_best(out_dir: Path, ckpt: dict) -> None:
    """Rewrite best.pt from last.pt when last.pt is the best epoch's end and best.pt lags.

    (last.pt is written first; a failure between the two writes leaves best.pt behind.)
    """
    best_epoch = ckpt["best_epoch"]
    if best_epoch is None:
        return
    path = out_dir / BEST
    try:
        held = load_checkpoint(path)["epoch"] if path.is_file() else None
    except DataError:
        held = None
    if held == best_epoch:
        return
    if ckpt["epoch"] == best_epoch and ckpt["step_in_epoch"] == 0:
        log.warning("%s lags %s (epoch %s, best %d): rewriting it from %s", BEST, LAST, held, best_epoch, LAST)
        atomic_torch_save(best_checkpoint(ckpt), path)
    else:
        log.warning("%s does not hold the best epoch %d and %s cannot restore it", path, best_epoch, LAST)
