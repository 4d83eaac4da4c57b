"""Plan stage: a memory budget and a device in, a Plan (pruning, pooling, precision, batch) out.

Deciding is apart from doing: ``plan`` only calls the runtime accounting (DESIGN 2b) on
meta networks and returns a :class:`Plan`; ``edgetl prune --plan`` and ``edgetl finetune
--plan`` act on it; ``verify_plan`` builds the planned network and measures real training
steps (DESIGN 2c).

Objective: fit the budget while removing as few hidden channels as possible, then prefer
a smaller pooling factor k, then a larger batch. Every candidate lies on one fixed *path*
from the exact configuration to the most memory-saving one, each step degrading one
dimension and never undoing another:

1. storage and the step, cheapest accuracy per byte saved first (``storage_ladder``,
   measured in ``benchmarks/levers_accuracy.md``): the frozen backbone streamed by 1 (with
   the batch kept as uint8 pixels), then recomputed in backward, fused optimizer kernels,
   the update inside backward, frozen weights fp32 -> fp16 -> int8, activations
   fp32 -> half (fp16 where this machine's convolutions run it, else bf16), side pooling
   k 1 -> 2 -> 4 (dimensions the caller fixes are skipped, and a k whose side convs would
   store exactly as the smaller k's, small maps pooling less);
2. pruning, at the most saving storage: the per-image peak of every sensitive block above
   a cap T is lowered to T (the paper's rule: prune the blocks that set the peak, just
   enough), T falling one channel at a time, and finally every candidate block at
   ``max_ratio``;
3. with ``batch_size="auto"`` the path starts at batch 1 and, once the exact
   configuration fits, the batch grows up to ``max_batch_size``.

The plan is the least degraded path element whose predicted peak fits, less the
optimizer's levers (and recomputing) it fits without, at the largest micro-batch that fits
where it streams. Because the path is fixed and each dimension only degrades along it, a
larger budget never prunes more, never pools coarser and never shrinks the batch. The predicted peak falls along the path
(every step shrinks tensors), so the boundary is found by bracketing: a model (peak
linear in the cap T) guesses, real accounting decides. A block's kept channels follow a
linear model of its per-image peak between unpruned and ``max_ratio``; it only shapes the
path, the fit is always checked with ``runtime_report``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from edgetl.errors import BudgetError, ConfigError, DataError
from edgetl.units import MB
from edgetl.models.backbone import BackboneSpec, build_backbone, hidden_channels, prunable_blocks

log = logging.getLogger(__name__)

PLAN_FORMAT = "edgetl-plan/1"
MODE = "repnet"  # the default planned mode: Rep-Net on a frozen lean backbone
# Modes a plan can be made for (issue #16 item 4): Rep-Net (pruning, pooling, storage, streaming),
# bias-only TinyTL-B (streaming, frozen-weight and activation storage) and lean full fine-tuning
# (each conv's stored input: exact, then pooled by 2, then by 4).
PLAN_MODES = ("repnet", "bias", "full")
CONV_STORAGES = ("exact", "pool2", "pool4")  # lean full fine-tuning's ladder, exact first
OPTIMIZER = "adam"  # the plan's step: edgetl.step.Step.plain(OPTIMIZER) (plan_step)
POOLS = (1, 2, 4)
PRECISIONS = ("fp32", "bf16", "fp16")
HALF_DTYPES = ("fp16", "bf16")  # "half" activations, preferred first (half_precision)
FROZEN_WEIGHTS = ("fp32", "fp16", "int8")
BUDGET_SCOPES = ("tensors", "process")
MAX_RATIO = 0.9
MAX_BATCH_SIZE = 256
VERIFY_TOLERANCE = 0.05
OBJECTIVE = ("fit the budget removing as few hidden channels as possible, then prefer a smaller "
             "pooling k, then a larger batch; storage savings (frozen fp16, int8 frozen weights, "
             "half activations) before pooling, pooling before pruning")


# ----------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class DevicePreset:
    """What a device adds around the training tensors.

    Attributes:
        name: preset name.
        memory_bytes: device memory (shared by CPU and GPU on Jetson); None if unknown.
        cuda_context_bytes: CUDA context of a torch process (DESIGN 2c: ~300 MB on Jetson).
        allocator_slack: extra the caching allocator reserves beyond live tensors
            (segment rounding, fragmentation), as a fraction of the tensor peak; an assumption
            to replace by ``max_memory_reserved / max_memory_allocated`` measured on the device.
        os_share: share of the device memory the OS, desktop and page cache keep
            (edgetl.doctor keeps 25 % of MemAvailable free).
    """

    name: str
    memory_bytes: int | None = None
    cuda_context_bytes: int = 0
    allocator_slack: float = 0.0
    os_share: float = 0.0

    def overheads(self, tensor_bytes: int) -> dict[str, int]:
        """Process memory beyond ``tensor_bytes`` of live tensors, one line per cause."""
        lines = {}
        if self.cuda_context_bytes:
            lines["CUDA context"] = self.cuda_context_bytes
        if self.allocator_slack:
            lines[f"allocator slack ({self.allocator_slack:.0%} of tensors)"] = int(
                math.ceil(tensor_bytes * self.allocator_slack))
        return lines

    def process_limit_bytes(self) -> int | None:
        """What the device leaves for one process once the OS share is kept free."""
        if self.memory_bytes is None:
            return None
        return int(self.memory_bytes * (1 - self.os_share))

    def tensor_budget(self, process_bytes: int) -> int:
        """Largest tensor peak whose process total (tensors + overheads) is <= ``process_bytes``."""
        room = process_bytes - self.cuda_context_bytes
        return max(0, int(room / (1 + self.allocator_slack)))


def _doctor_constants() -> tuple[int, float]:
    from edgetl.doctor import BUDGET_HEADROOM, CUDA_CONTEXT_BYTES

    return CUDA_CONTEXT_BYTES, BUDGET_HEADROOM


_CTX, _HEADROOM = _doctor_constants()
DEVICES = {
    "none": DevicePreset("none"),
    "orin-nano-8gb": DevicePreset("orin-nano-8gb", 8 * 2**30, _CTX, 0.10, _HEADROOM),
    "orin-nano-4gb": DevicePreset("orin-nano-4gb", 4 * 2**30, _CTX, 0.10, _HEADROOM),
}


def device_preset(name: str) -> DevicePreset:
    if name not in DEVICES:
        raise ConfigError(f"unknown device {name!r}; allowed: {', '.join(DEVICES)}")
    return DEVICES[name]


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Storage:
    pool: int
    precision: str
    frozen_weights: str
    stream: int = 0  # micro-batch of the streamed frozen backbone; 0: not streamed
    conv_storage: str = "exact"  # lean full fine-tuning: what each trained conv keeps (LeanOptions.storage)
    recompute: bool = False  # streamed segments may run forward again in backward (LeanOptions.recompute)
    fused: bool = False  # the optimizer runs fused kernels (optim.fused)
    step_in_backward: bool = False  # each parameter is updated inside backward (optim.step_in_backward)

    @property
    def uint8_input(self) -> bool:
        """A streamed plan keeps the batch as uint8 pixels until each micro-batch needs them:
        the same values, 1 byte a value (``LeanOptions.uint8_input``)."""
        return self.stream > 0


@dataclass
class PlanConfig:
    """One configuration: which hidden channels to keep, how to store, what batch.

    Attributes:
        kept: pruned block -> kept hidden channels (only blocks this plan prunes).
        channels: pruned block -> hidden channels of the input backbone.
        pool, precision, frozen_weights: lean runtime options (DESIGN 4); BN is folded.
        batch_size: images per training step.
        stream: micro-batch of the streamed frozen backbone (``edgetl.models.stream``); 0: none.
        mode: the fine-tuning mode planned (``PLAN_MODES``).
        conv_storage: mode full: what each trained conv keeps for its weight gradient.
        recompute: streamed segments may keep their input and run forward again in
            backward where that lowers the peak (``LeanOptions.recompute``).
        fused: the step's optimizer runs fused kernels (recipe ``optim.fused``).
        step_in_backward: the step updates each parameter inside backward and frees its
            gradient at once (recipe ``optim.step_in_backward``).
    """

    kept: dict[int, int]
    channels: dict[int, int]
    pool: int
    precision: str
    frozen_weights: str
    batch_size: int
    stream: int = 0
    mode: str = MODE
    conv_storage: str = "exact"
    recompute: bool = False
    fused: bool = False
    step_in_backward: bool = False

    @property
    def blocks(self) -> list[int]:
        return sorted(self.kept)

    @property
    def ratios(self) -> list[float]:
        """Ratios that make ``edgetl prune`` keep exactly ``kept`` (kept = int(C * (1 - r)))."""
        return [ratio_for(self.channels[b], self.kept[b]) for b in self.blocks]

    @property
    def removed_channels(self) -> int:
        return sum(self.channels[b] - self.kept[b] for b in self.kept)

    def describe(self) -> str:
        prune = ", ".join(f"{b}:{self.channels[b]}->{self.kept[b]}" for b in self.blocks) or "none"
        stream = f" | stream {self.stream}" if self.stream else ""
        stream += " (recompute)" if self.recompute else ""
        step = " | fused" if self.fused else ""
        step += " | update in backward" if self.step_in_backward else ""
        if self.mode == "full":
            return f"mode full | storage {self.conv_storage} | batch {self.batch_size}{step}"
        head = "" if self.mode == MODE else f"mode {self.mode} | "
        pool = "" if self.mode != MODE else f" | k={self.pool}"
        return (f"{head}prune {prune}{pool} | act {self.precision} | frozen {self.frozen_weights} "
                f"| batch {self.batch_size}{stream}{step}")

    @property
    def uint8_input(self) -> bool:
        return self.storage.uint8_input

    @property
    def storage(self) -> "Storage":
        return Storage(self.pool, self.precision, self.frozen_weights, self.stream, self.conv_storage,
                       self.recompute, self.fused, self.step_in_backward)

    def to_dict(self) -> dict:
        return {
            "prune": {"blocks": self.blocks, "ratios": self.ratios,
                      "channels": {b: self.channels[b] for b in self.blocks},
                      "kept": {b: self.kept[b] for b in self.blocks}},
            "finetune": {"mode": self.mode, "runtime": "lean", "pool": self.pool, "precision": self.precision,
                         "frozen_weights": self.frozen_weights, "bn": "fold",
                         "batch_size": self.batch_size, "stream": self.stream,
                         "uint8_input": self.uint8_input, "recompute": self.recompute,
                         "storage": self.conv_storage, "fused": self.fused,
                         "step_in_backward": self.step_in_backward},
        }

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "PlanConfig":
        _check_keys(data, {"prune", "finetune"}, where)
        p, f = data["prune"], data["finetune"]
        _check_keys(p, {"blocks", "ratios", "channels", "kept"}, f"{where}.prune")
        # plans written before streaming stream nothing; before issue #16 every plan was Rep-Net's;
        # before issue #30 no plan changed the optimizer step
        f = {"stream": 0, "runtime": "lean", "storage": "exact", "recompute": False, "fused": False,
             "step_in_backward": False, **f}
        _check_keys(f, {"mode", "runtime", "pool", "precision", "frozen_weights", "bn", "batch_size", "stream",
                        "storage", "recompute", "uint8_input", "fused", "step_in_backward"}
                    - ({"uint8_input"} - set(f)), f"{where}.finetune")
        for key in ("fused", "step_in_backward"):
            if not isinstance(f[key], bool):
                raise ConfigError(f"{where}.finetune.{key}: {f[key]!r}; allowed: true, false")
        kept = {int(b): int(k) for b, k in p["kept"].items()}
        channels = {int(b): int(c) for b, c in p["channels"].items()}
        if sorted(kept) != sorted(channels) or sorted(kept) != [int(b) for b in p["blocks"]]:
            raise ConfigError(f"{where}.prune: blocks, channels and kept name different blocks")
        for b in kept:
            if b not in prunable_blocks() or not 1 <= kept[b] <= channels[b]:
                raise ConfigError(f"{where}.prune: block {b} keeps {kept[b]} of {channels[b]} channels")
        if f["mode"] not in PLAN_MODES or f["bn"] != "fold" or f["runtime"] != "lean":
            raise ConfigError(f"{where}.finetune: mode {f['mode']!r}, bn {f['bn']!r}, runtime {f['runtime']!r}; "
                              f"planned are modes {', '.join(PLAN_MODES)} with bn fold on the lean runtime")
        if f["storage"] not in CONV_STORAGES or (f["storage"] != "exact" and f["mode"] != "full"):
            raise ConfigError(f"{where}.finetune.storage: {f['storage']!r}; allowed: {', '.join(CONV_STORAGES)} "
                              "(mode full), exact (other modes)")
        config = cls(kept, channels, int(f["pool"]), str(f["precision"]), str(f["frozen_weights"]),
                     int(f["batch_size"]), int(f["stream"]), str(f["mode"]), str(f["storage"]),
                     bool(f["recompute"]), f["fused"], f["step_in_backward"])
        if config.recompute and not config.stream:
            raise ConfigError(f"{where}.finetune.recompute: true needs stream >= 1 (it applies to streamed segments)")
        if config.stream < 0:
            raise ConfigError(f"{where}.finetune.stream: {config.stream}; allowed: 0 (off) or >= 1")
        if f.get("uint8_input", config.uint8_input) != config.uint8_input:
            raise ConfigError(f"{where}.finetune.uint8_input: {f['uint8_input']!r}; a plan keeps the batch uint8 "
                              f"exactly when it streams (allowed here: {config.uint8_input})")
        _check_storage(config.pool, config.precision, config.frozen_weights, where)
        if config.batch_size < 1:
            raise ConfigError(f"{where}.finetune.batch_size: {config.batch_size}; allowed: >= 1")
        return config


@dataclass
class Candidate:
    """A configuration the search evaluated, with its predicted peak."""

    config: PlanConfig
    predicted_bytes: int
    fits: bool
    why: str = ""

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "predicted_bytes": self.predicted_bytes,
                "fits": self.fits, "why": self.why}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "Candidate":
        _check_keys(data, {"config", "predicted_bytes", "fits", "why"}, where)
        return cls(PlanConfig.from_dict(data["config"], f"{where}.config"), int(data["predicted_bytes"]),
                   bool(data["fits"]), str(data["why"]))


@dataclass
class Plan:
    """The chosen configuration, its predicted breakdown against the budget, and the runners-up.

    Attributes:
        budget_bytes: the budget as given; ``budget_scope`` says what it covers.
        tensor_budget_bytes: what the training tensors may use (budget less device overheads
            when the scope is "process").
        device: device preset name; ``overheads`` its process lines for the chosen tensors.
        device_process_limit_bytes: device memory less the OS share (None if unknown).
        request: the constraints asked for (batch size or "auto", precision, ...).
        backbone: the input backbone spec (before this plan's pruning).
        chosen: the configuration; ``predicted_bytes`` its runtime-accounting peak and
            ``breakdown`` that peak's parts (runtime_report's breakdown).
        runners_up: other evaluated configurations near the chosen one on the path.
        measured_bytes: filled by ``verify_plan``.
    """

    budget_bytes: int
    budget_scope: str
    tensor_budget_bytes: int
    device: str
    overheads: dict[str, int]
    device_process_limit_bytes: int | None
    resolution: int
    num_classes: int
    request: dict
    backbone: dict
    chosen: PlanConfig
    predicted_bytes: int
    breakdown: dict[str, int]
    runners_up: list[Candidate] = field(default_factory=list)
    objective: str = OBJECTIVE
    evaluations: int = 0
    search_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    measured_bytes: int | None = None
    verify_steps: int | None = None

    @property
    def spec(self) -> BackboneSpec:
        """The backbone spec the plan fine-tunes: the input backbone with the planned pruning."""
        base = BackboneSpec.from_dict(self.backbone)
        return dataclasses.replace(base, num_classes=self.num_classes,
                                   hidden={**base.hidden, **self.chosen.kept})

    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "objective": self.objective,
            "budget": {"budget_bytes": self.budget_bytes, "scope": self.budget_scope,
                       "tensor_budget_bytes": self.tensor_budget_bytes, "device": self.device,
                       "overheads": dict(self.overheads),
                       "device_process_limit_bytes": self.device_process_limit_bytes},
            "resolution": self.resolution,
            "num_classes": self.num_classes,
            "request": dict(self.request),
            "backbone": dict(self.backbone),
            **self.chosen.to_dict(),
            "predicted": {"total_bytes": self.predicted_bytes, "breakdown": dict(self.breakdown)},
            "verify": (None if self.measured_bytes is None else
                       {"measured_bytes": self.measured_bytes, "steps": self.verify_steps}),
            "runners_up": [c.to_dict() for c in self.runners_up],
            "search": {"evaluations": self.evaluations, "seconds": round(self.search_seconds, 2)},
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise DataError(f"not an edgetl plan (format {PLAN_FORMAT})")
        _check_keys(data, {"format", "objective", "budget", "resolution", "num_classes", "request",
                           "backbone", "prune", "finetune", "predicted", "verify", "runners_up",
                           "search", "notes"}, "plan")
        b = data["budget"]
        _check_keys(b, {"budget_bytes", "scope", "tensor_budget_bytes", "device", "overheads",
                        "device_process_limit_bytes"}, "plan.budget")
        chosen = PlanConfig.from_dict({"prune": data["prune"], "finetune": data["finetune"]}, "plan")
        BackboneSpec.from_dict(data["backbone"])  # validates
        verify = data.get("verify") or {}
        search = data.get("search") or {}
        return cls(
            budget_bytes=int(b["budget_bytes"]), budget_scope=str(b["scope"]),
            tensor_budget_bytes=int(b["tensor_budget_bytes"]), device=str(b["device"]),
            overheads={str(k): int(v) for k, v in (b.get("overheads") or {}).items()},
            device_process_limit_bytes=b.get("device_process_limit_bytes"),
            resolution=int(data["resolution"]), num_classes=int(data["num_classes"]),
            request=dict(data["request"]), backbone=dict(data["backbone"]), chosen=chosen,
            predicted_bytes=int(data["predicted"]["total_bytes"]),
            breakdown={str(k): int(v) for k, v in data["predicted"]["breakdown"].items()},
            runners_up=[Candidate.from_dict(c, f"plan.runners_up[{i}]")
                        for i, c in enumerate(data.get("runners_up") or [])],
            objective=str(data.get("objective", OBJECTIVE)),
            evaluations=int(search.get("evaluations", 0)), search_seconds=float(search.get("seconds", 0.0)),
            notes=list(data.get("notes") or []),
            measured_bytes=verify.get("measured_bytes"), verify_steps=verify.get("steps"),
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "Plan":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DataError(f"plan is not valid YAML: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        from edgetl.io import atomic_write_text

        text = self.to_yaml() if str(path).endswith((".yaml", ".yml")) else json.dumps(self.to_dict(), indent=2) + "\n"
        atomic_write_text(path, text)


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``edgetl plan`` (YAML or JSON)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"plan file {path} does not exist")
    try:
        return Plan.from_yaml(path.read_text())
    except (ConfigError, DataError) as exc:
        raise type(exc)(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(f"{path} is not a valid edgetl plan: {type(exc).__name__} {exc}") from None


class PlanImpossible(BudgetError):
    """No configuration fits; ``min_budget_bytes`` (same scope as the budget) would."""

    def __init__(self, message: str, min_budget_bytes: int, config: PlanConfig):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.config = config


def _check_keys(data, allowed: set[str], where: str) -> None:
    import difflib

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping")
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(sorted(allowed))}"
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
    missing = allowed - set(data) - {"why", "verify", "runners_up", "search", "notes", "objective",
                                     "device_process_limit_bytes"}
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(sorted(missing))}")


def _check_storage(pool, precision, frozen_weights, where: str) -> None:
    if pool not in POOLS:
        raise ConfigError(f"{where}: pool {pool} is not allowed; allowed: {', '.join(map(str, POOLS))}")
    if precision not in PRECISIONS:
        raise ConfigError(f"{where}: precision {precision!r} is not allowed; allowed: {', '.join(PRECISIONS)}")
    if frozen_weights not in FROZEN_WEIGHTS:
        raise ConfigError(f"{where}: frozen weights {frozen_weights!r} is not allowed; "
                          f"allowed: {', '.join(FROZEN_WEIGHTS)}")


def ratio_for(channels: int, kept: int) -> float:
    """A ratio r with int(C * (1 - r)) == kept (edgetl.prune.kept_channels)."""
    if kept >= channels:
        return 0.0
    r = round(1 - (kept + 0.5) / channels, 6)
    if int(channels * (1 - r)) != kept:  # pragma: no cover - 0.5 channel margin
        raise RuntimeError(f"no 6-digit ratio keeps {kept} of {channels}")
    return r


# ----------------------------------------------------------------------------- search


def plan_step(storage: Storage | None = None):
    """The training step a plan is made for, predicted and verified: Adam, no weight decay,
    no label smoothing, single-tensor updates (``edgetl.step.Step.plain``), with fused
    kernels and the update inside backward where ``storage`` takes them. No DDP, foreach or
    loss scaling, so the levers never meet what ``Step`` refuses them with. finetune's
    pre-flight predicts the recipe's own step again before training."""
    from edgetl.step import Step

    if storage is None:
        return Step.plain(OPTIMIZER)
    return Step.plain(OPTIMIZER, fused=storage.fused, step_in_backward=storage.step_in_backward)


