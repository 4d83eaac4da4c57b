"""Datasets: samples (files, arrays, a torchvision dataset) in, ``(PIL image, int label)`` out;
transformed per (seed, epoch, index), and collated into batches that leave unreadable samples out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate

from edgetl.data.files import open_regular
from edgetl.data.images import BadImageError, bad_image_error, image_fault


class LabeledDataset(Dataset):
    """Common interface: ``classes`` (names in label order) and ``targets`` (one int per sample)."""

    classes: list[str]
    targets: list[int]

    def image_paths(self) -> list[Path] | None:
        """The image file of each sample, or None where samples are not files (arrays)."""
        return None


class FileListDataset(LabeledDataset):
    """Images from a list of (path, label) pairs, loaded as RGB."""

    def __init__(self, samples: list[tuple[Path, int]], classes: list[str]):
        self.samples = samples
        self.classes = list(classes)
        self.targets = [label for _, label in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def image_paths(self) -> list[Path]:
        return [Path(p) for p, _ in self.samples]

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        try:
            with open_regular(path) as f, Image.open(f) as img:
                return img.convert("RGB"), label
        except MemoryError:
            raise
        except Exception as exc:  # Pillow raises many types for damaged files
            raise bad_image_error(path, image_fault(exc)) from None


class ArrayDataset(LabeledDataset):
    """Gray uint8 images (N, H, W) replicated to 3 channels, with integer labels."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, classes: Sequence[str]):
        self.images = images
        self.targets = [int(y) for y in labels]
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return Image.fromarray(self.images[index], mode="L").convert("RGB"), self.targets[index]


class TorchvisionDataset(LabeledDataset):
    """A torchvision dataset (built without transforms) with classes and targets exposed.

    ``files``: the image file of each sample where the dataset reads files (Flowers102,
    OxfordIIITPet), so bad files are checked and named like an ImageFolder's.
    """

    def __init__(self, dataset, targets: list[int], classes: list[str], files: list | None = None):
        self.dataset = dataset
        self.targets = [int(t) for t in targets]
        self.classes = list(classes)
        self.files = [Path(f) for f in files] if files is not None else None

    def image_paths(self) -> list[Path] | None:
        return self.files

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            img, _ = self.dataset[index]
            return img.convert("RGB"), self.targets[index]
        except MemoryError:
            raise
        except Exception as exc:
            if self.files is None:
                raise
            raise bad_image_error(self.files[index], image_fault(exc)) from None


class SubsetDataset(LabeledDataset):
    """Some samples of a dataset, labels remapped (class subsets are relabelled 0..n-1)."""

    def __init__(self, base: LabeledDataset, indices: list[int], label_map: dict[int, int], classes: list[str]):
        self.base = base
        self.indices = list(indices)
        self.label_map = dict(label_map)
        self.classes = list(classes)
        self.targets = [self.label_map[base.targets[i]] for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def image_paths(self) -> list[Path] | None:
        paths = self.base.image_paths()
        return None if paths is None else [paths[i] for i in self.indices]

    def __getitem__(self, index: int):
        img, label = self.base[self.indices[index]]
        return img, self.label_map[label]


@dataclass(frozen=True)
class Skipped:
    """Stands for a sample whose image could not be read, under data.on_bad_image: skip."""

    path: str
    reason: str


class TransformedDataset(Dataset):
    """Applies a transform; keys ``(index, epoch)`` seed the augmentation per sample.

    torchvision's random transforms draw from torch's global generator; seeding it per
    sample (inside ``fork_rng``, so the caller's generator is untouched) makes the
    augmentation a function of (seed, epoch, index) only. With ``skip_bad`` a sample whose
    image cannot be read comes back as ``Skipped`` (``collate`` drops it) instead of raising.
    """

    def __init__(self, base: LabeledDataset, transform, seed: int = 0, skip_bad: bool = False):
        self.base = base
        self.transform = transform
        self.seed = int(seed)
        self.skip_bad = bool(skip_bad)
        self.classes = base.classes
        self.targets = base.targets

    def __len__(self) -> int:
        return len(self.base)

    def _load(self, index: int):
        try:
            return self.base[index]
        except BadImageError as exc:
            if not self.skip_bad:
                raise
            return Skipped(getattr(exc, "path", f"sample {index}"), getattr(exc, "fault", str(exc))), None

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, epoch = key
            img, label = self._load(index)
            if isinstance(img, Skipped):
                return img
            sample_seed = (self.seed * 1_000_003 + epoch) * 10_000_019 + index
            with torch.random.fork_rng(devices=[]):
                # the CPU generator alone, which the transforms draw from and fork_rng restores:
                # torch.manual_seed would also queue a seed for every accelerator torch knows
                # (CUDA, XPU, MTIA), formatting a stack trace for each while none is initialised,
                # 0.3-3 ms a sample, about as long as the sample's decoding and transforms
                torch.default_generator.manual_seed(sample_seed % (2**63))
                return self.transform(img), label
        img, label = self._load(key)
        if isinstance(img, Skipped):
            return img
        return self.transform(img), label


class Batch:
    """``(images, labels)`` plus ``skipped``: the Skipped samples left out of this batch.

    Unpacks and indexes like the usual pair. ``images`` and ``labels`` are None when every
    sample of the batch was skipped. Not a tuple: DataLoader(pin_memory=True) calls a batch's
    own ``pin_memory`` (torch >= 2.6 first of all; torch 2.5, the Jetson image's, only for a
    type that is neither a tuple nor a sequence, and turns a tuple subclass into a list, which
    would lose ``skipped``).
    """

    __slots__ = ("images", "labels", "skipped")

    def __init__(self, images, labels, skipped=()):
        self.images, self.labels, self.skipped = images, labels, tuple(skipped)

    def __iter__(self):
        return iter((self.images, self.labels))

    def __getitem__(self, i):
        return (self.images, self.labels)[i]

    def __len__(self) -> int:
        return 2

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (Batch, tuple)) else NotImplemented

    def __repr__(self) -> str:
        return f"Batch(images={self.images!r}, labels={self.labels!r}, skipped={self.skipped!r})"

    def __reduce__(self):
        return (Batch, (self.images, self.labels, self.skipped))

    def pin_memory(self, device=None):  # DataLoader(pin_memory=True) calls this on custom batch types
        if self.images is None:
            return self
        return Batch(self.images.pin_memory(), self.labels.pin_memory(), self.skipped)


def collate(samples: list) -> Batch:
    """default_collate of the readable samples; the Skipped ones are named in ``Batch.skipped``."""
    skipped = [s for s in samples if isinstance(s, Skipped)]
    kept = [s for s in samples if not isinstance(s, Skipped)]
    if not kept:
        return Batch(None, None, skipped)
    images, labels = default_collate(kept)
    return Batch(images, labels, skipped)
