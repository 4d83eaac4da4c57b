"""The loop: a model, loaders, optimizer and settings in; epochs of steps, evaluation, metrics rows
and checkpoints out (``fit`` in ``edgetl.train`` builds it).

Resuming (``_resume``) loads ``last.pt`` into the model, optimizer, scheduler and scaler and
returns where the run left off; distillation mixes the teacher's logits into the loss.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgetl.errors import CapabilityError, ConfigError, DataError, DivergedError
from edgetl.io import atomic_torch_save
from edgetl.recipe import Recipe
from edgetl.step import Step, build_optimizer, set_train_mode
from edgetl.train.checkpoint import (
    BEST,
    CHECKPOINT_FORMAT,
    LAST,
    _recipe_differences,
    _restore_best,
    best_checkpoint,
    load_checkpoint,
)
from edgetl.train.distributed import _all_reduce_sum, _gather, is_main_process, torchrun_env, unwrap
from edgetl.train.folder import RECIPE_FILE, _write_metrics, read_metrics
from edgetl.train.graph import eager_state_dict, host_batch
from edgetl.train.rng import rng_state
from edgetl.train.schedule import build_scheduler

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.train")


def input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model takes its images in: the lean runtime's activation dtype, else fp32."""
    return getattr(unwrap(model), "input_dtype", torch.float32)


def input_memory_format(model: nn.Module) -> torch.memory_format:
    """The layout the model takes its images in: channels-last where the network was laid out
    so (``EdgeNet.to_channels_last``: retraining, or a lean runtime's ``LeanOptions.channels_last``),
    else contiguous. The batch is converted where it is moved to the device (``device_batch``):
    a network given the other layout converts it inside its first conv, in scratch memory no
    tensor meter sees."""
    return getattr(unwrap(model), "input_memory_format", torch.contiguous_format)


def device_batch(images: torch.Tensor, model: nn.Module, device: torch.device) -> torch.Tensor:
    """The loader's batch on ``device`` in the model's dtype and layout: one copy on a CPU; on
    another device both are changed on the host first, pinned memory kept pinned
    (``edgetl.train.graph.host_batch``), and the transfer is one plain copy."""
    layout, dtype = input_memory_format(model), input_dtype(model)
    if device.type != "cpu":
        images = host_batch(images, layout, dtype)
    return images.to(device, dtype=dtype, memory_format=layout, non_blocking=True)


@dataclass
class FitResult:
    """What a run produced; ``history`` has one metrics dict per epoch (as metrics.jsonl),
    ``skipped`` maps each image the loaders left out (data.on_bad_image: skip) to its fault."""

    out_dir: Path
    best_acc1: float | None
    best_epoch: int | None
    history: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    execution: str = "eager"  # how the step ran: CUDA graphs (edgetl.train.graph) or eager, and why

    @property
    def last_path(self) -> Path:
        return self.out_dir / LAST

    @property
    def best_path(self) -> Path:
        return self.out_dir / BEST


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext, None
    if device.type != "cuda":
        raise CapabilityError(
            f"model.precision {precision} needs a CUDA device for mixed-precision training; "
            f"this run is on {device.type} (use model.precision: fp32)"
        )
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return (lambda: torch.autocast("cuda", dtype=dtype)), scaler


def note_skipped(batch, skipped: dict[str, str] | None) -> None:
    """Record (and log once) the unreadable images a batch left out (edgetl.data.Batch.skipped)."""
    for sample in getattr(batch, "skipped", ()):
        if skipped is not None and sample.path not in skipped:
            skipped[sample.path] = sample.reason
            log.warning("skipped unreadable image %s: %s", sample.path, sample.reason)


