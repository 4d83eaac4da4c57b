"""Sources: a layout on disk (ImageFolder, CUB-200-2011) or a torchvision preset in, one
untransformed split out."""

from __future__ import annotations

from pathlib import Path

import torch

from edgetl.data.datasets import FileListDataset, TorchvisionDataset
from edgetl.errors import ConfigError, DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
SPLITS = ("train", "val")


# --- ImageFolder -----------------------------------------------------------------------


def _read_labels_txt(path: Path) -> list[str]:
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not names:
        raise DataError(f"{path} is empty; expected one class name per line")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise DataError(f"{path} lists class {dup[0]!r} more than once")
    return names


def _scan_split(split_dir: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, int]]]:
    found = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"{split_dir} has no class folders; expected {split_dir}/<class>/*.jpg")
    if classes is None:
        classes = found
    samples = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if not folder.is_dir():
            raise DataError(f"{split_dir} has no folder for class {name!r}; expected {folder}/*.jpg")
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not files:
            raise DataError(
                f"class folder {folder} is empty; expected images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...)"
            )
        samples += [(f, label) for f in files]
    return classes, samples


def image_folder(root: str | Path, split: str) -> FileListDataset:
    """One split of ``root/{train,val}/<class>/*.jpg``; class order from labels.txt or sorted names.

    Raises:
        DataError: missing root or split folder, an empty class folder, or train and val
            (or labels.txt) naming different classes.
    """
    root = Path(root)
    if split not in SPLITS:
        raise ConfigError(f"split {split!r} not allowed; allowed: {', '.join(SPLITS)}")
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist; expected {root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg")
    missing = [s for s in SPLITS if not (root / s).is_dir()]
    if missing:
        raise DataError(
            f"{root} has no {' or '.join(m + '/' for m in missing)} folder; expected {root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg"
        )
    labels_txt = root / "labels.txt"
    classes = _read_labels_txt(labels_txt) if labels_txt.is_file() else None
    names = {s: sorted(p.name for p in (root / s).iterdir() if p.is_dir() and not p.name.startswith(".")) for s in SPLITS}
    for s in SPLITS:
        if not names[s]:
            raise DataError(f"{root / s} has no class folders; expected {root / s}/<class>/*.jpg")
    if classes is not None:
        for s in SPLITS:
            extra = sorted(set(names[s]) - set(classes))
            if extra:
                raise DataError(f"{root / s} has class folder {extra[0]!r} that {labels_txt} does not list")
    elif names["train"] != names["val"]:
        only_train = sorted(set(names["train"]) - set(names["val"]))
        only_val = sorted(set(names["val"]) - set(names["train"]))
        detail = f"{only_train[0]!r} only in train/" if only_train else f"{only_val[0]!r} only in val/"
        raise DataError(f"{root}: train/ and val/ have different classes ({detail}); they must match")
    classes, samples = _scan_split(root / split, classes)
    return FileListDataset(samples, classes)


# --- CUB-200-2011 ----------------------------------------------------------------------

CUB_FILES = ("images.txt", "train_test_split.txt", "image_class_labels.txt")


def _read_table(path: Path) -> dict[int, str]:
    table = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        key, sep, value = line.strip().partition(" ")
        if not sep or not key.isdigit():
            raise DataError(f"{path}:{n} is not '<id> <value>'")
        table[int(key)] = value.strip()
    return table


def cub200(root: str | Path, split: str) -> FileListDataset:
    """CUB-200-2011 from the official tarball layout; ``root`` is CUB_200_2011/ or its parent."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"CUB-200-2011 folder {root} does not exist; expected the unpacked CUB_200_2011.tgz")
    if not (root / CUB_FILES[0]).is_file() and (root / "CUB_200_2011" / CUB_FILES[0]).is_file():
        root = root / "CUB_200_2011"
    missing = [f for f in CUB_FILES if not (root / f).is_file()]
    if missing or not (root / "images").is_dir():
        what = missing[0] if missing else "images/"
        raise DataError(f"{root} is not the CUB_200_2011 layout: {what} is missing; expected {', '.join(CUB_FILES)} and images/")
    images = _read_table(root / "images.txt")
    is_train = _read_table(root / "train_test_split.txt")
    labels = {k: int(v) - 1 for k, v in _read_table(root / "image_class_labels.txt").items()}
    if (root / "classes.txt").is_file():
        names = _read_table(root / "classes.txt")
        classes = [names[k] for k in sorted(names)]
    else:
        classes = [f"class_{i:03d}" for i in range(max(labels.values()) + 1)]
    want = "1" if split == "train" else "0"
    samples = []
    for image_id in sorted(images):
        if image_id not in is_train or image_id not in labels:
            raise DataError(f"{root}: image id {image_id} lacks a split or a label")
        if is_train[image_id] == want:
            samples.append((root / "images" / images[image_id], labels[image_id]))
    if not samples:
        raise DataError(f"{root}: the {split} split is empty")
    return FileListDataset(samples, classes)


# --- torchvision presets ---------------------------------------------------------------


def _torchvision_preset(preset: str, root: str | Path | None, split: str, download: bool) -> TorchvisionDataset:
    import torchvision.datasets as tvd

    if root is None:
        raise ConfigError(f"data preset {preset!r} needs data.root (a folder holding or receiving the data)")
    root = str(root)
    if not download and not Path(root).is_dir():
        raise DataError(f"{preset} data folder {root} does not exist; point data.root at it or set data.download: true")
    train = split == "train"
    try:
        if preset == "cifar10":
            ds = tvd.CIFAR10(root, train=train, download=download)
            return TorchvisionDataset(ds, ds.targets, ds.classes)
        if preset == "flowers102":
            if train:  # the common protocol (TinyTL, Rep-Net): train + val for training, test for eval
                parts = [tvd.Flowers102(root, split=s, download=download) for s in ("train", "val")]
                ds = torch.utils.data.ConcatDataset(parts)
                targets = [t for p in parts for t in p._labels]
                files = [f for p in parts for f in p._image_files]
            else:
                ds = tvd.Flowers102(root, split="test", download=download)
                targets, files = ds._labels, ds._image_files
            return TorchvisionDataset(ds, targets, [f"flower_{i:03d}" for i in range(102)], files)
        if preset == "pets":
            ds = tvd.OxfordIIITPet(root, split="trainval" if train else "test", target_types="category", download=download)
            return TorchvisionDataset(ds, ds._labels, ds.classes, ds._images)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"{preset} not found or damaged under {root} ({first}); set data.download: true to fetch it"
        ) from None
    raise ConfigError(f"unknown preset {preset!r}")
