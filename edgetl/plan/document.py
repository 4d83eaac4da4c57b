"""The plan as data: a chosen configuration, its predicted peak and runners-up in; YAML/JSON out
(and back, validated)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from edgetl.errors import BudgetError, ConfigError, DataError
from edgetl.models.backbone import BackboneSpec, prunable_blocks
from edgetl.options import CONV_STORAGES, FROZEN_WEIGHTS, POOLS, PRECISIONS, LeanOptions

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
MAX_BATCH_SIZE = 256
VERIFY_TOLERANCE = 0.05
OBJECTIVE = ("fit the budget removing as few hidden channels as possible, then prefer a smaller "
             "pooling k, then a larger batch; storage savings (frozen fp16, int8 frozen weights, "
             "half activations) before pooling, pooling before pruning")



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

    @property
    def lean(self) -> LeanOptions:
        """The lean runtime options of this storage (BN folded); refused in one line where
        they do not hold together."""
        return LeanOptions(pool=self.pool, bn="fold", frozen_weights=self.frozen_weights,
                           precision=self.precision, stream=self.stream, storage=self.conv_storage,
                           uint8_input=self.uint8_input, recompute=self.recompute)


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
    def lean(self) -> LeanOptions:
        """The lean runtime options this configuration fine-tunes with (BN folded)."""
        return self.storage.lean

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
        if f.get("uint8_input", config.uint8_input) != config.uint8_input:
            raise ConfigError(f"{where}.finetune.uint8_input: {f['uint8_input']!r}; a plan keeps the batch uint8 "
                              f"exactly when it streams (allowed here: {config.uint8_input})")
        try:
            config.lean.for_mode(config.mode, "lean", defaults=LeanOptions(pool=1))
        except ConfigError as exc:
            raise ConfigError(f"{where}.finetune: {exc}") from None
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

    def save(self, path: str | Path) -> None:
        from edgetl.io import atomic_write_text

        text = self.to_yaml() if str(path).endswith((".yaml", ".yml")) else json.dumps(self.to_dict(), indent=2) + "\n"
        atomic_write_text(path, text)


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``edgetl plan`` (YAML or JSON) through the one safe YAML reader
    (``edgetl.io.read_yaml``: no aliases, repeated keys or huge files)."""
    from edgetl.io import read_yaml

    path = Path(path)
    if not path.is_file():
        raise DataError(f"plan file {path} does not exist")
    data = read_yaml(path, "plan")
    try:
        return Plan.from_dict(data)
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

