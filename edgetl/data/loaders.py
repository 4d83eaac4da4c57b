"""Loaders: a transformed dataset in, a DataLoader out (resumable and sharded for training,
an in-order shard for evaluation); a worker's death comes back as one line."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from edgetl.data.datasets import collate
from edgetl.data.splits import DataSplits
from edgetl.errors import DataError, ResourceError

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.data")


def worker_error(exc: BaseException) -> ResourceError | None:
    """A DataLoader worker's death (killed for memory, out of shared memory) as one line; else None."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and text.startswith("DataLoader worker")):
        return None
    return ResourceError(
        f"a data-loading worker died ({text.splitlines()[0].rstrip('. ')}): usually out of memory or "
        "out of shared memory (/dev/shm); lower train.workers (0 loads in the main process) or give "
        "the container more (docker run --shm-size)"
    )


@contextlib.contextmanager
def loader_errors():
    """Iterate a loader inside this: a worker's death becomes ``worker_error``'s one line."""
    try:
        yield
    except RuntimeError as exc:
        error = worker_error(exc)
        if error is None:
            raise
        raise error from None


def dist_rank_world() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(DistributedSampler):
    """Seeded shuffle per epoch, sharded across ranks, able to start part-way into an epoch.

    Yields ``(index, epoch)`` keys for ``TransformedDataset``. With one process it is a
    plain seeded shuffle. Every rank yields the same number of samples (DistributedSampler
    pads by repeating), so DDP ranks take the same number of steps.
    """

    def __init__(self, dataset: Dataset, *, seed: int, rank: int = 0, world_size: int = 1, drop_last: bool = False):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` samples of this rank's order for the current epoch."""
        self.start = int(start)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = list(super().__iter__())
        return iter([(i, self.epoch) for i in indices[self.start :]])

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(Sampler):
    """In-order evaluation shard ``rank::world_size`` (no padding, so nothing is counted twice)."""

    def __init__(self, n: int, rank: int = 0, world_size: int = 1):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    train: bool,
    workers: int = 2,
    seed: int = 0,
    distributed: bool | None = None,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader: ResumableSampler for training, ShardSampler for evaluation.

    Args:
        workers: worker processes; few by default (a Jetson shares its memory with the GPU,
            and each worker holds a copy of the dataset index).
        distributed: shard across the process group; None = whenever one is initialised.
        pin_memory: only useful with CUDA.
    """
    rank, world = dist_rank_world()
    if distributed is False:
        rank, world = 0, 1
    elif distributed and world == 1:
        log.info("distributed loader requested without a process group; using one process")
    if train:
        # Drop the ragged last batch: a batch of one breaks BatchNorm in train mode.
        drop_last = len(dataset) >= batch_size * world
        sampler: Sampler = ResumableSampler(dataset, seed=seed, rank=rank, world_size=world)
    else:
        drop_last = False
        sampler = ShardSampler(len(dataset), rank, world)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        drop_last=drop_last,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        collate_fn=collate,
        # The loader's own seed draw must not consume the global generator (dropout uses it).
        generator=torch.Generator().manual_seed(seed),
    )


def loaders_from_recipe(recipe, splits: DataSplits, pin_memory: bool = False) -> tuple[DataLoader, DataLoader]:
    """(train loader, val loader) with a Recipe's batch sizes, workers and seed."""
    t = recipe.train
    if len(splits.train) < t.batch_size:
        raise DataError(f"the training split has {len(splits.train)} images, fewer than one batch "
                        f"(train.batch_size = {t.batch_size}); lower train.batch_size or add images")
    return (
        build_loader(splits.train, batch_size=t.batch_size, train=True, workers=t.workers, seed=t.seed, pin_memory=pin_memory),
        build_loader(splits.val, batch_size=t.val_batch_size or t.batch_size, train=False, workers=t.workers, seed=t.seed, pin_memory=pin_memory),
    )
