"""The plan document's schema: its constants, and each section read as the recipe's are
(``edgetl.schema``), parsed, never coerced: unknown keys refused with a close match, missing
required values refused, every value of its type and in its range, one ConfigError line naming
the key. ``edgetl.plan.document`` builds the plan from them and checks that its values agree."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from edgetl.errors import ConfigError
import edgetl.models.archs as archs
from edgetl.models.backbone import MAX_CLASSES, MAX_WIDTH, prunable_blocks
from edgetl.options import CONV_STORAGES, FROZEN_WEIGHTS, MAX_BATCH, POOLS, PRECISIONS, option_default
from edgetl.plan.devices import DEVICES
from edgetl.schema import allowed, build, check_fields, show

# The blocks any shipped architecture can prune (MobileNetV2: 1..17, ResNet-18: 1..8): the
# schema's bounds; the plan's own architecture's are checked once its backbone is read
# (``Plan._check_agreement``).
_ANY_BLOCK = range(min(prunable_blocks(a).start for a in archs.registered()),
                   max(prunable_blocks(a).stop for a in archs.registered()))

PLAN_FORMAT = "edgetl-plan/1"
MODE = "repnet"  # the default planned mode: Rep-Net on a frozen lean backbone
# Modes a plan can be made for (issue #16 item 4): Rep-Net (pruning, pooling, storage, streaming),
# bias-only TinyTL-B (streaming, frozen-weight and activation storage) and lean full fine-tuning
# (each conv's stored input: exact, then pooled by 2, then by 4).
PLAN_MODES = ("repnet", "bias", "full")
OPTIMIZER = "adam"  # the plan's step: edgetl.step.Step.plain(OPTIMIZER) (plan_step)
HALF_DTYPES = ("fp16", "bf16")  # "half" activations, preferred first (half_precision)
BUDGET_SCOPES = ("tensors", "process")
MAX_RATIO = 0.9
MAX_CHANNELS = 100_000  # hidden channels of one block a plan may name (MobileNetV2 1.0 has at most 960)
MAX_BATCH_SIZE = 256
VERIFY_TOLERANCE = 0.05
OBJECTIVE = ("fit the budget removing as few hidden channels as possible, then prefer a smaller "
             "pooling k, then a larger batch; storage savings (frozen fp16, int8 frozen weights, "
             "half activations) before pooling, pooling before pruning")


# --- the document's schema: each section as the recipe's are (edgetl.schema), parsed, never coerced ----


@dataclass(kw_only=True)
class _FinetuneSection:
    """plan.finetune (and a runner-up's): the lean runtime options and the batch."""

    mode: Literal[PLAN_MODES]
    runtime: Literal["lean"] = "lean"  # plans before issue #16 had no runtime: lean
    pool: int = option_default("pool", dataclasses.MISSING)
    precision: Literal[PRECISIONS]
    frozen_weights: Literal[FROZEN_WEIGHTS]
    bn: Literal["fold"]
    batch_size: int = allowed(ge=1, le=MAX_BATCH)  # train.batch_size's range
    stream: int = option_default("stream", 0)  # plans before streaming streamed nothing
    uint8_input: bool | None = None  # derived from stream; absent in plans before it
    recompute: bool = False
    storage: Literal[CONV_STORAGES] = "exact"
    fused: bool = False  # plans before issue #30 changed no step
    step_in_backward: bool = False


@dataclass(kw_only=True)
class _PruneSection:
    """plan.prune, less its two mappings of block -> channels (``channels``, ``kept``)."""

    blocks: list[int] = allowed(ge=_ANY_BLOCK.start, le=_ANY_BLOCK.stop - 1)
    ratios: list[float] = allowed(ge=0, lt=1)


@dataclass(kw_only=True)
class _BudgetSection:
    """plan.budget, less ``overheads`` (name -> bytes)."""

    budget_bytes: int = allowed(ge=1)
    scope: Literal[BUDGET_SCOPES]
    tensor_budget_bytes: int = allowed(ge=0)
    device: Literal[tuple(DEVICES)]
    device_process_limit_bytes: int | None = allowed(None, ge=1)


@dataclass(kw_only=True)
class _RequestSection:
    """plan.request: what ``plan`` was asked (None: searched)."""

    mode: Literal[PLAN_MODES] = MODE  # absent before issue #16: Rep-Net
    batch_size: int | Literal["auto"]  # an integer >= 1 (checked in Plan.from_dict)
    precision: Literal[PRECISIONS] | None
    pool: int | None = allowed(choices=POOLS)
    frozen_weights: Literal[FROZEN_WEIGHTS] | None
    stream: int | None = allowed(None, ge=0, le=MAX_BATCH)  # absent before streaming
    fused: bool | None = None  # absent before issue #30
    step_in_backward: bool | None = None
    eager: bool = False  # an eager step asked for (--eager); absent before plans counted CUDA graphs
    blocks: list[int] | None = allowed(ge=_ANY_BLOCK.start, le=_ANY_BLOCK.stop - 1)
    max_ratio: float = allowed(ge=0, lt=1)
    max_batch_size: int = allowed(ge=1)


@dataclass(kw_only=True)
class _BackboneSection:
    """plan.backbone: the input backbone's ``BackboneSpec``, less ``hidden`` (block -> channels)."""

    arch: str = archs.DEFAULT_ARCH  # a registered architecture (checked by BackboneSpec after parsing)
    width: float = allowed(gt=0, le=MAX_WIDTH)
    num_classes: int = allowed(ge=1, le=MAX_CLASSES)
    dropout: float = allowed(0.2, ge=0, le=1)


@dataclass(kw_only=True)
class _TopSection:
    """The plan's own values (its sections are parsed apart)."""

    format: str
    objective: str = OBJECTIVE
    resolution: int = allowed(ge=1)
    num_classes: int = allowed(ge=1, le=MAX_CLASSES)
    notes: list[str] | None = None


@dataclass(kw_only=True)
class _PredictedSection:
    """plan.predicted, less ``breakdown`` (part -> bytes)."""

    total_bytes: int = allowed(ge=0)


@dataclass(kw_only=True)
class _VerifySection:
    measured_bytes: int = allowed(ge=0)
    steps: int = allowed(ge=1)


@dataclass(kw_only=True)
class _SearchSection:
    evaluations: int = allowed(0, ge=0)
    graph_replays: int = allowed(0, ge=0)  # absent before plans counted CUDA graphs
    seconds: float = allowed(0.0, ge=0)


@dataclass(kw_only=True)
class _CudaGraphSection:
    """plan.cuda_graph: the chosen step captured as CUDA graphs on the plan's device."""

    capability: list[int] = allowed(ge=0, le=99)
    extra_bytes: int = allowed(ge=0)
    total_bytes: int = allowed(ge=0)


@dataclass(kw_only=True)
class _CandidateSection:
    predicted_bytes: int = allowed(ge=0)
    fits: bool
    why: str = ""


def _section(schema, data, where: str, maps: dict[str, bool] | None = None):
    """``data`` read as the section ``schema`` by the recipe's machinery (``edgetl.schema``):
    unknown keys refused with a close match, missing required values refused, every value of
    its type (an integer is no float, a boolean no string or number) and in its range; one
    ConfigError line naming the key. ``maps`` names the keys that hold mappings to integers
    (True: keyed by block number), returned beside the section."""
    maps = maps or {}
    _check_keys(data, {f.name for f in dataclasses.fields(schema)} | set(maps), where)
    missing = [key for key in maps if key not in data]
    if missing:
        raise ConfigError(f"{where}: missing required value {missing[0]} (a mapping)")
    section = build(schema, {k: v for k, v in data.items() if k not in maps}, "", where)
    check_fields(section, where)
    return section, {key: _int_map(data[key], f"{where}.{key}", blocks) for key, blocks in maps.items()}


def _int_map(data, where: str, blocks: bool) -> dict:
    """A mapping of names (``blocks``: block numbers, JSON's "3" as YAML's 3) to integers >= 0."""
    if data is None and not blocks:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is {show(data)}; allowed: a mapping of "
                          f"{'block numbers' if blocks else 'names'} to integers")
    out = {}
    for key, value in data.items():
        name = key
        if blocks:
            number = key if isinstance(key, int) and not isinstance(key, bool) else (
                int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None)
            if number not in _ANY_BLOCK:
                raise ConfigError(f"{where}: key {show(key)} is not a block that can be pruned; allowed: "
                                  f"{_ANY_BLOCK.start}..{_ANY_BLOCK.stop - 1}")
            name = number
        elif not isinstance(key, str):
            raise ConfigError(f"{where}: key {show(key)} is not a name; allowed: a string")
        if name in out:
            raise ConfigError(f"{where}: block {name} is named twice ({show(key)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}.{key}: {show(value)} is not allowed; allowed: an integer >= 0")
        out[name] = value
    return out



def _check_keys(data, allowed: set[str], where: str, required: set[str] = frozenset()) -> None:
    """Refuse a section that is no mapping, a key it does not have (with a close match) and a
    missing ``required`` key; ``_section`` checks the values."""
    import difflib

    if not isinstance(data, dict):
        raise ConfigError(f"{where} is {show(data)}; allowed: a mapping of keys to values")
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1) if len(str(key)) < 100 else []
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(sorted(allowed))}"
            raise ConfigError(f"{where}: unknown key {show(key)}{hint}")
    missing = sorted(set(required) - set(data))
    if missing:
        raise ConfigError(f"{where}: missing required value {missing[0]}")
