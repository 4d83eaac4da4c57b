"""Issue #29 items 2 and 3: a diverging run stops at once in one line and leaves no
non-finite weights on disk; data a classifier cannot learn from is refused before training."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import make_color_folder
from tests.test_failures import backbone, error_line, exit_code, finetune_argv  # noqa: F401 (a fixture)


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def all_finite(path: Path) -> bool:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return all(bool(torch.isfinite(t).all()) for t in ckpt["model"].values() if t.is_floating_point())


def test_a_diverging_run_stops_in_one_line_and_saves_nothing_non_finite(tmp_path, capsys, backbone):
    data = make_color_folder(tmp_path / "d", 8, 4)
    out = tmp_path / "run"
    argv = finetune_argv(data, out, backbone, "--set", "optim.lr_side=1e30", "--set", "optim.lr_head=1e30")
    assert exit_code(argv) == 2
    line = error_line(capsys.readouterr().err)
    # a loss gone non-finite, or (BN normalising the huge weights away) a BN statistic gone inf
    assert line.startswith("training diverged at ") and "likely cause: a learning rate too high" in line
    assert "optim.lr_side = 1e+30" in line and "No non-finite weights were saved" in line
    assert not out.exists()  # it diverged before its first checkpoint: nothing of it is left


def test_divergence_after_a_checkpoint_keeps_the_last_finite_one(tmp_path, capsys, backbone):
    """Two epochs: the first trains sanely; the second's learning rate is poisoned through the
    scheduler (the recipe stays the same, so the folder would resume): last.pt stays finite."""
    from edgetl import train as T

    data = make_color_folder(tmp_path / "d", 8, 4)
    out = tmp_path / "run"
    real_step = T._Loop.train_step

    def poisoned(self, epoch, step, batch):
        if epoch == 1:
            for group in self.optimizer.param_groups:
                group["lr"] = float("inf")
        return real_step(self, epoch, step, batch)

    T._Loop.train_step = poisoned
    try:
        assert exit_code(finetune_argv(data, out, backbone, "--epochs", "2")) == 2
    finally:
        T._Loop.train_step = real_step
    line = error_line(capsys.readouterr().err)
    assert line.startswith("training diverged at ") and line.endswith(f"{out} keeps last.pt (after epoch 1), "
                                                                       "its last finite weights")
    saved = [p for p in out.iterdir() if p.suffix == ".pt"]
    assert saved and all(all_finite(p) for p in saved)
    assert torch.load(out / "last.pt", map_location="cpu", weights_only=False)["epoch"] == 1
    assert not (out / "model.pt").exists()


@pytest.mark.parametrize("case", ["one class", "val class unseen", "fewer than a batch"])
def test_data_a_classifier_cannot_learn_from_is_refused_before_training(tmp_path, capsys, backbone, case):
    data = make_color_folder(tmp_path / "d", 8, 4)
    extra: list[str] = []
    if case == "one class":
        for split in ("train", "val"):
            for c in ("c1", "c2"):
                shutil.rmtree(data / split / c)
        expected = f"imagefolder at {data}: the training split has images of 1 class ('c0'); a classifier needs at least 2"
    elif case == "val class unseen":  # ImageFolder needs the same class folders: a class subset does it
        for p in (data / "train" / "c2").iterdir():
            p.unlink()
        expected = None
    else:
        extra = ["--batch-size", "32"]
        expected = ("the training split has 24 images, fewer than one batch (train.batch_size = 32); "
                    "lower train.batch_size or add images")
    before = tree_digest(data)
    out = tmp_path / "run"
    assert exit_code(finetune_argv(data, out, backbone, *extra)) == 2
    line = error_line(capsys.readouterr().err)
    if expected is not None:
        assert line == expected
    else:
        assert "c2" in line  # an empty class folder is refused, naming it
    assert not out.exists() and tree_digest(data) == before


def test_a_validation_class_the_training_split_lacks_is_refused():
    from edgetl.data import SubsetDataset, check_learnable, FileListDataset
    from edgetl.errors import DataError

    classes = ["a", "b", "c"]
    train = FileListDataset([(Path(f"{i}.png"), i % 2) for i in range(6)], classes)
    val = FileListDataset([(Path(f"v{i}.png"), i % 3) for i in range(6)], classes)
    with pytest.raises(DataError, match="validation split has images of class 'c' that the training split has none of"):
        check_learnable(train, val, "here")
    check_learnable(train, SubsetDataset(val, [0, 1, 3, 4], {0: 0, 1: 1}, classes), "here")


def test_resume_against_other_classes_is_refused_and_changes_nothing(tmp_path, capsys, backbone):
    """Issue #29 item 5: the same data folder with other class names (or another count) is another run."""
    data = make_color_folder(tmp_path / "d", 8, 4)
    out = tmp_path / "run"
    assert exit_code(finetune_argv(data, out, backbone)) == 0
    capsys.readouterr()
    before = tree_digest(out)
    for split in ("train", "val"):
        (data / split / "c2").rename(data / split / "zebra")
    assert exit_code(finetune_argv(data, out, backbone, "--resume")) == 2
    assert error_line(capsys.readouterr().err) == (
        f"cannot resume {out}: it was trained on 3 classes ('c0', 'c1', 'c2'), the data now has "
        "3 classes ('c0', 'c1', 'zebra'); fine-tune into a new folder")
    assert tree_digest(out) == before
    shutil.rmtree(data / "train" / "zebra")
    shutil.rmtree(data / "val" / "zebra")
    assert exit_code(finetune_argv(data, out, backbone, "--resume")) == 2
    assert "the data now has 2 classes ('c0', 'c1')" in error_line(capsys.readouterr().err)
    assert tree_digest(out) == before
