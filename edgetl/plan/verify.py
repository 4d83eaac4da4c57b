"""Verify a plan: the plan in, the measured peak of real training steps of the planned network out."""

from __future__ import annotations

import copy
import logging

from edgetl.plan.document import Plan
from edgetl.plan.ladder import plan_step

log = logging.getLogger(__name__)
GRAPH_NOTE = "on the device finetune captures the step as CUDA graphs"


def verify_plan(plan: Plan, *, steps: int = 3, device: str = "cpu", seed: int = 0) -> int:
    """Build the planned network (random weights) and measure real training steps; returns bytes.

    Also stores the measurement in ``plan.measured_bytes``. For a CUDA device (a preset with a
    CUDA context) the same steps' trace is replayed as finetune captures the step there (CUDA
    graphs, ``edgetl.memory.cuda.replay_captured``), and a note says what the graphs reserve
    beyond an eager run and whether the tensors and that still fit the tensor budget.
    """
    import torch

    from edgetl.memory.meter import measure_training_memory
    from edgetl.memory.schedule import prepare_step
    from edgetl.models.side import build_network
    from edgetl.plan.devices import device_preset

    c = plan.chosen
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_network(copy.deepcopy(plan.spec), c.mode, device=device, lean=c.lean)
    # the step the plan predicted (and finetune runs): its schedule fitted and applied, its
    # optimizer fused and updating inside backward where the plan says so
    step = plan_step(c.storage)
    prepare_step(net, resolution=plan.resolution, batch_size=c.batch_size, step=step)
    graphs = device_preset(plan.device).cuda_context_bytes > 0 and steps >= 2
    got = measure_training_memory(net, resolution=plan.resolution, batch_size=c.batch_size, steps=steps,
                                  step=step, device=device, seed=seed, record_trace=graphs)
    measured = got.peak_bytes
    plan.measured_bytes, plan.verify_steps = int(measured), steps
    if graphs:  # one such note, however often the plan is verified
        plan.notes[:] = [n for n in plan.notes if not n.startswith(GRAPH_NOTE)] + [_graph_note(plan, got.trace)]
    log.info("verify: predicted %d, measured %d bytes", plan.predicted_bytes, measured)
    return int(measured)


def _graph_note(plan: Plan, trace: list) -> str:
    """What the step captured as CUDA graphs (finetune's default on a CUDA device) holds against
    the plan's tensor budget, for a Jetson Orin (sm87)."""
    from edgetl.memory.cuda import JETSON_ORIN, cublas_workspace_bytes, cublaslt_workspace_bytes, replay_captured
    from edgetl.memory.cuda_step import CapturedReport
    from edgetl.units import MB

    report = CapturedReport(plan.predicted_bytes, replay_captured(
        trace, cublas_workspace=cublas_workspace_bytes(JETSON_ORIN), cublaslt_workspace=cublaslt_workspace_bytes()),
        JETSON_ORIN)
    budget = plan.tensor_budget_bytes
    verdict = ("within it" if report.total_bytes <= budget else
               "over it: finetune refuses the plan with graphs; add --eager, or plan for the larger figure")
    return (f"{GRAPH_NOTE}: they reserve a predicted "
            f"{report.extra_bytes / MB:.1f} MB beyond an eager run, {report.total_bytes / MB:.1f} MB with the "
            f"tensors against the tensor budget {budget / MB:.1f} MB, {verdict} (Jetson Orin, the --verify "
            "steps' trace)")