def half_precision() -> str:
    """The dtype of "half" activations: fp16 where this machine's CPU runs fp16 convolutions, else bf16.

    Both store 2 bytes an element and cost no measured accuracy, but fp16 keeps 10 mantissa
    bits to bf16's 7: one batch's side-network gradient has cosine 0.956 (at initialisation)
    and 0.979 (after fine-tuning) to the fp32 one with fp16 activations, 0.812 and 0.880
    with bf16 (``benchmarks/levers_accuracy.md``, gradient check). fp16's narrow range
    needs no loss scaling there: scaling the loss by 1024 leaves that cosine unchanged
    (0.956, 0.979). The probe is the CPU's because ``--verify`` measures there; Orin
    (sm_87) runs both dtypes. Where the CPU lacks fp16 convolutions (older torch builds),
    bf16 is planned and the plan says so in its notes.
    """
    return _half_precision_probe()


@functools.lru_cache(maxsize=1)
def _half_precision_probe() -> str:
    import torch

    from edgetl.errors import CapabilityError
    from edgetl.models.lean import check_act_dtype

    try:
        check_act_dtype(torch.float16, "cpu")
    except CapabilityError:
        return HALF_DTYPES[1]
    return HALF_DTYPES[0]


def storage_ladder(*, pool: int | None = None, precision: str | None = None,
                   frozen_weights: str | None = None,
                   stored_pools: Callable[[int], list[int]] | None = None,
                   half: str | None = None, stream: int | None = None, mode: str = MODE,
                   fused: bool | None = None, step_in_backward: bool | None = None) -> list[Storage]:
    """Storage and step options from exact to most saving; a fixed dimension never changes.

    Rep-Net (``mode`` "repnet") as below; bias-only TinyTL-B the same without pooling (it
    has no side network); lean full fine-tuning trains every conv in fp32 with nothing
    frozen to stream or quantise, so its levers are the optimizer's two (below), then what
    each conv keeps for its weight gradient: exact, then pooled by 2, then by 4
    (``CONV_STORAGES``; the compressors store about as little as pool4 at 224 px and are
    left to the user, ``--storage``).

    Streaming by 1 (the batch kept as uint8 pixels) and recomputing streamed segments come
    first (issue #14): the same gradients up to the rounding of the frozen backbone's convs
    run on fewer samples (recomputing: bit for bit); they cost speed only. The optimizer's
    levers come next, fused kernels, then the update inside backward:

    * fused kernels (``optim.fused``) allocate nothing beyond the optimizer state and launch
      fewer kernels, but round every update of the trained weights differently (within 2e-4
      of the unfused weights after 3 steps at lr 1e-2, README "Step in backward"): after
      streaming, which only regroups the frozen backbone's arithmetic, and far below
      rounding every frozen weight to fp16's 11 bits, so before the frozen-weight levers.
    * the update inside backward (``optim.step_in_backward``) gives the same weights bit for
      bit and frees each gradient as soon as its parameter is updated, yet comes after fused
      kernels: without them each update's temporaries (single-tensor Adam: two copies of the
      parameter) land during backward, beside live activations, and can raise the peak
      (stock Rep-Net on MobileNetV2 0.35, 64 px, batch 4: 10.80 -> 11.72 MB), which the
      bisection below cannot have; with them the update allocates nothing, so freeing
      gradients early only lowers it. So it is a rung only where fused kernels are on or
      searched. It rules out DDP, foreach and fp16 loss scaling (``edgetl.step``); the
      planned step has none of them.

    ``plan`` drops either lever again where the chosen configuration fits without it
    (``_fewest_optimizer_levers``): past the levers, e.g. when pruning, the peak may be a
    forward temporary they do not touch.

    The storage levers after them go in the order of the measured accuracy cost per byte
    saved, cheapest first (``benchmarks/levers_accuracy.md``: Rep-Net fine-tuning on
    Fashion-MNIST, 3 seeds; MB saved by the runtime accounting at 224 px, batch 8; points
    lost per MB saved, negative = no measured loss):

    1. frozen weights fp16 (-1.14 points/MB, 0.76 MB saved), then 2. int8 (-0.81, 1.12 MB):
       both fine-tuned +0.9 points above fp32, within the baseline seeds' 2.2-point spread;
       they perturb only the frozen weights, not the stored activations or the gradients.
    3. half activations (``half``; default ``half_precision()``, fp16 where it runs): fp16
       -0.04, bf16 -0.00 points/MB for 16 MB saved, again no measured loss, but they round
       every stored activation and the backward through it (one batch's side-gradient
       cosine to fp32: fp16 0.96-0.98, bf16 0.81-0.88), so they come after the frozen-weight
       savings although they save far more.
    4. pooling k 2, then 4, last: it approximates the side convs' weight gradients and its
       cost is not resolved (at 64 px k=2 and k=4 store alike, and at 64 px and at 224 px,
       batch 8, the unpruned network's peak, a forward temporary, does not move).

    All of these Δ are within seed noise, so the points per MB mostly rank by bytes saved;
    the order of 1-2 before 3 before 4 also follows what each lever perturbs.

    Pruning is not a storage option; the plan prunes only past the ladder's end (without
    retraining it costs 2.5 points in the study, the one resolved loss).

    ``stored_pools(k)``, when given, says how the side convs really store their inputs for
    a requested k (small maps pool less, ``edgetl.models.lean.effective_pool``); a k that
    stores exactly as the smaller one before it is no step: it would save nothing, and the
    objective prefers the smaller k.

    ``plan`` bisects the ladder, so the predicted total must not rise along it. With fp32
    activations int8 frozen weights always hold less than fp16 ones (same fp32 dequantised
    copy), and at 224 px every dtype step saves (``tests/test_plan.py``, batch 8). It does
    not hold everywhere, in this order or the previous one (fp16, half, int8): at batch 1-4
    on small inputs (64-96 px) the int8 dequantisation buffer with half activations (an
    fp32 copy of a layer's weight plus its half cast) can outweigh what half activations
    save, and half+int8 then predicts more than a step before it.
    """
    def optimizer_steps() -> None:
        if fused is None:
            step(fused=True)
        if step_in_backward is None and fused is not False:
            step(step_in_backward=True)

    def step(**change):
        ladder.append(dataclasses.replace(ladder[-1], **change))

    first_step = dict(fused=bool(fused), step_in_backward=bool(step_in_backward))
    if mode == "full":
        ladder = [Storage(1, "fp32", "fp32", 0, CONV_STORAGES[0], **first_step)]
        optimizer_steps()
        for s in CONV_STORAGES[1:]:
            step(conv_storage=s)
        return ladder
    if mode != MODE:
        pool = 1
    if half is None:
        half = half_precision()
    if half not in HALF_DTYPES:
        raise ConfigError(f"half precision {half!r} is not allowed; allowed: {', '.join(HALF_DTYPES)}")
    p = 1 if pool is None else pool
    a = "fp32" if precision is None else precision
    w = "fp32" if frozen_weights is None else frozen_weights
    ladder = [Storage(p, a, w, stream or 0, **first_step)]

    if stream is None:  # streaming first: it costs no accuracy (issue #14), only speed
        step(stream=1)
        step(recompute=True)  # then forward again in backward where masks outweigh inputs
    optimizer_steps()  # then the optimizer's levers: see above for their order

    if frozen_weights is None:
        step(frozen_weights="fp16")
        step(frozen_weights="int8")
    if precision is None:
        step(precision=half)
    if pool is None:
        for k in (2, 4):
            if stored_pools is None or stored_pools(k) != stored_pools(ladder[-1].pool):
                step(pool=k)
    return ladder


