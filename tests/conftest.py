"""Shared fixtures: a tiny MobileNetV2 pretrained on real data (Fashion-MNIST source task)."""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

# ``make test`` runs the tests in one process per core (pytest-xdist): each worker's torch
# gets its share of the cores, so the workers do not fight over them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

from edgetl.data import find_fashion_mnist
from edgetl.errors import DataError

try:
    find_fashion_mnist()
    HAVE_FMNIST = True
except DataError:
    HAVE_FMNIST = False

COLORS = [(200, 40, 40), (40, 200, 40), (40, 40, 200)]


def make_color_folder(root: Path, n_train: int, n_val: int = 8, size: int = 24, classes=COLORS) -> Path:
    """An ImageFolder root/{train,val}/c<i>/*.png whose classes are told apart by colour, with noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        for c, color in enumerate(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                px = np.clip(np.array(color) + rng.integers(-60, 60, (size, size, 3)), 0, 255)
                Image.fromarray(px.astype(np.uint8)).save(folder / f"{i}.png")
    return root


def make_fmnist_folder(root: Path, classes: list[int], n_train: int, n_val: int) -> Path:
    """An ImageFolder root/{train,val}/<name>/*.png of real Fashion-MNIST images (PNG, as a user's).

    Training images come from the training split, validation images from the test split;
    the first ``n`` of each class in file order, so the folder is the same on every machine.
    """
    import numpy as np
    from PIL import Image

    from edgetl.data import FASHION_MNIST_CLASSES, fashion_mnist

    for split, n in (("train", n_train), ("val", n_val)):
        ds = fashion_mnist(None, split)
        targets = np.asarray(ds.targets)
        for c in classes:
            folder = root / split / FASHION_MNIST_CLASSES[c].replace("/", "-").replace(" ", "_")
            folder.mkdir(parents=True, exist_ok=True)
            for i in np.flatnonzero(targets == c)[:n]:
                Image.fromarray(ds.images[i]).save(folder / f"{i:05d}.png")
    return root


@pytest.fixture(autouse=True)
def offline_torch_cache(monkeypatch, tmp_path_factory):
    """No test touches the network: an empty torch cache, and downloads forbidden (issue 18)."""
    empty = tmp_path_factory.getbasetemp() / "torch_home_empty"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("TORCH_HOME", str(empty))
    monkeypatch.setenv("EDGETL_OFFLINE", "1")


def place_imagenet_weights(torch_home: Path, name: str = "mobilenet_v2:IMAGENET1K_V1", seed: int = 0) -> dict:
    """Put a seeded MobileNetV2 1.0 state_dict where torchvision's cache expects ``name``'s file.

    Stands in for the downloaded ImageNet file (same name, same layout); returns the state_dict.
    """
    import os

    import torch
    from torchvision.models import mobilenet_v2

    from edgetl.models.backbone import weights_file

    old = os.environ.get("TORCH_HOME")
    os.environ["TORCH_HOME"] = str(torch_home)
    try:
        path = weights_file(name)
    finally:
        if old is None:
            del os.environ["TORCH_HOME"]
        else:
            os.environ["TORCH_HOME"] = old
    torch.manual_seed(seed)
    state = mobilenet_v2().state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


FMNIST_REASON = "Fashion-MNIST not installed (as root: apt-get install dataset-fashion-mnist; make test does it)"


@pytest.fixture(scope="session")
def pretrained_backbone(tmp_path_factory) -> Path:
    """Backbone folder: MobileNetV2 width 0.35 trained 3 epochs at 64 px on classes 0-4.

    About 70 % top-1 on the source task; the fine-tuning tests transfer it to classes 5-9.
    """
    if not HAVE_FMNIST:
        pytest.skip(FMNIST_REASON)
    from edgetl.data import datasets_from_recipe, loaders_from_recipe
    from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
    from edgetl.models.side import set_trainable
    from edgetl.recipe import load_recipe
    from edgetl.train import fit, seed_everything

    folder = tmp_path_factory.mktemp("pretrained")
    recipe = load_recipe("fashion_mnist", {
        "data.classes": [0, 1, 2, 3, 4], "data.max_samples": 2000, "data.max_val_samples": 200,
        "model.mode": "full", "optim.lr_head": 3e-3, "optim.lr_side": None, "train.epochs": 3,
    })
    seed_everything(0)
    splits = datasets_from_recipe(recipe)
    net = build_backbone(BackboneSpec(width=0.35, num_classes=5))
    set_trainable(net, "full")
    train_loader, val_loader = loaders_from_recipe(recipe, splits)
    fit(model=net, train_loader=train_loader, val_loader=val_loader, recipe=recipe, out_dir=folder / "run")
    save_backbone(folder, net)
    return folder


@pytest.fixture(scope="session")
def calibrated_backbone(tmp_path_factory) -> Path:
    """Backbone folder: random MobileNetV2 0.35 whose BN statistics come from real images.

    Cheap (no training): for tests of the mechanics (resume, export) rather than accuracy.
    """
    if not HAVE_FMNIST:
        pytest.skip(FMNIST_REASON)
    import torch

    from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
    from edgetl.prune import calibration_batches

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("calibrated")
    net = build_backbone(BackboneSpec(width=0.35, num_classes=5)).train()
    with torch.no_grad():
        for batch in calibration_batches("fashion-mnist", resolution=64, batches=4, batch_size=16):
            net(batch)
    save_backbone(folder, net.eval())
    return folder


def meter_op_count(net, batch: int, resolution: int) -> int:
    """The aten ops of the second plain training step of a meta ``net``, as the storage meter's
    trace records them: an op count independent of ``edgetl.memory.meter.count_step_ops``."""
    import torch

    from edgetl.memory.meter import StorageMeter
    from edgetl.step import Step, set_train_mode, training_step

    step = Step.plain()
    opt = step.optimizer(net)
    set_train_mode(net, step.bn)
    x = torch.empty(batch, 3, resolution, resolution, device="meta")
    y = torch.zeros(batch, dtype=torch.int64, device="meta")
    training_step(net, step, opt, x, y)  # creates the optimizer state
    meter = StorageMeter(record_trace=True)
    try:
        with meter:
            training_step(net, step, opt, x, y)
    finally:
        meter.close()
    return sum(1 for e in meter.trace if e[0] == "op")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: Path, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a two-process torchrun launch of ``script`` with ``args``
    on this machine: one thread a rank, a free port, and PYTHONFAULTHANDLER, so a rank that dies
    of a signal (a SIGABRT as gloo tears down, before ``exit_worker``) prints every thread's
    Python stack into the failure (``launch_failure``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *args]
    return cmd, env


def launch_failure(stderr: str) -> str:
    """What a failed torchrun launch's stderr says: a rank's fatal signal (PYTHONFAULTHANDLER's
    Python stack of every thread, without its list of extension modules), then the launcher's
    last words."""
    start = stderr.find("Fatal Python error")
    if start < 0:
        return stderr[-3000:]
    end = stderr.find("\nExtension modules:", start)
    return stderr[start:end if end >= 0 else start + 5000][:5000] + "\n...\n" + stderr[-1500:]
