"""Recipe schema: every bundled recipe validates; bad keys, types and missing values fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from edgetl.errors import ConfigError
from edgetl.recipe import (
    MODES,
    RECIPE_DIR,
    Recipe,
    apply_overrides,
    find_recipe,
    load_recipe,
    parse_override,
    save_recipe,
)

BUNDLED = sorted(RECIPE_DIR.glob("*.yaml"))
EXPECTED = {"cifar10", "flowers102", "pets", "cub200", "imagefolder", "fashion_mnist", "imagenet_retrain"}

# DESIGN 3: lr_head, lr_side, label smoothing of the reference code.
DESIGN3 = {
    "cifar10": (3e-4, 1.5e-3, 0.1),
    "flowers102": (2e-4, 1e-3, 0.0),
    "cub200": (6e-4, 3e-3, 0.7),
    "pets": (1e-4, 1e-4, 0.7),
}


def minimal() -> dict:
    return {
        "data": {"preset": "imagefolder", "root": "/x", "resolution": 64},
        "model": {"mode": "repnet"},
        "optim": {"name": "adam", "lr": 1e-3, "weight_decay": 0, "label_smoothing": 0.1, "schedule": "cosine"},
        "train": {"epochs": 2, "batch_size": 8, "seed": 0},
    }


def test_all_expected_recipes_exist():
    assert {p.stem for p in BUNDLED} == EXPECTED


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_bundled_recipe_loads_and_round_trips(path: Path):
    recipe = load_recipe(path)
    again = Recipe.from_dict(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe
    # plain data: JSON-able and loadable from a checkpoint with weights_only=True
    json.dumps(recipe.to_dict())
    assert load_recipe(path.stem) == recipe


@pytest.mark.parametrize("name", sorted(DESIGN3))
def test_finetune_recipes_use_design3_hyperparameters(name):
    r = load_recipe(name)
    lr_head, lr_side, smoothing = DESIGN3[name]
    assert (r.optim.head_lr, r.optim.side_lr, r.optim.label_smoothing) == (lr_head, lr_side, smoothing)
    assert (r.optim.name, r.optim.weight_decay, r.optim.schedule) == ("adam", 0.0, "cosine")
    assert (r.train.batch_size, r.data.resolution, r.train.epochs, r.model.mode) == (8, 224, 5, "repnet")
    assert r.data.preset == name


def test_imagenet_retrain_recipe():
    r = load_recipe("imagenet_retrain")
    assert (r.optim.name, r.optim.momentum, r.optim.label_smoothing, r.optim.weight_decay) == ("sgd", 0.9, 0.1, 4e-5)
    assert r.optim.decay_norm_and_bias is False and r.optim.warmup_epochs > 0
    assert r.train.batch_size == 256 and r.model.mode == "full" and r.distill is None  # opt-in: --distill-from


def test_fashion_mnist_recipe_is_offline_and_small():
    r = load_recipe("fashion_mnist")
    assert r.data.preset == "fashion_mnist" and r.data.download is False and r.data.root is None
    assert r.data.resolution <= 64 and r.train.epochs <= 3 and r.data.max_samples <= 2000


def test_checkpoint_safe(tmp_path):
    recipe = load_recipe("imagenet_retrain")
    torch.save({"recipe": recipe.to_dict()}, tmp_path / "r.pt")
    loaded = torch.load(tmp_path / "r.pt", weights_only=True)["recipe"]
    assert Recipe.from_dict(loaded) == recipe


def test_unknown_key_suggests_close_match():
    data = minimal()
    data["train"]["batchsize"] = 4
    with pytest.raises(ConfigError, match=r"unknown key 'train.batchsize'; did you mean 'train.batch_size'"):
        Recipe.from_dict(data)
    data = minimal()
    data["optm"] = {}
    with pytest.raises(ConfigError, match="did you mean 'optim'"):
        Recipe.from_dict(data)


@pytest.mark.parametrize(
    "section,key,value,pattern",
    [
        ("train", "batch_size", "8", r"train.batch_size is '8'; allowed: an integer"),
        ("train", "epochs", 2.5, r"train.epochs is 2.5; allowed: an integer"),
        ("train", "epochs", True, r"train.epochs is True"),
        ("optim", "lr", "fast", r"optim.lr is 'fast'"),
        ("optim", "name", "adamw", r"did you mean 'adam'"),
        ("model", "mode", "repnet+bais", r"did you mean 'repnet\+bias'"),
        ("data", "classes", [0, "a"], r"data.classes\[1\] is 'a'"),
        ("data", "classes", 3, r"data.classes is 3"),
        ("data", "download", "yes", r"data.download is 'yes'; allowed: true/false"),
    ],
)
def test_values_are_type_checked(section, key, value, pattern):
    data = minimal()
    data[section][key] = value
    with pytest.raises(ConfigError, match=pattern) as info:
        Recipe.from_dict(data)
    assert "\n" not in str(info.value)


def test_int_is_accepted_as_float():
    data = minimal()
    data["optim"]["lr"] = 1
    assert Recipe.from_dict(data).optim.lr == 1.0 and isinstance(Recipe.from_dict(data).optim.lr, float)


@pytest.mark.parametrize(
    "section,key", [("train", "seed"), ("train", "epochs"), ("optim", "weight_decay"),
                    ("optim", "label_smoothing"), ("data", "resolution"), ("model", "mode")]
)
def test_missing_required_value_is_an_error(section, key):
    data = minimal()
    del data[section][key]
    with pytest.raises(ConfigError, match=f"missing required value {section}.{key}"):
        Recipe.from_dict(data)


def test_missing_section_is_an_error():
    data = minimal()
    del data["optim"]
    with pytest.raises(ConfigError, match="missing required value optim"):
        Recipe.from_dict(data)


def test_cross_checks():
    data = minimal()
    data["optim"] = {"name": "sgd", "lr": 0.1, "weight_decay": 0, "label_smoothing": 0, "schedule": "cosine"}
    with pytest.raises(ConfigError, match="sgd needs a momentum"):
        Recipe.from_dict(data)
    data = minimal()
    data["optim"].pop("lr")
    data["optim"]["lr_head"] = 1e-3
    with pytest.raises(ConfigError, match="set optim.lr_side or optim.lr"):
        Recipe.from_dict(data)
    data["model"]["mode"] = "last"
    assert Recipe.from_dict(data).optim.side_lr is None
    data = minimal()
    data["optim"]["label_smoothing"] = 1.0
    with pytest.raises(ConfigError, match="label_smoothing"):
        Recipe.from_dict(data)
    data = minimal()
    data["optim"]["warmup_epochs"] = -1
    with pytest.raises(ConfigError, match="warmup_epochs"):
        Recipe.from_dict(data)


def test_defaults_are_off_and_visible():
    r = Recipe.from_dict(minimal())
    d = r.to_dict()
    assert d["model"]["pool"] == 1 and d["model"]["precision"] == "fp32" and d["distill"] is None
    assert d["data"]["download"] is False


def test_overrides():
    r = Recipe.from_dict(minimal())
    r2 = apply_overrides(r, {"train.batch_size": 16, "optim.lr_side": "2e-3", "data.classes": "[5, 6]",
                             "data.root": "123", "model.precision": "bf16"})
    assert r2.train.batch_size == 16 and r2.optim.lr_side == 2e-3 and r2.data.classes == [5, 6]
    assert r2.data.root == "123" and r2.model.precision == "bf16"
    assert r.train.batch_size == 8  # the original is untouched
    assert apply_overrides(r, {"data.classes": None}).data.classes is None
    with pytest.raises(ConfigError, match="did you mean 'train.batch_size'"):
        apply_overrides(r, {"train.batchsize": 3})
    with pytest.raises(ConfigError, match="train.batch_size is 'x'"):
        apply_overrides(r, {"train.batch_size": "x"})
    with pytest.raises(ConfigError, match="missing required value distill.temperature"):
        apply_overrides(r, {"distill.teacher": "runs/t"})
    r3 = apply_overrides(r, {"distill.teacher": "t", "distill.temperature": 2, "distill.weight": 0.5})
    assert r3.distill.temperature == 2.0
    r4 = load_recipe("cifar10", {"train.epochs": "1"})
    assert r4.train.epochs == 1


def test_parse_override():
    assert parse_override("train.batch_size=16") == ("train.batch_size", 16)
    assert parse_override("optim.lr=1e-3") == ("optim.lr", 1e-3)
    assert parse_override("data.root=/a=b") == ("data.root", "/a=b")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("train.batch_size")


def test_find_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'cifar10'"):
        find_recipe("cifar1O")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_recipe(bad)
    assert "\n" not in str(info.value)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_recipe(top)


def test_save_recipe_round_trip(tmp_path):
    r = load_recipe("fashion_mnist")
    save_recipe(r, tmp_path / "recipe.yaml")
    assert load_recipe(tmp_path / "recipe.yaml") == r


def test_modes_match_side_network():
    from edgetl.models.side import TRAIN_MODES

    assert tuple(MODES) == tuple(TRAIN_MODES)


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    data = minimal()
    text = yaml.safe_dump(data).replace("lr: 0.001", "lr: 1e-3")
    assert "lr: 1e-3" in text
    (tmp_path / "r.yaml").write_text(text)
    assert load_recipe(tmp_path / "r.yaml").optim.lr == 1e-3
