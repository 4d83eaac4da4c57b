"""The walk along the plan's path: a ladder, a backbone and a budget in, the least degraded
configuration that fits out, with every candidate evaluated (for the runners-up)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from edgetl.memory import search
import edgetl.models.archs as archs
from edgetl.models.backbone import BackboneSpec
from edgetl.plan.document import MODE, Candidate, PlanConfig, PlanImpossible, Storage
from edgetl.plan.ladder import _network_key, plan_step

log = logging.getLogger(__name__)


# runtime_report of a configuration by (backbone, resolution, mode, configuration): it reads
# the meta network's shapes and trainability alone, so plans in one process (budgets swept, the
# bench's plan row) share what an earlier plan evaluated; kept for the last _SHARED_MAX
_SHARED: dict[tuple, object] = {}
_SHARED_MAX = 512


def remember(store: dict, key, value, most: int):
    """``store[key] = value``, the oldest entry dropped first where ``store`` holds ``most``
    already (the process-wide stores of evaluations that plans share); returns ``value``."""
    if len(store) >= most:
        store.pop(next(iter(store)))
    store[key] = value
    return value


class _Evaluator:
    """runtime_report of a configuration, cached per configuration (meta networks); ``count``:
    the configurations this search evaluated (an earlier plan's evaluation in ``_SHARED``
    serves as this one's)."""

    def __init__(self, base: BackboneSpec, resolution: int, mode: str = MODE,
                 on_evaluation: Callable[[int], None] | None = None):
        self.base, self.resolution, self.mode = base, resolution, mode
        self.reports: dict[tuple, object] = {}
        self.nets: dict[tuple, object] = {}
        self.count = 0
        self.on_evaluation = on_evaluation  # called with ``count`` each time it grows
        self.shared_key = (base.key(), resolution, mode)

    def report(self, kept: dict[int, int], storage: Storage, batch: int):
        from edgetl.memory.schedule import predict_step
        from edgetl.models.side import build_network

        if storage.stream >= batch:  # streams nothing (so no uint8 batch): as ``plan``'s config runs it
            storage = dataclasses.replace(storage, stream=0, recompute=False)
        key = (tuple(sorted(kept.items())), storage, batch)
        shared = (self.shared_key, key)
        if key not in self.reports and shared not in _SHARED:
            # predict_step fits and applies the schedule of this step each time: a network
            # serves every step
            net_key = (key[0], _network_key(storage))
            if net_key not in self.nets:
                spec = dataclasses.replace(self.base, hidden={**self.base.hidden, **kept})
                self.nets[net_key] = build_network(spec, self.mode, device="meta", lean=storage.lean)
            net = self.nets[net_key]
            remember(_SHARED, shared, predict_step(net, mode=self.mode, resolution=self.resolution,
                                                   batch_size=batch, step=plan_step(storage)), _SHARED_MAX)
            log.debug("evaluated %s %s batch %d: %d bytes", kept, storage, batch, _SHARED[shared].total_bytes)
        if key not in self.reports:
            self.reports[key] = _SHARED[shared]
            self.count += 1
            if self.on_evaluation is not None:
                self.on_evaluation(self.count)
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
            best, _ = search.largest_batch(lambda b: self.record((2, b), {}, exact, b), self.tensor_budget,
                                           max_batch_size)
            chosen = self.config({}, exact, best)
            chosen_pos = (2, best)
        return chosen, chosen_pos

    def least_degraded_storage(self) -> tuple[PlanConfig, tuple]:
        """The most saving storage fits: the least degraded rung that does (totals fall along
        the ladder, so they rise with j = top - rung; j = 0 fits and j = top does not)."""
        ladder, top = self.ladder, len(self.ladder) - 1
        j = search.largest_fitting(lambda j: self.record((1, j), {}, ladder[top - j], self.batch),
                                   self.tensor_budget, 0, top)
        return self.config({}, ladder[top - j], self.batch), (1, j)

    def prune(self, total_saving: int, blocks, max_ratio: float) -> tuple[PlanConfig, tuple]:
        """Nothing fits unpruned: the least pruning along the path at the most saving storage."""
        saving = self.ladder[-1]
        # The path's per-block model reads batch-1 peaks without frozen-weight dequantisation
        # temporaries: those do not grow with the batch and would mislead the model.
        shape = dataclasses.replace(saving, frozen_weights="fp32")
        report = self.ev.report({}, shape, 1)
        if blocks is None:
            # a sensitive block without hidden channels of its own maps to the blocks whose
            # count changes it (MobileNetV2's stem: block 1); ResNet's stem maps to none
            affects = archs.get(self.ev.base.arch).affects
            cand = sorted({u for b in report.sensitive_blocks for u in self.chan if b in affects(u)})
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
        i = search.largest_fitting(lambda i: self.record((0, i), path.kept(last - i), saving, self.batch),
                                   self.tensor_budget, 0, last, first)
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


def _level_of(path: _PruningPath, cap: float) -> int:
    """The first level (most channels kept) whose cap is <= ``cap``."""
    import bisect

    if cap != cap:  # NaN
        return path.last
    neg = [-c for c in path.caps[1:]]  # caps descend from inf; negated they ascend
    return min(bisect.bisect_left(neg, -cap) + 1, path.last)


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
    m = search.largest_fitting(lambda m: total(dataclasses.replace(chosen, stream=m)), budget,
                               chosen.stream, chosen.batch_size)
    return dataclasses.replace(chosen, stream=m)