def _stored_pools_of(spec: BackboneSpec, resolution: int) -> Callable[[int], list[int]]:
    """k -> the factor each side conv of ``spec`` stores its input with at ``resolution``."""
    from edgetl.models.lean import effective_pool
    from edgetl.models.lean_side import side_conv_sizes
    from edgetl.models.side import build_network

    sizes = side_conv_sizes(build_network(spec, MODE, device="meta"), resolution)
    return lambda k: [effective_pool(k, hw) for hw in sizes]


def lean_options(storage: Storage):
    """The lean runtime options of a planned storage (BN folded)."""
    from edgetl.models.side import LeanOptions

    return LeanOptions(pool=storage.pool, bn="fold", frozen_weights=storage.frozen_weights,
                       precision=storage.precision, stream=storage.stream, storage=storage.conv_storage,
                       uint8_input=storage.uint8_input, recompute=storage.recompute)


def _network_key(storage: Storage) -> Storage:
    """What of a storage builds the network: the optimizer's levers change only the step."""
    return dataclasses.replace(storage, fused=False, step_in_backward=False)


class _Evaluator:
    """runtime_report of a configuration, cached per configuration (meta networks)."""

    def __init__(self, base: BackboneSpec, resolution: int, mode: str = MODE):
        self.base, self.resolution, self.mode = base, resolution, mode
        self.reports: dict[tuple, object] = {}
        self.nets: dict[tuple, object] = {}
        self.count = 0

    def report(self, kept: dict[int, int], storage: Storage, batch: int):
        from edgetl.memory.schedule import predict_step
        from edgetl.models.side import build_network

        if storage.stream >= batch:  # streams nothing (so no uint8 batch): as ``plan``'s config runs it
            storage = dataclasses.replace(storage, stream=0, recompute=False)
        key = (tuple(sorted(kept.items())), storage, batch)
        if key not in self.reports:
            # predict_step fits and applies the schedule of this step each time: a network
            # serves every step
            net_key = (key[0], _network_key(storage))
            if net_key not in self.nets:
                spec = dataclasses.replace(self.base, hidden={**self.base.hidden, **kept})
                self.nets[net_key] = build_network(spec, self.mode, device="meta", lean=lean_options(storage))
            net = self.nets[net_key]
            self.reports[key] = predict_step(net, mode=self.mode, resolution=self.resolution, batch_size=batch,
                                             step=plan_step(storage))
            self.count += 1
            log.debug("evaluated %s %s batch %d: %d bytes", kept, storage, batch,
                      self.reports[key].total_bytes)
        return self.reports[key]

    def total(self, kept, storage, batch) -> int:
        return self.report(kept, storage, batch).total_bytes


