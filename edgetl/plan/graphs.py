"""A plan for a device with a GPU, as finetune runs it there: the step captured as CUDA graphs by
default, which reserve device memory beyond an eager run's (``edgetl.memory.cuda_step.captured_report``).
Graphs are a matter of speed, so they are chosen after the objective: the planned configuration
runs as graphs where its tensors and that reserve fit the tensor budget (streamed, or by a
smaller micro-batch, if need be), eagerly where they do not; the plan says which in a note."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from edgetl.memory import search
from edgetl.plan.document import GraphMemory, Plan, PlanConfig
from edgetl.plan.verify import configured_network
from edgetl.units import MB

GRAPH_NOTE = "on the device finetune captures the step as CUDA graphs"
# micro-batches below this are each tried, largest first; above it the bisection of the tensors'
# search finds a boundary (what graphs reserve need not grow with the micro-batch)
EXHAUSTIVE_BELOW = 16


class GraphChoice(NamedTuple):
    """How the planned configuration's step runs on the device: ``config`` (its micro-batch
    perhaps smaller than the eager pick's), its figures captured as graphs where they fit
    (``graphs``), else the figures of the pick's graphs that did not (``over``, the step then
    runs eagerly) and the micro-batch whose graphs came nearest (``least``: micro-batch, figures);
    ``replays``: captured steps replayed to decide."""

    config: PlanConfig
    graphs: GraphMemory | None
    over: GraphMemory | None
    replays: int
    least: tuple[int, GraphMemory] | None = None


def graph_memory(base, config: PlanConfig, *, resolution: int, predicted_bytes: int,
                 capability: tuple[int, int]) -> GraphMemory:
    """What ``config``'s step holds captured as CUDA graphs on a GPU of ``capability``: its
    network (``base``, the input backbone's spec with the plan's classes, plus the configuration's
    pruning, as the search's evaluator builds it) built and scheduled as finetune builds it,
    three steps traced on the meta device (a CPU copy where the optimizer's kernels are fused:
    they have no meta implementation) and replayed as ``CapturedStep`` runs them;
    ``predicted_bytes``: its runtime accounting."""
    from edgetl.memory.cuda_step import captured_report
    from edgetl.plan.path import remember

    key = (base.key(), repr(config), resolution, predicted_bytes, tuple(capability))
    if key not in _REPLAYED:
        spec = dataclasses.replace(base, hidden={**base.hidden, **config.kept})
        net, step = configured_network(spec, config, resolution, device="cpu" if config.fused else "meta")
        report = captured_report(net, runtime_bytes=predicted_bytes, resolution=resolution,
                                 batch_size=config.batch_size, step=step, capability=capability)
        remember(_REPLAYED, key, GraphMemory(tuple(capability), report.extra_bytes, report.total_bytes), 256)
    return _REPLAYED[key]


# graph_memory's figures by its arguments: the replay reads shapes alone, so the plans of one
# process (budgets swept, the same configuration fixed another way) share them
_REPLAYED: dict[tuple, GraphMemory] = {}


def with_graphs(chosen: PlanConfig, base, ev, budget: int, capability: tuple[int, int], *, resolution: int,
                can_stream: bool) -> GraphChoice:
    """The planned configuration ``chosen`` (its tensors within ``budget``) captured as CUDA
    graphs if they fit beside them. Where they do not and the plan may choose the micro-batch
    (``can_stream``: streaming is on its path and not fixed), the largest micro-batch below the
    pick's (or, unstreamed, below the batch) whose graphs fit: streaming costs no accuracy, and
    graphs launch the streamed step's thousands of kernels at once (docs/planner.md has the
    figures). What graphs reserve goes up and down with the micro-batch, so those below
    ``EXHAUSTIVE_BELOW`` are each tried, largest first, and larger ones bisected before them;
    a pick that recomputes drops it at that micro-batch where it fits without. ``ev``: the
    search's runtime accounting (``_Evaluator``)."""
    replays = 0
    figures: dict[tuple[int, bool], GraphMemory] = {}  # by (micro-batch, recompute)

    def graphs_at(stream: int, recompute: bool = chosen.recompute) -> GraphMemory:
        nonlocal replays
        if (stream, recompute) not in figures:
            # streamed, the batch comes as uint8 pixels
            config = dataclasses.replace(chosen, stream=stream, recompute=recompute)
            figures[stream, recompute] = graph_memory(
                base, config, resolution=resolution, capability=capability,
                predicted_bytes=ev.total(config.kept, config.storage, config.batch_size))
            replays += 1
        return figures[stream, recompute]

    def streamed(m: int) -> GraphChoice:
        """Streamed by ``m``, whose graphs fit: without recomputing if that fits too (recomputing
        runs segments forward twice)."""
        if chosen.recompute and graphs_at(m, False).total_bytes <= budget:
            return GraphChoice(dataclasses.replace(chosen, stream=m, recompute=False), graphs_at(m, False), None,
                               replays)
        return GraphChoice(dataclasses.replace(chosen, stream=m), graphs_at(m), None, replays)

    picked = graphs_at(chosen.stream)
    if picked.total_bytes <= budget:
        return GraphChoice(chosen, picked, None, replays)
    below = chosen.stream or chosen.batch_size  # an unstreamed step is one micro-batch of the batch
    if can_stream and below > 1:
        if below > EXHAUSTIVE_BELOW:  # a boundary among the large ones (EXHAUSTIVE_BELOW - 1: none there)
            m = search.largest_fitting(lambda m: graphs_at(m).total_bytes, budget, EXHAUSTIVE_BELOW - 1, below)
            if m >= EXHAUSTIVE_BELOW:
                return streamed(m)
        for m in range(min(below, EXHAUSTIVE_BELOW) - 1, 0, -1):
            if graphs_at(m).total_bytes <= budget:
                return streamed(m)
    (m, _), nearest = min(figures.items(), key=lambda item: item[1].total_bytes)
    return GraphChoice(chosen, None, picked, replays, (m, nearest))


