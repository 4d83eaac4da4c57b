"""Data: a dataset location (ImageFolder or a preset) in, transformed datasets and loaders out.

Layouts a user brings: ImageFolder ``root/{train,val}/<class>/*.jpg`` with an optional
``root/labels.txt`` (one class a line, the line order is the label order, as
jetson-inference writes it). Presets: fashion_mnist (IDX files, read from the Debian
package location first), cifar10, flowers102, pets (torchvision; downloaded only when
the user asks), cub200 (official CUB_200_2011 layout), imagenet (ImageFolder).

Base datasets return ``(PIL image, int label)``. ``TransformedDataset`` applies the
DESIGN 3 transforms; a training sample's augmentation is seeded by (seed, epoch,
index), so the data a step sees does not depend on worker count or on where a run was
resumed. ``ResumableSampler`` (a DistributedSampler) yields ``(index, epoch)`` keys and
can start part-way through an epoch.

Bad image files: ``check_images`` reads every file's header (and, for JPEG, PNG and WebP,
its end) before training, in well under a millisecond a file, so a truncated or foreign
file is found before a run folder exists. ``data.on_bad_image`` says what happens to one:
"error" stops with a one-line DataError naming the file, "skip" leaves it out (logged
once, counted). A file that passes the check but fails to decode while training raises
``BadImageError``, one line even when a DataLoader worker re-raises it; under "skip" its
sample is dropped from the batch (``Batch.skipped`` names it).

Entries that are not files: an ImageFolder is read without passing over anything in
silence. In a split folder, an entry that is neither a folder nor a file (a dangling
symlink, a FIFO, a socket) is refused in one line whatever ``data.on_bad_image`` says: it
may be a class, and leaving a class out changes the label set. In a class folder, such an
entry is an unreadable image: "error" refuses naming it, "skip" leaves it out, counted in
``ImageCheck.bad`` and the run's summary, and named in the log. Nothing is opened in a way
that waits (a FIFO). Symlinks to folders and files that exist are followed. labels.txt and
CUB's tables are UTF-8 text with or without a byte-order mark, LF or CRLF line ends.

Rooms: ``sources`` (ImageFolder, CUB-200-2011 and the torchvision presets, one split each),
``files`` (what an entry is when it is not a readable file; a user's text file's lines),
``datasets`` (the dataset types, ``TransformedDataset``, ``Batch`` and ``collate``),
``transforms`` (DESIGN 3), ``images`` (one image file's check, ``BadImageError``), ``splits``
(class subsets and caps, ``check_learnable``, ``check_images``, ``DataSplits``) and
``loaders`` (samplers, ``build_loader``). Fashion-MNIST and the presets' front door
(``load_split``, ``build_datasets``, ``datasets_from_recipe``) stay here: they read
``FASHION_MNIST_DIRS`` from this namespace, where a caller (a test) may point it elsewhere.
"""

from __future__ import annotations

import gzip
import logging
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgetl.data.datasets import (
    ArrayDataset,
    Batch,
    FileListDataset,
    LabeledDataset,
    Skipped,
    SubsetDataset,
    TorchvisionDataset,
    TransformedDataset,
    collate,
)
from edgetl.data.images import BadImageError, bad_image_error, check_image_file, image_fault
from edgetl.data.loaders import (
    ResumableSampler,
    ShardSampler,
    build_loader,
    dist_rank_world,
    loader_errors,
    loaders_from_recipe,
    worker_error,
)
from edgetl.data.files import NotAFileError, entry_fault, open_regular, read_text_lines
from edgetl.data.sources import (
    CUB_FILES,
    IMAGE_EXTENSIONS,
    SPLITS,
    _torchvision_preset,
    class_folders,
    cub200,
    image_folder,
)
from edgetl.data.splits import (
    BAD_IMAGE_POLICIES,
    DataSplits,
    ImageCheck,
    check_images,
    check_learnable,
    drop_samples,
    select,
)
from edgetl.data.transforms import eval_transform, train_transform
from edgetl.errors import ConfigError, DataError
from edgetl.imagenet import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "ArrayDataset",
    "BAD_IMAGE_POLICIES",
    "BadImageError",
    "Batch",
    "CUB_FILES",
    "DataSplits",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIRS",
    "FASHION_MNIST_FILES",
    "FileListDataset",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "ImageCheck",
    "LabeledDataset",
    "NotAFileError",
    "ResumableSampler",
    "SPLITS",
    "ShardSampler",
    "Skipped",
    "SubsetDataset",
    "TorchvisionDataset",
    "TransformedDataset",
    "bad_image_error",
    "build_datasets",
    "build_loader",
    "check_image_file",
    "check_images",
    "check_learnable",
    "class_folders",
    "collate",
    "cub200",
    "datasets_from_recipe",
    "dist_rank_world",
    "drop_samples",
    "entry_fault",
    "eval_transform",
    "fashion_mnist",
    "find_fashion_mnist",
    "image_fault",
    "image_folder",
    "load_split",
    "loader_errors",
    "loaders_from_recipe",
    "open_regular",
    "read_text_lines",
    "select",
    "train_transform",
    "worker_error",
]

log = logging.getLogger(__name__)

FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


