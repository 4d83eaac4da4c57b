"""Issue #18 item 4: bad images, too small a resolution and a full disk end in one line, exit 2,
and leave no run folder (or, mid-run, a resumable one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetl import data as D
from edgetl import train as T
from edgetl.cli import main
from edgetl.errors import ConfigError, DataError, ResourceError
from edgetl.io import MB
from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
from edgetl.models.side import LeanOptions, build_network, min_resolution
from edgetl.recipe import Recipe, apply_overrides
from edgetl.step import Step

from tests.bad_files import flip_png_data, truncate
from tests.conftest import make_color_folder


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def error_line(err: str) -> str:
    """The CLI's error: the last stderr line, and no traceback anywhere."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1].split("\r")[-1]
    assert last.startswith("edgetl: error: "), err
    return last[len("edgetl: error: "):]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> Path:
    """A backbone folder: MobileNetV2 0.35, random weights (the mechanics, not accuracy, are tested)."""
    folder = tmp_path_factory.mktemp("backbone")
    torch.manual_seed(0)
    save_backbone(folder, build_backbone(BackboneSpec(width=0.35, num_classes=3)).eval())
    return folder


def colors(root: Path, n_train: int = 8, n_val: int = 4) -> Path:
    return make_color_folder(root, n_train, n_val, size=24)


def finetune_argv(data: Path, out: Path, backbone: Path, *extra: str) -> list[str]:
    return ["finetune", "--recipe", "imagefolder", "--data", str(data), "--backbone", str(backbone),
            "--set", "data.resolution=64", "--set", "train.workers=2", "--batch-size", "4", "--epochs", "1",
            "--no-measure", "-o", str(out), *extra]


# --- resolution ------------------------------------------------------------------------------


@pytest.mark.parametrize("lean", [None, LeanOptions(pool=2)], ids=["stock", "lean"])
@pytest.mark.parametrize("batch", [2, 1])
def test_min_resolution_is_where_a_training_step_starts_to_work(lean, batch):
    """33 px (97 at batch 1) from the strides; a real forward + backward agrees on both sides of it."""
    net = build_network(BackboneSpec(width=0.35, num_classes=3), "repnet", lean=lean)
    low = min_resolution(net, batch)
    assert low == (33 if batch >= 2 else 97)
    net.train()
    net(torch.randn(batch, 3, low, low)).sum().backward()
    with pytest.raises((RuntimeError, ValueError)):
        net(torch.randn(batch, 3, low - 1, low - 1)).sum().backward()


@pytest.mark.parametrize("extra, allowed", [
    (["--set", "data.resolution=32"], "data.resolution: 32 px is too small for the Rep-Net side network; allowed: >= 33 px"),
    (["--batch-size", "1"], "data.resolution: 64 px is too small for the Rep-Net side network at batch size 1 "
                            "(the smallest side map gives BatchNorm one value per channel); allowed: >= 97 px"),
])
def test_finetune_refuses_a_resolution_below_the_side_networks_minimum(tmp_path, capsys, backbone, extra, allowed):
    out = tmp_path / "run"
    assert exit_code(finetune_argv(colors(tmp_path / "d"), out, backbone, *extra)) == 2
    assert error_line(capsys.readouterr().err) == allowed
    assert not out.exists()


# --- bad images through the CLI ----------------------------------------------------------------


def test_a_truncated_image_is_found_before_the_run_folder_exists(tmp_path, capsys, backbone):
    data = colors(tmp_path / "d")
    bad = data / "train" / "c1" / "5.png"
    truncate(bad)
    out = tmp_path / "run"
    assert exit_code(finetune_argv(data, out, backbone)) == 2
    assert error_line(capsys.readouterr().err) == (
        f"image file {bad} cannot be read: image file is truncated; fix or remove it, or set data.on_bad_image: skip")
    assert not out.exists()


def test_skip_leaves_the_file_out_and_counts_it(finished_run):
    out, printed, data = finished_run
    files = sum(1 for _ in data.rglob("*.png"))
    line = next(line for line in printed.splitlines() if line.startswith("images: "))
    seconds = float(line.split(" checked in ")[1].split(" s ")[0])
    assert line == (f"images: {files} files checked in {seconds:.2f} s (header and end of each); "
                    "1 unreadable, left out (data.on_bad_image: skip)")
    assert files == 36 and 0 <= seconds < 5
    assert "skipped 1 unreadable image (1 found before training, 0 while training; each named in a warning above)" in printed
    steps = T.read_metrics(out)[0]["global_step"]
    assert steps == (3 * 8 - 1) // 4  # 23 readable training images, batch 4, ragged batch dropped


