"""Learning-rate schedule: the optim section and the run's length in, a per-iteration LambdaLR out."""

from __future__ import annotations

import logging
import math

import torch

from edgetl.recipe import OptimConfig

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.train")


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base rate before optimizer step ``step`` (0-based).

    Linear warmup from 1/warmup_steps to 1, then cosine from 1 to 0 at ``total_steps``
    (or constant).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, steps_per_epoch: int, epochs: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-iteration schedule (stepped after every optimizer step)."""
    total = steps_per_epoch * epochs
    warmup = warmup_steps(optim, steps_per_epoch, epochs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup, optim.schedule))


def warmup_steps(optim: OptimConfig, steps_per_epoch: int, epochs: int) -> int:
    """Warmup length in steps; a run shorter than twice its warmup warms up for half its steps.

    (A recipe's warmup is written for its full length, e.g. 1 of 10 epochs; a 1-epoch trial
    run of it would otherwise be all warmup and never anneal.)
    """
    total = steps_per_epoch * epochs
    wanted = int(round(optim.warmup_epochs * steps_per_epoch))
    if wanted > total // 2:
        log.warning("optim.warmup_epochs %g is too long for a %d-epoch run: warming up for %d of %d steps",
                    optim.warmup_epochs, epochs, total // 2, total)
        return total // 2
    return wanted