def _unit_peak(report, block: int) -> int:
    """Per-image peak of pruning unit ``block`` (block 1 shares its channels with the stem)."""
    blocks = (0, 1) if block == 1 else (block,)
    return max(report.block(i).peak_bytes for i in blocks)


class _PruningPath:
    """Kept-channel vectors from no pruning (level 0) to every candidate at its floor (last).

    Level i > 0 caps every candidate unit's modelled per-image peak at ``caps[i]``; the
    model is linear in the kept count between the unpruned and floor reports.
    """

    def __init__(self, channels: dict[int, int], floor: dict[int, int], full_report, floor_report,
                 candidates: list[int]):
        self.channels, self.floor = channels, floor
        fixed = [b.peak_bytes for b in full_report.blocks
                 if not any(b.index in ((0, 1) if u == 1 else (u,)) for u in candidates)]
        self.reach = max(fixed, default=0)  # peak that no pruning of the candidates lowers
        self.model = {}
        for u in candidates:
            hi, lo = _unit_peak(full_report, u), _unit_peak(floor_report, u)
            if hi > lo and channels[u] > floor[u]:
                self.model[u] = (lo, hi)
        breaks = set()
        for u, (lo, hi) in self.model.items():
            c, f = channels[u], floor[u]
            for k in range(f + 1, c + 1):
                t = lo + (k - f) * (hi - lo) / (c - f)  # the cap from which u keeps k channels
                breaks.add(t)  # below ``reach`` too: at batch b the batch-1 reach may not bind
        # a level per cap just below a breakpoint: the unit drops to k - 1 channels
        self.caps = [math.inf] + sorted(breaks, reverse=True)
        self.last = len(self.caps)  # index of the floor element

    def kept(self, level: int) -> dict[int, int]:
        if level >= self.last:
            return dict(self.floor)
        cap = self.caps[level]
        out = {}
        for u, (lo, hi) in self.model.items():
            c, f = self.channels[u], self.floor[u]
            if cap == math.inf:
                k = c
            else:
                # largest k whose breakpoint is strictly below the cap, i.e. below level's own break
                k = f + math.ceil((cap - lo) * (c - f) / (hi - lo) - 1e-9) - 1
                k = min(c, max(f, k))
            if k < c:
                out[u] = k
        return out

    def cap(self, level: int) -> float:
        if level >= self.last:
            return float(self.reach)
        return self.caps[level]