def test_an_image_that_fails_in_a_worker_mid_run_leaves_a_resumable_folder(tmp_path, capsys, backbone):
    """A flipped bit passes the header check and breaks decoding in a DataLoader worker."""
    data = colors(tmp_path / "d")
    rcp = Recipe.from_dict({
        "data": {"preset": "imagefolder", "root": str(data), "resolution": 64}, "model": {"mode": "repnet"},
        "optim": {"name": "adam", "lr": 1e-3, "weight_decay": 0.0, "label_smoothing": 0.0, "schedule": "cosine"},
        "train": {"epochs": 1, "batch_size": 4, "seed": 0}})
    splits = D.datasets_from_recipe(rcp)
    order = [i for i, _ in D.build_loader(splits.train, batch_size=4, train=True, workers=0).sampler]
    index = order[4 * 3]  # first image of the fourth batch: three checkpoints (every step) before it
    broken = splits.train.base.image_paths()[index]
    flip_png_data(broken)
    out = tmp_path / "run"
    argv = finetune_argv(data, out, backbone, "--set", "train.checkpoint_every=1")
    assert exit_code(argv) == 2
    assert error_line(capsys.readouterr().err) == (
        f"cannot read image {broken}: broken data stream when reading image file; fix or remove it, or set "
        f"data.on_bad_image: skip; {out} keeps last.pt (at epoch 1 step 3): add --resume to continue once "
        "that is fixed")
    assert T.load_checkpoint(out / "last.pt")["step_in_epoch"] == 3
    assert exit_code([*argv, "--resume", "--set", "data.on_bad_image=skip"]) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 unreadable image (0 found before training, 1 while training; each named" in printed
    assert (out / "model.pt").is_file() and T.read_metrics(out)[0]["global_step"] == 6


# --- the loop: no folder before the first checkpoint, a resumable one after --------------------


class Small(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU())
        self.classifier = nn.Linear(8, classes)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


def small_recipe(root: Path, **overrides) -> Recipe:
    base = Recipe.from_dict({
        "data": {"preset": "imagefolder", "root": str(root), "resolution": 32},
        "model": {"mode": "full"},
        "optim": {"name": "adam", "lr": 0.01, "weight_decay": 0.0, "label_smoothing": 0.0, "schedule": "cosine"},
        "train": {"epochs": 2, "batch_size": 4, "seed": 0, "workers": 0, "checkpoint_every": 0},
    })
    return apply_overrides(base, overrides) if overrides else base


def small_fit(rcp: Recipe, out: Path, resume: bool = False, on_step=None) -> T.FitResult:
    splits = D.datasets_from_recipe(rcp)
    train_loader, val_loader = D.loaders_from_recipe(rcp, splits)
    torch.manual_seed(0)
    return T.fit(model=Small(), train_loader=train_loader, val_loader=val_loader, recipe=rcp, out_dir=out,
                 resume=resume, on_step=on_step)


@pytest.mark.parametrize("made_by", ["fit", "user"])
def test_a_failure_before_the_first_checkpoint_leaves_no_trace(tmp_path, made_by):
    data = colors(tmp_path / "d")
    flip_png_data(data / "val" / "c0" / "0.png")  # fails at the first evaluation, before any last.pt
    out = tmp_path / "run"
    if made_by == "user":
        out.mkdir()
    with pytest.raises(DataError) as info:
        small_fit(small_recipe(data), out)
    assert "\n" not in str(info.value) and "keeps" not in str(info.value)
    assert (not out.exists()) if made_by == "fit" else list(out.iterdir()) == []


def test_a_failure_after_a_checkpoint_says_how_to_resume(tmp_path):
    data = colors(tmp_path / "d")
    flip_png_data(data / "val" / "c0" / "0.png")
    out = tmp_path / "run"
    rcp = small_recipe(data, **{"train.checkpoint_every": 2})
    with pytest.raises(DataError) as info:
        small_fit(rcp, out)
    assert str(info.value).endswith(f"; {out} keeps last.pt (at epoch 1 step 4): add --resume to continue once that is fixed")
    assert sorted(p.name for p in out.iterdir()) == [".edgetl-files", "last.pt", "recipe.yaml"]
    result = small_fit(apply_overrides(rcp, {"data.on_bad_image": "skip"}), out, resume=True)
    assert list(result.skipped) == [str(data / "val" / "c0" / "0.png")]
    assert [r["epoch"] for r in result.history] == [1, 2]


def test_a_batch_left_with_one_readable_image_is_not_trained_on(tmp_path, caplog):
    """BatchNorm needs two samples: under skip, a batch of two that loses one skips its step."""
    data = colors(tmp_path / "d")
    broken = data / "train" / "c2" / "3.png"
    flip_png_data(broken)
    rcp = small_recipe(data, **{"train.batch_size": 2, "data.on_bad_image": "skip"})
    result = small_fit(rcp, tmp_path / "run")
    assert result.skipped == {str(broken): "broken data stream when reading image file"}
    assert sum("too few readable images left; step skipped" in m for m in caplog.messages) == 2  # once an epoch
    assert sum("skipped unreadable image" in m for m in caplog.messages) == 1  # the file: once
    adam_steps = T.load_checkpoint(result.last_path)["optimizer"]["state"][0]["step"]
    assert int(adam_steps) == 2 * 24 // 2 - 2


def test_a_full_disk_mid_run_keeps_the_previous_last_pt(tmp_path):
    """A real write failure: the process's file-size limit (RLIMIT_FSIZE) drops below last.pt's size
    after the step-2 checkpoint; the step-4 write fails with EFBIG."""
    data = colors(tmp_path / "d")
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from tests.test_failures import small_fit, small_recipe
        from edgetl.errors import ResourceError
        from pathlib import Path

        import torch
        # the parent's thread count: the resume below runs in the parent and must add up the same way
        torch.set_num_threads({torch.get_num_threads()})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write returns EFBIG instead of killing us

        def on_step(info):
            if info["global_step"] == 3:
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

        try:
            small_fit(small_recipe(Path({str(data)!r}), **{{"train.checkpoint_every": 2}}), Path({str(out)!r}),
                      on_step=on_step)
        except ResourceError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"cannot write {out / 'last.pt'}: file too large (about ")
    assert line.endswith(f"; {out} keeps last.pt (at epoch 1 step 2): add --resume to continue once that is fixed")
    assert T.load_checkpoint(out / "last.pt")["step_in_epoch"] == 2
    assert not list(out.glob(".*.tmp"))
    resumed = small_fit(small_recipe(data, **{"train.checkpoint_every": 2}), out, resume=True)
    whole = small_fit(small_recipe(data, **{"train.checkpoint_every": 2}), tmp_path / "whole")
    a, b = (T.load_checkpoint(r.last_path)["model"] for r in (resumed, whole))
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- disk space ---------------------------------------------------------------------------------