def evaluate(
    model: nn.Module, loader, device: torch.device | str, precision: str = "fp32",
    skipped: dict[str, str] | None = None,
) -> dict[str, float]:
    """Top-1 accuracy (%) and mean cross-entropy (no smoothing) over the loader, summed over ranks.

    ``skipped`` collects path -> fault of images the loader left out (data.on_bad_image: skip).
    """
    from edgetl.data import loader_errors

    device = torch.device(device)
    autocast, _ = _autocast(device, precision)
    model = unwrap(model)
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    with torch.no_grad(), autocast(), loader_errors():
        for batch in loader:
            note_skipped(batch, skipped if skipped is not None else {})
            images, labels = batch
            if images is None:
                continue
            images = device_batch(images, model, device)
            labels = labels.to(device, non_blocking=True)
            logits = model(images).float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(1) == labels).sum().item()
            count += labels.numel()
    model.train(was_training)
    loss_sum, correct, count = _all_reduce_sum([loss_sum, correct, count], device)
    if count == 0:
        raise DataError("the validation set is empty")
    return {"loss": loss_sum / count, "acc1": 100.0 * correct / count, "count": int(count)}


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hinton's KL(teacher || student) at temperature T, scaled by T^2."""
    t = temperature
    return F.kl_div(
        F.log_softmax(student / t, dim=1), F.log_softmax(teacher / t, dim=1),
        reduction="batchmean", log_target=True,
    ) * (t * t)


