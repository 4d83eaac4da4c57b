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
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import re

import yaml

from edgetl.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; recipes mean a number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass

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
    resolution: int
    root: str | None = None
    classes: list[int] | None = None
    max_samples: int | None = None
    max_val_samples: int | None = None
    download: bool = False
    on_bad_image: Literal["error", "skip"] = "error"

    def check(self, where: str) -> None:
        if self.resolution < 32:
            raise ConfigError(f"{where}.resolution: {self.resolution} is too small; allowed: >= 32")
        if self.classes is not None:
            if not self.classes:
                raise ConfigError(f"{where}.classes: empty list; give class indices or leave it out")
            if len(set(self.classes)) != len(self.classes) or min(self.classes) < 0:
                raise ConfigError(f"{where}.classes: {self.classes} must be distinct indices >= 0")
        for name in ("max_samples", "max_val_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{name}: {value} is not allowed; allowed: >= 1 or null")


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
    backbone: str | None = None
    width: float = 1.0
    pool: int = 1
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    frozen_weights: Literal["fp32", "fp16", "int8"] = "fp32"
    bn: Literal["fold", "batch"] = "fold"
    stream: int = 0
    runtime: Literal["auto", "lean", "stock"] = "auto"
    storage: str = "exact"
    keep: float = 0.1
    uint8_input: bool = False
    recompute: bool = False

    def check(self, where: str) -> None:
        from edgetl.models.lean_full import STORAGES

        if self.storage not in STORAGES:
            raise ConfigError(f"{where}.storage: {self.storage!r} is not allowed; allowed: {', '.join(STORAGES)}")
        if not 0 < self.keep <= 1:
            raise ConfigError(f"{where}.keep: {self.keep} is not allowed; allowed: a fraction in (0, 1]")
        if not self.width > 0:
            raise ConfigError(f"{where}.width: {self.width} is not allowed; allowed: > 0")
        if self.pool < 1:
            raise ConfigError(f"{where}.pool: {self.pool} is not allowed; allowed: >= 1")
        if self.stream < 0:
            raise ConfigError(f"{where}.stream: {self.stream} is not allowed; allowed: 0 (off) or >= 1")
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
    weight_decay: float
    label_smoothing: float
    schedule: Literal["cosine", "constant"]
    lr: float | None = None
    lr_head: float | None = None
    lr_side: float | None = None
    momentum: float | None = None
    nesterov: bool = False
    decay_norm_and_bias: bool = True
    warmup_epochs: float = 0.0
    foreach: bool = False
    fused: bool = False
    step_in_backward: bool = False

    def check(self, where: str) -> None:
        for name in ("lr", "lr_head", "lr_side"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{where}.{name}: {value} is not allowed; allowed: > 0")
        if self.lr is None and self.lr_head is None:
            raise ConfigError(f"{where}: missing learning rate; set {where}.lr or {where}.lr_head")
        if self.fused and self.foreach:
            raise ConfigError(f"{where}.fused and {where}.foreach are both on; allowed: one of the two")
        if self.weight_decay < 0:
            raise ConfigError(f"{where}.weight_decay: {self.weight_decay} is not allowed; allowed: >= 0")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"{where}.label_smoothing: {self.label_smoothing} is not allowed; allowed: 0 <= x < 1")
        if self.name == "sgd" and self.momentum is None:
            raise ConfigError(f"{where}.momentum: missing; sgd needs a momentum (e.g. 0.9)")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ConfigError(f"{where}.momentum: {self.momentum} is not allowed; allowed: 0 <= x < 1")
        if self.warmup_epochs < 0:
            raise ConfigError(f"{where}.warmup_epochs: {self.warmup_epochs} is not allowed; allowed: >= 0")

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

    epochs: int
    batch_size: int
    seed: int
    workers: int = 2
    val_batch_size: int | None = None
    eval_every: int = 1
    checkpoint_every: int = 200

    def check(self, where: str) -> None:
        for name in ("epochs", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: {getattr(self, name)} is not allowed; allowed: >= 1")
        if self.val_batch_size is not None and self.val_batch_size < 1:
            raise ConfigError(f"{where}.val_batch_size: {self.val_batch_size} is not allowed; allowed: >= 1")
        for name in ("workers", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}: {getattr(self, name)} is not allowed; allowed: >= 0")


@dataclass
class DistillConfig:
    """Knowledge distillation from a teacher (retraining a pruned backbone).

    Attributes:
        teacher: backbone folder of the teacher (e.g. the unpruned network).
        temperature: softmax temperature of both teacher and student.
        weight: share of the distillation loss; the label loss gets 1 - weight.
    """

    teacher: str
    temperature: float
    weight: float

    def check(self, where: str) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"{where}.temperature: {self.temperature} is not allowed; allowed: > 0")
        if not 0 <= self.weight <= 1:
            raise ConfigError(f"{where}.weight: {self.weight} is not allowed; allowed: 0 <= x <= 1")


@dataclass
class Recipe:
    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    train: TrainConfig
    distill: DistillConfig | None = None

    def check(self, where: str = "recipe") -> None:
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
        recipe = _build(cls, data, "", source)
        recipe.check(source)
        return recipe


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
        raise ConfigError(f"{source}: {key} is {value!r}; allowed: {_type_name(tp)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value in allowed:
            return value
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{source}: {key} is {value!r}{hint}; allowed: {', '.join(repr(a) for a in allowed)}"
        )
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} is {value!r}; allowed: {_type_name(tp)}")
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
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
        raise ConfigError(f"{source}: {key} is {value!r}; allowed: {_type_name(tp)}")
    return float(value) if tp is float else value


def _build(cls, data: Any, prefix: str, source: str):
    where = prefix or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            full = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(
                f"{source}: unknown key {full!r}{hint} (allowed in {where}: {', '.join(fields)})"
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
    path = find_recipe(name_or_path)
    try:
        data = _yaml_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if overrides:
        data = _set_dotted(data if isinstance(data, dict) else {}, overrides, str(path))
    return Recipe.from_dict(data, source=str(path.name))


def apply_overrides(recipe: Recipe, overrides: dict[str, Any], source: str = "override") -> Recipe:
    """A new Recipe with dotted keys replaced (e.g. {"train.batch_size": 16}), validated.

    String values for non-string keys are parsed as YAML, so CLI text like "16", "1e-3",
    "true", "null" or "[0, 1]" works.
    """
    return Recipe.from_dict(_set_dotted(recipe.to_dict(), overrides, source), source=source)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.batch_size=16"`` -> ("train.batch_size", 16) for ``--set KEY=VALUE`` flags."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. train.batch_size=16)")
    try:
        parsed = _yaml_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


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
            value = parse_override(f"{key}={value}")[1]
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data


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