# --- Fashion-MNIST ---------------------------------------------------------------------


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{path} is truncated; expected an IDX file")
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08 or dims != ndim:
        raise DataError(f"{path} is not an IDX file of {ndim}-d unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise DataError(f"{path} holds {body.size} bytes, its header promises {int(np.prod(shape))}")
    return body.reshape(shape)


def find_fashion_mnist(root: str | Path | None = None) -> Path:
    """The folder holding the four Fashion-MNIST IDX files: ``root`` (or its FashionMNIST/raw,
    torchvision's layout) when given — a folder the user named is never passed over for
    another — else /usr/share/datasets/fashion-mnist."""
    needed = [name for pair in FASHION_MNIST_FILES.values() for name in pair]
    candidates = [Path(d) for d in FASHION_MNIST_DIRS]
    if root is not None:
        root = Path(root)
        candidates = [root, root / "FashionMNIST" / "raw"]
    for folder in candidates:
        if all((folder / n).is_file() or (folder / n[:-3]).is_file() for n in needed):
            return folder
    where = root if root is not None else FASHION_MNIST_DIRS[0]
    raise DataError(
        f"Fashion-MNIST not found in {where}; expected {needed[0]} and the other "
        "3 IDX files (install the Debian package dataset-fashion-mnist, or set data.download: true)"
    )


def fashion_mnist(root: str | Path | None, split: str, download: bool = False) -> ArrayDataset:
    """Fashion-MNIST (gray 28x28, shown as RGB); split "train" (60000) or "val" (the 10000 test images)."""
    try:
        folder = find_fashion_mnist(root)
    except DataError:
        if not download:
            raise
        if root is None:
            raise ConfigError("data.download needs data.root: the folder to download Fashion-MNIST into") from None
        from torchvision.datasets import FashionMNIST

        log.info("downloading Fashion-MNIST into %s", root)
        FashionMNIST(str(root), train=True, download=True)
        FashionMNIST(str(root), train=False, download=True)
        folder = find_fashion_mnist(root)
    images_name, labels_name = FASHION_MNIST_FILES[split]

    def pick(name: str) -> Path:
        return folder / name if (folder / name).is_file() else folder / name[:-3]

    images = _read_idx(pick(images_name), 3)
    labels = _read_idx(pick(labels_name), 1)
    if len(images) != len(labels):
        raise DataError(f"{folder}: {len(images)} images but {len(labels)} labels in the {split} split")
    return ArrayDataset(images, labels, FASHION_MNIST_CLASSES)


# --- presets ---------------------------------------------------------------------------


def load_split(preset: str, root: str | Path | None, split: str, download: bool = False) -> LabeledDataset:
    """One split ("train" or "val"; "val" is the preset's test set) of a preset, untransformed."""
    if split not in SPLITS:
        raise ConfigError(f"split {split!r} not allowed; allowed: {', '.join(SPLITS)}")
    if preset in ("imagefolder", "imagenet"):
        if root is None:
            raise ConfigError(f"data preset {preset!r} needs data.root: a folder with train/ and val/")
        return image_folder(root, split)
    if preset == "fashion_mnist":
        return fashion_mnist(root, split, download=download)
    if preset == "cub200":
        if root is None:
            raise ConfigError("data preset 'cub200' needs data.root: the unpacked CUB_200_2011 folder")
        return cub200(root, split)
    if preset in ("cifar10", "flowers102", "pets"):
        return _torchvision_preset(preset, root, split, download)
    from edgetl.recipe import PRESETS

    raise ConfigError(f"unknown data preset {preset!r}; allowed: {', '.join(PRESETS)}")


def build_datasets(
    *,
    preset: str,
    resolution: int,
    root: str | Path | None = None,
    classes: Sequence[int] | None = None,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    download: bool = False,
    seed: int = 0,
    on_bad_image: str = "error",
    check: bool = True,
    uint8: bool = False,
) -> DataSplits:
    """Train/val datasets of a preset with DESIGN 3 transforms, class subset and caps applied.

    Args:
        on_bad_image: "error" or "skip": what an unreadable image file does (``check_images``).
        check: check every image file now (``check_images``); False leaves it to the caller.
        uint8: images come as uint8 pixels, to be normalised by the network
            (``model.uint8_input``); else as the normalised fp32 tensor.
    """
    if on_bad_image not in BAD_IMAGE_POLICIES:
        raise ConfigError(f"data.on_bad_image: {on_bad_image!r} is not allowed; allowed: {', '.join(BAD_IMAGE_POLICIES)}")
    train = select(load_split(preset, root, "train", download), classes, max_samples, seed)
    val = select(load_split(preset, root, "val", download), classes, max_val_samples, seed)
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"{preset} at {root}: no samples left after selecting classes {list(classes or [])}")
    check_learnable(train, val, f"{preset} at {root}" if root else preset)
    skip = on_bad_image == "skip"
    splits = DataSplits(
        train=TransformedDataset(train, train_transform(resolution, uint8), seed=seed, skip_bad=skip),
        val=TransformedDataset(val, eval_transform(resolution, uint8), seed=seed, skip_bad=skip),
        classes=list(train.classes),
    )
    return check_images(splits, on_bad_image) if check else splits


def datasets_from_recipe(recipe, check: bool = True) -> DataSplits:
    """``build_datasets`` with a Recipe's data section and train.seed."""
    d = recipe.data
    return build_datasets(
        preset=d.preset, resolution=d.resolution, root=d.root, classes=d.classes,
        max_samples=d.max_samples, max_val_samples=d.max_val_samples, download=d.download,
        seed=recipe.train.seed, on_bad_image=d.on_bad_image, check=check,
        uint8=bool(getattr(recipe.model, "uint8_input", False)),
    )
