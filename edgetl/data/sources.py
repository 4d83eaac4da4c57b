"""Sources: a layout on disk (ImageFolder, CUB-200-2011) or a torchvision preset in, one
untransformed split out."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from edgetl.data.datasets import FileListDataset, TorchvisionDataset
from edgetl.data.files import entry_fault, read_text_lines
from edgetl.errors import ConfigError, DataError

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.data")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
SPLITS = ("train", "val")


# --- ImageFolder -----------------------------------------------------------------------


def _read_labels_txt(path: Path) -> list[str]:
    names = [line.strip() for line in read_text_lines(path, "one class name a line") if line.strip()]
    if not names:
        raise DataError(f"{path} is empty; expected one class name per line")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise DataError(f"{path} lists class {dup[0]!r} more than once")
    return names


def _not_a_folder(path: Path) -> str:
    """Why ``path`` is no folder: "does not exist", "is a symlink to X, which does not exist", "is a file"."""
    if not os.path.lexists(path):
        return "does not exist"
    return f"is {entry_fault(path) or 'a file'}"


def _list_folder(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as exc:
        raise DataError(f"cannot list folder {folder}: {(exc.strerror or str(exc)).lower()}; "
                        "every folder of the data must be readable") from None


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks; a dangling one is not a folder
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()  # a regular file or a symlink to one; no stat for a plain file
    except OSError:
        return False


def _class_names(split_dir: Path) -> list[str]:
    """The class folders of a split folder (symlinks to folders included; hidden entries and
    files left alone), sorted.

    Raises:
        DataError: an entry that is neither a folder nor a file (a dangling symlink, a FIFO,
            ...): it may be a class whose images cannot be read, and leaving it out would
            change the label set.
    """
    names = []
    for entry in _list_folder(split_dir):
        if entry.name.startswith("."):
            continue
        if _is_dir(entry):
            names.append(entry.name)
        elif not _is_file(entry):
            what = entry_fault(entry.path) or "not a folder"
            raise DataError(f"{entry.path} is {what}; each entry of {split_dir} must be a class folder (a folder "
                            "or a symlink to one) or a file: fix or remove it")
    return sorted(names)


def _class_files(folder: Path) -> list[Path]:
    """The samples of one class folder, in path order: every file with an image extension,
    and every entry that is neither a folder nor a file (a dangling symlink, a FIFO, a
    socket), which ``check_images`` then names as an unreadable image under
    data.on_bad_image. Subfolders are searched, symlinked ones too (torchvision's
    ImageFolder follows them as well).
    """
    found: list[Path] = []

    def walk(here: Path, above: frozenset) -> None:
        for entry in _list_folder(here):
            path = Path(entry.path)
            if _is_dir(entry):
                st = entry.stat()
                # ``above``: (device, inode) of every folder holding this one, up to /. A
                # symlink to one of them is a loop: it would bring this class's images
                # again, and other classes' as this one's.
                if (st.st_dev, st.st_ino) in above:
                    log.warning("not following %s: a symlink to %s, a folder that holds it (a loop)",
                                path, os.readlink(path) if path.is_symlink() else path)
                else:
                    walk(path, above | {(st.st_dev, st.st_ino)})
            elif not _is_file(entry) or path.suffix.lower() in IMAGE_EXTENSIONS:
                found.append(path)

    real = Path(os.path.realpath(folder))
    walk(folder, frozenset((st.st_dev, st.st_ino) for st in map(os.stat, [real, *real.parents])))
    return sorted(found)


def _scan_split(split_dir: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, int]]]:
    found = _class_names(split_dir)
    if not found:
        raise DataError(f"{split_dir} has no class folders; expected {split_dir}/<class>/*.jpg")
    if classes is None:
        classes = found
    samples = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if not folder.is_dir():
            raise DataError(f"{split_dir} has no folder for class {name!r}; expected {folder}/*.jpg")
        files = _class_files(folder)
        if not files:
            raise DataError(
                f"class folder {folder} is empty; expected images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...)"
            )
        samples += [(f, label) for f in files]
    return classes, samples


def class_folders(folder: str | Path) -> FileListDataset:
    """One folder of class folders (``folder/<class>/*.jpg``, no labels.txt, no split), as
    ``image_folder`` reads a split: the same refusals, and unreadable entries as samples
    that ``check_image_file`` names (loading one raises ``BadImageError``, never waits)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"image folder {folder} {_not_a_folder(folder)}; expected {folder}/<class>/*.jpg")
    classes, samples = _scan_split(folder, None)
    return FileListDataset(samples, classes)


def image_folder(root: str | Path, split: str) -> FileListDataset:
    """One split of ``root/{train,val}/<class>/*.jpg``; class order from labels.txt or sorted names.

    Nothing in the folder is passed over in silence: an entry of a split folder that is
    neither a folder nor a file (a dangling symlink, a FIFO) is refused, as leaving out a
    class changes the label set; such an entry in a class folder is a sample that
    ``check_images`` names as unreadable (data.on_bad_image: refused, or left out and
    counted). labels.txt may carry a UTF-8 byte-order mark and CRLF line ends.

    Raises:
        DataError: missing root or split folder, an empty class folder, an entry that is not
            a folder or a file where class folders are, a folder that cannot be listed, an
            unreadable labels.txt, or train and val (or labels.txt) naming different classes.
    """
    root = Path(root)
    if split not in SPLITS:
        raise ConfigError(f"split {split!r} not allowed; allowed: {', '.join(SPLITS)}")
    expected = f"expected {root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg"
    if not root.is_dir():
        raise DataError(f"data folder {root} {_not_a_folder(root)}; {expected}")
    for s in SPLITS:
        if os.path.lexists(root / s) and not (root / s).is_dir():
            raise DataError(f"{root / s} {_not_a_folder(root / s)}; {expected}")
    missing = [s for s in SPLITS if not (root / s).is_dir()]
    if missing:
        raise DataError(f"{root} has no {' or '.join(m + '/' for m in missing)} folder; {expected}")
    labels_txt = root / "labels.txt"
    # labels.txt in any form but absent is read: a dangling link or a FIFO is refused by
    # read_text_lines, never taken for "no labels.txt" (that would reorder the labels)
    classes = _read_labels_txt(labels_txt) if os.path.lexists(labels_txt) else None
    names = {s: _class_names(root / s) for s in SPLITS}
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
    for n, line in enumerate(read_text_lines(path, "'<id> <value>' a line"), 1):
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