def graph_note(plan: Plan, over: GraphMemory | None = None,
               least: tuple[int, GraphMemory] | None = None) -> str | None:
    """The note on how the planned step runs on a device with a GPU, or where an eager step was
    asked (None otherwise); ``over``: the figures of the pick's graphs that did not fit,
    ``least``: the micro-batch whose graphs came nearest, and its figures."""
    g = plan.cuda_graph
    if g is not None:
        return (f"{GRAPH_NOTE}: they reserve a predicted {g.extra_bytes / MB:.1f} MB beyond an eager run "
                f"(compute capability {g.capability[0]}.{g.capability[1]}), counted against the tensor budget: "
                f"{g.total_bytes / MB:.1f} MB with the tensors, of {plan.tensor_budget_bytes / MB:.1f} MB")
    if over is not None:
        m, nearest = least if least is not None else (plan.chosen.stream, over)
        at = f"streamed by {m}" if m and m != plan.chosen.stream else "as it is"
        need = math.ceil(nearest.total_bytes / 1e4) / 100  # rounded up: that budget does fit
        return (f"{GRAPH_NOTE} by default, but this step's would reserve a predicted {over.extra_bytes / MB:.1f} MB "
                f"beyond an eager run, {over.total_bytes / MB:.1f} MB with the tensors, over the tensor budget "
                f"{plan.tensor_budget_bytes / MB:.1f} MB: the plan runs it eagerly (finetune --plan sets "
                f"train.cuda_graph false); this configuration would run as graphs {at} in a tensor budget of "
                f"{need:.2f} MB")
    if plan.request.get("eager"):
        return ("planned for an eager step (--eager): finetune --plan runs it eagerly (train.cuda_graph false), "
                "launching each op of the step from Python")
    return None
