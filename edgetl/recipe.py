"""Recipes: a YAML file (plus dotted-key overrides) in, a validated, typed Recipe out.

One schema for every stage that trains (``edgetl finetune``, ``edgetl retrain``). A
recipe has the sections ``data``, ``model``, ``optim``, ``train`` and, for retraining
with a teacher, ``distill``. Loading is strict: an unknown key fails with a close-match
suggestion, every value is type-checked, and a hyperparameter that changes results
(learning rates, weight decay, label smoothing, epochs, batch size, seed, resolution,
schedule, mode) has no default, so a recipe that omits it is an error. Only switches for
optional edgetl features and operational knobs have defaults, and those default to
"off" / exact behaviour (``model.pool: 1``, ``model.precision: fp32``); the resolved
recipe, defaults included, is written into every run folder and checkpoint.

Every value is checked in one place, whatever filled it (a recipe file, ``--set``, a CLI
flag, a plan, a checkpoint, Python code): each section's ``__post_init__`` runs
``_check_fields``, which checks every field's type and, for numbers, that it is finite and
within the range its field declares (``Allowed``), then the section's cross-field checks.
A refused value is one ConfigError line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from edgetl.errors import ConfigError

INT32_MAX = 2**31 - 1  # counts (epochs, samples, steps) stay in 32 bits
MAX_BATCH = 2**16  # images per step per process
MAX_WORKERS = 256  # DataLoader processes; more is a typo, and each one copies the dataset's state
SEED_MAX = 2**32 - 1  # the widest range every RNG edgetl seeds accepts (numpy's)


@dataclass(frozen=True)
class Allowed:
    """The numbers a recipe field allows besides its type: finite, within the bounds given, or one of choices.

    An Optional field also allows null; a list field's bounds apply to each item.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple = ()

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.choices:
            return value in self.choices
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))

    def describe(self, integer: bool) -> str:
        if self.choices:
            return ", ".join(map(str, self.choices))
        low = ("(", self.gt) if self.gt is not None else ("[", self.ge) if self.ge is not None else None
        high = (")", self.lt) if self.lt is not None else ("]", self.le) if self.le is not None else None
        if low and high:
            kind = "an integer" if integer else "a fraction" if low[1] >= 0 and high[1] <= 1 else "a finite number"
            return f"{kind} in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
        kind = "an integer" if integer else "a finite number"
        if low:
            return f"{kind} {'>' if low[0] == '(' else '>='} {_num(low[1])}"
        if high:
            return f"{kind} {'<' if high[0] == ')' else '<='} {_num(high[1])}"
        return kind


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def allowed(default: Any = dataclasses.MISSING, **bounds) -> Any:
    """A dataclass field whose numbers ``Allowed(**bounds)`` admits (checked by ``_check_fields``)."""
    return dataclasses.field(default=default, metadata={"allowed": Allowed(**bounds)})


