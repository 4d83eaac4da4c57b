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

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Callable

from edgetl.errors import ConfigError
from edgetl.models.backbone import BackboneSpec, build_backbone, hidden_channels, input_spec, prunable_blocks
from edgetl.plan.devices import DEVICES, DevicePreset
from edgetl.plan.document import (
    BUDGET_SCOPES, CONV_STORAGES, FROZEN_WEIGHTS, HALF_DTYPES, MAX_BATCH_SIZE, MAX_RATIO, MODE, OBJECTIVE,
    OPTIMIZER, PLAN_FORMAT, PLAN_MODES, POOLS, PRECISIONS, VERIFY_TOLERANCE, Candidate, GraphMemory, Plan,
    PlanConfig, PlanImpossible, Storage, _check_storage, load_plan, ratio_for,
)
from edgetl.plan.graphs import GraphChoice, graph_note, with_graphs
from edgetl.plan.ladder import _stored_pools_of, half_precision, plan_step, storage_ladder
from edgetl.plan.path import _Evaluator, _fastest_stream, _fewest_optimizer_levers, _runners_up, _Search
from edgetl.plan.verify import verify_plan
from edgetl.units import MB

log = logging.getLogger(__name__)

__all__ = [
    "BUDGET_SCOPES", "CONV_STORAGES", "DEVICES", "FROZEN_WEIGHTS", "HALF_DTYPES", "MAX_BATCH_SIZE", "MAX_RATIO",
    "MODE", "OBJECTIVE", "OPTIMIZER", "PLAN_FORMAT", "PLAN_MODES", "POOLS", "PRECISIONS", "VERIFY_TOLERANCE",
    "Candidate", "DevicePreset", "GraphMemory", "Plan", "PlanConfig", "PlanImpossible", "Storage", "half_precision",
    "load_plan", "plan", "plan_step", "ratio_for", "storage_ladder", "verify_plan",
]


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
        from edgetl.options import check_full_options

        check_full_options("mode full", precision=precision, frozen_weights=frozen_weights, stream=stream)
    if mode != MODE and pool not in (None, 1):
        raise ConfigError(f"pool {pool} is not allowed with mode {mode} (no side network); allowed: 1")
    if mode != MODE and blocks:
        raise ConfigError(f"pruning blocks {blocks} is planned for mode {MODE} only; mode {mode} plans no pruning")


def _input_backbone(backbone, width: float, num_classes: int, blocks) -> tuple[BackboneSpec, object]:
    """The backbone to plan for, its spec and a meta network (to read its channels);
    refuses ``blocks`` pruning may not touch."""
    base = input_spec(backbone, width=width, num_classes=num_classes)
    meta = build_backbone(base, device="meta")
    if blocks is not None:
        from edgetl.prune import check_plan

        check_plan(list(blocks), [0.0] * len(blocks), arch=base.arch)
    return base, meta


