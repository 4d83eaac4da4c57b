"""One options object (edgetl.options.LeanOptions): the recipe, the plan, the flags of
``edgetl profile`` / ``edgetl finetune`` and Python code take the same options with the same
rules and refuse a bad value with the same message."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from edgetl.errors import ConfigError
from edgetl.options import (
    BN_MODES,
    FROZEN_WEIGHTS,
    POOLS,
    PRECISIONS,
    STORAGES,
    LeanOptions,
    add_option_flags,
)
from edgetl.recipe import ModelConfig, load_recipe

# What each option allows, written out here (not read from the schema): the flags and the
# recipe must accept exactly these
ALLOWED = {"pool": ("1", "2", "4"), "bn": ("fold", "batch"), "frozen_weights": ("fp32", "fp16", "int8"),
           "precision": ("fp32", "bf16", "fp16"),
           "storage": ("exact", "pool2", "pool4", "haar", "db3", "dct", "threshold")}
REFUSED = {"pool": "3", "bn": "eval", "frozen_weights": "int4", "precision": "fp8", "storage": "pool8"}


def _parser(defaults):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_option_flags(p, defaults=defaults)
    return p


def test_the_tables_are_what_the_options_allow():
    assert (POOLS, BN_MODES, FROZEN_WEIGHTS, PRECISIONS, STORAGES) == (
        (1, 2, 4), ALLOWED["bn"], ALLOWED["frozen_weights"], ALLOWED["precision"], ALLOWED["storage"])


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_a_flag_takes_exactly_what_the_option_allows(name):
    flag = "--" + name.replace("_", "-")
    for value in ALLOWED[name]:
        args = _parser(LeanOptions()).parse_args([flag, value])
        assert str(getattr(LeanOptions.of(args), name)) == value
        recipe = load_recipe("fashion_mnist", overrides={f"model.{name}": value})
        assert str(getattr(recipe.model, name)) == value
    with pytest.raises(argparse.ArgumentError):
        _parser(LeanOptions()).parse_args([flag, REFUSED[name]])
    with pytest.raises(ConfigError, match=f"model.{name}"):
        load_recipe("fashion_mnist", overrides={f"model.{name}": REFUSED[name]})


def test_every_option_has_one_flag_and_one_recipe_key():
    names = {f.name for f in dataclasses.fields(LeanOptions)}
    flags = {a.dest for a in _parser(None)._actions if a.dest != "help"}
    assert flags == names
    assert names <= {f.name for f in dataclasses.fields(ModelConfig)}
    # not given: every flag None, so the recipe's value stands
    assert all(v is None for v in vars(_parser(None).parse_args([])).values())
    assert LeanOptions.of(_parser(LeanOptions()).parse_args([])) == LeanOptions()


@pytest.mark.parametrize("values, tail", [
    (dict(stream=-1), "stream: -1 is not allowed; allowed: an integer in [0, 65536]"),
    (dict(keep=0), "keep: 0.0 is not allowed; allowed: a fraction in (0, 1]"),
    (dict(keep=1.5), "keep: 1.5 is not allowed; allowed: a fraction in (0, 1]"),
    (dict(stream=2, bn="batch"), "stream: 2 needs bn fold (got batch)"),
    (dict(recompute=True), "recompute needs stream >= 1"),
])
def test_python_and_the_recipe_refuse_alike(values, tail):
    with pytest.raises(ConfigError) as direct:
        LeanOptions(**values)
    assert tail in str(direct.value) and "\n" not in str(direct.value)
    with pytest.raises(ConfigError) as recipe:
        load_recipe("fashion_mnist", overrides={f"model.{k}": v for k, v in values.items()})
    # the recipe names its keys model.<option>; otherwise the same words
    words = str(recipe.value).replace("model.", "")
    assert tail in words, words


@pytest.mark.parametrize("mode, runtime, values, needle", [
    ("bias", "lean", dict(pool=4), "pool 4 does not apply to mode bias"),
    ("repnet", "lean", dict(storage="dct"), "storage dct does not apply to mode repnet"),
    ("full", "lean", dict(storage="pool2", keep=0.3), "keep 0.3 does not apply to mode full"),
    ("full", "lean", dict(precision="bf16"), "precision bf16 is not allowed with lean full fine-tuning"),
    ("full", "lean", dict(uint8_input=True), "uint8 input is for a frozen lean backbone"),
    ("bn+last", "auto", dict(frozen_weights="int8"), "frozen_weights int8 does not apply to mode bn+last on stock"),
])
def test_options_a_mode_would_ignore_are_refused_by_every_caller(mode, runtime, values, needle, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        LeanOptions(**{"pool": 1, **values}).for_mode(mode, runtime, defaults=LeanOptions(pool=1))
    recipe = load_recipe("fashion_mnist", overrides={"model.mode": mode, "model.runtime": runtime,
                                                     **{f"model.{k}": v for k, v in values.items()}})
    with pytest.raises(ConfigError, match=re.escape(f"model.{needle}" if not needle.startswith("uint8") else needle)):
        recipe.model.lean()


def test_what_a_stock_recipe_honours_passes_and_nothing_else():
    """On stock modules a recipe's precision is autocast's and bn picks the statistics; the
    lean options are refused, none ignored."""
    recipe = load_recipe("fashion_mnist", overrides={"model.mode": "bn+last", "model.precision": "bf16",
                                                     "model.bn": "batch"})
    assert recipe.model.lean() is None
    for key, value in (("keep", 0.5), ("pool", 2), ("stream", 1), ("uint8_input", True)):
        recipe = load_recipe("fashion_mnist", overrides={"model.mode": "bn+last", f"model.{key}": value})
        with pytest.raises(ConfigError, match=f"model.{key} .* on stock modules"):
            recipe.model.lean()


def test_a_plan_configuration_is_checked_by_the_same_rules(tmp_path):
    from edgetl.plan.document import PlanConfig

    config = PlanConfig({}, {}, 2, "fp32", "int8", 8, stream=2, mode="repnet")
    assert config.lean == LeanOptions(pool=2, frozen_weights="int8", stream=2, uint8_input=True)
    data = config.to_dict()
    data["finetune"]["pool"] = 4
    data["finetune"]["mode"] = "bias"
    with pytest.raises(ConfigError, match=r"chosen.finetune: pool 4 does not apply to mode bias"):
        PlanConfig.from_dict(data, "chosen")
