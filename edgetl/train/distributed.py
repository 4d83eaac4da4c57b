"""Distributed: torchrun's environment in, the process group, this process's rank and collectives out."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.train")


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun with more than one process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


def setup_distributed(device: torch.device | str = "cpu") -> torch.device:
    """Join the torchrun process group if there is one (gloo on CPU, nccl on CUDA).

    Call before building loaders, so they shard. Returns the device this process uses
    (``cuda:LOCAL_RANK`` for a CUDA device).
    """
    device = torch.device(device)
    env = torchrun_env()
    if env is None:
        return device
    rank, world, local_rank = env
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        log.info("process group ready: rank %d of %d (%s)", rank, world, dist.get_backend())
    return device


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Only rank 0 logs and writes files."""
    return get_rank() == 0


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _gather(obj: Any) -> list[Any]:
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (checkpoints hold its state_dict, not the wrapper's)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