def _resolve_spec(backbone, width: float, num_classes: int) -> BackboneSpec:
    if backbone is None:
        return BackboneSpec(width=width, num_classes=num_classes)
    if isinstance(backbone, BackboneSpec):
        return dataclasses.replace(backbone, num_classes=num_classes, hidden=dict(backbone.hidden))
    from edgetl.models.backbone import backbone_spec

    # a folder, or a weights name: only the architecture matters here (nothing is loaded)
    return dataclasses.replace(backbone_spec(backbone, width=width), num_classes=num_classes)


def _check_budget(budget_bytes, device_preset, budget_scope: str, batch_size, max_batch_size) -> DevicePreset:
    """Refuse an unknown device or scope, or a budget or batch that is no positive integer;
    returns the device preset."""
    preset = device_preset if isinstance(device_preset, DevicePreset) else DEVICES.get(device_preset)
    if preset is None:
        raise ConfigError(f"unknown device {device_preset!r}; allowed: {', '.join(DEVICES)}")
    if budget_scope not in BUDGET_SCOPES:
        raise ConfigError(f"unknown budget scope {budget_scope!r}; allowed: {', '.join(BUDGET_SCOPES)}")
    if not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ConfigError(f"budget {budget_bytes!r} is not allowed; allowed: a positive number of bytes")
    if batch_size != "auto" and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ConfigError(f"batch size {batch_size!r} is not allowed; allowed: an integer >= 1 or 'auto'")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ConfigError(f"max batch size {max_batch_size!r} is not allowed; allowed: an integer >= 1")
    return preset


