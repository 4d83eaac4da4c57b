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
``edgetl.schema.check_fields``, which checks every field's type and, for numbers, that it is finite and
within the range its field declares (``Allowed``), then the section's cross-field checks.
A refused value is one ConfigError line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from edgetl.errors import ConfigError
from edgetl.options import MAX_BATCH, MODES, RUNTIMES, LeanOptions, option_default
from edgetl.schema import allowed, build, check_fields, parse_value, path_field, set_dotted, show

INT32_MAX = 2**31 - 1  # counts (epochs, samples, steps) stay in 32 bits
# published MobileNetV2 widths are 0.35-1.4; past 4 the network outgrows any Jetson
MAX_WIDTH = 4.0
# past any classifier a Jetson trains: 1280 x 10**6 fp32 weights are 5.1 GB (ImageNet-21k has 21,841 classes)
MAX_CLASSES = 10**6
MAX_WORKERS = 256  # DataLoader processes; more is a typo, and each one copies the dataset's state
SEED_MAX = 2**32 - 1  # the widest range every RNG edgetl seeds accepts (numpy's)


PRESETS = ("imagefolder", "fashion_mnist", "cifar10", "flowers102", "pets", "cub200", "imagenet")

Preset = Literal["imagefolder", "fashion_mnist", "cifar10", "flowers102", "pets", "cub200", "imagenet"]
Mode = Literal[MODES]


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
        check_fields(self, where)
        if self.classes is not None:
            if not self.classes:
                raise ConfigError(f"{where}.classes: empty list; give class indices or leave it out")
            if len(set(self.classes)) != len(self.classes):
                raise ConfigError(f"{where}.classes: {show(self.classes)} repeats an index; allowed: distinct indices")


@dataclass(kw_only=True)
class ModelConfig(LeanOptions):
    """What trains, and how the lean runtime stores it: the fields of
    ``edgetl.options.LeanOptions`` (pool, bn, frozen_weights, precision, stream, storage,
    keep, uint8_input, recompute, channels_last; declared, documented and checked there) plus these.

    Attributes:
        mode: which parameters train (see edgetl.models.side.set_trainable).
        backbone: a backbone folder (from edgetl prune / retrain), an architecture or a
            torchvision weights name ("resnet18", "mobilenet_v2:IMAGENET1K_V2", "resnet50:random")
            or a torchvision state_dict file; None = the default MobileNetV2 at the width below.
        width: the width multiplier of an architecture that has one (MobileNetV2) where the
            backbone is not a folder; 1.0 for one that has none (ResNet).
        runtime: "lean" (edgetl's lean layers), "stock" (torch modules) or "auto" (lean
            wherever the mode allows, except full: see ``edgetl.options.resolve_runtime``).
            On stock modules precision is autocast's (CUDA only for fp16/bf16) and bn
            chooses eval or batch statistics; the other options need the lean runtime.
        pool: as LeanOptions.pool, but a recipe stores exactly unless it asks (default 1).
    """

    mode: Mode
    backbone: str | None = path_field(None)
    width: float = allowed(1.0, gt=0, le=MAX_WIDTH)
    runtime: Literal[RUNTIMES] = "auto"
    pool: int = option_default("pool", 1)

    def __post_init__(self) -> None:
        self.check("model")

    def lean(self) -> LeanOptions | None:
        """The lean options this model runs with (None: stock modules), after refusing every
        option its mode and runtime would ignore (``LeanOptions.for_mode``)."""
        return LeanOptions.of(self).for_mode(self.mode, self.runtime, defaults=RECIPE_DEFAULTS, prefix="model.",
                                             stock_honours=STOCK_HONOURS)


RECIPE_DEFAULTS = LeanOptions(pool=1)  # what a recipe that sets no option runs with
STOCK_HONOURS = ("precision", "bn")  # on stock modules: autocast, and eval or batch statistics


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
        check_fields(self, where)
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
        cuda_graph: on CUDA, capture the whole training step as CUDA graphs and replay them
            (edgetl.train.graph) where the step can be captured; false: eager. How the step
            executes, not what it computes: a run may resume the other way. recipe.yaml
            records what ran.
    """

    epochs: int = allowed(ge=1, le=INT32_MAX)
    batch_size: int = allowed(ge=1, le=MAX_BATCH)
    seed: int = allowed(ge=0, le=SEED_MAX)
    workers: int = allowed(2, ge=0, le=MAX_WORKERS)
    val_batch_size: int | None = allowed(None, ge=1, le=MAX_BATCH)
    eval_every: int = allowed(1, ge=1, le=INT32_MAX)
    checkpoint_every: int = allowed(200, ge=0, le=INT32_MAX)
    cuda_graph: bool = True

    def __post_init__(self) -> None:
        self.check("train")

    def check(self, where: str) -> None:
        check_fields(self, where)


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
        check_fields(self, where)


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
        check_fields(self, "")  # each section is its dataclass (a mapping is built into one)
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if section is not None:
                section.check(f.name)
        if self.model.mode.startswith("repnet") and self.optim.side_lr is None:
            raise ConfigError(
                f"{where}: model.mode {self.model.mode!r} trains a side network; set optim.lr_side or optim.lr"
            )

    def to_dict(self) -> dict:
        """Plain dict (only str/int/float/bool/None/list/dict): YAML-, JSON- and checkpoint-safe.
        The model section starts with what trains, then the lean options."""
        data = dataclasses.asdict(self)
        own = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in LeanOptions.names()]
        data["model"] = {k: data["model"][k] for k in [*own, *LeanOptions.names()]}
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any, source: str = "recipe") -> "Recipe":
        """A Recipe from plain data (a recipe file's mapping, a checkpoint's ``recipe``), validated."""
        return build(cls, data, "", source)




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
        data = set_dotted(Recipe, data, overrides, str(path))
    return Recipe.from_dict(data, source=str(path.name))


def apply_overrides(recipe: Recipe, overrides: dict[str, Any], source: str = "override") -> Recipe:
    """A new Recipe with dotted keys replaced (e.g. {"train.batch_size": 16}), validated.

    String values for non-string keys are parsed as YAML, so CLI text like "16", "1e-3",
    "true", "null" or "[0, 1]" works.
    """
    return Recipe.from_dict(set_dotted(Recipe, recipe.to_dict(), overrides, source), source=source)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.batch_size=16"`` -> ("train.batch_size", 16) for ``--set KEY=VALUE`` flags.

    The value is read as its key's schema type wants: text for a string key (``data.root=123``
    is the folder "123"; ``null`` or nothing is null where the key allows it), YAML otherwise
    ("16", "1e-3", "true", "[0, 1]"), where ``nan`` and ``inf`` are numbers, which the
    recipe then refuses with what is allowed. The value is checked when the recipe is built.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {show(text)} is not KEY=VALUE (e.g. train.batch_size=16)")
    key = key.strip()
    return key, parse_value(Recipe, key, value)


def save_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write the resolved recipe as YAML, atomically."""
    from edgetl.io import atomic_write_text

    atomic_write_text(path, recipe.to_yaml())
