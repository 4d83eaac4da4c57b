"""Backbones by torchvision weights name (issue 18): read from the torch cache, never downloaded in tests.

The cache files here are seeded MobileNetV2 1.0 state_dicts placed under the names
torchvision's weights API expects; ``conftest.offline_torch_cache`` gives every test an
empty TORCH_HOME and forbids downloads.
"""

import json
from pathlib import Path

import pytest
import torch

from edgetl.cli import main
from edgetl.errors import ConfigError, DataError
from edgetl.models.backbone import (
    DEFAULT_WEIGHTS,
    backbone_spec,
    open_backbone,
    weights_file,
    weights_names,
)
from tests.conftest import COLORS, make_color_folder, place_imagenet_weights

V1_FILE = "mobilenet_v2-b0353104.pth"
V2_FILE = "mobilenet_v2-7ebf99e0.pth"


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture
def imagenet_home(tmp_path, monkeypatch) -> tuple[Path, dict]:
    home = tmp_path / "torch_home"
    state = place_imagenet_weights(home)
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home, state


def test_names_resolve_to_torchvisions_files_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    assert weights_file("mobilenet_v2:IMAGENET1K_V1") == tmp_path / "hub" / "checkpoints" / V1_FILE
    assert weights_file("mobilenet_v2:IMAGENET1K_V2").name == V2_FILE
    assert weights_file("mobilenet_v2:DEFAULT").name == V2_FILE  # torchvision's DEFAULT is V2
    assert DEFAULT_WEIGHTS == "mobilenet_v2:IMAGENET1K_V1"
    assert set(weights_names("mobilenet_v2")) == {"mobilenet_v2:IMAGENET1K_V1", "mobilenet_v2:IMAGENET1K_V2",
                                    "mobilenet_v2:DEFAULT", "mobilenet_v2:random"}
    with pytest.raises(ConfigError, match="unknown weights 'mobilenet_v2:IMAGENET9'.*mobilenet_v2:IMAGENET1K_V2"):
        open_backbone("mobilenet_v2:IMAGENET9")
    # the architecture alone needs no file
    assert backbone_spec("mobilenet_v2:IMAGENET1K_V1").width == 1.0
    assert backbone_spec("mobilenet_v2:random", width=0.35).width == 0.35
    with pytest.raises(ConfigError, match="width 1.0 only"):
        backbone_spec("mobilenet_v2:IMAGENET1K_V2", width=0.5)


def test_weights_name_loads_the_cached_file_and_describes_it(imagenet_home):
    _, state = imagenet_home
    net, info = open_backbone("mobilenet_v2:IMAGENET1K_V1")
    got = net.state_dict()
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert info["weights"] == "mobilenet_v2:IMAGENET1K_V1" and info["width"] == 1.0
    assert info["imagenet_acc1"] == 71.878
    assert info["preprocessing"] == {"crop_size": 224, "resize_size": 256, "mean": [0.485, 0.456, 0.406],
                                     "std": [0.229, 0.224, 0.225], "interpolation": "bilinear"}
    assert len(info["categories"]) == 1000 and info["categories"][:2] == ["tench", "goldfish"]
    with pytest.raises(ConfigError, match="width 1.0 only, not 0.5"):
        open_backbone("mobilenet_v2:IMAGENET1K_V1", width=0.5)
    # random init by name: seeded, at any width
    a, _ = open_backbone("mobilenet_v2:random", width=0.35, seed=3)
    b, _ = open_backbone("mobilenet_v2:random", width=0.35, seed=3)
    assert a.spec.width == 0.35 and torch.equal(a.features[0][0].weight, b.features[0][0].weight)


def test_a_damaged_cache_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = weights_file("mobilenet_v2:IMAGENET1K_V1")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match=f"{V1_FILE} is damaged or not a state_dict"):
        open_backbone("mobilenet_v2:IMAGENET1K_V1")
    torch.save({"features.0.0.weight": torch.zeros(1)}, path)
    with pytest.raises(DataError, match="does not fit mobilenet_v2 width 1.0"):
        open_backbone("mobilenet_v2:IMAGENET1K_V1")


