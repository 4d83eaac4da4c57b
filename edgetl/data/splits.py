"""Splits: datasets in; a class subset and a balanced cap, then both splits checked (learnable
classes, every image file readable) out, as ``DataSplits``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgetl.data.datasets import LabeledDataset, SubsetDataset, TransformedDataset
from edgetl.data.images import check_image_file
from edgetl.data.sources import SPLITS
from edgetl.errors import ConfigError, DataError

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.data")

BAD_IMAGE_POLICIES = ("error", "skip")


def select(
    dataset: LabeledDataset,
    classes: Sequence[int] | None = None,
    max_samples: int | None = None,
    seed: int = 0,
) -> LabeledDataset:
    """Keep some classes (relabelled 0..n-1 in the given order) and at most ``max_samples`` samples.

    The cap keeps classes balanced: a seeded shuffle within each class, then round-robin.
    """
    n_classes = len(dataset.classes)
    if classes is None:
        keep = list(range(n_classes))
    else:
        keep = [int(c) for c in classes]
        bad = [c for c in keep if not 0 <= c < n_classes]
        if bad:
            raise ConfigError(f"data.classes: class {bad[0]} does not exist; allowed: 0..{n_classes - 1}")
    label_map = {c: i for i, c in enumerate(keep)}
    per_class: dict[int, list[int]] = {c: [] for c in keep}
    for i, t in enumerate(dataset.targets):
        if t in per_class:
            per_class[t].append(i)
    indices = [i for c in keep for i in per_class[c]]
    if max_samples is not None and max_samples < len(indices):
        g = torch.Generator().manual_seed(seed)
        shuffled = [[idx[j] for j in torch.randperm(len(idx), generator=g).tolist()] for idx in per_class.values()]
        picked: list[int] = []
        depth = 0
        while len(picked) < max_samples:
            for idx in shuffled:
                if depth < len(idx) and len(picked) < max_samples:
                    picked.append(idx[depth])
            depth += 1
        indices = sorted(picked)
    if classes is None and len(indices) == len(dataset):
        return dataset
    return SubsetDataset(dataset, indices, label_map, [dataset.classes[c] for c in keep])


@dataclass
class DataSplits:
    """Transformed train and val datasets, the class names (label order), and what
    ``check_images`` found (None until it ran)."""

    train: TransformedDataset
    val: TransformedDataset
    classes: list[str]
    image_check: ImageCheck | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def check_learnable(train: LabeledDataset, val: LabeledDataset, where: str) -> None:
    """Refuse data a classifier cannot learn from: fewer than two classes with training
    images, or validation images of a class the training split has none of."""
    have = sorted(set(train.targets))
    if len(have) < 2:
        names = [train.classes[c] for c in have]
        raise DataError(f"{where}: the training split has images of {len(have)} class{'es' if len(have) != 1 else ''} "
                        f"({', '.join(map(repr, names)) or 'none'}); a classifier needs at least 2")
    unseen = sorted(set(val.targets) - set(have))
    if unseen:
        names = ", ".join(repr(val.classes[c]) for c in unseen[:3])
        raise DataError(f"{where}: the validation split has images of class {names} that the training "
                        f"split has none of; add training images or remove the class")


@dataclass
class ImageCheck:
    """What ``check_images`` found.

    Attributes:
        checked: image files checked (both splits).
        seconds: wall time of the check.
        bad: (split, path, what is wrong) for each bad file.
        policy: data.on_bad_image: "error" or "skip" (skipped files are left out).
    """

    checked: int
    seconds: float
    bad: list[tuple[str, str, str]]
    policy: str


def _map_io(fn, items: list) -> list:
    """``[fn(x) for x in items]`` on a few threads: the check mostly waits for the disk (a cold
    cache, an SD card), and threads overlap those waits."""
    if len(items) < 64:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        return list(pool.map(fn, items, chunksize=64))


def drop_samples(dataset: LabeledDataset, bad: set[int]) -> LabeledDataset:
    """``dataset`` without the samples at ``bad`` (labels unchanged)."""
    keep = [i for i in range(len(dataset)) if i not in bad]
    identity = {c: c for c in range(len(dataset.classes))}
    return SubsetDataset(dataset, keep, identity, list(dataset.classes))


def check_images(splits: "DataSplits", policy: str = "error") -> "DataSplits":
    """Check every image file of both splits (``check_image_file``) before any training.

    Args:
        splits: from ``build_datasets``.
        policy: "error" raises a one-line DataError naming the first bad file (all of them
            are logged at INFO); "skip" logs each bad file once (WARNING) and leaves it out,
            then one WARNING with the count and the first names. A bad file is also an entry
            that is not a file at all: a dangling symlink, a FIFO, a socket (``image_folder``).

    Returns:
        The splits (without the bad files under "skip") with ``image_check`` set.
    """
    if policy not in BAD_IMAGE_POLICIES:
        raise ConfigError(f"data.on_bad_image: {policy!r} is not allowed; allowed: {', '.join(BAD_IMAGE_POLICIES)}")
    t0 = time.perf_counter()
    checked = 0
    bad: list[tuple[str, str, str]] = []
    kept = {}
    for name in SPLITS:
        ds: TransformedDataset = getattr(splits, name)
        paths = ds.base.image_paths()
        if paths is None:
            kept[name] = ds
            continue
        bad_here = set()
        for i, (path, fault) in enumerate(zip(paths, _map_io(check_image_file, paths))):
            if fault is not None:
                bad.append((name, str(path), fault))
                bad_here.add(i)
        checked += len(paths)
        if bad_here and policy == "skip":
            base = drop_samples(ds.base, bad_here)
            if len(base) == 0:
                raise DataError(f"every image of the {name} split is unreadable (first: {bad[-1][1]}: {bad[-1][2]})")
            ds = TransformedDataset(base, ds.transform, seed=ds.seed, skip_bad=ds.skip_bad)
        kept[name] = ds
    seconds = time.perf_counter() - t0
    for name, path, fault in bad:
        if policy == "skip":
            log.warning("skipping unreadable image %s: %s", path, fault)
        else:
            log.info("unreadable image (%s split) %s: %s", name, path, fault)
    if bad and policy == "error":
        _, path, fault = bad[0]
        if len(bad) == 1:
            raise DataError(f"image file {path} cannot be read: {fault}; fix or remove it, or set "
                            "data.on_bad_image: skip")
        raise DataError(
            f"{len(bad)} of {checked} image files cannot be read, first {path}: {fault} (-v lists all); "
            "fix or remove them, or set data.on_bad_image: skip"
        )
    log.info("checked %d image files in %.2f s: %d bad", checked, seconds, len(bad))
    if policy == "skip" and bad:
        first = ", ".join(path for _, path, _ in bad[:3])
        log.warning("left out %d of %d image files as unreadable (data.on_bad_image: skip): %s%s", len(bad),
                    checked, first, ", ..." if len(bad) > 3 else "")
    if policy == "skip" and bad:
        check_learnable(kept["train"].base, kept["val"].base, "after skipping unreadable images")
    return DataSplits(train=kept["train"], val=kept["val"], classes=splits.classes,
                      image_check=ImageCheck(checked, seconds, bad, policy))
