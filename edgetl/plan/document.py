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
from edgetl.plan.devices import DEVICES
from edgetl.plan.sections import (  # noqa: F401 (the schema's constants are read from here too)
    BUDGET_SCOPES, HALF_DTYPES, MAX_BATCH_SIZE, MAX_CHANNELS, MAX_RATIO, MODE, OBJECTIVE, OPTIMIZER, PLAN_FORMAT,
    PLAN_MODES, VERIFY_TOLERANCE, _BackboneSection, _BudgetSection, _CandidateSection, _check_keys,
    _CudaGraphSection, _FinetuneSection, _PredictedSection, _PruneSection, _RequestSection, _SearchSection, _section,
    _TopSection, _VerifySection,
)
from edgetl.schema import show


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
        """Parse ``{"prune": ..., "finetune": ...}``: every value of its type and range, and the
        redundant ones agreeing (blocks, ratios, channels and kept; stream and uint8_input)."""
        _check_keys(data, {"prune", "finetune"}, where, required={"prune", "finetune"})
        finetune = data["finetune"]
        for key in ("fused", "step_in_backward"):
            if isinstance(finetune, dict) and not isinstance(finetune.get(key, False), bool):
                raise ConfigError(f"{where}.finetune.{key}: {finetune[key]!r}; allowed: true, false")
        p, maps = _section(_PruneSection, data["prune"], f"{where}.prune", {"channels": True, "kept": True})
        f, _ = _section(_FinetuneSection, finetune, f"{where}.finetune")
        kept, channels = maps["kept"], maps["channels"]
        _check_pruning(p.blocks, p.ratios, channels, kept, f"{where}.prune")
        if f.storage != "exact" and f.mode != "full":
            raise ConfigError(f"{where}.finetune.storage: {f.storage!r}; allowed: {', '.join(CONV_STORAGES)} "
                              "(mode full), exact (other modes)")
        config = cls(kept, channels, f.pool, f.precision, f.frozen_weights, f.batch_size, f.stream, f.mode,
                     f.storage, f.recompute, f.fused, f.step_in_backward)
        if f.uint8_input is not None and f.uint8_input != config.uint8_input:
            raise ConfigError(f"{where}.finetune.uint8_input: {f.uint8_input!r} disagrees with "
                              f"{where}.finetune.stream {f.stream}: a plan keeps the batch uint8 exactly when "
                              f"it streams (allowed here: {str(config.uint8_input).lower()})")
        try:
            config.lean.for_mode(config.mode, "lean", defaults=LeanOptions(pool=1))
        except ConfigError as exc:
            raise ConfigError(f"{where}.finetune: {exc}") from None
        return config

    def check_channels(self, hidden: dict[int, int], where: str) -> None:
        """Refuse blocks the input backbone cannot prune and channel counts that are not its
        ``hidden`` (block -> channels)."""
        for b in self.blocks:
            if b not in hidden:
                raise ConfigError(f"{where}.prune.blocks: block {b} is not a block the plan's backbone can prune; "
                                  f"allowed: {min(hidden)}..{max(hidden)} (plan.backbone)")
            if self.channels[b] != hidden[b]:
                raise ConfigError(f"{where}.prune.channels: block {b} has {self.channels[b]} hidden channels "
                                  f"here but {hidden[b]} in the plan's backbone (plan.backbone)")


def _check_pruning(blocks: list[int], ratios: list[float], channels: dict[int, int], kept: dict[int, int],
                   where: str) -> None:
    """The four views of one pruning agree: the same blocks, once each, a ratio per block that
    makes ``edgetl prune`` keep exactly ``kept`` of ``channels``, and 1 <= kept <= channels."""
    from edgetl.prune import kept_channels

    if len(set(blocks)) != len(blocks):
        raise ConfigError(f"{where}.blocks: {show(blocks)} names a block twice")
    for key, named in (("channels", channels), ("kept", kept)):
        if sorted(named) != sorted(blocks):
            raise ConfigError(f"{where}: {key} names blocks {sorted(named)}, blocks names {sorted(blocks)}; "
                              "allowed: the same blocks")
    if len(ratios) != len(blocks):
        raise ConfigError(f"{where}.ratios: {len(ratios)} ratios for {len(blocks)} blocks {show(blocks)}; "
                          "allowed: one ratio per block")
    for b, r in zip(blocks, ratios):
        if not 1 <= channels[b] <= MAX_CHANNELS:  # past it no 6-digit ratio names every kept count
            raise ConfigError(f"{where}.channels: block {b} has {show(channels[b])} channels; "
                              f"allowed: 1..{MAX_CHANNELS}")
        if not 1 <= kept[b] <= channels[b]:
            raise ConfigError(f"{where}.kept: block {b} keeps {kept[b]} of {channels[b]} channels; "
                              f"allowed: 1..{channels[b]}")
        if kept_channels(channels[b], r) != kept[b]:
            raise ConfigError(f"{where}.ratios: block {b} ratio {r} keeps {kept_channels(channels[b], r)} of "
                              f"{channels[b]} channels, kept says {kept[b]}; allowed: a ratio that keeps "
                              f"{kept[b]} (e.g. {ratio_for(channels[b], kept[b])})")


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
        _check_keys(data, {"config", "predicted_bytes", "fits", "why"}, where, required={"config"})
        c, _ = _section(_CandidateSection, {k: v for k, v in data.items() if k != "config"}, where)
        return cls(PlanConfig.from_dict(data["config"], f"{where}.config"), c.predicted_bytes, c.fits, c.why)