def _notes_and_overheads(chosen: PlanConfig, half: str, preset: DevicePreset, total_bytes: int,
                         counted_bytes: int) -> tuple[list[str], dict[str, int], int | None]:
    """The plan's notes, the device's overheads for ``total_bytes`` of tensors and its process
    limit; ``counted_bytes``: the tensors and what CUDA graphs reserve where the step runs so."""
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
    process_total = counted_bytes + sum(overheads.values())
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
    width: float | None = None,
    blocks: list[int] | None = None,
    max_ratio: float = MAX_RATIO,
    max_batch_size: int = MAX_BATCH_SIZE,
    mode: str = MODE,
    fused: bool | None = None,
    step_in_backward: bool | None = None,
    eager: bool = False,
    on_evaluation: Callable[[int], None] | None = None,
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
        width: width multiplier of the default backbone (1.0 where None); refused beside a
            backbone that has its own (a folder, ImageNet weights, a spec of another width).
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
        eager: plan an eager step (finetune --plan then runs eagerly). Otherwise, on a device
            with a GPU (``DevicePreset.capability``), where finetune captures the step as CUDA
            graphs by default, the plan runs it so where its tensors and what the graphs reserve
            beyond an eager run fit the tensor budget, streamed or by a smaller micro-batch if
            need be (``edgetl.plan.graphs.with_graphs``), eagerly where they do not: graphs are a
            matter of speed, chosen after the objective (a plan never prunes, pools or stores
            less exactly to run as graphs).
        on_evaluation: called with the number of configurations evaluated so far each time
            the search evaluates one (``Plan.evaluations`` in all; the command's progress line).

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
    if mode == MODE and batch_size != "auto":  # a step that cannot train is no plan (finetune refuses it too)
        from edgetl.models.side import build_network, check_resolution

        check_resolution(build_network(base, mode, device="meta"), resolution, batch_size, where="--resolution")

    if budget_scope == "process":
        tensor_budget = preset.tensor_budget(budget_bytes)
    else:
        tensor_budget = budget_bytes
    ev = _Evaluator(base, resolution, mode, on_evaluation)
    ladder = storage_ladder(pool=pool, precision=precision, frozen_weights=frozen_weights,
                            stored_pools=_stored_pools_of(base, resolution) if mode == MODE else None,
                            half=half, stream=stream, mode=mode, fused=fused, step_in_backward=step_in_backward)
    request = {"mode": mode, "batch_size": batch_size, "precision": precision, "pool": pool,
               "frozen_weights": frozen_weights, "stream": stream, "fused": fused,
               "step_in_backward": step_in_backward, "eager": eager,
               "blocks": None if blocks is None else list(blocks),
               "max_ratio": max_ratio, "max_batch_size": max_batch_size}

    def impossible(total: int, cfg: PlanConfig) -> PlanImpossible:
        return _impossible(total, cfg, budget_bytes, tensor_budget, budget_scope, preset, auto, resolution)

    search = _Search(ev, ladder, {b: hidden_channels(meta, b) for b in prunable_blocks(base.arch)},
                     1 if auto else batch_size, mode, tensor_budget, impossible)
    chosen, chosen_pos = search.walk(auto=auto, max_batch_size=max_batch_size, blocks=blocks,
                                     max_ratio=max_ratio)
    # fewer optimizer levers before speed: they change the update's rounding or its speed
    chosen = _fewest_optimizer_levers(chosen, ev, tensor_budget, fused=fused, step_in_backward=step_in_backward)
    if chosen.stream and stream is None:
        chosen = _fastest_stream(chosen, ev, tensor_budget)
    pick, step = chosen, GraphChoice(chosen, None, None, 0)
    if not eager and preset.capability is not None:  # then speed: the step captured as CUDA graphs if it fits
        step = with_graphs(chosen, base, ev, tensor_budget, preset.capability, resolution=resolution,
                           can_stream=stream is None and any(s.stream for s in ladder))
        chosen = step.config
    report = ev.report(chosen.kept, chosen.storage, chosen.batch_size)
    runners = _runners_up(search.evaluated, chosen_pos, pick, tensor_budget)  # the pick is no runner-up
    counted = report.total_bytes if step.graphs is None else step.graphs.total_bytes
    notes, overheads, limit = _notes_and_overheads(chosen, half, preset, report.total_bytes, counted)
    elapsed = time.perf_counter() - start
    log.info("plan: %s, predicted %d bytes, %d evaluations, %d CUDA-graph replays in %.1f s", chosen.describe(),
             report.total_bytes, ev.count, step.replays, elapsed)
    result = Plan(
        budget_bytes=budget_bytes, budget_scope=budget_scope, tensor_budget_bytes=tensor_budget,
        device=preset.name, overheads=overheads, device_process_limit_bytes=limit,
        resolution=resolution, num_classes=num_classes, request=request,
        backbone=dataclasses.replace(base, num_classes=num_classes).to_dict(), chosen=chosen,
        predicted_bytes=report.total_bytes, breakdown=dict(report.breakdown), runners_up=runners,
        evaluations=ev.count, search_seconds=elapsed, notes=notes, cuda_graph=step.graphs,
        eager=eager or step.over is not None, graph_replays=step.replays,
    )
    note = graph_note(result, step.over, step.least)
    if note is not None:
        result.notes.append(note)
    return result


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