def _check_levers(*, precision, pool, frozen_weights, stream, max_ratio: float, mode: str, blocks,
                  fused=None, step_in_backward=None) -> None:
    """Refuse fixed levers (storage, streaming, the optimizer's, pruning) that are unknown or
    not planned for ``mode``."""
    _check_storage(1 if pool is None else pool, precision or "fp32", frozen_weights or "fp32", "plan")
    for name, value in (("fused", fused), ("step_in_backward", step_in_backward)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name} {value!r} is not allowed; allowed: True, False or None (searched)")
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool) or stream < 0):
        raise ConfigError(f"stream micro-batch {stream!r} is not allowed; allowed: 0 (never) or an integer >= 1")
    if not 0 <= max_ratio < 1:
        raise ConfigError(f"max ratio {max_ratio} is not allowed; allowed: 0 <= ratio < 1")
    if mode not in PLAN_MODES:
        raise ConfigError(f"mode {mode!r} is not planned; allowed: {', '.join(PLAN_MODES)}")
    if mode == "full":
        from edgetl.models.lean_full import check_full_options

        check_full_options("mode full", precision=precision, frozen_weights=frozen_weights, stream=stream)
    if mode != MODE and pool not in (None, 1):
        raise ConfigError(f"pool {pool} is not allowed with mode {mode} (no side network); allowed: 1")
    if mode != MODE and blocks:
        raise ConfigError(f"pruning blocks {blocks} is planned for mode {MODE} only; mode {mode} plans no pruning")


def _input_backbone(backbone, width: float, num_classes: int, blocks) -> tuple[BackboneSpec, object]:
    """The backbone to plan for, its spec and a meta network (to read its channels);
    refuses ``blocks`` pruning may not touch."""
    base = _resolve_spec(backbone, width, num_classes)
    meta = build_backbone(base, device="meta")
    if blocks is not None:
        from edgetl.prune import check_plan

        check_plan(list(blocks), [0.0] * len(blocks))
    return base, meta


@dataclass
class _Search:
    """The walk along the plan's path (see the module docstring), remembering every candidate.

    Path positions order candidates, larger is less degraded: (stage, index), stage 0
    pruning (index 0 the floor, ``path.last`` no pruning), 1 storage (index from the
    saving end of the ladder), 2 batch (the batch).
    """

    ev: _Evaluator
    ladder: list[Storage]
    chan: dict[int, int]  # channels of every prunable block of the input backbone (ratios are relative to them)
    batch: int  # the path's batch: 1 with batch_size "auto"
    mode: str
    tensor_budget: int
    impossible: Callable[[int, PlanConfig], PlanImpossible]  # (total, most saving config) -> the error
    evaluated: list[tuple[tuple, PlanConfig, int]] = field(default_factory=list)  # (path position, config, total)

    def config(self, kept, storage: Storage, batch: int) -> PlanConfig:
        """The configuration of a path element."""
        stream = storage.stream if storage.stream < batch else 0  # m >= batch streams nothing
        return PlanConfig(dict(kept), {b: self.chan[b] for b in kept}, storage.pool, storage.precision,
                          storage.frozen_weights, batch, stream, self.mode, storage.conv_storage,
                          storage.recompute and stream > 0, storage.fused, storage.step_in_backward)

    def fits(self, total: int) -> bool:
        """Whether a predicted total is within the tensor budget."""
        return total <= self.tensor_budget

    def record(self, pos: tuple, kept, storage: Storage, batch: int) -> int:
        """The predicted total of a candidate, remembered for the runners-up."""
        total = self.ev.total(kept, storage, batch)
        self.evaluated.append((pos, self.config(kept, storage, batch), total))
        return total

    def walk(self, *, auto: bool, max_batch_size: int, blocks, max_ratio: float) -> tuple[PlanConfig, tuple]:
        """The least degraded path element that fits, and its path position."""
        ladder = self.ladder
        saving, exact, top = ladder[-1], ladder[0], len(ladder) - 1
        if self.fits(self.record((1, top), {}, exact, self.batch)):
            return self.grow_batch(auto, max_batch_size)
        if self.fits(total_saving := self.record((1, 0), {}, saving, self.batch)):
            return self.least_degraded_storage()
        if self.mode != MODE:  # only Rep-Net plans prune: the ladder's end was the last chance
            raise self.impossible(total_saving, self.config({}, saving, self.batch))
        return self.prune(total_saving, blocks, max_ratio)

    def grow_batch(self, auto: bool, max_batch_size: int) -> tuple[PlanConfig, tuple]:
        """The exact storage fits: with batch "auto", the largest batch that does."""
        exact, top = self.ladder[0], len(self.ladder) - 1
        chosen = self.config({}, exact, self.batch)
        chosen_pos = (1, top)
        if auto:
            best = _largest_batch(lambda b: self.record((2, b), {}, exact, b), self.tensor_budget,
                                  max_batch_size)
            chosen = self.config({}, exact, best)
            chosen_pos = (2, best)
        return chosen, chosen_pos

    def least_degraded_storage(self) -> tuple[PlanConfig, tuple]:
        """The most saving storage fits: bisect the ladder (totals fall along it)."""
        ladder, top = self.ladder, len(self.ladder) - 1
        good, bad = top, 0
        while good - bad > 1:
            mid = (good + bad) // 2
            if self.fits(self.record((1, top - mid), {}, ladder[mid], self.batch)):
                good = mid
            else:
                bad = mid
        return self.config({}, ladder[good], self.batch), (1, top - good)

    def prune(self, total_saving: int, blocks, max_ratio: float) -> tuple[PlanConfig, tuple]:
        """Nothing fits unpruned: the least pruning along the path at the most saving storage."""
        saving = self.ladder[-1]
        # The path's per-block model reads batch-1 peaks without frozen-weight dequantisation
        # temporaries: those do not grow with the batch and would mislead the model.
        shape = dataclasses.replace(saving, frozen_weights="fp32")
        report = self.ev.report({}, shape, 1)
        if blocks is None:
            cand = sorted({1 if b == 0 else b for b in report.sensitive_blocks} & set(prunable_blocks()))
        else:
            cand = sorted(blocks)
        floor = {u: max(1, int(self.chan[u] * (1 - max_ratio))) for u in cand}
        floor = {u: k for u, k in floor.items() if k < self.chan[u]}
        if not floor:
            raise self.impossible(total_saving, self.config({}, saving, self.batch))
        total_floor = self.record((0, 0), floor, saving, self.batch)  # impossible unless it fits
        if not self.fits(total_floor):
            raise self.impossible(total_floor, self.config(floor, saving, self.batch))
        path = _PruningPath(self.chan, floor, report, self.ev.report(floor, shape, 1), list(floor))
        last = path.last
        top_cap = max((m[1] for m in path.model.values()), default=path.cap(last))
        # first guess: the peak image's activations shrink by the cap cut, times the batch;
        # index i = last - level: 0 is the floor (fits), last is no pruning (does not fit)
        first = last - _level_of(path, top_cap - (total_saving - self.tensor_budget) / self.batch)
        i = _largest_fitting(lambda i: self.record((0, i), path.kept(last - i), saving, self.batch),
                             0, last, self.tensor_budget, first)
        return self.config(path.kept(last - i), saving, self.batch), (0, i)


