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
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import math
import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate

from edgetl.errors import ConfigError, DataError, ResourceError
from edgetl.imagenet import IMAGENET_MEAN, IMAGENET_STD

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
SPLITS = ("train", "val")
BAD_IMAGE_POLICIES = ("error", "skip")


# --- transforms (DESIGN 3) -------------------------------------------------------------


def _to_tensor(uint8: bool) -> list:
    """The last steps: ImageNet normalisation into fp32, or the uint8 pixels themselves for a
    network that normalises its own batch (``edgetl.models.lean.InputNorm``, the same values)."""
    from torchvision import transforms as T

    if uint8:
        return [T.PILToTensor()]
    return [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


def train_transform(resolution: int, uint8: bool = False):
    """RandomResizedCrop(scale 0.22-1) + horizontal flip + ImageNet normalisation (``uint8``:
    left to the network)."""
    from torchvision import transforms as T

    return T.Compose([
        T.RandomResizedCrop(resolution, scale=(0.22, 1.0)),
        T.RandomHorizontalFlip(),
        *_to_tensor(uint8),
    ])


def eval_transform(resolution: int, uint8: bool = False):
    """Resize the short side to resolution / 0.875, centre crop, ImageNet normalisation
    (``uint8``: left to the network)."""
    from torchvision import transforms as T

    return T.Compose([
        T.Resize(int(math.floor(resolution / 0.875))),
        T.CenterCrop(resolution),
        *_to_tensor(uint8),
    ])


# --- bad images ------------------------------------------------------------------------


class BadImageError(DataError):
    """An image file that cannot be read or decoded; the message names the file and the fault.

    A DataLoader worker's exception comes back to the main process rebuilt as
    ``type(text)``, where text is "Caught ... Original Traceback ..." ending in this
    class's own line; the constructor keeps only that line, so the user sees one line.
    """

    def __init__(self, message: str):
        marker = f"{__name__}.{type(self).__qualname__}: "
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


def bad_image_error(path, fault: str) -> BadImageError:
    exc = BadImageError(f"cannot read image {path}: {fault}; fix or remove it, or set data.on_bad_image: skip")
    exc.path, exc.fault = str(path), fault
    return exc


def image_fault(exc: BaseException) -> str:
    """What is wrong with a file, in a few words, from the exception reading it raised."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image file Pillow can read"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, OSError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
# bytes per pixel of raw-coded rows (PPM/PGM/TGA...) when the format does not give a stride
_RAW_BYTES = {"L": 1, "P": 1, "LA": 2, "I;16": 2, "I;16B": 2, "RGB": 3, "BGR": 3, "RGBA": 4, "RGBX": 4, "CMYK": 4}


def _end_looks_whole(f, img: Image.Image, size: int) -> bool:
    """Whether the file's last bytes are what its format ends with (a cheap truncation test).

    JPEG ends with the EOI marker, PNG with its IEND chunk, WebP is as long as its RIFF
    header says, a raw-coded image (BMP, PPM, ...) holds its rows. Other formats: True
    (their header was read). False is a suspicion only: the caller decodes to confirm.
    """
    fmt = img.format
    if fmt == "JPEG":
        f.seek(max(0, size - 64))
        return f.read().rstrip(b"\x00\r\n\t ").endswith(b"\xff\xd9")
    if fmt == "PNG":
        f.seek(max(0, size - len(_PNG_END)))
        return f.read() == _PNG_END
    if fmt == "WEBP":
        f.seek(4)
        return int.from_bytes(f.read(4), "little") + 8 <= size
    tile = getattr(img, "tile", None) or []
    if len(tile) == 1 and tile[0][0] == "raw":
        _, (x0, y0, x1, y1), offset, args = tile[0]
        rawmode, stride = (args, 0) if isinstance(args, str) else (args[0], args[1] if len(args) > 1 else 0)
        if not stride:
            if rawmode == "1":
                stride = -(-(x1 - x0) // 8)
            elif rawmode in _RAW_BYTES:
                stride = (x1 - x0) * _RAW_BYTES[rawmode]
        if stride > 0:
            return offset + stride * (y1 - y0) <= size
    return True


def check_image_file(path: str | Path) -> str | None:
    """None if the image file looks whole, else what is wrong with it.

    Reads the header (format, size) and the end of the file (``_end_looks_whole``); only a
    file whose end looks wrong is decoded in full, so a good file costs one open and two
    small reads.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return "the file is empty"
            with Image.open(f) as img:
                width, height = img.size
                if width < 1 or height < 1:
                    return f"its header says {width}x{height} pixels"
                if _end_looks_whole(f, img, size):
                    return None
        with Image.open(path) as img:
            img.load()
        return None
    except MemoryError:
        raise
    except Exception as exc:  # Pillow raises many types for damaged files
        return image_fault(exc)


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


# --- base datasets ---------------------------------------------------------------------


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
            with Image.open(path) as img:
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
                torch.manual_seed(sample_seed % (2**63))
                return self.transform(img), label
        img, label = self._load(key)
        if isinstance(img, Skipped):
            return img
        return self.transform(img), label


class Batch(tuple):
    """``(images, labels)`` plus ``skipped``: the Skipped samples left out of this batch.

    Unpacks like the usual pair. ``images`` and ``labels`` are None when every sample of
    the batch was skipped.
    """

    skipped: tuple[Skipped, ...]

    def __new__(cls, images, labels, skipped=()):
        batch = super().__new__(cls, (images, labels))
        batch.skipped = tuple(skipped)
        return batch

    def __reduce__(self):
        return (Batch, (self[0], self[1], self.skipped))

    def pin_memory(self):  # DataLoader(pin_memory=True) calls this on custom batch types
        images, labels = self
        if images is None:
            return self
        return Batch(images.pin_memory(), labels.pin_memory(), self.skipped)


def collate(samples: list) -> Batch:
    """default_collate of the readable samples; the Skipped ones are named in ``Batch.skipped``."""
    skipped = [s for s in samples if isinstance(s, Skipped)]
    kept = [s for s in samples if not isinstance(s, Skipped)]
    if not kept:
        return Batch(None, None, skipped)
    images, labels = default_collate(kept)
    return Batch(images, labels, skipped)


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
            are logged at INFO); "skip" logs each bad file once (WARNING) and leaves it out.

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
        check_learnable(kept["train"].base, kept["val"].base, "after skipping unreadable images")
    return DataSplits(train=kept["train"], val=kept["val"], classes=splits.classes,
                      image_check=ImageCheck(checked, seconds, bad, policy))


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


# --- subsets and caps ------------------------------------------------------------------


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


def datasets_from_recipe(recipe, check: bool = True) -> DataSplits:
    """``build_datasets`` with a Recipe's data section and train.seed."""
    d = recipe.data
    return build_datasets(
        preset=d.preset, resolution=d.resolution, root=d.root, classes=d.classes,
        max_samples=d.max_samples, max_val_samples=d.max_val_samples, download=d.download,
        seed=recipe.train.seed, on_bad_image=d.on_bad_image, check=check,
        uint8=bool(getattr(recipe.model, "uint8_input", False)),
    )


# --- samplers and loaders --------------------------------------------------------------


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
