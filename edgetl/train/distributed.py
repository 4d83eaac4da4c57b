"""Distributed: torchrun's environment in, the process group, this process's rank and collectives out."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, NoReturn

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


# set once this process, a torchrun worker, has joined its process group: ``edgetl.cli.main``
# then ends the process with ``exit_worker``
joined_group = False


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
    global joined_group
    joined_group = True
    return device


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker process now, its output flushed and its logging shut down, without
    the interpreter's own shutdown, as ``multiprocessing`` ends its child processes.

    Why: once DDP has wrapped a model, torch keeps references to the gloo process group that
    ``destroy_process_group`` does not drop, so its worker threads outlive the program. A
    worker still releasing a finished collective's tensors when the interpreter shuts down
    needs the GIL, and Python (3.11) ends a thread that asks for it then in the middle of a C++
    destructor: ``std::terminate``, a SIGABRT after the run has finished and written everything
    (the two-process tests under load, now and then; the core dump shows
    ``~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop`` waiting in ``take_gil``). The
    process group is left first, where the caller has not."""
    cleanup_distributed()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or full stream: nothing more to show
            stream.flush()
    logging.shutdown()
    os._exit(code)


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