def _fewest_optimizer_levers(chosen: PlanConfig, ev: _Evaluator, budget: int, *, fused: bool | None,
                             step_in_backward: bool | None) -> PlanConfig:
    """The chosen configuration with the fewest optimizer levers that still fit, everything
    else kept: none, the update inside backward alone (the same weights), fused kernels alone.

    The path pulls them before the storage levers and keeps them on past them, into
    pruning; where the peak lies elsewhere (a forward temporary) they save nothing there,
    and a plan that fits without them must not take them. Levers the caller fixed stay.
    """
    have = (chosen.fused, chosen.step_in_backward)
    for option in ((False, False), (False, True), (True, False)):
        fewer = option != have and all(o <= h for o, h in zip(option, have))
        kept = all(f is None or o == f for o, f in zip(option, (fused, step_in_backward)))
        if fewer and kept:
            lighter = dataclasses.replace(chosen, fused=option[0], step_in_backward=option[1])
            if ev.total(lighter.kept, lighter.storage, lighter.batch_size) <= budget:
                return lighter
    return chosen


def _fastest_stream(chosen: PlanConfig, ev: _Evaluator, budget: int) -> PlanConfig:
    """A streamed pick without recomputing if that fits (recomputing costs speed), then at
    the largest micro-batch that fits."""
    total_of = lambda c: ev.total(c.kept, c.storage, c.batch_size)  # noqa: E731
    if chosen.recompute and total_of(dataclasses.replace(chosen, recompute=False)) <= budget:
        chosen = dataclasses.replace(chosen, recompute=False)  # recomputing costs speed
    return _largest_micro_batch(chosen, total_of, budget)


def _notes_and_overheads(chosen: PlanConfig, half: str, preset: DevicePreset,
                  total_bytes: int) -> tuple[list[str], dict[str, int], int | None]:
    """The plan's notes, the device's overheads for ``total_bytes`` of tensors and its process limit."""
    notes = []
    if chosen.step_in_backward:
        notes.append("each parameter is updated inside backward (optim.step_in_backward, the same weights): "
                     "finetune refuses it under DDP (torchrun), with optim.foreach and with fp16 loss "
                     "scaling; plan with --no-step-in-backward for those")
    if chosen.fused:
        notes.append("fused optimizer kernels (optim.fused): the same update up to float rounding; "
                     "not with optim.foreach")
    if chosen.precision == half != HALF_DTYPES[0]:
        notes.append(f"half activations are {half}: this machine's torch runs no {HALF_DTYPES[0]} "
                     f"convolutions on the CPU (where --verify measures); same bytes")
    overheads = preset.overheads(total_bytes)
    limit = preset.process_limit_bytes()
    process_total = total_bytes + sum(overheads.values())
    if limit is not None and process_total > limit:
        notes.append(f"tensors + overheads {process_total / MB:.1f} MB exceed what {preset.name} leaves "
                     f"for a process ({limit / MB:.1f} MB after the OS share)")
    return notes, overheads, limit


def plan(
    *,
    budget_bytes: int,
    device_preset: str = "none",
    budget_scope: str = "tensors",
    batch_size: int | str = 8,
    resolution: int = 224,
    num_classes: int = 102,
    precision: str | None = None,
    pool: int | None = None,
    frozen_weights: str | None = None,
    stream: int | None = None,
    backbone: BackboneSpec | str | Path | None = None,
    width: float = 1.0,
    blocks: list[int] | None = None,
    max_ratio: float = MAX_RATIO,
    max_batch_size: int = MAX_BATCH_SIZE,
    mode: str = MODE,
    fused: bool | None = None,
    step_in_backward: bool | None = None,
) -> Plan:
    """Choose pruning, pooling, precision, frozen-weight storage and batch size to fit a budget.

    Args:
        budget_bytes: the memory budget.
        device_preset: "none", "orin-nano-8gb" or "orin-nano-4gb" (its process overheads).
        budget_scope: "tensors" (the budget covers the training tensors) or "process"
            (it also covers the device's overheads, which are subtracted first).
        batch_size: a fixed batch, or "auto" (the largest that fits, see the module docstring).
        resolution: input side in pixels.
        num_classes: classifier outputs.
        precision: fix the activation precision ("fp32", "half", "bf16", "fp16"; "half" is
            ``half_precision()``); None searches.
        pool: fix the side pooling k; None searches 1, 2, 4.
        frozen_weights: fix the frozen-weight storage; None searches fp32, fp16, int8.
        stream: fix the micro-batch of the streamed frozen backbone (0: never stream); None
            searches: streaming is the first lever, and the plan keeps the largest micro-batch
            that fits (fewer, larger kernels).
        backbone: a BackboneSpec or a backbone folder (pruned or not); None: MobileNetV2 ``width``.
        width: width multiplier when no backbone is given.
        blocks: blocks pruning may touch; None: the sensitive blocks of the runtime profile.
        max_ratio: most any block may be pruned.
        max_batch_size: upper end of the "auto" search.
        mode: what fine-tunes (``PLAN_MODES``): "repnet" searches everything above;
            "bias" the same without pooling and pruning; "full" (lean full fine-tuning)
            the optimizer's levers, each conv's stored input, exact, pooled by 2, pooled
            by 4, and the batch.
        fused: fix fused optimizer kernels (``optim.fused``) on or off; None searches.
        step_in_backward: fix the update inside backward (``optim.step_in_backward``) on or
            off (off for a run under DDP); None searches (only where fused kernels are on or
            searched, see ``storage_ladder``).

    Raises:
        PlanImpossible: nothing fits; carries the smallest budget that would.
    """
    start = time.perf_counter()
    preset = _check_budget(budget_bytes, device_preset, budget_scope, batch_size, max_batch_size)
    auto = batch_size == "auto"
    half = half_precision()
    if precision == "half":
        precision = half
    _check_levers(precision=precision, pool=pool, frozen_weights=frozen_weights, stream=stream,
                  max_ratio=max_ratio, mode=mode, blocks=blocks, fused=fused, step_in_backward=step_in_backward)
    from edgetl.profile import check_options

    check_options(mode=mode, accounting="runtime", resolution=resolution, batch_size=1)
    base, meta = _input_backbone(backbone, width, num_classes, blocks)

    if budget_scope == "process":
        tensor_budget = preset.tensor_budget(budget_bytes)
    else:
        tensor_budget = budget_bytes
    ev = _Evaluator(base, resolution, mode)
    ladder = storage_ladder(pool=pool, precision=precision, frozen_weights=frozen_weights,
                            stored_pools=_stored_pools_of(base, resolution) if mode == MODE else None,
                            half=half, stream=stream, mode=mode, fused=fused, step_in_backward=step_in_backward)
    request = {"mode": mode, "batch_size": batch_size, "precision": precision, "pool": pool,
               "frozen_weights": frozen_weights, "stream": stream, "fused": fused,
               "step_in_backward": step_in_backward,
               "blocks": None if blocks is None else list(blocks),
               "max_ratio": max_ratio, "max_batch_size": max_batch_size}

    def impossible(total: int, cfg: PlanConfig) -> PlanImpossible:
        return _impossible(total, cfg, budget_bytes, tensor_budget, budget_scope, preset, auto, resolution)

    search = _Search(ev, ladder, {b: hidden_channels(meta, b) for b in prunable_blocks()},
                     1 if auto else batch_size, mode, tensor_budget, impossible)
    chosen, chosen_pos = search.walk(auto=auto, max_batch_size=max_batch_size, blocks=blocks,
                                     max_ratio=max_ratio)
    # fewer optimizer levers before speed: they change the update's rounding or its speed
    chosen = _fewest_optimizer_levers(chosen, ev, tensor_budget, fused=fused, step_in_backward=step_in_backward)
    if chosen.stream and stream is None:
        chosen = _fastest_stream(chosen, ev, tensor_budget)
    report = ev.report(chosen.kept, chosen.storage, chosen.batch_size)
    runners = _runners_up(search.evaluated, chosen_pos, chosen, tensor_budget)
    notes, overheads, limit = _notes_and_overheads(chosen, half, preset, report.total_bytes)
    elapsed = time.perf_counter() - start
    log.info("plan: %s, predicted %d bytes, %d evaluations in %.1f s", chosen.describe(),
             report.total_bytes, ev.count, elapsed)
    return Plan(
        budget_bytes=budget_bytes, budget_scope=budget_scope, tensor_budget_bytes=tensor_budget,
        device=preset.name, overheads=overheads, device_process_limit_bytes=limit,
        resolution=resolution, num_classes=num_classes, request=request,
        backbone=dataclasses.replace(base, num_classes=num_classes).to_dict(), chosen=chosen,
        predicted_bytes=report.total_bytes, breakdown=dict(report.breakdown), runners_up=runners,
        evaluations=ev.count, search_seconds=elapsed, notes=notes,
    )