@pytest.mark.parametrize("command, expected_file", [
    (lambda d, o: ["finetune", "--recipe", "imagefolder", "--data", str(d), "-o", str(o)], V1_FILE),
    (lambda d, o: ["prune", "--checkpoint", "mobilenet_v2:IMAGENET1K_V2", "--ratios", "0.3,0.78,0.46,0.46",
                   "--importance", "weight-l2", "-o", str(o)], V2_FILE),
    (lambda d, o: ["retrain", "--backbone", "mobilenet_v2:IMAGENET1K_V1", "--data", str(d), "--epochs", "1",
                   "-o", str(o)], V1_FILE),
])
def test_offline_with_an_empty_cache_is_one_line_exit_2(tmp_path, capsys, command, expected_file):
    data = make_color_folder(tmp_path / "data", 2, 1, size=8)
    out = tmp_path / "out"
    assert exit_code(command(data, out)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    home = Path(torch.hub.get_dir())
    assert str(home / "checkpoints" / expected_file) in err and "--weights FILE" in err
    assert "EDGETL_OFFLINE" in err
    assert not out.exists()


def test_finetune_starts_from_imagenet_weights_by_default(imagenet_home, tmp_path, capsys):
    _, state = imagenet_home
    data = make_color_folder(tmp_path / "data", 8, 4, size=16, classes=COLORS)
    run = tmp_path / "run"
    assert exit_code(["finetune", "--recipe", "imagefolder", "--data", str(data), "--epochs", "1",
                      "--batch-size", "8", "--set", "data.resolution=64", "--set", "train.workers=0",
                      "--no-measure", "-o", str(run)]) == 0
    out = capsys.readouterr().out
    assert "backbone: mobilenet_v2:IMAGENET1K_V1" in out
    info = json.loads((run / "model.json").read_text())
    source = info["backbone_source"]
    assert source["weights"] == "mobilenet_v2:IMAGENET1K_V1" and source["preprocessing"]["resize_size"] == 256
    assert source["categories"][0] == "tench" and info["labels"] == ["c0", "c1", "c2"]
    weights = torch.load(run / "model.pt", weights_only=True)["model"]
    # the frozen backbone is the cached file's, the classifier is new (3 classes)
    for key in ("features.0.0.weight", "features.7.conv.1.0.weight", "features.18.0.weight"):
        assert torch.equal(weights[key], state[key]), key
    assert weights["classifier.1.weight"].shape == (3, 1280)


def test_finetune_random_init_only_when_asked(tmp_path, capsys):
    data = make_color_folder(tmp_path / "data", 2, 1, size=8)
    out = tmp_path / "run"
    # fashion_mnist trains MobileNetV2 0.35: no ImageNet weights of that width exist
    assert exit_code(["finetune", "--recipe", "imagefolder", "--data", str(data), "--set", "model.width=0.35",
                      "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mobilenet_v2:random" in err and "0.35" in err
    assert not out.exists()


def test_prune_and_profile_take_weights_names(imagenet_home, tmp_path, capsys):
    _, state = imagenet_home
    out = tmp_path / "pruned"
    assert exit_code(["prune", "--checkpoint", "mobilenet_v2:IMAGENET1K_V1", "--ratios", "0.3,0.78,0.46,0.46",
                      "--importance", "weight-l2", "-o", str(out)]) == 0
    info = json.loads((out / "backbone.json").read_text())
    assert info["base"]["weights"] == "mobilenet_v2:IMAGENET1K_V1"
    assert info["base"]["categories"][0] == "tench"
    assert info["spec"]["hidden"] == {"1": 22, "2": 21, "3": 77, "4": 77}
    pruned = torch.load(out / "backbone.pt", weights_only=True)
    assert torch.equal(pruned["features.9.conv.1.0.weight"], state["features.9.conv.1.0.weight"])  # unpruned block
    capsys.readouterr()
    # the architecture needs no weights file: profile works on an empty cache too
    assert exit_code(["profile", "--checkpoint", "mobilenet_v2:IMAGENET1K_V2", "--num-classes", "10"]) == 0
