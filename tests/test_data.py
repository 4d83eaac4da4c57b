"""Data layer: layouts, errors, class subsets, caps, transforms, seeded sampling."""

from __future__ import annotations

import gzip
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgetl import data as D
from edgetl.errors import ConfigError, DataError

FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(
    not (FMNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)

COLORS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}


def make_folder(root: Path, per_class: dict[str, int] | None = None, splits=("train", "val"), size=20) -> Path:
    per_class = per_class or {"red": 4, "green": 3, "blue": 2}
    rng = np.random.default_rng(0)
    for split in splits:
        for name, n in per_class.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = np.array(COLORS.get(name, (128, 128, 128)), dtype=np.int16)
                pixels = np.clip(base + rng.integers(-20, 20, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.jpg" if i % 2 else folder / f"{i}.png")
    return root


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# --- ImageFolder -------------------------------------------------------------------------


def test_image_folder_layout(tmp_path):
    root = make_folder(tmp_path / "d")
    (root / "train" / "red" / "notes.txt").write_text("not an image")
    train = D.image_folder(root, "train")
    assert train.classes == ["blue", "green", "red"]  # sorted without labels.txt
    assert Counter(train.targets) == {2: 4, 1: 3, 0: 2}
    img, label = train[0]
    assert img.mode == "RGB" and img.size == (20, 20) and label == 0
    assert np.asarray(img)[..., 2].mean() > 150  # blue


def test_labels_txt_sets_label_order(tmp_path):
    root = make_folder(tmp_path / "d")
    (root / "labels.txt").write_text("red\ngreen\nblue\n")
    train = D.image_folder(root, "train")
    assert train.classes == ["red", "green", "blue"]
    assert Counter(train.targets) == {0: 4, 1: 3, 2: 2}
    img, label = train[0]
    assert label == 0 and np.asarray(img)[..., 0].mean() > 150


@pytest.mark.parametrize(
    "breakage,pattern",
    [
        ("missing_root", r"data folder .*/nope does not exist; expected .*/train/<class>"),
        ("no_val", r"has no val/ folder; expected"),
        ("empty_class", r"class folder .*val/green is empty; expected images"),
        ("mismatch", r"train/ and val/ have different classes \('purple' only in train/\)"),
        ("labels_missing_folder", r"has no folder for class 'cyan'"),
        ("labels_extra_folder", r"class folder 'blue' that .*labels.txt does not list"),
        ("no_classes", r"has no class folders"),
    ],
)
def test_image_folder_errors(tmp_path, breakage, pattern):
    root = tmp_path / "d"
    if breakage != "missing_root":
        make_folder(root)
    if breakage == "missing_root":
        root = tmp_path / "nope"
    elif breakage == "no_val":
        import shutil

        shutil.rmtree(root / "val")
    elif breakage == "empty_class":
        for f in (root / "val" / "green").iterdir():
            f.unlink()
    elif breakage == "mismatch":
        make_folder(root, {"purple": 1}, splits=("train",))
    elif breakage == "labels_missing_folder":
        (root / "labels.txt").write_text("red\ngreen\nblue\ncyan\n")
    elif breakage == "labels_extra_folder":
        (root / "labels.txt").write_text("red\ngreen\n")
    elif breakage == "no_classes":
        import shutil

        shutil.rmtree(root / "train")
        (root / "train").mkdir()
    with pytest.raises(DataError) as info:
        D.build_datasets(preset="imagefolder", root=root, resolution=32)
    import re

    assert re.search(pattern, one_line(info)), str(info.value)


def test_presets_need_a_root_and_never_download(tmp_path):
    with pytest.raises(ConfigError, match="needs data.root"):
        D.load_split("imagefolder", None, "train")
    with pytest.raises(DataError, match="cifar10 data folder .* does not exist"):
        D.load_split("cifar10", tmp_path / "none", "train")
    (tmp_path / "empty").mkdir()
    for preset in ("cifar10", "flowers102", "pets"):
        with pytest.raises(DataError, match=f"{preset} not found or damaged under .*data.download: true") as info:
            D.load_split(preset, tmp_path / "empty", "train")
        one_line(info)
    assert list((tmp_path / "empty").rglob("*")) == [] or all(p.is_dir() for p in (tmp_path / "empty").rglob("*"))
    with pytest.raises(ConfigError, match="unknown data preset"):
        D.load_split("mnist", tmp_path, "train")


# --- subsets and caps --------------------------------------------------------------------


def test_class_subset_relabels_in_given_order(tmp_path):
    train = D.image_folder(make_folder(tmp_path / "d"), "train")  # blue 0 (2), green 1 (3), red 2 (4)
    sub = D.select(train, classes=[2, 0])
    assert sub.classes == ["red", "blue"]
    assert Counter(sub.targets) == {0: 4, 1: 2}
    for i in range(len(sub)):
        img, label = sub[i]
        assert label == sub.targets[i]
        assert np.asarray(img)[..., 0 if label == 0 else 2].mean() > 150
    with pytest.raises(ConfigError, match=r"class 3 does not exist; allowed: 0..2"):
        D.select(train, classes=[3])


def test_sample_cap_is_balanced_and_seeded(tmp_path):
    train = D.image_folder(make_folder(tmp_path / "d", {"red": 10, "green": 10, "blue": 3}), "train")
    capped = D.select(train, max_samples=12, seed=1)
    assert len(capped) == 12
    assert Counter(capped.targets) == {0: 3, 1: 5, 2: 4} or Counter(capped.targets) == {0: 3, 1: 4, 2: 5}
    assert D.select(train, max_samples=12, seed=1).indices == capped.indices
    assert D.select(train, max_samples=12, seed=2).indices != capped.indices
    assert D.select(train, max_samples=100) is train


# --- transforms --------------------------------------------------------------------------


def test_transforms_sizes_and_normalisation():
    img = Image.fromarray(np.full((40, 60, 3), 255, dtype=np.uint8))
    x = D.eval_transform(32)(img)
    assert x.shape == (3, 32, 32)
    expected = (1 - torch.tensor(D.IMAGENET_MEAN)) / torch.tensor(D.IMAGENET_STD)
    torch.testing.assert_close(x.mean((1, 2)), expected)
    assert D.train_transform(48)(img).shape == (3, 48, 48)
    tf = D.eval_transform(224).transforms
    assert tf[0].size == 256 and tf[1].size == (224, 224)  # 224 / 0.875
    crop = D.train_transform(224).transforms[0]
    assert crop.scale == (0.22, 1.0)


def test_augmentation_is_a_function_of_seed_epoch_index(tmp_path):
    splits = D.build_datasets(preset="imagefolder", root=make_folder(tmp_path / "d"), resolution=32, seed=3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = splits.train[(4, 0)][0]
    assert torch.equal(torch.get_rng_state(), before)  # caller's generator untouched
    _ = splits.train[(5, 0)]
    assert torch.equal(splits.train[(4, 0)][0], a)
    assert not torch.equal(splits.train[(4, 1)][0], a)
    assert torch.equal(splits.val[4][0], splits.val[4][0])
    other = D.build_datasets(preset="imagefolder", root=tmp_path / "d", resolution=32, seed=4)
    assert not torch.equal(other.train[(4, 0)][0], a)


def test_augmentation_seeds_the_cpu_generator_alone(tmp_path, monkeypatch):
    """A sample's seed goes to the CPU generator the transforms draw from and nowhere else:
    ``torch.manual_seed`` also queued it for every accelerator torch knows, formatting a stack
    trace for each while none was initialised, per sample. The crop is still the one that
    seed gives the global generator."""
    splits = D.build_datasets(preset="imagefolder", root=make_folder(tmp_path / "d"), resolution=32, seed=3)
    seen = []
    for module in (torch.cuda, torch.xpu, torch.mtia):
        monkeypatch.setattr(module, "manual_seed_all", lambda seed: seen.append(seed))
    monkeypatch.setattr(torch, "manual_seed", lambda seed: seen.append(seed))
    image, _ = splits.train[(4, 1)]
    assert seen == []
    monkeypatch.undo()
    index, epoch = 4, 1
    img, _ = splits.train.base[index]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(((3 * 1_000_003 + epoch) * 10_000_019 + index) % (2**63))
        assert torch.equal(splits.train.transform(img), image)


# --- samplers and loaders ----------------------------------------------------------------


def test_resumable_sampler_order_and_start():
    ds = list(range(10))
    s = D.ResumableSampler(ds, seed=0)
    s.set_epoch(2)
    full = list(s)
    assert sorted(i for i, _ in full) == list(range(10)) and all(e == 2 for _, e in full)
    s.set_start(6)
    assert list(s) == full[6:] and len(s) == 4
    s.set_start(0)
    s.set_epoch(3)
    assert [i for i, _ in s] != [i for i, _ in full]
    s.set_epoch(2)
    assert list(s) == full


def test_distributed_shards_are_disjoint():
    ds = list(range(12))
    shards = []
    for rank in range(3):
        s = D.ResumableSampler(ds, seed=5, rank=rank, world_size=3)
        s.set_epoch(1)
        shards.append([i for i, _ in s])
    assert all(len(x) == 4 for x in shards)
    assert sorted(sum(shards, [])) == list(range(12))
    evals = [list(D.ShardSampler(10, r, 3)) for r in range(3)]
    assert sorted(sum(evals, [])) == list(range(10))


def test_build_loader(tmp_path):
    splits = D.build_datasets(preset="imagefolder", root=make_folder(tmp_path / "d"), resolution=32)
    train = D.build_loader(splits.train, batch_size=4, train=True, workers=0)
    assert len(train) == 2  # 9 images, ragged batch dropped
    images, labels = next(iter(train))
    assert images.shape == (4, 3, 32, 32) and labels.dtype == torch.int64
    val = D.build_loader(splits.val, batch_size=4, train=False, workers=0)
    assert sum(len(y) for _, y in val) == 9
    assert [y.tolist() for _, y in val] == [[0, 0, 1, 1], [1, 2, 2, 2], [2]]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(train)
    assert torch.equal(torch.get_rng_state(), before)  # loading does not consume the global generator


def test_loader_order_independent_of_workers(tmp_path):
    splits = D.build_datasets(preset="imagefolder", root=make_folder(tmp_path / "d"), resolution=32)
    batches = []
    for workers in (0, 2):
        loader = D.build_loader(splits.train, batch_size=4, train=True, workers=workers, seed=7)
        loader.sampler.set_epoch(1)
        batches.append([x for x, _ in loader])
    assert all(torch.equal(a, b) for a, b in zip(*batches))


# --- Fashion-MNIST -----------------------------------------------------------------------


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def fake_fmnist(folder: Path, n_train=20, n_test=10) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)


def test_fashion_mnist_from_user_path(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "FASHION_MNIST_DIRS", (str(tmp_path / "not-installed"),))
    with pytest.raises(DataError, match="Fashion-MNIST not found in .*dataset-fashion-mnist") as info:
        D.fashion_mnist(tmp_path / "mine", "train")
    one_line(info)
    fake_fmnist(tmp_path / "not-installed")  # the system copy does not stand in for a folder the user named
    with pytest.raises(DataError, match=f"Fashion-MNIST not found in {tmp_path / 'mine'};"):
        D.fashion_mnist(tmp_path / "mine", "train")
    assert D.find_fashion_mnist(None) == tmp_path / "not-installed"
    fake_fmnist(tmp_path / "mine")
    train = D.fashion_mnist(tmp_path / "mine", "train")
    assert len(train) == 20 and train.targets[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    img, _ = train[3]
    raw = np.frombuffer(gzip.open(tmp_path / "mine" / "train-images-idx3-ubyte.gz").read()[16:], np.uint8)
    arr = np.asarray(img)
    assert arr.shape == (28, 28, 3) and (arr == raw.reshape(20, 28, 28)[3][..., None]).all()
    splits = D.build_datasets(preset="fashion_mnist", root=tmp_path / "mine", resolution=32, classes=[5, 6, 7, 8, 9])
    assert splits.classes == ["Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    assert Counter(splits.train.targets) == {0: 2, 1: 2, 2: 2, 3: 2, 4: 2} and len(splits.val) == 5
    x, y = splits.train[(0, 0)]
    assert x.shape == (3, 32, 32)
    gray = x * torch.tensor(D.IMAGENET_STD)[:, None, None] + torch.tensor(D.IMAGENET_MEAN)[:, None, None]
    torch.testing.assert_close(gray[0], gray[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(gray[1], gray[2], atol=1e-5, rtol=0)


def test_idx_header_is_checked(tmp_path):
    bad = tmp_path / "x.gz"
    with gzip.open(bad, "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, 3) + struct.pack(">3I", 2, 28, 28) + b"\0" * 10)
    with pytest.raises(DataError, match="holds 10 bytes, its header promises 1568"):
        D._read_idx(bad, 3)
    with pytest.raises(DataError, match="not an IDX file of 1-d"):
        D._read_idx(bad, 1)


@needs_fmnist
def test_fashion_mnist_debian_package():
    train = D.fashion_mnist(None, "train")
    test = D.fashion_mnist(None, "val")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.targets[:5] == [9, 0, 0, 3, 0]  # the published first training labels
    assert Counter(train.targets) == {c: 6000 for c in range(10)}
    raw = np.frombuffer(gzip.open(FMNIST / "train-images-idx3-ubyte.gz").read()[16:], np.uint8)
    img, _ = train[0]
    arr = np.asarray(img).astype(np.int64)
    assert arr.sum() == 3 * raw[:784].astype(np.int64).sum()
    assert (arr[..., 0] == arr[..., 1]).all() and (arr[..., 1] == arr[..., 2]).all()
    source = D.build_datasets(preset="fashion_mnist", resolution=32, classes=[0, 1, 2, 3, 4], max_samples=50, max_val_samples=25)
    assert sorted(Counter(source.train.targets).values()) == [10] * 5 and len(source.val) == 25


# --- CUB-200-2011 ------------------------------------------------------------------------


def make_cub(parent: Path) -> Path:
    root = parent / "CUB_200_2011"
    rows, splits, labels = [], [], []
    for image_id in range(1, 7):
        cls = 1 if image_id <= 3 else 2
        rel = f"{cls:03d}.Bird_{cls}/img_{image_id}.jpg"
        (root / "images" / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), 40 * image_id, np.uint8)).save(root / "images" / rel)
        rows.append(f"{image_id} {rel}")
        splits.append(f"{image_id} {1 if image_id % 3 else 0}")
        labels.append(f"{image_id} {cls}")
    (root / "images.txt").write_text("\n".join(rows) + "\n")
    (root / "train_test_split.txt").write_text("\n".join(splits) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (root / "classes.txt").write_text("1 001.Bird_1\n2 002.Bird_2\n")
    return root


def test_cub200_layout(tmp_path):
    root = make_cub(tmp_path)
    for given in (root, tmp_path):  # the CUB_200_2011 folder or its parent
        train = D.load_split("cub200", given, "train")
        test = D.load_split("cub200", given, "val")
        assert train.targets == [0, 0, 1, 1] and test.targets == [0, 1]
        assert train.classes == ["001.Bird_1", "002.Bird_2"]
        assert np.asarray(test[1][0]).mean() == pytest.approx(240, abs=2)  # image 6
    (root / "train_test_split.txt").unlink()
    with pytest.raises(DataError, match="train_test_split.txt is missing"):
        D.load_split("cub200", root, "train")


# --- bad image files ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt, suffix", [("JPEG", "jpg"), ("PNG", "png"), ("BMP", "bmp"), ("WEBP", "webp"), ("PPM", "ppm")])
def test_check_image_file_finds_a_file_cut_short(tmp_path, fmt, suffix):
    from tests.bad_files import image_bytes, truncate

    good = tmp_path / f"good.{suffix}"
    good.write_bytes(image_bytes(fmt))
    assert D.check_image_file(good) is None
    bad = tmp_path / f"bad.{suffix}"
    bad.write_bytes(image_bytes(fmt))
    truncate(bad, 0.6)
    fault = D.check_image_file(bad)
    assert fault is not None and "\n" not in fault, fault
    with pytest.raises(D.BadImageError):  # what the check predicts is what loading does
        D.FileListDataset([(bad, 0)], ["a"])[0]


def test_check_image_file_faults_and_a_false_suspicion(tmp_path):
    from tests.bad_files import flip_png_data, image_bytes

    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.jpg").write_text("not an image\n")
    assert D.check_image_file(tmp_path / "empty.jpg") == "the file is empty"
    assert D.check_image_file(tmp_path / "notes.jpg") == "not an image file Pillow can read"
    assert D.check_image_file(tmp_path / "missing.jpg") == "no such file or directory"
    # bytes after the JPEG end marker (some cameras append data): suspicious end, decodes fine
    (tmp_path / "tail.jpg").write_bytes(image_bytes("JPEG") + b"\x01" * 500)
    assert D.check_image_file(tmp_path / "tail.jpg") is None
    # a flipped bit inside the data: header and end intact, so only decoding finds it
    (tmp_path / "flipped.png").write_bytes(image_bytes("PNG"))
    flip_png_data(tmp_path / "flipped.png")
    assert D.check_image_file(tmp_path / "flipped.png") is None
    with pytest.raises(D.BadImageError, match="flipped.png: broken data stream"):
        D.FileListDataset([(tmp_path / "flipped.png", 0)], ["a"])[0]


def break_two(root: Path) -> list[Path]:
    """Cut one training and one validation image of make_folder's layout short."""
    from tests.bad_files import truncate

    bad = [root / "train" / "red" / "1.jpg", root / "val" / "blue" / "0.png"]
    for path in bad:
        truncate(path)
    return bad


def test_check_images_error_policy_is_one_line_naming_the_file(tmp_path, caplog):
    import logging

    root = make_folder(tmp_path / "d")
    bad = break_two(root)
    with caplog.at_level(logging.INFO, logger="edgetl.data"), pytest.raises(DataError) as info:
        D.build_datasets(preset="imagefolder", root=root, resolution=32)
    text = one_line(info)
    assert text.startswith(f"2 of 18 image files cannot be read, first {bad[0]}: ")
    assert text.endswith("set data.on_bad_image: skip")
    assert all(str(p) in caplog.text for p in bad)  # -v lists every one
    with pytest.raises(ConfigError, match=r"'skp' is not allowed; allowed: error, skip"):
        D.build_datasets(preset="imagefolder", root=root, resolution=32, on_bad_image="skp")


def test_check_images_skip_policy_leaves_the_files_out(tmp_path, caplog):
    root = make_folder(tmp_path / "d")
    bad = break_two(root)
    splits = D.build_datasets(preset="imagefolder", root=root, resolution=32, on_bad_image="skip")
    check = splits.image_check
    assert check.checked == 18 and check.policy == "skip" and check.seconds > 0
    assert [(s, p) for s, p, _ in check.bad] == [("train", str(bad[0])), ("val", str(bad[1]))]
    assert len(splits.train) == 8 and len(splits.val) == 8
    assert Counter(splits.train.targets) == {0: 2, 1: 3, 2: 3}  # classes blue, green, red: red lost one
    assert Counter(splits.val.targets) == {0: 1, 1: 3, 2: 4}  # blue lost one
    assert str(bad[0]) not in [str(p) for p in splits.train.base.image_paths()]
    logged = [m for m in caplog.messages if m.startswith("skipping unreadable image")]
    assert [m.split(": ")[0] for m in logged] == [f"skipping unreadable image {p}" for p in bad]


def test_header_check_is_cheap(tmp_path):
    """Header and end of 600 real images: well under a millisecond each (measured ~0.1 ms)."""
    root = make_folder(tmp_path / "d", {"red": 100, "green": 100, "blue": 100}, size=64)
    splits = D.build_datasets(preset="imagefolder", root=root, resolution=32)
    check = splits.image_check
    assert check.checked == 600 and check.bad == []
    assert check.seconds / check.checked < 2e-3, check.seconds


def test_worker_error_reaches_the_caller_as_one_line(tmp_path):
    from tests.bad_files import flip_png_data

    root = make_folder(tmp_path / "d")
    broken = root / "train" / "green" / "0.png"
    flip_png_data(broken)  # passes the check, fails in a loader worker
    splits = D.build_datasets(preset="imagefolder", root=root, resolution=32)
    loader = D.build_loader(splits.train, batch_size=3, train=True, workers=2)
    with pytest.raises(D.BadImageError) as info:
        list(loader)
    assert one_line(info) == (f"cannot read image {broken}: broken data stream when reading image file; "
                              "fix or remove it, or set data.on_bad_image: skip")


def test_skip_policy_drops_a_sample_that_fails_in_a_worker(tmp_path):
    from tests.bad_files import flip_png_data

    root = make_folder(tmp_path / "d")
    broken = root / "train" / "green" / "0.png"
    flip_png_data(broken)
    splits = D.build_datasets(preset="imagefolder", root=root, resolution=32, on_bad_image="skip")
    assert splits.image_check.bad == []
    loader = D.build_loader(splits.train, batch_size=3, train=True, workers=2)
    batches = list(loader)
    skipped = [s for b in batches for s in b.skipped]
    assert skipped == [D.Skipped(str(broken), "broken data stream when reading image file")]
    assert sum(len(labels) for _, labels in batches) == 9 - 1
    assert sorted(len(labels) for _, labels in batches) == [2, 3, 3]


def test_a_batch_keeps_what_it_skipped_through_pinning_on_every_torch():
    """A Batch is neither a tuple nor a sequence, so DataLoader(pin_memory=True) pins it through
    its own method on every torch (torch 2.5, the Jetson image's, turns a tuple subclass into a
    list before looking for one, which would drop ``skipped``); it unpacks, indexes and
    pickles (to and from loader workers) as the pair it stands for."""
    import collections.abc
    import pickle

    skipped = (D.Skipped("a.png", "truncated"),)
    batch = D.Batch(torch.zeros(2, 3), torch.tensor([0, 1]), skipped)
    assert not isinstance(batch, (tuple, collections.abc.Sequence, collections.abc.Mapping))
    assert hasattr(batch, "pin_memory")
    images, labels = batch
    assert images is batch[0] and labels is batch[1] and len(batch) == 2 and batch == (images, labels)
    again = pickle.loads(pickle.dumps(batch))
    assert again.skipped == skipped and torch.equal(again[0], images) and torch.equal(again[1], labels)
    empty = D.Batch(None, None, skipped)
    assert empty.pin_memory() is empty  # nothing to pin: every sample was skipped


class _KillsItsWorker(torch.utils.data.Dataset):
    """A dataset whose worker process is killed by SIGKILL, as the kernel's OOM killer does."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_one_line():
    from edgetl.errors import ResourceError

    loader = torch.utils.data.DataLoader(_KillsItsWorker(), batch_size=2, num_workers=1)
    with pytest.raises(ResourceError) as info, D.loader_errors():
        list(loader)
    text = one_line(info)
    assert text.startswith("a data-loading worker died (DataLoader worker (pid") and "train.workers" in text