def tmpfs(folder: Path, size: str):
    """Mount a small tmpfs (needs root); skip the test where that is impossible."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not root'})")
    return folder


@pytest.fixture
def small_disk(tmp_path):
    folder = tmpfs(tmp_path / "disk", "4m")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, backbone) -> tuple[Path, str, Path]:
    """One whole finetune run with one truncated image and data.on_bad_image: skip.

    Returns (run folder, what the CLI printed, data folder); the files' real sizes check the
    disk estimates.
    """
    import contextlib
    import io

    root = tmp_path_factory.mktemp("finished")
    data = colors(root / "d")
    truncate(data / "train" / "c1" / "5.png")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert exit_code(finetune_argv(data, root / "run", backbone, "--set", "data.on_bad_image=skip")) == 0
    return root / "run", printed.getvalue(), data


def test_checkpoint_sizes_are_close_upper_bounds(finished_run):
    """last.pt, best.pt and model.pt as the disk check predicts them, against the files written."""
    from edgetl.finetune import build_model, lean_options
    from edgetl.models.side import make_lean
    from edgetl.recipe import load_recipe

    out = finished_run[0]
    rcp = load_recipe(out / "recipe.yaml")
    stock = build_model(rcp, 3)
    net = make_lean(build_model(rcp, 3), lean_options(rcp))
    optimizer = Step.from_recipe(rcp).optimizer(net)
    predicted = {"last.pt": T.checkpoint_bytes(net, optimizer), "best.pt": T.checkpoint_bytes(net, None),
                 "model.pt": T.saved_file_bytes(stock.state_dict())}
    for name, bound in predicted.items():
        real = (out / name).stat().st_size
        assert real <= bound <= real * 1.1 + 128 * 1024, (name, real, bound)
    best = torch.load(out / "best.pt", weights_only=True)
    assert "optimizer" not in best and "rank_state" not in best  # weights only: nothing resumes from it
    last = torch.load(out / "last.pt", weights_only=True)
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in best["model"])  # one epoch: the same


def test_finetune_refuses_a_disk_that_is_too_small(tmp_path, capsys, backbone, finished_run, small_disk):
    out = small_disk / "run"
    assert exit_code(finetune_argv(colors(tmp_path / "d"), out, backbone)) == 2
    text = error_line(capsys.readouterr().err)
    need = float(text.split("it needs up to ")[1].split(" MB")[0])
    free = float(text.split("), ")[1].split(" MB free")[0])
    sizes = {n: (finished_run[0] / n).stat().st_size for n in ("last.pt", "best.pt", "model.pt")}
    real_peak = sizes["last.pt"] + sizes["best.pt"] + max(sizes.values())
    assert real_peak / MB <= need <= real_peak / MB * 1.1 + 0.5
    assert free == pytest.approx(shutil.disk_usage(small_disk).free / MB, abs=0.051)
    assert text.startswith(f"not enough disk space for run folder {out}: it needs up to {need:.1f} MB (last.pt ")
    assert text.endswith(f"{free:.1f} MB free in {small_disk}")
    assert list(small_disk.iterdir()) == []


def test_check_disk_compares_with_the_free_space(tmp_path):
    """Without root (no tmpfs): the check against shutil.disk_usage, and a resumed run's files counted."""
    free = shutil.disk_usage(tmp_path).free
    files = {"last.pt": 3_000_000, "best.pt": 2_000_000, "model.pt": 2_500_000}
    need, have = T.disk_need(tmp_path / "run", files)
    assert need == 3_000_000 + 2_000_000 + 3_000_000 + T.METADATA_BYTES and have == pytest.approx(free, rel=0.01)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"x" * 1_000_000)
    assert T.disk_need(tmp_path / "run", files)[0] == need - 1_000_000
    with pytest.raises(ResourceError) as info:
        T.check_disk(tmp_path / "new", {"last.pt": free, "best.pt": 1_000_000})
    text = str(info.value)
    assert text.startswith(f"not enough disk space for run folder {tmp_path / 'new'}: it needs up to "
                           f"{(2 * free + 1_000_000 + T.METADATA_BYTES) / MB:.1f} MB (last.pt {free / MB:.1f}, "
                           "best.pt 1.0 MB, and a checkpoint is written beside the old one before replacing it)")
    assert not (tmp_path / "new").exists()


