"""The options of a fine-tuning run, declared once: what each may be, which combinations hold,
which apply to which mode and runtime, and the command-line flags that set them.

``LeanOptions`` is how the lean runtime stores things; ``edgetl.models.side.make_lean``
builds a network from one. The recipe's model section (``edgetl.recipe.ModelConfig``) is a
LeanOptions with what trains added, a plan's chosen configuration gives one
(``edgetl.plan.PlanConfig.lean``), and ``edgetl profile`` / ``edgetl finetune`` generate
their flags from its fields (``add_option_flags``). So a recipe, a plan, a flag and Python
code are checked by the same rules and refused with the same one-line message naming the
value and what is allowed.

A rule that depends on the network or the device (the activation dtype's kernels, a side
network's image pool) is checked where the network is built; every rule about the options
themselves is here.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from edgetl.errors import ConfigError
from edgetl.schema import allowed, check_fields, show

# What trains (edgetl.models.side.set_trainable)
MODES = ("full", "last", "bias", "bn+last", "repnet", "repnet+bias")
# lean: edgetl's lean layers; stock: torch modules; auto: lean wherever the mode allows, except full
RUNTIMES = ("auto", "lean", "stock")
# Modes the lean runtime runs: with a frozen backbone whose BN it folds, or (full) with every
# conv training and BN folded (edgetl.models.lean_full); BN scales that train (bn+last) need
# the stock modules.
LEAN_MODES = ("repnet", "repnet+bias", "last", "bias", "full")
# Modes ``auto`` runs on stock modules although the lean runtime can run them: stock full
# fine-tuning trains BN (batch statistics, gammas), lean full folds it; a different method.
AUTO_STOCK_MODES = ("full",)

POOLS = (1, 2, 4)  # side-network storage: average-pooled by k (edgetl.models.lean.PooledConv2d)
BN_MODES = ("fold", "batch")
PRECISIONS = ("fp32", "bf16", "fp16")  # activation dtypes of the frozen backbone
FROZEN_WEIGHTS = ("fp32", "fp16", "int8")
# ReLU masks by torch's ops, or by edgetl's compiled kernels (edgetl.models.lean.fused)
MASK_KERNELS = ("aten", "fused")
CONV_STORAGES = ("exact", "pool2", "pool4")  # lean full fine-tuning: a conv's input, exact or pooled
COMPRESSORS = ("haar", "db3", "dct", "threshold")  # edgetl.models.compress
STORAGES = (*CONV_STORAGES, *COMPRESSORS)
MAX_BATCH = 2**16  # images per step per process (edgetl.recipe); a micro-batch is at most a batch
# Options lean full fine-tuning cannot change: its convs train in fp32 with BN folded, and
# nothing is frozen to stream or quantise
FULL_FIXED = {"bn": "fold", "precision": "fp32", "frozen_weights": "fp32", "stream": 0}


def option(default: Any, help: str, *, metavar: str | None = None, **bounds) -> Any:
    """A field of an options schema: its default, the values it allows (``allowed``) and the
    help its command-line flag shows."""
    f = allowed(default, **bounds)
    return dataclasses.field(default=default, metadata={**f.metadata, "help": help, "metavar": metavar})


def option_default(name: str, default: Any) -> Any:
    """LeanOptions' field ``name`` (its rules and help) with another default, for a schema
    that extends LeanOptions (the recipe stores exactly unless asked)."""
    f = next(f for f in dataclasses.fields(LeanOptions) if f.name == name)
    return dataclasses.field(default=default, metadata=f.metadata)


@dataclass(kw_only=True)
class LeanOptions:
    """How the lean runtime stores things. Every field is checked when the object is made
    (``check``); a refusal is one ConfigError line naming the field, the value and what is
    allowed."""

    pool: int = option(2, "side-network activations stored average-pooled by k (1 = exact; maps that would "
                          "pool below 4x4 cells pool less or not at all)", choices=POOLS)
    bn: Literal[BN_MODES] = option("fold", "frozen backbone BN: folded into the convs (eval statistics), or "
                                           "batch statistics")
    frozen_weights: Literal[FROZEN_WEIGHTS] = option("fp32", "storage of frozen backbone weights")
    precision: Literal[PRECISIONS] = option("fp32", "activation dtype of the frozen backbone")
    stream: int = option(0, "run the frozen backbone's segments on micro-batches of M samples, forward and "
                            "backward (same results, less memory; needs bn fold); 0: off",
                         metavar="M", ge=0, le=MAX_BATCH)
    storage: str = option("exact", "lean full fine-tuning (mode full, runtime lean): what each backbone conv "
                                   "keeps for its weight gradient: its input exact, pooled by 2 or 4, or "
                                   "compressed (haar, db3, dct, threshold; keeping `keep` of each map's "
                                   "coefficients)", choices=STORAGES)
    keep: float = option(0.1, "share of each map's coefficients a compressor storage keeps, in (0, 1]",
                         metavar="FRACTION", gt=0, le=1)
    uint8_input: bool = option(False, "keep the batch as uint8 pixels and normalise inside the network, "
                                      "micro-batch by micro-batch where it streams (same values, 1 byte a value)")
    recompute: bool = option(False, "with stream: segments whose saved masks outweigh their input keep the "
                                    "input and run forward again in backward, where that lowers the peak "
                                    "(same results, one more forward of those blocks)")
    channels_last: bool = option(False, "run the network channels-last (NHWC in memory), the batch converted "
                                        "where it reaches the device: faster convolution kernels on CPU, the "
                                        "same memory, results equal to rounding")
    mask_kernels: Literal[MASK_KERNELS] = option("aten", "how the lean layers pack their ReLU masks forward and "
                                                         "apply them backward: aten (torch's ops, any device) or "
                                                         "fused (one compiled kernel each way, built on first use "
                                                         "with g++ and ninja, and nvcc for a GPU; the same "
                                                         "results, fewer ops, no more memory)")

    def __post_init__(self) -> None:
        self.check("")

    def check(self, where: str) -> None:
        """Each field's type and range, then the rules across fields. ``where`` prefixes the
        names a refusal shows ("model": ``model.stream``)."""
        check_fields(self, where)
        key = (lambda name: f"{where}.{name}") if where else (lambda name: name)
        if self.recompute and not self.stream:
            raise ConfigError(f"{key('recompute')} needs {key('stream')} >= 1 (it applies to streamed segments)")
        if self.stream and self.bn != "fold":
            raise ConfigError(f"{key('stream')}: {self.stream} needs {key('bn')} fold (got {self.bn}): "
                              "with batch statistics the samples of a batch depend on each other")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(LeanOptions))

    @classmethod
    def of(cls, source: Any) -> "LeanOptions":
        """The lean options held by ``source``, anything with an attribute per option (a
        recipe's model section, parsed flags)."""
        return cls(**{name: getattr(source, name) for name in cls.names()})

    def given(self, defaults: "LeanOptions") -> dict[str, object]:
        """The options set to something other than ``defaults`` (what the caller asked for)."""
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) != getattr(defaults, name)}

    def for_mode(self, mode: str, runtime: str, *, defaults: "LeanOptions", prefix: str = "",
                 stock_honours: tuple[str, ...] = ()) -> "LeanOptions | None":
        """The options mode ``mode`` runs with on ``runtime`` (None: stock modules), after
        refusing, in one line, every option it would ignore or cannot honour: lean options on
        stock modules, storage and keep outside lean full fine-tuning (keep: outside a
        compressor storage), pool without a side network, and what lean full fine-tuning
        fixes (``FULL_FIXED``, the float batch). ``defaults`` says what counts as asked for;
        ``prefix`` names where options live ("model."); ``stock_honours``, the options the
        caller's stock path honours (a recipe's: precision by autocast, bn)."""
        given = self.given(defaults)
        if resolve_runtime(mode, runtime) == "stock":
            given = {k: v for k, v in given.items() if k not in stock_honours}
            if given:
                name, value = next(iter(given.items()))
                raise ConfigError(f"{prefix}{name} {value} does not apply to mode {mode} on stock modules: it "
                                  f"needs the lean runtime ({prefix}runtime lean; modes {', '.join(LEAN_MODES)})")
            return None
        needs = {}
        if mode != "full":
            needs.update({k: "mode full (lean full fine-tuning)" for k in ("storage", "keep")})
        elif self.storage not in COMPRESSORS:
            needs["keep"] = f"a compressor storage ({', '.join(COMPRESSORS)})"
        if "repnet" not in mode:
            needs["pool"] = "a Rep-Net mode (repnet, repnet+bias): it pools the side network's activations"
        for name, value in given.items():
            if name in needs:
                raise ConfigError(f"{prefix}{name} {value} does not apply to mode {mode}: it needs {needs[name]}")
        self.check_backbone(trains_convs=mode == "full", prefix=prefix)
        return self

    def check_backbone(self, *, trains_convs: bool, prefix: str = "") -> None:
        """Refuse what the backbone cannot do: lean full fine-tuning (its convs train) fixes
        ``FULL_FIXED`` and takes the float batch; a frozen backbone keeps each conv's input
        as nothing, so a conv storage other than exact has nothing to store."""
        if trains_convs:
            if self.channels_last:
                raise ConfigError(f"{prefix}channels_last is for a frozen lean backbone; lean full fine-tuning "
                                  "(mode full) runs its convs plain (allowed: channels_last off with mode full)")
            if self.uint8_input:
                raise ConfigError("uint8 input is for a frozen lean backbone; lean full fine-tuning takes "
                                  "the float batch (allowed: uint8_input off with mode full)")
            check_full_options("lean full fine-tuning", prefix=prefix,
                               **{name: getattr(self, name) for name in FULL_FIXED})
        elif self.storage != "exact":
            raise ConfigError(f"{prefix}storage {self.storage} applies to mode full, whose backbone convs train; "
                              "allowed here: exact (the side network stores by pool)")


