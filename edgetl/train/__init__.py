"""Training: a model, loaders and a Recipe in, a run folder (recipe, metrics, last.pt, best.pt) out.

The one loop ``edgetl finetune`` and ``edgetl retrain`` share, in the style of the
torchvision references: per-iteration cosine schedule (optional linear warmup), label
smoothing, Adam or SGD, autocast + GradScaler on CUDA, per-epoch evaluation, optional
distillation from a teacher, torchrun/DDP. Checkpoints (``last.pt`` and ``best.pt``
only) are plain dicts written atomically and loadable with ``weights_only=True``; a
mid-epoch ``last.pt`` every ``train.checkpoint_every`` steps carries the step, the
optimizer/scheduler/scaler states and every rank's RNG states, so a resumed run ends
with exactly the weights an uninterrupted one would (the data order and augmentation
are functions of seed, epoch and index: see edgetl.data). ``best.pt`` holds the weights
only (no optimizer state): nothing resumes from it.

Failures: before the run folder is made, the disk is checked for everything the run will
write (``disk_need``). At an epoch end ``last.pt`` is written before ``best.pt``, so a
failed write leaves a resumable ``last.pt`` (``best.pt``, if it lags, is restored from it
on resume). A run that fails before its first ``last.pt`` removes the files it wrote and
the folder it made; one that fails later keeps them and its error says how to resume.

Rooms: ``loop`` (the epoch and step loop, evaluation, distillation, resuming), ``checkpoint``
(last.pt and best.pt: format, size bounds, what a resume may change), ``folder`` (the run
folder: disk check, recipe.yaml, metrics files, clean-up after a failure), ``schedule`` (the
learning rate), ``rng`` (seeds and RNG states), ``distributed`` (torchrun, the process group),
``graph`` (the step captured as CUDA graphs and replayed, and when it cannot be).
``fit`` stays here: it hands the loop ``training_step`` as found in this namespace, where a
caller (a test) may replace it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from edgetl.recipe import Recipe
from edgetl.step import Step, ddp_wrap, training_step  # fit passes the loop this name's value
from edgetl.train.checkpoint import (
    ADDED_SETTINGS,
    BEST,
    CHECKPOINT_FORMAT,
    FILE_BYTES_FIXED,
    FILE_BYTES_PER_TENSOR,
    LAST,
    RESUME_MAY_CHANGE,
    best_checkpoint,
    checkpoint_bytes,
    load_checkpoint,
    optimizer_state_shapes,
    saved_file_bytes,
)
from edgetl.train.distributed import (
    cleanup_distributed,
    exit_worker,
    get_rank,
    get_world_size,
    is_main_process,
    setup_distributed,
    torchrun_env,
    unwrap,
)
from edgetl.train.folder import (
    METADATA_BYTES,
    METRICS_CSV,
    METRICS_JSONL,
    RECIPE_FILE,
    _after_failure,
    _start_run_folder,
    check_disk,
    check_run_folder,
    disk_need,
    read_metrics,
)
from edgetl.train.loop import (
    FitResult,
    _Loop,
    _LoopSettings,
    _Progress,
    _autocast,
    _check_fit,
    _optimizer_and_schedule,
    _resume,
    distill_loss,
    evaluate,
    input_dtype,
    input_memory_format,
    note_skipped,
)
from edgetl.train.graph import CapturedStep, rate_changes, why_eager
from edgetl.train.rng import rng_state, seed_everything, set_rng_state
from edgetl.train.schedule import build_scheduler, lr_factor, warmup_steps

log = logging.getLogger("edgetl.train")

__all__ = [
    "ADDED_SETTINGS",
    "BEST",
    "CHECKPOINT_FORMAT",
    "CapturedStep",
    "FILE_BYTES_FIXED",
    "FILE_BYTES_PER_TENSOR",
    "FitResult",
    "LAST",
    "METADATA_BYTES",
    "METRICS_CSV",
    "METRICS_JSONL",
    "RECIPE_FILE",
    "RESUME_MAY_CHANGE",
    "best_checkpoint",
    "build_scheduler",
    "check_disk",
    "check_run_folder",
    "checkpoint_bytes",
    "cleanup_distributed",
    "disk_need",
    "distill_loss",
    "evaluate",
    "exit_worker",
    "fit",
    "get_rank",
    "get_world_size",
    "input_dtype",
    "input_memory_format",
    "is_main_process",
    "load_checkpoint",
    "lr_factor",
    "note_skipped",
    "optimizer_state_shapes",
    "read_metrics",
    "rng_state",
    "saved_file_bytes",
    "seed_everything",
    "set_rng_state",
    "setup_distributed",
    "torchrun_env",
    "unwrap",
    "warmup_steps",
    "why_eager",
]


def fit(
    *,
    model: nn.Module,
    train_loader,
    val_loader,
    recipe: Recipe,
    out_dir: str | Path,
    device: torch.device | str = "cpu",
    param_groups: list[dict] | None = None,
    optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
    resume: bool = False,
    on_step: Callable[[dict], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    teacher: nn.Module | None = None,
    final_files: dict[str, int] | None = None,
    amp: bool = True,
    before_capture: Callable[[nn.Module], None] | None = None,
) -> FitResult:
    """Train ``model`` per ``recipe``, evaluating every epoch; write the run folder.

    Args:
        model: the network, trainability already set (edgetl.models.side.set_trainable).
        train_loader: from edgetl.data.build_loader(train=True): its ResumableSampler makes
            the data order reproducible and lets a resumed run start mid-epoch.
        val_loader: evaluation loader (edgetl.data.build_loader(train=False)).
        recipe: the resolved recipe; its optim and train sections drive the loop.
        out_dir: run folder: recipe.yaml, metrics.csv, metrics.jsonl, last.pt, best.pt.
        device: where to train; the model is moved there.
        param_groups: optimizer groups; default ``edgetl.step.param_groups(model, recipe.optim)``.
        optimizer_factory: groups -> optimizer; default from recipe.optim.
        resume: continue from ``out_dir/last.pt`` (required if it exists, error if not).
        on_step: called after each step with {epoch, epochs, step, steps, global_step,
            loss, lr} (the CLI draws progress from it; the library never prints).
        on_epoch: called after each epoch with that epoch's metrics row.
        teacher: distillation teacher (needs the recipe's distill section).
        final_files: name -> size bound of what the caller writes into ``out_dir`` after
            training (e.g. finetune's model.pt), for the disk check.
        amp: run ``model.precision`` as autocast (CUDA). False: the model keeps its own
            dtypes (the lean runtime casts inside its layers) and the recipe still records
            the precision it asked for, so a resumed run continues the same way.
        before_capture: called with ``model`` (not yet moved) when the step will be captured as
            CUDA graphs, before anything is written; it may refuse the run by raising
            (``edgetl.finetune``'s budget check of the graph's memory).

    Under torchrun call ``setup_distributed`` before building the loaders; the model is
    then wrapped in DDP and only rank 0 writes.
    """
    device = torch.device(device)
    out_dir = Path(out_dir)
    rank, world = get_rank(), get_world_size()
    sampler = getattr(train_loader, "sampler", None)
    _check_fit(sampler, recipe, teacher, world)
    amp_precision = recipe.model.precision if amp else "fp32"
    autocast, scaler = _autocast(device, amp_precision)
    check_run_folder(out_dir, resume)
    eager = why_eager(recipe, device, world=world, scaler=scaler, teacher=teacher, model=model)
    if eager is not None and recipe.train.cuda_graph:  # recipe.yaml records what runs
        log.info("the training step runs eagerly: %s", eager)
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, cuda_graph=False))
    if eager is None and before_capture is not None:
        before_capture(model)

    model.to(device)
    if teacher is not None:
        teacher.to(device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    step_spec = Step.from_recipe(recipe, ddp=world > 1)
    optimizer, scheduler, steps_per_epoch = _optimizer_and_schedule(
        model, train_loader, sampler, recipe, step_spec, param_groups, optimizer_factory)

    progress = _Progress()
    if resume:
        progress = _resume(out_dir, recipe, model, optimizer, scheduler, scaler, rank, world, train_loader)
    try:
        with contextlib.ExitStack() as stack:  # the run folder's lock, until the loop ends
            _start_run_folder(out_dir, recipe, model, optimizer, world, final_files, resume, stack,
                              progress.created)
            progress.saved = (progress.start_epoch, progress.start_step) if resume else None
            net = ddp_wrap(model, step_spec, device) if step_spec.ddp else model
            captured = None if eager is not None else CapturedStep(
                training_step, net, step_spec, optimizer, device, dtype=input_dtype(model),
                memory_format=input_memory_format(model), autocast=autocast,
                tensor_lr=rate_changes(recipe))
            if captured is not None:  # the graphs go when the loop ends, however it ends
                stack.callback(captured.release)

            if progress.rank_rng is not None:
                set_rng_state(progress.rank_rng)
            elif not resume or progress.start_step == 0:
                # Dropout etc. differ between ranks but are fixed by the seed.
                seed_everything(recipe.train.seed + rank)

            settings = _LoopSettings(
                recipe=recipe, out_dir=out_dir, device=device, world=world, step_spec=step_spec,
                amp_precision=amp_precision, steps_per_epoch=steps_per_epoch,
                skipping=getattr(train_loader.dataset, "skip_bad", False),  # data.on_bad_image: skip
                on_step=on_step, on_epoch=on_epoch,
            )
            loop = _Loop(model=model, net=net, teacher=teacher, train_loader=train_loader, sampler=sampler,
                         val_loader=val_loader, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                         autocast=autocast, run_step=training_step, settings=settings, progress=progress,
                         captured=captured)
            for epoch in range(progress.start_epoch, recipe.train.epochs):
                t0, seen = loop.train_epoch(epoch)
                loop.end_epoch(epoch, t0, seen)
    except BaseException as exc:
        failure = _after_failure(exc, out_dir, progress.created, progress.saved)
        if failure is not exc:
            raise failure from None
        raise
    return FitResult(out_dir=out_dir, best_acc1=progress.best_acc1, best_epoch=progress.best_epoch,
                     history=progress.history, skipped=progress.skipped,
                     execution=captured.describe() if captured is not None else f"eager: {eager}")