def _distill_mix(distill, teacher: nn.Module, images: torch.Tensor) -> Callable:
    """(loss, student logits) -> the distillation mix with the teacher's logits on ``images``."""
    def mix(loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logits = teacher(images)
        return (1 - distill.weight) * loss + distill.weight * distill_loss(
            logits.float(), t_logits.float(), distill.temperature)

    return mix


def _check_fit(sampler, recipe: Recipe, teacher: nn.Module | None, world: int) -> None:
    """Refuse a call whose process group, loader sharding and distillation settings disagree."""
    if torchrun_env() is not None and world == 1:
        raise ConfigError("started by torchrun but no process group: call edgetl.train.setup_distributed() first")
    if getattr(sampler, "num_replicas", 1) != world:
        raise ConfigError(
            f"the training loader is sharded for {getattr(sampler, 'num_replicas', 1)} processes but "
            f"{world} are running; build loaders after setup_distributed()"
        )
    if teacher is not None and recipe.distill is None:
        raise ConfigError("a teacher was given but the recipe has no distill section")
    if recipe.distill is not None and teacher is None:
        raise ConfigError("the recipe's distill section needs a teacher model (distill.teacher)")


def _optimizer_and_schedule(model: nn.Module, train_loader, sampler, recipe: Recipe, step_spec: Step,
                            param_groups: list[dict] | None, optimizer_factory) -> tuple[Any, Any, int]:
    """The optimizer over ``param_groups`` (default: the step's), its per-iteration schedule
    and the steps of an epoch (a loader without batches is refused)."""
    groups = param_groups if param_groups is not None else step_spec.param_groups(model)
    optimizer = (optimizer_factory or (lambda g: build_optimizer(g, recipe.optim)))(groups)
    if hasattr(sampler, "set_start"):
        sampler.set_start(0)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise DataError("the training loader yields no batches (fewer samples than one batch?)")
    scheduler = build_scheduler(optimizer, recipe.optim, steps_per_epoch, recipe.train.epochs)
    return optimizer, scheduler, steps_per_epoch


@dataclass
class _Progress:
    """Where a fit call stands: what last.pt records and what the loop has gathered."""

    start_epoch: int = 0
    start_step: int = 0
    best_acc1: float | None = None
    best_epoch: int | None = None
    # train loss sum, correct, count of the epoch in progress
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    history: list[dict] = field(default_factory=list)
    rank_rng: dict | None = None  # this rank's RNG states from last.pt
    saved: tuple[int, int] | None = None  # where the newest last.pt resumes
    created: list[Path] = field(default_factory=list)  # what this call made, removed if it fails before its first last.pt
    skipped: dict[str, str] = field(default_factory=dict)


def _class_names(loader) -> list[str] | None:
    classes = getattr(getattr(loader, "dataset", None), "classes", None)
    return None if classes is None else [str(c) for c in classes]


def _describe_classes(classes: list[str]) -> str:
    shown = ", ".join(map(repr, classes[:4])) + (", ..." if len(classes) > 4 else "")
    return f"{len(classes)} classes ({shown})"


def _resume(out_dir: Path, recipe: Recipe, model: nn.Module, optimizer, scheduler, scaler,
            rank: int, world: int, train_loader=None) -> _Progress:
    """Load ``out_dir/last.pt`` into the model, optimizer, scheduler and scaler; where it left off."""
    last_path = out_dir / LAST
    progress = _Progress()
    ckpt = load_checkpoint(last_path)
    diff = _recipe_differences(ckpt["recipe"], recipe.to_dict())
    if diff:
        raise ConfigError(
            f"cannot resume {out_dir}: the recipe differs in {', '.join(diff[:4])}"
            f"{' ...' if len(diff) > 4 else ''} (see {out_dir / RECIPE_FILE})"
        )
    if ckpt["step_in_epoch"] > 0 and ckpt["world_size"] != world:
        raise ConfigError(
            f"cannot resume {last_path} mid-epoch with {world} processes; it was written by "
            f"{ckpt['world_size']} (the data order depends on it)"
        )
    saved_classes, classes = ckpt.get("classes"), _class_names(train_loader)
    if saved_classes is not None and classes is not None and list(saved_classes) != list(classes):
        raise ConfigError(f"cannot resume {out_dir}: it was trained on {_describe_classes(saved_classes)}, "
                          f"the data now has {_describe_classes(classes)}; fine-tune into a new folder")
    try:
        unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(f"cannot resume {out_dir}: its {LAST} holds another network than the one asked "
                          f"for ({detail}); fine-tune into a new folder") from None
    scheduler.load_state_dict(ckpt["scheduler"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    progress.start_epoch, progress.start_step = ckpt["epoch"], ckpt["step_in_epoch"]
    progress.best_acc1, progress.best_epoch = ckpt["best_acc1"], ckpt["best_epoch"]
    states = ckpt["rank_state"]
    if rank < len(states) and ckpt["world_size"] == world:
        progress.rank_rng = states[rank]["rng"]
        progress.sums = [float(v) for v in states[rank]["sums"].tolist()]
    progress.history = [r for r in read_metrics(out_dir) if r["epoch"] <= progress.start_epoch]
    log.info("resuming %s at epoch %d step %d", out_dir, progress.start_epoch + 1, progress.start_step)
    if is_main_process():
        _restore_best(out_dir, ckpt)
    return progress


@dataclass(frozen=True)
class _LoopSettings:
    """What a fit call fixed before the loop starts: the recipe, where and how it runs."""

    recipe: Recipe
    out_dir: Path
    device: torch.device
    world: int
    step_spec: Step
    amp_precision: str
    steps_per_epoch: int
    skipping: bool  # the training set skips unreadable images (data.on_bad_image: skip)
    on_step: Callable[[dict], None] | None = None
    on_epoch: Callable[[dict], None] | None = None


@dataclass
class _Pending:
    """A step's loss and top-1 hits on their way to the host: copied without waiting for the
    device, read (``_Loop.settle``) once the next step has been launched, so no step waits for
    the one before it to finish (a captured step is one launch)."""

    epoch: int
    step: int
    count: int
    values: torch.Tensor  # (loss, correct) in host memory, pinned on CUDA
    done: torch.cuda.Event | None  # recorded after the copy (CUDA); None: the copy has finished
    lr: float  # the first group's learning rate after the step (what the progress line shows)


def _to_host(loss: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(loss, correct) copied to host memory without a host synchronisation, and the event that
    says the copy is done (None on CPU, where the copy has finished)."""
    values = torch.stack((loss.detach().float(), correct.float()))
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(2, dtype=torch.float32, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(values.device))
    return host, done


@dataclass
class _Loop:
    """What a fit call trains with, and its progress; the methods are the loop's parts."""

    model: nn.Module
    net: nn.Module  # ``model``, or its DDP wrapper
    teacher: nn.Module | None
    train_loader: Any
    sampler: Any  # the training loader's
    val_loader: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    autocast: Callable
    run_step: Callable  # edgetl.step.training_step, as fit found it in edgetl.train
    settings: _LoopSettings
    progress: _Progress
    captured: Any = None  # edgetl.train.graph.CapturedStep: the step as CUDA graphs; None: eager
    pending: _Pending | None = None  # the newest step whose loss the host has not read yet

    @property
    def lr(self) -> float:
        """The first group's learning rate, as the schedule set it: the LambdaLR's own rule on
        its numbers (a captured step's rates are device tensors, which a read would wait for)."""
        sched = self.scheduler
        return float(sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch))

    def diverged(self, where: str, what: str) -> DivergedError:
        """The one-line error of a diverged run, with its likely cause."""
        r = self.settings.recipe
        if r.model.precision == "fp16" and self.scaler is None:
            cause = "fp16 activations without loss scaling: try model.precision bf16 or fp32"
        else:
            rates = {k: getattr(r.optim, k) for k in ("lr", "lr_side", "lr_head") if getattr(r.optim, k, None)}
            given = ", ".join(f"optim.{k} = {v:g}" for k, v in rates.items())
            cause = f"a learning rate too high ({given}): try one 10x lower"
        return DivergedError(f"training diverged at {where}: {what}; likely cause: {cause}. "
                             f"No non-finite weights were saved")

    def check_finite_weights(self, where: str) -> None:
        """Refuse to save weights that hold NaN or inf (every rank holds the same weights)."""
        for name, t in unwrap(self.model).state_dict().items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise self.diverged(where, f"{name} holds non-finite values")

    def save(self, epoch: int, step: int, best: bool = False) -> None:
        """last.pt, then (``best``) best.pt: weights only, as nothing resumes from it."""
        self.check_finite_weights(f"epoch {epoch + 1} step {step}" if step else f"the end of epoch {epoch}")
        p, s = self.progress, self.settings
        # Collective (gathers every rank's RNG state), so every rank calls it.
        state = _gather({"rng": rng_state(), "sums": torch.tensor(p.sums, dtype=torch.float64)})
        if not is_main_process():
            return
        ckpt = {
            "format": CHECKPOINT_FORMAT,
            "model": unwrap(self.model).state_dict(),
            "optimizer": eager_state_dict(self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": epoch,
            "step_in_epoch": step,
            "global_step": epoch * s.steps_per_epoch + step,
            "best_acc1": p.best_acc1,
            "best_epoch": p.best_epoch,
            "world_size": s.world,
            "rank_state": state,
            "recipe": s.recipe.to_dict(),
            "classes": _class_names(self.train_loader),
        }
        atomic_torch_save(ckpt, s.out_dir / LAST)
        p.saved = (epoch, step)
        p.created.clear()  # from here on the folder is a resumable run
        if best:
            atomic_torch_save(best_checkpoint(ckpt), s.out_dir / BEST)

    def save_mid_epoch(self, epoch: int, step: int) -> None:
        """last.pt after step ``step`` (0-based) when ``train.checkpoint_every`` says so."""
        every = self.settings.recipe.train.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.settings.steps_per_epoch:
            self.settle()
            self.save(epoch, step + 1)

    def train_epoch(self, epoch: int) -> tuple[float, int]:
        """One epoch's steps (from a resumed run's step on); returns its start time and images seen."""
        p, sampler, loader = self.progress, self.sampler, self.train_loader
        first = p.start_step if epoch == p.start_epoch else 0
        if epoch != p.start_epoch:
            p.sums = [0.0, 0.0, 0.0]
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if hasattr(sampler, "set_start"):
            sampler.set_start(first * loader.batch_size)
        batches = iter(loader)
        if first and not hasattr(sampler, "set_start"):
            log.warning("loader cannot start mid-epoch; skipping %d batches", first)
            for _ in range(first):
                next(batches)
        set_train_mode(self.net, self.settings.recipe.model.bn)
        t0, seen = time.perf_counter(), 0
        for step, batch in enumerate(batches, start=first):
            seen += self.train_step(epoch, step, batch)
        self.settle()
        return t0, seen

    def train_step(self, epoch: int, step: int, batch) -> int:
        """One optimizer step on ``batch`` (skipped if too few of its images were readable);
        returns the images it trained on."""
        p, s = self.progress, self.settings
        device = s.device
        note_skipped(batch, p.skipped)
        images, labels = batch
        # every image (or all but one: BatchNorm needs two) of this batch was unreadable
        too_few = images is None or len(labels) < min(2, self.train_loader.batch_size)
        if s.world > 1 and s.skipping:  # every rank skips the step, or none (DDP all-reduces)
            too_few = _all_reduce_sum([float(too_few)], device)[0] > 0
        if too_few:
            log.warning("epoch %d step %d: too few readable images left; step skipped", epoch + 1, step + 1)
            self.scheduler.step()
            self.save_mid_epoch(epoch, step)
            return 0
        if self.captured is not None:  # copies the batch into its static buffers
            loss, correct = self.captured(images, labels)
        else:
            images = device_batch(images, self.model, device)
            labels = labels.to(device, non_blocking=True)
            mix = None
            if s.recipe.distill is not None:
                mix = _distill_mix(s.recipe.distill, self.teacher, images)
            loss, correct = self.run_step(self.net, s.step_spec, self.optimizer, images, labels,
                                          autocast=self.autocast, scaler=self.scaler, mix=mix)
        values, done = _to_host(loss, correct)
        self.scheduler.step()
        self.settle()  # the step before this one, while this one runs
        self.pending = _Pending(epoch, step, labels.numel(), values, done, self.lr)
        self.save_mid_epoch(epoch, step)
        return labels.numel()

    def settle(self) -> None:
        """Read the pending step's loss and hits (waiting for its copy only): the divergence
        guard, the epoch's sums and the progress callback, one step after the step ran."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        p, s = self.progress, self.settings
        if pending.done is not None:
            pending.done.synchronize()
        loss_value, correct = (float(v) for v in pending.values.tolist())
        bad = not math.isfinite(loss_value)
        if s.world > 1:  # every rank stops, or none (the others would wait in the next all-reduce)
            bad = _all_reduce_sum([float(bad)], s.device)[0] > 0
        epoch, step = pending.epoch, pending.step
        if bad:
            raise self.diverged(f"epoch {epoch + 1} step {step + 1}", f"the loss is {loss_value}")
        n = pending.count
        p.sums[0] += loss_value * n
        p.sums[1] += correct
        p.sums[2] += n
        if s.on_step is not None:
            s.on_step({
                "epoch": epoch, "epochs": s.recipe.train.epochs, "step": step + 1,
                "steps": s.steps_per_epoch, "global_step": epoch * s.steps_per_epoch + step + 1,
                "loss": loss_value, "lr": pending.lr,
            })

    def end_epoch(self, epoch: int, t0: float, seen: int) -> None:
        """The epoch's metrics row (evaluated when due), metrics files, last.pt and best.pt."""
        p, s = self.progress, self.settings
        loss_sum, correct, count = _all_reduce_sum(p.sums, s.device)
        elapsed = time.perf_counter() - t0
        row: dict[str, Any] = {
            "epoch": epoch + 1,
            "global_step": (epoch + 1) * s.steps_per_epoch,
            "lr": self.lr,
            "train_loss": loss_sum / max(count, 1),
            "train_acc1": 100.0 * correct / max(count, 1),
            "val_loss": None,
            "val_acc1": None,
            "epoch_time_s": elapsed,
            "images_per_s": seen * s.world / elapsed if elapsed > 0 else None,
        }
        improved = self.evaluate_epoch(epoch, row)
        p.history.append(row)
        p.sums = [0.0, 0.0, 0.0]
        if is_main_process():
            _write_metrics(s.out_dir, p.history)
            log.info("epoch %d/%d: %s", epoch + 1, s.recipe.train.epochs, row)
        self.save(epoch + 1, 0, best=improved)
        if s.on_epoch is not None:
            s.on_epoch(row)

    def evaluate_epoch(self, epoch: int, row: dict[str, Any]) -> bool:
        """Evaluate when ``train.eval_every`` (or the last epoch) says so, into ``row``;
        returns whether the accuracy is the best yet."""
        p, s = self.progress, self.settings
        epochs = s.recipe.train.epochs
        if not ((epoch + 1) % s.recipe.train.eval_every == 0 or epoch + 1 == epochs):
            return False
        metrics = evaluate(self.net, self.val_loader, s.device, s.amp_precision, p.skipped)
        row["val_loss"], row["val_acc1"] = metrics["loss"], metrics["acc1"]
        if p.best_acc1 is None or metrics["acc1"] > p.best_acc1:
            p.best_acc1, p.best_epoch = metrics["acc1"], epoch + 1
            return True
        return False