@dataclass(frozen=True)
class GraphMemory:
    """The chosen step captured as CUDA graphs, as ``finetune`` runs it on the plan's device
    (``edgetl.memory.cuda_step.captured_report``): the GPU's compute capability, what the graphs
    reserve beyond an eager run, and what a budget counts for it (the predicted tensors and that)."""

    capability: tuple[int, int]
    extra_bytes: int
    total_bytes: int

    def to_dict(self) -> dict:
        return {"capability": list(self.capability), "extra_bytes": self.extra_bytes, "total_bytes": self.total_bytes}


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
        cuda_graph: the chosen step captured as CUDA graphs, as ``finetune`` runs it by default
            on a device with a GPU: what they reserve is counted against the tensor budget
            beside ``predicted_bytes``. None: the step runs eagerly there (``eager``), or the
            device has no GPU the plan knows.
        eager: ``finetune --plan`` runs the step eagerly (``train.cuda_graph`` false): asked
            (``request["eager"]``), or its graphs would not fit.
        graph_replays: the captured steps the plan replayed (``captured_report``).
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
    cuda_graph: GraphMemory | None = None
    eager: bool = False
    graph_replays: int = 0

    @property
    def counted_bytes(self) -> int:
        """What the tensor budget counts for the step as finetune runs it on the device: the
        predicted tensors, and what CUDA graphs reserve beyond an eager run where it captures them."""
        return self.predicted_bytes if self.cuda_graph is None else self.cuda_graph.total_bytes

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
            # null: the device decides; false: an eager step; else the step's CUDA-graph figures
            "cuda_graph": (False if self.eager else None) if self.cuda_graph is None else self.cuda_graph.to_dict(),
            "verify": (None if self.measured_bytes is None else
                       {"measured_bytes": self.measured_bytes, "steps": self.verify_steps}),
            "runners_up": [c.to_dict() for c in self.runners_up],
            "search": {"evaluations": self.evaluations, "graph_replays": self.graph_replays,
                       "seconds": round(self.search_seconds, 2)},
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """Parse a plan document (``PLAN_FORMAT``) as a recipe is parsed: no unknown or missing
        key, every value of its type and range, never coerced; then its redundant values must
        agree (``_check_agreement``). One ConfigError line naming the key otherwise."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise DataError(f"not an edgetl plan (format {PLAN_FORMAT})")
        scalars = {f.name for f in dataclasses.fields(_TopSection)}
        required = {"budget", "request", "backbone", "prune", "finetune", "predicted"}
        _check_keys(data, scalars | required | {"verify", "runners_up", "search", "cuda_graph"}, "plan",
                    required=required)
        top, _ = _section(_TopSection, {k: v for k, v in data.items() if k in scalars}, "plan")
        budget, budget_maps = _section(_BudgetSection, data["budget"], "plan.budget", {"overheads": False})
        _section(_RequestSection, data["request"], "plan.request")
        backbone, backbone_maps = _section(_BackboneSection, data["backbone"], "plan.backbone", {"hidden": True})
        predicted, predicted_maps = _section(_PredictedSection, data["predicted"], "plan.predicted",
                                             {"breakdown": False})
        verify = None if data.get("verify") is None else _section(_VerifySection, data["verify"], "plan.verify")[0]
        search = _section(_SearchSection, {} if data.get("search") is None else data["search"], "plan.search")[0]
        graph = data.get("cuda_graph")
        if graph is not None and graph is not False and not isinstance(graph, dict):
            raise ConfigError(f"plan.cuda_graph is {show(graph)}; allowed: null, false (an eager step) or the "
                              "figures of the step captured as CUDA graphs (a mapping)")
        eager = graph is False
        graph = _section(_CudaGraphSection, graph, "plan.cuda_graph")[0] if isinstance(graph, dict) else None
        if graph is not None and len(graph.capability) != 2:
            raise ConfigError(f"plan.cuda_graph.capability: {show(graph.capability)}; allowed: [major, minor], "
                              "e.g. [8, 7]")
        runners = [] if data.get("runners_up") is None else data["runners_up"]
        if not isinstance(runners, list):
            raise ConfigError(f"plan.runners_up is {show(runners)}; allowed: a list of configurations")
        try:
            BackboneSpec(backbone.arch, backbone.width, backbone.num_classes, backbone_maps["hidden"],
                         backbone.dropout)
        except ConfigError as exc:
            raise ConfigError(f"plan.backbone: {exc}") from None
        plan = cls(
            budget_bytes=budget.budget_bytes, budget_scope=budget.scope,
            tensor_budget_bytes=budget.tensor_budget_bytes, device=budget.device,
            overheads=budget_maps["overheads"], device_process_limit_bytes=budget.device_process_limit_bytes,
            resolution=top.resolution, num_classes=top.num_classes,
            request=dict(data["request"]), backbone=dict(data["backbone"]),
            chosen=PlanConfig.from_dict({"prune": data["prune"], "finetune": data["finetune"]}, "plan"),
            predicted_bytes=predicted.total_bytes, breakdown=predicted_maps["breakdown"],
            runners_up=[Candidate.from_dict(c, f"plan.runners_up[{i}]") for i, c in enumerate(runners)],
            objective=top.objective, evaluations=search.evaluations, search_seconds=search.seconds,
            notes=list(top.notes or []),
            measured_bytes=None if verify is None else verify.measured_bytes,
            verify_steps=None if verify is None else verify.steps,
            cuda_graph=None if graph is None else GraphMemory(tuple(graph.capability), graph.extra_bytes,
                                                              graph.total_bytes),
            eager=eager, graph_replays=search.graph_replays,
        )
        plan._check_agreement()
        return plan

    def _check_agreement(self) -> None:
        """Refuse a plan whose redundant values disagree (a hand edit of one of them), naming
        both sides: the backbone's classes and hidden channels against the plan's; the tensor
        budget, overheads and process limit against the budget, its scope and device; the
        breakdown against its total, which must fit; each runner-up's ``fits``; the chosen
        configuration against what was requested; the resolution against the mode."""
        from edgetl.models.backbone import build_backbone, hidden_channels
        from edgetl.profile import check_options

        base = BackboneSpec.from_dict(self.backbone)
        if base.num_classes != self.num_classes:
            raise ConfigError(f"plan.backbone.num_classes: {base.num_classes} disagrees with plan.num_classes "
                              f"{self.num_classes}; allowed: the same class count")
        meta = build_backbone(base, device="meta")
        hidden = {b: hidden_channels(meta, b) for b in prunable_blocks(base.arch)}
        self.chosen.check_channels(hidden, "plan")
        for i, c in enumerate(self.runners_up):
            c.config.check_channels(hidden, f"plan.runners_up[{i}].config")
        preset = DEVICES[self.device]
        tensor_budget = self.budget_bytes if self.budget_scope == "tensors" else preset.tensor_budget(self.budget_bytes)
        if self.tensor_budget_bytes != tensor_budget:
            raise ConfigError(f"plan.budget.tensor_budget_bytes: {self.tensor_budget_bytes} disagrees with "
                              f"plan.budget.budget_bytes {self.budget_bytes} (scope {self.budget_scope}, device "
                              f"{self.device}); allowed here: {tensor_budget}")
        for key, have, want in (("overheads", self.overheads, preset.overheads(self.predicted_bytes)),
                                ("device_process_limit_bytes", self.device_process_limit_bytes,
                                 preset.process_limit_bytes())):
            if have != want:
                if isinstance(have, dict):  # name the line that disagrees (a long mapping is cut when shown)
                    name = next(k for k in [*have, *want] if have.get(k) != want.get(k))
                    have = {name: have.get(name, "missing")}
                raise ConfigError(f"plan.budget.{key}: {show(have)} disagrees with device {self.device} at "
                                  f"{self.predicted_bytes} predicted bytes; allowed here: {show(want)}")
        if sum(self.breakdown.values()) != self.predicted_bytes:
            raise ConfigError(f"plan.predicted.total_bytes: {self.predicted_bytes} disagrees with "
                              f"plan.predicted.breakdown, which adds up to {sum(self.breakdown.values())}")
        if self.predicted_bytes > self.tensor_budget_bytes:
            raise ConfigError(f"plan.predicted.total_bytes: {self.predicted_bytes} exceeds "
                              f"plan.budget.tensor_budget_bytes {self.tensor_budget_bytes}: the chosen "
                              "configuration does not fit its own budget")
        self._check_graphs(preset)
        for i, c in enumerate(self.runners_up):
            if c.fits != (c.predicted_bytes <= self.tensor_budget_bytes):
                raise ConfigError(f"plan.runners_up[{i}].fits: {str(c.fits).lower()} disagrees with its "
                                  f"predicted_bytes {c.predicted_bytes} against plan.budget.tensor_budget_bytes "
                                  f"{self.tensor_budget_bytes}")
        self._check_request(prunable_blocks(base.arch))
        try:
            check_options(mode=self.chosen.mode, accounting="runtime", resolution=self.resolution, batch_size=1)
        except ConfigError as exc:
            raise ConfigError(f"plan.resolution: {exc}") from None

    def _check_graphs(self, preset) -> None:
        """The step's CUDA-graph figures agree with the request (none where an eager step was
        asked), the device (its capability), the predicted tensors (their total) and the budget
        (they fit)."""
        g = self.cuda_graph
        if self.request.get("eager") and not self.eager:
            raise ConfigError(f"plan.cuda_graph: {'the figures of graphs' if g else 'null'} disagrees with "
                              "plan.request.eager true; allowed: false (an eager step)")
        if g is None:
            return
        if preset.capability is None:
            raise ConfigError(f"plan.cuda_graph: device {self.device} has no GPU whose graphs a plan counts; "
                              f"allowed: null, false, or a device with one "
                              f"({', '.join(n for n, d in DEVICES.items() if d.capability)})")
        if g.capability != preset.capability:
            raise ConfigError(f"plan.cuda_graph.capability: {list(g.capability)} disagrees with device {self.device} "
                              f"({list(preset.capability)}); allowed: {list(preset.capability)}")
        if g.total_bytes != self.predicted_bytes + g.extra_bytes:
            raise ConfigError(f"plan.cuda_graph.total_bytes: {g.total_bytes} disagrees with plan.predicted.total_bytes "
                              f"{self.predicted_bytes} + plan.cuda_graph.extra_bytes {g.extra_bytes}")
        if g.total_bytes > self.tensor_budget_bytes:
            raise ConfigError(f"plan.cuda_graph.total_bytes: {g.total_bytes} exceeds plan.budget.tensor_budget_bytes "
                              f"{self.tensor_budget_bytes}: the step captured as CUDA graphs does not fit its own "
                              "budget")

    def _check_request(self, allowed: range) -> None:
        """The chosen configuration is what ``request`` asked: its mode, every lever the request
        fixed, a fixed batch (or one up to max_batch_size), pruning only the blocks it allows
        (``allowed``: those the plan's backbone can prune)."""
        r, c = self.request, self.chosen
        batch = r["batch_size"]
        if batch != "auto" and batch < 1:
            raise ConfigError(f"plan.request.batch_size: {batch} is not allowed; allowed: an integer >= 1 or 'auto'")
        fixed = {"mode": r.get("mode", MODE), "batch_size": None if batch == "auto" else batch,
                 "precision": r["precision"], "pool": r["pool"], "frozen_weights": r["frozen_weights"],
                 "stream": r.get("stream"), "fused": r.get("fused"), "step_in_backward": r.get("step_in_backward")}
        if isinstance(fixed["stream"], int) and fixed["stream"] >= c.batch_size:  # m >= the batch streams nothing
            fixed["stream"] = 0
        for key, want in fixed.items():
            have = getattr(c, key)
            if want is not None and have != want:
                raise ConfigError(f"plan.finetune.{key}: {show(have)} disagrees with plan.request.{key} "
                                  f"{show(want)}; allowed: the value requested")
        if batch == "auto" and c.batch_size > r["max_batch_size"]:
            raise ConfigError(f"plan.finetune.batch_size: {c.batch_size} exceeds plan.request.max_batch_size "
                              f"{r['max_batch_size']}")
        if r["blocks"] is not None and not set(r["blocks"]) <= set(allowed):
            raise ConfigError(f"plan.request.blocks: {r['blocks']} names blocks the plan's backbone cannot prune; "
                              f"allowed: {allowed.start}..{allowed.stop - 1} (plan.backbone)")
        if r["blocks"] is not None and not set(c.blocks) <= set(r["blocks"]):
            raise ConfigError(f"plan.prune.blocks: {c.blocks} prunes blocks plan.request.blocks {r['blocks']} "
                              "does not allow")

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