def check_full_options(context: str, prefix: str = "", **given) -> None:
    """Raise a one-line ConfigError for an option of ``FULL_FIXED`` given another value
    (None: not given). ``context`` names the caller, e.g. "mode full"."""
    for name, value in given.items():
        fixed = FULL_FIXED[name]
        if value is not None and value != fixed:
            raise ConfigError(f"{prefix}{name} {value} is not allowed with {context} (its convs train in fp32 with "
                              f"BN folded, nothing frozen); allowed: {fixed}")


def resolve_runtime(mode: str, runtime: str) -> str:
    """"lean" or "stock": ``auto`` is lean wherever the mode allows it, except for full
    fine-tuning (``AUTO_STOCK_MODES``), whose stock form trains BN."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; allowed: {', '.join(RUNTIMES)}")
    if runtime == "auto":
        return "lean" if mode in LEAN_MODES and mode not in AUTO_STOCK_MODES else "stock"
    if runtime == "lean" and mode not in LEAN_MODES:
        raise ConfigError(
            f"mode {mode} trains backbone convs or BN scales; the lean runtime allows "
            f"{', '.join(LEAN_MODES)}; use --runtime stock"
        )
    return runtime


# --- command-line flags ------------------------------------------------------------------


def _flag_value(tp) -> Any:
    """An argparse ``type`` reading the text as the field's type; the range is the schema's."""
    def read(text: str):
        try:
            return tp(text)
        except ValueError:
            kind = "an integer" if tp is int else "a number"
            raise argparse.ArgumentTypeError(f"{show(text)} is not {kind}") from None
    read.__name__ = tp.__name__
    return read


def add_option_flags(parser, *, defaults: LeanOptions | None, key_prefix: str = "") -> None:
    """One flag per LeanOptions field (``--frozen-weights`` for ``frozen_weights``), with its
    choices and help from the field. ``defaults`` None leaves every flag None when not
    given (the recipe's value stands); otherwise each flag defaults to its field there.
    ``key_prefix`` ("model.") is shown before the help, naming the recipe key it sets."""
    hints = typing.get_type_hints(LeanOptions)
    for f in dataclasses.fields(LeanOptions):
        flag = "--" + f.name.replace("_", "-")
        default = None if defaults is None else getattr(defaults, f.name)
        text = f"{key_prefix}{f.name}: {f.metadata['help']}" if key_prefix else f.metadata["help"]
        tp = hints[f.name]
        if tp is bool:
            parser.add_argument(flag, action="store_true", default=default, help=text)
            continue
        kw: dict[str, Any] = {"default": default, "help": text}
        if typing.get_origin(tp) is Literal:
            kw["choices"] = typing.get_args(tp)
        else:
            rule = f.metadata["allowed"]
            if rule.choices:
                kw["choices"] = rule.choices
            if tp is not str:
                kw["type"] = _flag_value(tp)
            if f.metadata.get("metavar"):
                kw["metavar"] = f.metadata["metavar"]
        parser.add_argument(flag, **kw)