def test_best_pt_failing_after_last_pt_is_restored_on_resume(tmp_path):
    """The disk fills between last.pt and best.pt at an epoch end: last.pt resumes, best.pt is rebuilt."""
    data = colors(tmp_path / "d")
    disk = tmpfs(tmp_path / "disk", "1m")
    try:
        out = disk / "run"
        rcp = small_recipe(data)
        whole = small_fit(rcp, tmp_path / "whole")
        pages = [-(-(whole.out_dir / n).stat().st_size // 4096) * 4096 for n in ("last.pt", "best.pt")]

        def fill(info):  # at the last step of epoch 1: room for the metrics and last.pt, not best.pt
            if info["global_step"] == info["steps"]:
                room = 2 * 4096 + pages[0] + pages[1] - 4096
                (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - room))

        with pytest.raises(ResourceError) as info:
            small_fit(rcp, out, on_step=fill)
        assert str(info.value).startswith(f"cannot write {out / 'best.pt'}: no space left on device (about ")
        assert str(info.value).endswith(f"{out} keeps last.pt (after epoch 1): add --resume to continue once that is fixed")
        assert not (out / "best.pt").exists() and T.load_checkpoint(out / "last.pt")["epoch"] == 1
        (disk / "filler").unlink()
        resumed = small_fit(rcp, out, resume=True)
        assert resumed.best_epoch == whole.best_epoch
        a, b = (T.load_checkpoint(r.best_path) for r in (resumed, whole))
        assert a["epoch"] == b["epoch"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    finally:
        subprocess.run(["umount", str(disk)], check=False)