def _largest_fitting(total_at, lo: int, hi: int, budget: int, first: int | None = None) -> int:
    """Largest index in [lo, hi) whose total fits, totals non-decreasing in the index.

    ``lo`` is taken to fit and ``hi`` not to (it may be one past the range). ``first`` is
    a model's guess; from it the search gallops (steps 1, 2, 4, ...) towards the boundary,
    then bisects: about 1 + 2 log2(model error) evaluations, correct for any monotone totals.
    """
    if hi - lo <= 1:
        return lo
    guess = (lo + hi) // 2 if first is None else min(max(first, lo + 1), hi - 1)
    up = total_at(guess) <= budget
    lo, hi = (guess, hi) if up else (lo, guess)
    step = 1
    while hi - lo > 1:
        probe = lo + step if up else hi - step
        galloping = lo < probe < hi
        if not galloping:
            probe = (lo + hi) // 2
        if total_at(probe) <= budget:
            lo = probe
            if not up:
                step = 0  # crossed: bisect from here on
        else:
            hi = probe
            if up:
                step = 0
        step = step * 2 if step and galloping else 0
        if step == 0:
            step = hi  # forces bisection
    return lo


def _level_of(path: _PruningPath, cap: float) -> int:
    """The first level (most channels kept) whose cap is <= ``cap``."""
    import bisect

    if cap != cap:  # NaN
        return path.last
    neg = [-c for c in path.caps[1:]]  # caps descend from inf; negated they ascend
    return min(bisect.bisect_left(neg, -cap) + 1, path.last)


def _largest_batch(total_at, budget: int, upper: int) -> int:
    """Largest batch <= upper that fits, given batch 1 does; totals grow with the batch."""
    if upper == 1:
        return 1
    # small batches can peak in the optimizer step: take the slope from batches 8 and 16
    points = [(1, total_at(1))]
    lo, hi = 1, upper + 1
    for probe in (8, 16):
        if probe >= hi:
            break
        t = total_at(probe)
        points.append((probe, t))
        if t <= budget:
            lo = probe
        else:
            hi = probe
            break
    (x1, t1), (x2, t2) = points[-2], points[-1]
    first = None
    if t2 > t1:
        first = int(math.floor(x1 + (budget - t1) * (x2 - x1) / (t2 - t1)))
    return _largest_fitting(total_at, lo, hi, budget, first)


def _runners_up(evaluated, chosen_pos, chosen: PlanConfig, budget: int, count: int = 4) -> list[Candidate]:
    seen, better, worse = set(), [], []
    for pos, cfg, total in sorted(evaluated, key=lambda e: e[0]):
        key = cfg.describe()
        if key in seen or key == chosen.describe():
            continue
        seen.add(key)
        (better if pos > chosen_pos else worse).append((pos, cfg, total))
    out = []
    for pos, cfg, total in better[:2]:
        out.append(Candidate(cfg, total, total <= budget,
                             "better on the objective but over the budget" if total > budget else
                             "fits, but the path prefers the chosen one"))
    picks = [worse[-1], worse[0]] if len(worse) > 1 else worse  # nearest, and most degraded seen
    for pos, cfg, total in picks[:count - len(out)]:
        out.append(Candidate(cfg, total, total <= budget,
                             "fits, but prunes more, pools coarser or stores less exactly"
                             if total <= budget else "over the budget"))
    return out


def _largest_micro_batch(chosen: PlanConfig, total: Callable[[PlanConfig], int], budget: int) -> PlanConfig:
    """Streaming costs speed, not accuracy: the largest micro-batch below the batch that
    still fits (``chosen``'s fits; the peak grows with the micro-batch)."""
    lo, hi = chosen.stream, chosen.batch_size - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(dataclasses.replace(chosen, stream=mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return dataclasses.replace(chosen, stream=lo)


def _impossible(total: int, cfg: PlanConfig, budget: int, tensor_budget: int, scope: str,
                preset: DevicePreset, auto: bool, resolution: int) -> PlanImpossible:
    need = total
    if scope == "process":
        need = preset.cuda_context_bytes + math.ceil(total * (1 + preset.allocator_slack))
        while preset.tensor_budget(need) < total:  # float rounding of the slack
            need += 1
    what = "batch 1 (auto)" if auto else f"batch {cfg.batch_size}"
    return PlanImpossible(
        f"budget {budget / MB:.2f} MB ({scope}) is impossible at {what}, {resolution} px: the most "
        f"saving configuration ({cfg.describe()}) needs {total / MB:.2f} MB of tensors; the smallest "
        f"budget that works is {math.ceil(need / 1e4) / 100:.2f} MB ({scope})",
        need, cfg)


# ----------------------------------------------------------------------------- verify


def verify_plan(plan: Plan, *, steps: int = 3, device: str = "cpu", seed: int = 0) -> int:
    """Build the planned network (random weights) and measure real training steps; returns bytes.

    Also stores the measurement in ``plan.measured_bytes``.
    """
    import torch

    from edgetl.memory.meter import measure_training_peak
    from edgetl.memory.schedule import prepare_step
    from edgetl.models.side import build_network

    c = plan.chosen
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_network(copy.deepcopy(plan.spec), c.mode, device=device, lean=lean_options(c.storage))
    # the step the plan predicted (and finetune runs): its schedule fitted and applied, its
    # optimizer fused and updating inside backward where the plan says so
    step = plan_step(c.storage)
    prepare_step(net, resolution=plan.resolution, batch_size=c.batch_size, step=step)
    measured = measure_training_peak(net, resolution=plan.resolution, batch_size=c.batch_size,
                                     steps=steps, step=step, device=device, seed=seed)
    plan.measured_bytes, plan.verify_steps = int(measured), steps
    log.info("verify: predicted %d, measured %d bytes", plan.predicted_bytes, measured)
    return int(measured)
