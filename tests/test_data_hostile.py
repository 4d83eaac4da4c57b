"""Issue #41 items 4 and 5 (data): nothing in a data folder is dropped without a word, and
text files saved by other editors read as the plain file.

The rule under test: an entry of a split folder that is neither a folder nor a file (a
dangling symlink, a FIFO, a socket) is refused in one line whatever data.on_bad_image says,
since leaving out a class changes the label set; such an entry in a class folder is an
unreadable image under data.on_bad_image (error: one line naming it; skip: left out, counted
and named). Nothing is ever opened in a way that waits (a FIFO). Valid symlinks work.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import socket
import stat
from pathlib import Path

import pytest

from edgetl import data as D
from edgetl.errors import DataError

from tests.conftest import make_color_folder
from tests.test_failures import backbone, error_line, exit_code, finetune_argv  # noqa: F401 - a fixture

SKIP_HINT = "fix or remove it, or set data.on_bad_image: skip"
CLASS_RULE = "must be a class folder (a folder or a symlink to one) or a file: fix or remove it"


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO opened for reading waits for a writer forever: fail the test instead of hanging."""

    def expired(signum, frame):
        raise TimeoutError("hung: something waited on a FIFO")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def colors(root: Path, n_train: int = 4, n_val: int = 2) -> Path:
    return make_color_folder(root, n_train, n_val, size=24)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` as (kind, content): bytes of files, targets of symlinks;
    nothing that is not a regular file is opened."""
    found = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(here) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                found[str(path)] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                found[str(path)] = ("file", path.read_bytes())
            else:
                found[str(path)] = (stat.S_IFMT(mode), None)
    return found


def make_socket(path: Path) -> None:
    """A Unix socket's file at ``path`` (bound from its folder: socket paths are short)."""
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path.name)
    finally:
        os.chdir(here)


def one_line(info: pytest.ExceptionInfo) -> str:
    text = str(info.value)
    assert "\n" not in text, text
    return text


def build(root: Path, policy: str = "error") -> D.DataSplits:
    return D.build_datasets(preset="imagefolder", root=root, resolution=32, on_bad_image=policy)


# --- class folders: refused, whatever data.on_bad_image says ---------------------------------


def _dangling_class(split: Path) -> tuple[Path, str]:
    (split / "c3").symlink_to("/media/card/c3")
    return split / "c3", "a symlink to /media/card/c3, which does not exist"


def _fifo_class(split: Path) -> tuple[Path, str]:
    os.mkfifo(split / "c3")
    return split / "c3", "a FIFO (named pipe)"


def _socket_class(split: Path) -> tuple[Path, str]:
    make_socket(split / "c3")
    return split / "c3", "a socket"


def _loop_class(split: Path) -> tuple[Path, str]:
    (split / "c3").symlink_to("c3")
    return split / "c3", "a symlink loop (its links lead back to themselves)"


@pytest.mark.parametrize("make", [_dangling_class, _fifo_class, _socket_class, _loop_class],
                         ids=["dangling", "fifo", "socket", "loop"])
@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_class_entry_that_is_not_a_folder_is_refused(tmp_path, make, split, policy):
    root = colors(tmp_path / "d")
    entry, what = make(root / split)
    before = snapshot(root)
    with pytest.raises(DataError) as info:
        build(root, policy)
    assert one_line(info) == f"{entry} is {what}; each entry of {root / split} {CLASS_RULE}"
    assert snapshot(root) == before


def test_a_dangling_class_folder_is_refused_when_labels_txt_lists_it(tmp_path):
    """labels.txt names the class; its folder is a link to an unmounted card."""
    root = colors(tmp_path / "d")
    (root / "labels.txt").write_text("c0\nc1\nc2\nc3\n")
    entry, what = _dangling_class(root / "train")
    with pytest.raises(DataError) as info:
        build(root, "skip")
    assert one_line(info) == f"{entry} is {what}; each entry of {root / 'train'} {CLASS_RULE}"


def test_hidden_entries_and_files_beside_class_folders_are_left_alone(tmp_path):
    """As before: README files and hidden entries (an editor's lock link) are not classes."""
    root = colors(tmp_path / "d")
    (root / "train" / "README.md").write_text("three colours\n")
    (root / "train" / ".#README.md").symlink_to("user@host.1234:1700000000")  # emacs' lock
    assert build(root).classes == ["c0", "c1", "c2"]


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_folder_that_is_a_dangling_symlink_is_named(tmp_path, split):
    root = colors(tmp_path / "d")
    (root / split).rename(tmp_path / "moved")
    (root / split).symlink_to(tmp_path / "gone")
    with pytest.raises(DataError) as info:
        build(root)
    assert one_line(info) == (f"{root / split} is a symlink to {tmp_path / 'gone'}, which does not exist; "
                              f"expected {root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg")


def test_a_data_folder_that_is_a_dangling_symlink_is_named(tmp_path):
    (tmp_path / "d").symlink_to(tmp_path / "gone")
    with pytest.raises(DataError) as info:
        build(tmp_path / "d")
    assert one_line(info).startswith(f"data folder {tmp_path / 'd'} is a symlink to {tmp_path / 'gone'}, "
                                     "which does not exist; expected ")


# --- images: an unreadable image under data.on_bad_image -------------------------------------


def _dangling_image(folder: Path) -> tuple[Path, str]:
    (folder / "9.png").symlink_to("/media/card/9.png")
    return folder / "9.png", "a symlink to /media/card/9.png, which does not exist"


def _fifo_image(folder: Path) -> tuple[Path, str]:
    os.mkfifo(folder / "9.png")
    return folder / "9.png", "a FIFO (named pipe), not a file"


def _socket_image(folder: Path) -> tuple[Path, str]:
    make_socket(folder / "9.png")
    return folder / "9.png", "a socket, not a file"


def _device_image(folder: Path) -> tuple[Path, str]:
    """A link to a device: readable as root (where a chmod 000 file is not), and never a file."""
    (folder / "9.png").symlink_to("/dev/zero")
    return folder / "9.png", "a character device, not a file"


def _loop_image(folder: Path) -> tuple[Path, str]:
    (folder / "9.png").symlink_to("9.png")
    return folder / "9.png", "a symlink loop (its links lead back to themselves)"


def _dangling_subfolder(folder: Path) -> tuple[Path, str]:
    """No image suffix: it may have been a folder of images, so it is named too."""
    (folder / "batch2").symlink_to("/media/card/batch2")
    return folder / "batch2", "a symlink to /media/card/batch2, which does not exist"


IMAGE_ENTRIES = [_dangling_image, _fifo_image, _socket_image, _device_image, _loop_image, _dangling_subfolder]
IMAGE_IDS = ["dangling", "fifo", "socket", "device", "loop", "dangling-subfolder"]


@pytest.mark.parametrize("make", IMAGE_ENTRIES, ids=IMAGE_IDS)
def test_an_image_entry_that_is_not_a_file_is_refused_naming_it(tmp_path, make):
    root = colors(tmp_path / "d")
    entry, what = make(root / "train" / "c1")
    before = snapshot(root)
    with pytest.raises(DataError) as info:
        build(root)
    assert one_line(info) == f"image file {entry} cannot be read: {what}; {SKIP_HINT}"
    assert snapshot(root) == before


@pytest.mark.parametrize("make", IMAGE_ENTRIES, ids=IMAGE_IDS)
def test_an_image_entry_that_is_not_a_file_is_skipped_counted_and_named(tmp_path, make, caplog):
    root = colors(tmp_path / "d")
    entry, what = make(root / "val" / "c2")
    with caplog.at_level(logging.INFO, logger="edgetl.data"):
        splits = build(root, "skip")
    check = splits.image_check
    assert check.bad == [("val", str(entry), what)] and check.checked == 3 * 4 + 3 * 2 + 1
    assert len(splits.train) == 12 and len(splits.val) == 6
    assert str(entry) not in map(str, splits.val.base.image_paths())
    assert f"skipping unreadable image {entry}: {what}" in caplog.messages
    assert (f"left out 1 of 19 image files as unreadable (data.on_bad_image: skip): {entry}"
            in caplog.messages)


def test_many_skipped_entries_are_counted_and_the_first_named(tmp_path, caplog):
    root = colors(tmp_path / "d", n_train=6)
    entries = [root / "train" / "c0" / f"{i}.png" for i in range(5)]
    for path in entries:
        path.unlink()
        path.symlink_to(f"/media/card/{path.name}")
    with caplog.at_level(logging.WARNING, logger="edgetl.data"):
        splits = build(root, "skip")
    assert len(splits.image_check.bad) == 5 and len(splits.train) == 3 * 6 - 5
    first = ", ".join(map(str, entries[:3]))
    assert f"left out 5 of 24 image files as unreadable (data.on_bad_image: skip): {first}, ..." in caplog.messages


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file; the device link stands in for it")
def test_an_image_without_read_permission_is_refused_naming_it(tmp_path):
    root = colors(tmp_path / "d")
    entry = root / "train" / "c1" / "0.png"
    entry.chmod(0)
    with pytest.raises(DataError) as info:
        build(root)
    assert one_line(info) == f"image file {entry} cannot be read: permission denied; {SKIP_HINT}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root lists a chmod 000 folder")
@pytest.mark.parametrize("where", ["train/c1", "train/c1/more"])
def test_a_folder_that_cannot_be_listed_is_refused_naming_it(tmp_path, where):
    """A class folder, or a subfolder of one, whose images cannot be seen: refused, whatever
    data.on_bad_image says (how many images it holds is unknown)."""
    root = colors(tmp_path / "d")
    (root / "train" / "c1" / "more").mkdir()
    (root / where).chmod(0)
    try:
        with pytest.raises(DataError) as info:
            build(root, "skip")
    finally:
        (root / where).chmod(0o755)
    assert one_line(info) == (f"cannot list folder {root / where}: permission denied; "
                              "every folder of the data must be readable")


@pytest.mark.parametrize("make", [_fifo_image, _dangling_image], ids=["fifo", "dangling"])
def test_loading_an_unchecked_entry_raises_one_line_and_never_waits(tmp_path, make):
    """check=False leaves the check to the caller; loading the sample still names the entry."""
    root = colors(tmp_path / "d")
    entry, what = make(root / "train" / "c1")
    splits = D.build_datasets(preset="imagefolder", root=root, resolution=32, check=False)
    index = [str(p) for p in splits.train.base.image_paths()].index(str(entry))
    with pytest.raises(D.BadImageError) as info:
        splits.train[index]
    assert one_line(info) == f"cannot read image {entry}: {what}; {SKIP_HINT}"


def test_a_class_folder_holding_only_a_dangling_link_names_it(tmp_path):
    """Was "class folder ... is empty": now the entry that holds no image is named."""
    root = colors(tmp_path / "d")
    for path in (root / "val" / "c1").iterdir():
        path.unlink()
    entry, what = _dangling_image(root / "val" / "c1")
    with pytest.raises(DataError) as info:
        build(root)
    assert one_line(info) == f"image file {entry} cannot be read: {what}; {SKIP_HINT}"


# --- valid symlinks keep working -------------------------------------------------------------


def test_valid_symlinks_to_class_folders_images_and_subfolders_work(tmp_path, caplog):
    """A class folder, an image and a subfolder kept elsewhere (as on a Jetson with the data on
    an SD card) are read as if they were in place; a link back up the tree is a loop, named."""
    plain = colors(tmp_path / "plain")
    linked = colors(tmp_path / "linked")
    elsewhere = tmp_path / "card"
    elsewhere.mkdir()
    (linked / "train" / "c2").rename(elsewhere / "c2")
    (linked / "train" / "c2").symlink_to(elsewhere / "c2")
    (linked / "val" / "c0" / "1.png").rename(elsewhere / "1.png")
    (linked / "val" / "c0" / "1.png").symlink_to(elsewhere / "1.png")
    (elsewhere / "more").mkdir()
    (linked / "train" / "c1" / "3.png").rename(elsewhere / "more" / "3.png")
    (linked / "train" / "c1" / "more").symlink_to(elsewhere / "more")
    (linked / "train" / "c0" / "up").symlink_to("..")  # a loop: not followed, and said so
    a = build(plain)
    with caplog.at_level(logging.WARNING, logger="edgetl.data"):
        b = build(linked)
    assert caplog.messages == [f"not following {linked / 'train' / 'c0' / 'up'}: a symlink to .., "
                               "a folder that holds it (a loop)"]
    assert a.classes == b.classes == ["c0", "c1", "c2"]
    assert b.image_check.bad == [] and b.image_check.checked == a.image_check.checked
    for split in ("train", "val"):
        sa, sb = getattr(a, split), getattr(b, split)
        assert sa.targets == sb.targets
        for i in range(len(sa)):
            assert sa.base[i][0].tobytes() == sb.base[i][0].tobytes()


# --- labels.txt: a byte-order mark and CRLF read as the plain file ---------------------------


@pytest.mark.parametrize("encode", [
    lambda text: text.encode(),
    lambda text: b"\xef\xbb\xbf" + text.encode(),
    lambda text: text.replace("\n", "\r\n").encode(),
    lambda text: b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode(),
    lambda text: b"\xef\xbb\xbf" + text.replace("\n", " \t\r\n").encode() + b"\r\n",
    lambda text: text.rstrip("\n").encode(),
], ids=["plain", "bom", "crlf", "bom-crlf", "bom-crlf-trailing-blanks", "no-final-newline"])
def test_labels_txt_as_windows_editors_save_it(tmp_path, encode):
    plain, saved = colors(tmp_path / "plain"), colors(tmp_path / "saved")
    (plain / "labels.txt").write_text("c2\nc0\nc1\n")
    (saved / "labels.txt").write_bytes(encode("c2\nc0\nc1\n"))
    a, b = build(plain), build(saved)
    assert a.classes == b.classes == ["c2", "c0", "c1"]
    for split in ("train", "val"):
        sa, sb = getattr(a, split).base, getattr(b, split).base
        assert sa.targets == sb.targets
        assert [p.relative_to(plain) for p in sa.image_paths()] == [p.relative_to(saved) for p in sb.image_paths()]
    first = b.train.base.image_paths()[0]
    assert first.parent.name == "c2" and b.train.base[0][1] == 0  # c2 is label 0, as labels.txt says


@pytest.mark.parametrize("make, what", [
    (lambda p: p.symlink_to("/media/card/labels.txt"), "a symlink to /media/card/labels.txt, which does not exist"),
    (lambda p: os.mkfifo(p), "a FIFO (named pipe), not a file"),
    (lambda p: p.mkdir(), "a folder, not a file"),
], ids=["dangling", "fifo", "folder"])
def test_a_labels_txt_that_is_not_a_file_is_refused_not_ignored(tmp_path, make, what):
    """Taking it for "no labels.txt" would give the sorted folder order: other labels."""
    root = colors(tmp_path / "d")
    make(root / "labels.txt")
    with pytest.raises(DataError) as info:
        build(root)
    assert one_line(info) == (f"cannot read {root / 'labels.txt'}: {what}; expected a text file, "
                              "one class name a line")


@pytest.mark.parametrize("data, message", [
    ("c0\nc1\nc2\n".encode("utf-16"), "is UTF-16 text; allowed: UTF-8 text (with or without a byte-order mark), "
                                      "one class name a line"),
    ("c0\nc1\nc\xe92\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 on line 3); allowed: UTF-8 text, "
                                           "one class name a line"),
    (b"c0\nc1\x00\nc2\n", "is a binary file (NUL byte at offset 5); expected a text file, one class name a line"),
], ids=["utf-16", "latin-1", "binary"])
def test_a_labels_txt_in_another_encoding_is_refused_in_one_line(tmp_path, data, message):
    root = colors(tmp_path / "d")
    (root / "labels.txt").write_bytes(data)
    with pytest.raises(DataError) as info:
        build(root)
    assert one_line(info) == f"{root / 'labels.txt'} {message}"


def test_cub_tables_with_a_byte_order_mark_and_crlf_read_as_plain_ones(tmp_path):
    from tests.test_data import make_cub

    plain, windows = make_cub(tmp_path / "plain"), make_cub(tmp_path / "windows")
    for name in ("images.txt", "train_test_split.txt", "image_class_labels.txt", "classes.txt"):
        path = windows / name
        if path.is_file():
            path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    for split in ("train", "val"):
        a, b = D.load_split("cub200", plain, split), D.load_split("cub200", windows, split)
        assert a.classes == b.classes and a.targets == b.targets
        assert [p.relative_to(plain) for p in a.image_paths()] == [p.relative_to(windows) for p in b.image_paths()]


# --- through the CLI ------------------------------------------------------------------------


@pytest.mark.parametrize("make, what, kind", [
    (_dangling_class, "a symlink to /media/card/c3, which does not exist", "class"),
    (_fifo_class, "a FIFO (named pipe)", "class"),
    (_dangling_image, "a symlink to /media/card/9.png, which does not exist", "image"),
    (_fifo_image, "a FIFO (named pipe), not a file", "image"),
], ids=["dangling-class", "fifo-class", "dangling-image", "fifo-image"])
def test_finetune_refuses_in_one_line_and_leaves_no_run_folder(tmp_path, capsys, backbone, make, what, kind):
    data = colors(tmp_path / "d", n_train=8, n_val=4)
    entry, _ = make(data / "train" / ("c1" if kind == "image" else ""))
    before = snapshot(data)
    out = tmp_path / "run"
    assert exit_code(finetune_argv(data, out, backbone)) == 2
    line = error_line(capsys.readouterr().err)
    if kind == "class":
        assert line == f"{entry} is {what}; each entry of {data / 'train'} {CLASS_RULE}"
    else:
        assert line == f"image file {entry} cannot be read: {what}; {SKIP_HINT}"
    assert not out.exists() and snapshot(data) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_finetune_skips_a_dangling_image_and_reports_the_count(tmp_path, capsys, caplog, backbone):
    data = colors(tmp_path / "d", n_train=8, n_val=4)
    entry, what = _fifo_image(data / "train" / "c1")
    out = tmp_path / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), caplog.at_level(logging.WARNING, logger="edgetl.data"):
        assert exit_code(finetune_argv(data, out, backbone, "--set", "data.on_bad_image=skip")) == 0
    text = printed.getvalue()
    line = next(line for line in text.splitlines() if line.startswith("images: "))
    assert line.endswith("; 1 unreadable, left out (data.on_bad_image: skip)") and "37 files checked" in line
    assert "skipped 1 unreadable image (1 found before training, 0 while training" in text
    assert f"skipping unreadable image {entry}: {what}" in caplog.messages
    assert (out / "model.pt").is_file()


def test_class_folders_reads_one_folder_of_classes_by_the_same_rules(tmp_path):
    """The reader for a folder of class folders without splits (calibration images)."""
    root = colors(tmp_path / "d")
    ds = D.class_folders(root / "train")
    assert ds.classes == ["c0", "c1", "c2"] and ds.targets == [0] * 4 + [1] * 4 + [2] * 4
    entry, what = _fifo_image(root / "train" / "c0")
    assert D.check_image_file(D.class_folders(root / "train").image_paths()[4]) == what  # sorted after 3.png
    entry, what = _dangling_class(root / "train")
    with pytest.raises(DataError) as info:
        D.class_folders(root / "train")
    assert one_line(info) == f"{entry} is {what}; each entry of {root / 'train'} {CLASS_RULE}"


def test_prune_calibration_reads_class_folders_by_the_same_rules(tmp_path, capsys, backbone):
    """`edgetl prune --calib-data DIR` samples images the way training reads a split: a dangling
    class folder is named in one line (torchvision's ImageFolder passed over it)."""
    data = colors(tmp_path / "d", n_train=8, n_val=4)
    entry, what = _dangling_class(data / "train")
    before = snapshot(data)
    out = tmp_path / "pruned"
    assert exit_code(["prune", "--checkpoint", str(backbone), "--blocks", "2", "--ratios", "0.5",
                      "--calib-data", str(data), "--calib-batches", "1", "--resolution", "64", "-o", str(out)]) == 2
    assert error_line(capsys.readouterr().err) == f"{entry} is {what}; each entry of {data / 'train'} {CLASS_RULE}"
    assert not out.exists() and snapshot(data) == before