def path_field(default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field holding a path or a name: a non-empty string without control characters."""
    return dataclasses.field(default=default, metadata={"path": True})


PRESETS = ("imagefolder", "fashion_mnist", "cifar10", "flowers102", "pets", "cub200", "imagenet")
MODES = ("full", "last", "bias", "bn+last", "repnet", "repnet+bias")

Preset = Literal["imagefolder", "fashion_mnist", "cifar10", "flowers102", "pets", "cub200", "imagenet"]
Mode = Literal["full", "last", "bias", "bn+last", "repnet", "repnet+bias"]


@dataclass
class DataConfig:
    """What to train on.

    Attributes:
        preset: dataset kind; "imagefolder" is ``root/{train,val}/<class>/*.jpg``.
        resolution: training and test input size in pixels.
        root: dataset folder; None means the preset's standard location
            (Fashion-MNIST: /usr/share/datasets/fashion-mnist).
        classes: keep only these class indices, relabelled 0..n-1 in this order.
        max_samples: cap on training samples (class-balanced, fixed by train.seed).
        max_val_samples: cap on validation samples.
        download: let torchvision download the preset (never done unless asked).
        on_bad_image: what an unreadable image file does: "error" stops before training
            with its name; "skip" leaves it out (each logged once, counted in the summary).
    """

    preset: Preset
    # 32 px: the backbone's five stride-2 stages leave one cell; 4096: far past any Jetson's memory
    resolution: int = allowed(ge=32, le=4096)
    root: str | None = path_field(None)
    classes: list[int] | None = allowed(None, ge=0, le=INT32_MAX)
    max_samples: int | None = allowed(None, ge=1, le=INT32_MAX)
    max_val_samples: int | None = allowed(None, ge=1, le=INT32_MAX)
    download: bool = False
    on_bad_image: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        self.check("data")

    def check(self, where: str) -> None:
        _check_fields(self, where)
        if self.classes is not None:
            if not self.classes:
                raise ConfigError(f"{where}.classes: empty list; give class indices or leave it out")
            if len(set(self.classes)) != len(self.classes):
                raise ConfigError(f"{where}.classes: {_show(self.classes)} repeats an index; allowed: distinct indices")


@dataclass
class ModelConfig:
    """What trains and how it is stored.

    Attributes:
        mode: which parameters train (see edgetl.models.side.set_trainable).
        backbone: a backbone folder (from edgetl prune / retrain); None = the stock
            architecture with the width below.
        width: MobileNetV2 width multiplier when no backbone folder is given.
        pool: side-network activations are stored average-pooled by this factor (1 = exact).
        precision: activation dtype: the lean runtime casts the backbone itself (CPU and CUDA); stock modules use autocast (CUDA only for fp16/bf16).
        frozen_weights: storage dtype of frozen backbone weights.
        bn: "fold" keeps frozen BN layers in eval mode (statistics fixed, foldable);
            "batch" lets them use batch statistics.
        stream: micro-batch of the streamed frozen backbone segments (lean runtime, bn fold;
            ``edgetl.models.stream``); 0 = no streaming.
        runtime: "lean" (edgetl's lean layers), "stock" (torch modules) or "auto" (lean
            wherever the mode allows, except full: see ``edgetl.profile.resolve_runtime``).
        storage: lean full fine-tuning: what each backbone conv keeps for its weight
            gradient (exact, pool2, pool4, haar, db3, dct, threshold).
        keep: share of each map's coefficients a compressor storage keeps, in (0, 1].
        uint8_input: the loaders yield uint8 pixels and the network normalises them, micro-batch
            by micro-batch where it streams (lean frozen backbone; ``LeanOptions.uint8_input``).
        recompute: streamed segments keep their input and run forward again in backward where
            that lowers the peak (``LeanOptions.recompute``); needs stream.
    """

    mode: Mode
    backbone: str | None = path_field(None)
    # published MobileNetV2 widths are 0.35-1.4; past 4 the network outgrows any Jetson
    width: float = allowed(1.0, gt=0, le=4)
    pool: int = allowed(1, choices=(1, 2, 4))  # edgetl.models.lean.POOLS
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    frozen_weights: Literal["fp32", "fp16", "int8"] = "fp32"
    bn: Literal["fold", "batch"] = "fold"
    stream: int = allowed(0, ge=0, le=MAX_BATCH)  # a micro-batch: at most a batch
    runtime: Literal["auto", "lean", "stock"] = "auto"
    storage: str = "exact"
    keep: float = allowed(0.1, gt=0, le=1)
    uint8_input: bool = False
    recompute: bool = False

    def __post_init__(self) -> None:
        self.check("model")

    def check(self, where: str) -> None:
        from edgetl.models.lean_full import STORAGES

        _check_fields(self, where)
        if self.storage not in STORAGES:
            raise ConfigError(f"{where}.storage: {_show(self.storage)} is not allowed; allowed: {', '.join(STORAGES)}")
        if self.recompute and not self.stream:
            raise ConfigError(f"{where}.recompute needs {where}.stream >= 1 (it applies to streamed segments)")
        if self.stream and self.bn != "fold":
            raise ConfigError(f"{where}.stream: {self.stream} needs {where}.bn fold (got {self.bn}): "
                              "with batch statistics the samples of a batch depend on each other")


@dataclass
class OptimConfig:
    """Optimizer and schedule.

    Attributes:
        name: "adam" or "sgd".
        weight_decay: L2 weight decay.
        label_smoothing: cross-entropy label smoothing in [0, 1).
        schedule: "cosine" (per iteration, to 0) or "constant".
        lr: learning rate of every parameter group without its own rate below.
        lr_head: rate of everything that is not the side network (classifier, biases).
        lr_side: rate of the side network (Rep-Net modes).
        momentum: SGD momentum (required for sgd).
        nesterov: SGD Nesterov momentum.
        decay_norm_and_bias: apply weight decay to normalisation weights and biases too.
        warmup_epochs: linear warmup length (may be fractional); 0 = none. A run shorter than
            twice its warmup warms up for half its steps (edgetl.train.warmup_steps).
        foreach: update all of a group's parameters with multi-tensor kernels (fewer kernel
            launches; temporaries the size of the whole group instead of one parameter).
            PyTorch would pick by device; edgetl sets it, so the memory it predicts is the
            memory the update takes on every device.
        fused: one fused kernel per parameter (PyTorch's ``fused=True``, CPU and CUDA): no
            temporaries beyond the state, where the single-tensor update allocates two of a
            parameter's size. The same update up to float rounding (not bit for bit the
            unfused one); not with foreach.
        step_in_backward: update each parameter as soon as its gradient is complete, inside
            backward (post-accumulate-grad hooks), and free that gradient at once, so not
            all gradients are alive together (issue #14 item 3). The same weights as the
            ordinary step; incompatible with gradient accumulation or clipping across
            parameters, DDP, fp16 loss scaling and foreach (edgetl.step).
    """

    name: Literal["adam", "sgd"]
    weight_decay: float = allowed(ge=0)
    label_smoothing: float = allowed(ge=0, lt=1)  # 1 would make every target uniform
    schedule: Literal["cosine", "constant"]
    lr: float | None = allowed(None, gt=0)
    lr_head: float | None = allowed(None, gt=0)
    lr_side: float | None = allowed(None, gt=0)
    momentum: float | None = allowed(None, ge=0, lt=1)  # 1 never forgets: the update grows without bound
    nesterov: bool = False
    decay_norm_and_bias: bool = True
    warmup_epochs: float = allowed(0.0, ge=0, le=INT32_MAX)  # times steps per epoch stays finite
    foreach: bool = False
    fused: bool = False
    step_in_backward: bool = False

    def __post_init__(self) -> None:
        self.check("optim")

    def check(self, where: str) -> None:
        _check_fields(self, where)
        if self.lr is None and self.lr_head is None:
            raise ConfigError(f"{where}: missing learning rate; set {where}.lr or {where}.lr_head")
        if self.fused and self.foreach:
            raise ConfigError(f"{where}.fused and {where}.foreach are both on; allowed: one of the two")
        if self.name == "sgd" and self.momentum is None:
            raise ConfigError(f"{where}.momentum: missing; sgd needs a momentum (e.g. 0.9)")

    @property
    def head_lr(self) -> float:
        """Learning rate of parameters outside the side network."""
        return self.lr_head if self.lr_head is not None else self.lr  # type: ignore[return-value]

    @property
    def side_lr(self) -> float | None:
        """Learning rate of the side network, or None if neither lr_side nor lr is set."""
        return self.lr_side if self.lr_side is not None else self.lr


@dataclass
class TrainConfig:
    """Loop settings.

    Attributes:
        epochs: training epochs.
        batch_size: images per step (per process under torchrun).
        seed: seeds model init, data order, augmentation and dropout.
        workers: DataLoader worker processes (few: a Jetson shares memory with the GPU).
        val_batch_size: evaluation batch size; None = batch_size.
        eval_every: evaluate every this many epochs (and always after the last).
        checkpoint_every: also write last.pt every this many steps inside an epoch
            (0 = only at epoch ends), so a killed run loses little work.
    """

    epochs: int = allowed(ge=1, le=INT32_MAX)
    batch_size: int = allowed(ge=1, le=MAX_BATCH)
    seed: int = allowed(ge=0, le=SEED_MAX)
    workers: int = allowed(2, ge=0, le=MAX_WORKERS)
    val_batch_size: int | None = allowed(None, ge=1, le=MAX_BATCH)
    eval_every: int = allowed(1, ge=1, le=INT32_MAX)
    checkpoint_every: int = allowed(200, ge=0, le=INT32_MAX)

    def __post_init__(self) -> None:
        self.check("train")

    def check(self, where: str) -> None:
        _check_fields(self, where)


@dataclass
class DistillConfig:
    """Knowledge distillation from a teacher (retraining a pruned backbone).

    Attributes:
        teacher: backbone folder of the teacher (e.g. the unpruned network).
        temperature: softmax temperature of both teacher and student.
        weight: share of the distillation loss; the label loss gets 1 - weight.
    """

    teacher: str = path_field()
    temperature: float = allowed(gt=0)
    weight: float = allowed(ge=0, le=1)

    def __post_init__(self) -> None:
        self.check("distill")

    def check(self, where: str) -> None:
        _check_fields(self, where)


@dataclass
class Recipe:
    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    train: TrainConfig
    distill: DistillConfig | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self, where: str = "recipe") -> None:
        _check_fields(self, "")  # each section is its dataclass (a mapping is built into one)
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if section is not None:
                section.check(f.name)
        if self.model.mode.startswith("repnet") and self.optim.side_lr is None:
            raise ConfigError(
                f"{where}: model.mode {self.model.mode!r} trains a side network; set optim.lr_side or optim.lr"
            )

    def to_dict(self) -> dict:
        """Plain dict (only str/int/float/bool/None/list/dict): YAML-, JSON- and checkpoint-safe."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any, source: str = "recipe") -> "Recipe":
        """A Recipe from plain data (a recipe file's mapping, a checkpoint's ``recipe``), validated."""
        return _build(cls, data, "", source)


# --- strict construction -------------------------------------------------------------


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp) -> str:
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _show(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: its repr, cut to ``limit`` characters (one line)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        bits = value.bit_length()  # str() of more than 4300 digits raises
        digits = len(str(abs(value))) if bits < 14_000 else f"about {int(bits * math.log10(2)) + 1}"
        return f"{'-' if value < 0 else ''}an integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _at(source: str, key: str) -> str:
    return f"{source}: {key}" if source else key


def _check_value(value: Any, tp, key: str, source: str) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float only) or raise a one-line ConfigError."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(value, arg, key, source)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{_at(source, key)} is {_show(value)}; allowed: {_type_name(tp)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, str) and value in choices:
            return value
        hint = ""
        if isinstance(value, str) and len(value) < 100:
            close = difflib.get_close_matches(value, [str(a) for a in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{_at(source, key)} is {_show(value)}{hint}; allowed: {', '.join(repr(a) for a in choices)}"
        )
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{_at(source, key)} is {_show(value)}; allowed: {_type_name(tp)}")
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return _build(tp, value, key, source)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"recipe schema uses unsupported type {tp}")
    if not ok:
        raise ConfigError(f"{_at(source, key)} is {_show(value)}; allowed: {_type_name(tp)}")
    if tp is float:
        try:
            return float(value)
        except OverflowError:  # an integer past 1.8e308
            raise ConfigError(f"{_at(source, key)}: {_show(value)} is not allowed; allowed: a finite number") from None
    return value


def _base_type(tp):
    """int for ``int``, ``int | None`` and ``list[int] | None``."""
    while _is_union(tp) or typing.get_origin(tp) is list:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _check_fields(obj, where: str) -> None:
    """Check every field of a recipe section: its type (ints become floats where a float is
    expected), then numbers against the field's ``Allowed`` (finite, in range) and paths."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{where}.{f.name}" if where else f.name
        value = _check_value(getattr(obj, f.name), hints[f.name], key, "")
        setattr(obj, f.name, value)
        if value is None:
            continue
        rule = f.metadata.get("allowed")
        if rule is not None:
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
            for item_key, item in items:
                if not rule.admits(item):
                    optional = type(None) in typing.get_args(hints[f.name])
                    text = rule.describe(integer=_base_type(hints[f.name]) is int)
                    null = " or null" if optional and not isinstance(value, list) else ""
                    raise ConfigError(f"{item_key}: {_show(item)} is not allowed; allowed: {text}{null}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {_show(value)} is not allowed; allowed: a finite number")
        if f.metadata.get("path") and (not value or not value.isprintable()):
            raise ConfigError(f"{key}: {_show(value)} is not allowed; allowed: a path or name "
                              "(not empty, no control characters)")


def _build(cls, data: Any, prefix: str, source: str):
    where = prefix or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {_show(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            full = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1) if len(str(key)) < 100 else []
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(
                f"{source}: unknown key {_show(full)}{hint} (allowed in {where}: {', '.join(fields)})"
            )
    kwargs = {}
    for name, f in fields.items():
        full = f"{prefix}.{name}" if prefix else name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                raise ConfigError(f"{source}: missing required value {full} ({_type_name(hints[name])})")
            continue
        kwargs[name] = _check_value(data[name], hints[name], full, source)
    return cls(**kwargs)


# --- files and overrides ---------------------------------------------------------------

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"


def find_recipe(name_or_path: str | Path) -> Path:
    """A recipe file path, or the name of a bundled recipe (``cifar10`` -> recipes/cifar10.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = RECIPE_DIR / f"{path.stem}.yaml"
    if path.suffix in ("", ".yaml") and path.parent == Path(".") and bundled.is_file():
        return bundled
    names = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
    close = difflib.get_close_matches(path.stem, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"recipe {str(name_or_path)!r} not found{hint} (give a YAML path or one of: {', '.join(names) or 'none'})"
    )


def load_recipe(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read, override and validate a recipe.

    Args:
        name_or_path: a YAML file or a bundled recipe name.
        overrides: dotted keys to values, applied before validation (e.g. {"train.epochs": 1}).
    """
    from edgetl.io import read_yaml

    path = find_recipe(name_or_path)
    data = read_yaml(path, what="recipe")  # bounded, and a mapping
    if overrides:
        data = _set_dotted(data, overrides, str(path))
    return Recipe.from_dict(data, source=str(path.name))


def apply_overrides(recipe: Recipe, overrides: dict[str, Any], source: str = "override") -> Recipe:
    """A new Recipe with dotted keys replaced (e.g. {"train.batch_size": 16}), validated.

    String values for non-string keys are parsed as YAML, so CLI text like "16", "1e-3",
    "true", "null" or "[0, 1]" works.
    """
    return Recipe.from_dict(_set_dotted(recipe.to_dict(), overrides, source), source=source)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.batch_size=16"`` -> ("train.batch_size", 16) for ``--set KEY=VALUE`` flags.

    The value is read as its key's schema type wants: text for a string key (``data.root=123``
    is the folder "123"; ``null`` or nothing is null where the key allows it), YAML otherwise
    ("16", "1e-3", "true", "[0, 1]"), where ``nan`` and ``inf`` are numbers, which the
    recipe then refuses with what is allowed. The value is checked when the recipe is built.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {_show(text)} is not KEY=VALUE (e.g. train.batch_size=16)")
    key = key.strip()
    return key, _parse_value(key, value)


_YAML_NULLS = ("", "~", "null", "Null", "NULL")


def _parse_value(key: str, text: str) -> Any:
    from edgetl.io import yaml_loads

    tp = _schema_type(key.split("."))
    plain = text.strip()
    if tp is not None and _accepts_str(tp) and not plain.startswith(("'", '"')):
        return None if plain in _YAML_NULLS and _accepts_none(tp) else plain
    if not plain:
        return None
    try:
        parsed = yaml_loads(text, f"--set {key}")
    except ConfigError:  # not YAML (or refused, e.g. an alias): the text, for the type check to name
        return text
    if isinstance(parsed, str) and tp is not None and _accepts(tp, float):
        try:
            return float(parsed)  # YAML 1.1 spells them .nan / .inf; "nan" and "inf" mean them too
        except ValueError:
            pass
    return parsed


def _schema_type(path: list[str]):
    """Type of a dotted key in the schema, or None if the key does not exist."""
    tp: Any = Recipe
    for part in path:
        if _is_union(tp):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _set_dotted(data: dict, overrides: dict[str, Any], source: str) -> dict:
    import copy

    data = copy.deepcopy(data)
    for key, value in overrides.items():
        parts = key.split(".")
        tp = _schema_type(parts)
        if tp is None:
            keys = _all_keys(Recipe)
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown key {key!r}{hint}")
        if isinstance(value, str) and not _accepts_str(tp):
            value = _parse_value(key, value)
        node = data
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):  # never silently replaced
                raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} is {_show(node[part])}; allowed: a mapping")
            node = node[part]
        node[parts[-1]] = value
    return data


def _accepts(tp, kind) -> bool:
    return tp is kind or (_is_union(tp) and kind in typing.get_args(tp))


def _accepts_none(tp) -> bool:
    return _is_union(tp) and type(None) in typing.get_args(tp)


def _accepts_str(tp) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) is Literal:
        return True
    if _is_union(tp):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return False


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        if _is_union(tp):
            inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            tp = inner[0] if inner else tp
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def save_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write the resolved recipe as YAML, atomically."""
    from edgetl.io import atomic_write_text

    atomic_write_text(path, recipe.to_yaml())
