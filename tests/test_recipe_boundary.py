"""Issue #29: every recipe value, from a file, ``--set`` or a flag, is checked when the recipe
is resolved: a bad one is one line naming the key, exit 2, no traceback, no run folder.

The allowed ranges are written out here, apart from edgetl.recipe, and a test checks that
every numeric field of the recipe dataclasses has one; generated values outside them
(non-finite, negative, huge, wrong type) are driven through the CLI with hypothesis.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetl.errors import ConfigError
from edgetl.recipe import RECIPE_DIR, DataConfig, OptimConfig, Recipe, TrainConfig, apply_overrides, load_recipe
from tests.test_recipe_files import run_cli

I32 = 2**31 - 1
FAST = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class Range(NamedTuple):
    """Allowed values of a numeric key: low..high, an end excluded where open (None: unbounded)."""

    kind: type
    low: float | None
    high: float | None
    low_open: bool = False
    high_open: bool = False


RANGES = {
    "data.resolution": Range(int, 32, 4096),
    "data.classes": Range(int, 0, I32),  # each item
    "data.max_samples": Range(int, 1, I32),
    "data.max_val_samples": Range(int, 1, I32),
    "model.width": Range(float, 0, 4, low_open=True),
    "model.stream": Range(int, 0, 2**16),
    "model.keep": Range(float, 0, 1, low_open=True),
    "optim.weight_decay": Range(float, 0, None),
    "optim.label_smoothing": Range(float, 0, 1, high_open=True),
    "optim.lr": Range(float, 0, None, low_open=True),
    "optim.lr_head": Range(float, 0, None, low_open=True),
    "optim.lr_side": Range(float, 0, None, low_open=True),
    "optim.momentum": Range(float, 0, 1, high_open=True),
    "optim.warmup_epochs": Range(float, 0, I32),
    "train.epochs": Range(int, 1, I32),
    "train.batch_size": Range(int, 1, 2**16),
    "train.seed": Range(int, 0, 2**32 - 1),
    "train.workers": Range(int, 0, 256),
    "train.val_batch_size": Range(int, 1, 2**16),
    "train.eval_every": Range(int, 1, I32),
    "train.checkpoint_every": Range(int, 0, I32),
    "distill.temperature": Range(float, 0, None, low_open=True),
    "distill.weight": Range(float, 0, 1),
}
CHOICES = {"model.pool": (1, 2, 4)}
SCALARS = sorted(k for k in RANGES if k != "data.classes")
# a distill section needs all three values; the key under test is set after these
DISTILL = ["--set", "distill.teacher=runs/t", "--set", "distill.temperature=1", "--set", "distill.weight=0.5"]


def leaf_types(tp) -> set:
    """The plain types in a hint: {int} for ``list[int] | None``; none for a Literal."""
    if typing.get_origin(tp) is typing.Literal:
        return set()
    args = typing.get_args(tp)
    return set().union(*(leaf_types(a) for a in args)) if args else {tp}


def numeric_keys() -> set[str]:
    """Every int / float field of the recipe sections (Optional and list[int] included)."""
    keys = set()
    for section, tp in typing.get_type_hints(Recipe).items():
        cls = next(a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a))
        keys |= {f"{section}.{name}" for name, hint in typing.get_type_hints(cls).items()
                 if leaf_types(hint) & {int, float}}
    return keys


def test_every_numeric_field_has_a_range_here():
    assert numeric_keys() == set(RANGES) | set(CHOICES)


# --- generated bad values ------------------------------------------------------------------------

NON_FINITE = st.sampled_from(["nan", "inf", "-inf", ".nan", ".inf", "-.inf", "NaN", ".NaN", "Infinity", "+.inf",
                              "1e400", "-1e999"])
WORDS = st.from_regex(r"\A[a-z][a-z_/]{1,12}\Z").filter(lambda w: w not in {"null", "nan", "inf", "infinity"})


def float_text(x: float) -> str:
    return repr(x)


def below(r: Range):
    if r.low is None:
        return st.nothing()
    if r.kind is int:
        return st.integers(max_value=int(r.low) - 1).map(str)
    fine = st.floats(max_value=r.low, allow_nan=False, allow_infinity=False)
    return fine.filter(lambda x: x <= r.low if r.low_open else x < r.low).map(float_text)


def above(r: Range):
    if r.high is None:
        return st.nothing()
    if r.kind is int:
        return st.one_of(st.integers(min_value=int(r.high) + 1), st.integers(min_value=2**63)).map(str)
    fine = st.floats(min_value=r.high, allow_nan=False, allow_infinity=False)
    return fine.filter(lambda x: x >= r.high if r.high_open else x > r.high).map(float_text)


def wrong_type(r: Range):
    # (a quoted number is no wrong type through --set: text for a number key is read as YAML, as documented)
    words = st.one_of(WORDS, st.sampled_from(["true", "false", "yes", "off", "[1, 2]", "{a: 1}", "2020-01-01"]))
    if r.kind is int:
        fractional = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer())
        return st.one_of(words, fractional.map(float_text), st.sampled_from(["2.0", "1e3", "-0.5"]))
    return words


def invalid(key: str):
    r = RANGES[key]
    return st.one_of(NON_FINITE, below(r), above(r), wrong_type(r))


def assert_refused(code: int, err: str, key: str, out: Path) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgetl: error: "), err
    assert key in lines[0] and "allowed" in lines[0], err
    assert not out.exists(), f"{out} was created"
    return lines[0][len("edgetl: error: "):]


def finetune_argv(out: Path, *extra: str) -> list[str]:
    # a data folder that does not exist: a value wrongly accepted fails fast there instead of training
    return ["finetune", "--recipe", "imagefolder", "--data", str(out.parent / "no-data"),
            "--backbone", "mobilenet_v2:random", "-o", str(out), *extra]


@pytest.mark.parametrize("key", SCALARS)
@FAST
@given(data=st.data())
def test_set_refuses_bad_numbers_in_one_line(key, data, tmp_path, capsys):
    text = data.draw(invalid(key), label="value")
    out = tmp_path / "run"
    extra = (DISTILL if key.startswith("distill.") else []) + ["--set", f"{key}={text}"]
    assert_refused(*run_cli(capsys, finetune_argv(out, *extra)), key, out)


@FAST
@given(item=st.one_of(below(RANGES["data.classes"]), above(RANGES["data.classes"]), NON_FINITE,
                      st.sampled_from(["2.5", "true", "x"])))
def test_set_refuses_bad_class_indices(item, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = run_cli(capsys, finetune_argv(out, "--set", f"data.classes=[0, {item}]"))
    assert_refused(code, err, "data.classes", out)


@FAST
@given(value=st.one_of(st.integers().filter(lambda v: v not in (1, 2, 4)).map(str), NON_FINITE,
                       st.sampled_from(["2.0", "true", "two"])))
def test_set_refuses_pools_other_than_1_2_4(value, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = run_cli(capsys, finetune_argv(out, "--set", f"model.pool={value}"))
    assert_refused(code, err, "model.pool", out)


@FAST
@given(value=st.integers(max_value=-1))
def test_stream_flag_is_checked_by_the_recipe(value, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = run_cli(capsys, finetune_argv(out, "--stream", str(value)))
    assert_refused(code, err, "model.stream", out)


BOOLS = ["data.download", "model.uint8_input", "model.recompute", "optim.nesterov", "optim.decay_norm_and_bias",
         "optim.foreach", "optim.fused", "optim.step_in_backward"]


@pytest.mark.parametrize("key", BOOLS)
@pytest.mark.parametrize("text", ["maybe", "1", "0", "2.5", "nan", "[true]", "{a: true}"])
def test_bool_keys_take_only_booleans(key, text, tmp_path, capsys):
    out = tmp_path / "run"
    assert_refused(*run_cli(capsys, finetune_argv(out, "--set", f"{key}={text}")), key, out)


@pytest.mark.parametrize("key, text", [("model.backbone", "a\tb"), ("data.root", "a\x00b"),
                                       ("distill.teacher", ""), ("distill.teacher", "x\ny")])
def test_paths_are_not_empty_nor_hold_control_characters(key, text, tmp_path, capsys):
    out = tmp_path / "run"
    extra = ["--set", "distill.temperature=1", "--set", "distill.weight=0.5"] if key.startswith("distill") else []
    if key.startswith("distill."):
        argv = finetune_argv(out, *extra, "--set", f"{key}={text}")
    else:  # no --backbone / --data flag, which would win over --set
        argv = ["finetune", "--recipe", "imagefolder", "-o", str(out), "--set", f"{key}={text}"]
    assert_refused(*run_cli(capsys, argv), key, out)
    # through --set an empty data.root is null (the preset's own place); "" itself is refused
    with pytest.raises(ConfigError, match=r"^data.root: '' is not allowed; allowed: a path or name"):
        apply_overrides(load_recipe("fashion_mnist"), {"data.root": ""})


def test_the_message_names_key_value_and_what_is_allowed(tmp_path, capsys):
    out = tmp_path / "run"
    line = assert_refused(*run_cli(capsys, finetune_argv(out, "--set", "optim.lr_side=nan")), "optim.lr_side", out)
    assert line == "optim.lr_side: nan is not allowed; allowed: a finite number > 0 or null"
    line = assert_refused(*run_cli(capsys, finetune_argv(out, "--set", "train.workers=-1")), "train.workers", out)
    assert line == "train.workers: -1 is not allowed; allowed: an integer in [0, 256]"
    line = assert_refused(*run_cli(capsys, finetune_argv(out, "--set", "model.keep=2")), "model.keep", out)
    assert line == "model.keep: 2.0 is not allowed; allowed: a fraction in (0, 1]"
    line = assert_refused(*run_cli(capsys, finetune_argv(out, "--set", f"train.seed={10**400}")), "train.seed", out)
    assert line == "train.seed: an integer of 401 digits is not allowed; allowed: an integer in [0, 4294967295]"


@pytest.mark.parametrize("extra, key", [
    (["--set", "optim.lr=inf"], "optim.lr"),
    (["--set", "train.workers=-1"], "train.workers"),
    (["--set", "train.epochs=2.5"], "train.epochs"),
    (["--set", "model.width=0"], "model.width"),
])
def test_retrain_resolves_through_the_same_checks(extra, key, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["retrain", "--backbone", "mobilenet_v2", "--device", "cpu", "--data", str(tmp_path / "no-data"),
            "-o", str(out), *extra]
    assert_refused(*run_cli(capsys, argv), key, out)


# --- the recipe file entry point -----------------------------------------------------------------


def recipe_with(path: Path, key: str, text: str) -> bytes:
    """The imagefolder recipe with ``key`` set to the YAML text ``text``; its bytes."""
    data = yaml.safe_load((RECIPE_DIR / "imagefolder.yaml").read_text())
    if key.startswith("distill."):
        data["distill"] = {"teacher": "runs/t", "temperature": 1.0, "weight": 0.5}
    section, name = key.split(".")
    data[section][name] = "@VALUE@"
    raw = yaml.safe_dump(data, sort_keys=False).replace("'@VALUE@'", text).encode()
    path.write_bytes(raw)
    return raw


@pytest.mark.parametrize("key", ["optim.lr_side", "optim.weight_decay", "train.batch_size", "train.seed",
                                 "model.width", "data.resolution", "distill.weight"])
@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_recipe_file_values_are_checked_and_the_file_is_left_alone(key, data, tmp_path, capsys):
    text = data.draw(st.one_of(invalid(key).filter(lambda t: not t.startswith("{")), st.just("'3'")), label="value")
    path = tmp_path / "mine.yaml"
    raw = recipe_with(path, key, text)
    out = tmp_path / "run"
    code, err = run_cli(capsys, ["finetune", "--recipe", str(path), "--backbone", "mobilenet_v2:random",
                                 "--data", str(tmp_path / "no-data"), "-o", str(out)])
    assert_refused(code, err, key, out)
    assert path.read_bytes() == raw


# --- the Python API: direct construction and replace are checked too -----------------------------


def test_direct_construction_is_checked():
    with pytest.raises(ConfigError, match=r"^optim.lr: nan is not allowed"):
        OptimConfig(name="adam", weight_decay=0.0, label_smoothing=0.0, schedule="constant", lr=math.nan)
    with pytest.raises(ConfigError, match=r"^train.epochs is True; allowed: an integer"):
        TrainConfig(epochs=True, batch_size=8, seed=0)
    with pytest.raises(ConfigError, match=r"^data.resolution: 4097 is not allowed"):
        DataConfig(preset="imagefolder", resolution=4097)
    recipe = load_recipe("fashion_mnist")
    with pytest.raises(ConfigError, match=r"^optim.weight_decay: -inf is not allowed"):
        dataclasses.replace(recipe.optim, weight_decay=-math.inf)
    assert isinstance(TrainConfig(epochs=1, batch_size=1, seed=0).workers, int)
    assert OptimConfig(name="adam", weight_decay=0, label_smoothing=0, schedule="constant", lr=1).lr == 1.0


def test_checkpoint_dicts_are_checked():
    data = load_recipe("fashion_mnist").to_dict()
    data["train"]["batch_size"] = -8
    with pytest.raises(ConfigError, match=r"train.batch_size: -8 is not allowed"):
        Recipe.from_dict(data)


# --- what is allowed stays allowed ---------------------------------------------------------------


def edges(r: Range) -> list:
    values = []
    for end, is_open, step in ((r.low, r.low_open, 1), (r.high, r.high_open, -1)):
        if end is None:
            continue
        if r.kind is int:
            values.append(int(end) + (step if is_open else 0))
        else:
            values.append(math.nextafter(end, end + step) if is_open else float(end))
    return values


@pytest.mark.parametrize("key", SCALARS)
def test_the_ends_of_each_range_are_accepted(key):
    base = load_recipe("fashion_mnist")
    extra = {"distill.teacher": "runs/t", "distill.temperature": 1.0, "distill.weight": 0.5}
    for value in edges(RANGES[key]):
        overrides = {**(extra if key.startswith("distill.") else {}), key: value}
        recipe = apply_overrides(base, overrides)
        section, name = key.split(".")
        assert getattr(getattr(recipe, section), name) == value


@FAST
@given(lr=st.floats(min_value=5e-324, max_value=1e300), smoothing=st.floats(min_value=0, max_value=1, exclude_max=True),
       batch=st.integers(1, 2**16), classes=st.lists(st.integers(0, I32), min_size=1, max_size=5, unique=True))
def test_generated_valid_values_pass_through_set_unchanged(lr, smoothing, batch, classes):
    from edgetl.recipe import parse_override

    overrides = dict(parse_override(text) for text in [
        f"optim.lr_side={lr!r}", f"optim.label_smoothing={smoothing!r}", f"train.batch_size={batch}",
        f"data.classes={classes}"])
    recipe = apply_overrides(load_recipe("fashion_mnist"), overrides)
    assert (recipe.optim.lr_side, recipe.optim.label_smoothing) == (lr, smoothing)
    assert (recipe.train.batch_size, recipe.data.classes) == (batch, classes)


def test_set_reads_a_string_key_as_text():
    from edgetl.recipe import parse_override

    assert parse_override("data.root=123") == ("data.root", "123")
    assert parse_override("data.root=null") == ("data.root", None)
    assert parse_override("model.backbone=yes") == ("model.backbone", "yes")
    assert math.isnan(parse_override("optim.lr=nan")[1]) and parse_override("optim.lr=-inf")[1] == -math.inf
    assert parse_override("data.root='a b'") == ("data.root", "a b")
