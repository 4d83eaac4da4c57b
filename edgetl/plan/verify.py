"""Verify a plan: the plan in, the measured peak of real training steps of the planned network out."""

from __future__ import annotations

import copy
import logging

from edgetl.plan.document import Plan, PlanConfig
from edgetl.plan.ladder import plan_step

log = logging.getLogger(__name__)


def planned_network(plan: Plan, *, device: str = "cpu", seed: int = 0):
    """The planned network (random weights drawn from ``seed``, the global random state
    untouched) with the step the plan predicted (and finetune runs): its schedule fitted and
    applied, its optimizer fused and updating inside backward where the plan says so.
    Returns (network, step)."""
    return configured_network(plan.spec, plan.chosen, plan.resolution, device=device, seed=seed)


def configured_network(spec, config: PlanConfig, resolution: int, *, device: str = "cpu", seed: int = 0):
    """``planned_network`` for any configuration of a plan's path: ``spec`` the backbone with
    its pruning (``Plan.spec``). Returns (network, step)."""
    import torch

    from edgetl.memory.schedule import prepare_step
    from edgetl.models.side import build_network

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_network(copy.deepcopy(spec), config.mode, device=device, lean=config.lean)
    step = plan_step(config.storage)
    prepare_step(net, resolution=resolution, batch_size=config.batch_size, step=step)
    return net, step


def verify_plan(plan: Plan, *, steps: int = 3, device: str = "cpu", seed: int = 0) -> int:
    """Build the planned network (random weights) and measure real training steps; returns bytes.

    Also stores the measurement in ``plan.measured_bytes``.
    """
    from edgetl.memory.meter import measure_training_peak

    net, step = planned_network(plan, device=device, seed=seed)
    c = plan.chosen
    measured = measure_training_peak(net, resolution=plan.resolution, batch_size=c.batch_size,
                                     steps=steps, step=step, device=device, seed=seed)
    plan.measured_bytes, plan.verify_steps = int(measured), steps
    log.info("verify: predicted %d, measured %d bytes", plan.predicted_bytes, measured)
    return int(measured)
