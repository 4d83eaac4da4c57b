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
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from edgetl.errors import CapabilityError, ConfigError, DataError, DivergedError, EdgetlError, ResourceError
from edgetl.io import (
    MB,
    atomic_torch_save,
    atomic_write_text,
    existing_folder,
    free_bytes,
    tensor_bytes,
    tensors_in,
)
from edgetl.recipe import OptimConfig, Recipe
from edgetl.runfolder import MANIFEST, Manifest, check_output_folder, run_lock
from edgetl.step import Step, build_optimizer, ddp_wrap, set_train_mode, training_step

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "edgetl-checkpoint/1"
LAST, BEST = "last.pt", "best.pt"
RECIPE_FILE = "recipe.yaml"
METRICS_CSV, METRICS_JSONL = "metrics.csv", "metrics.jsonl"
# Recipe keys that may change between a run and its resume without changing the result.
# Streaming, recomputing and a uint8 batch change where the bytes go, not what is computed.
RESUME_MAY_CHANGE = ("data.root", "data.download", "data.on_bad_image", "train.workers",
                     "model.stream", "model.uint8_input", "model.recompute")
# settings added after checkpoints were first written: one that a checkpoint lacks ran as this
ADDED_SETTINGS = {"optim.foreach": False, "model.stream": 0, "model.uint8_input": False,
                  "model.recompute": False, "optim.fused": False}
# Upper bounds of what torch.save adds to the tensor data: zip headers, 64-byte alignment and
# pickled key names per tensor (about 330 B measured), the pickle, recipe and RNG states.
FILE_BYTES_PER_TENSOR = 512
FILE_BYTES_FIXED = 64 * 1024
METADATA_BYTES = 256 * 1024  # recipe.yaml, metrics.csv/jsonl


# --- distributed helpers ---------------------------------------------------------------


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun with more than one process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


def setup_distributed(device: torch.device | str = "cpu") -> torch.device:
    """Join the torchrun process group if there is one (gloo on CPU, nccl on CUDA).

    Call before building loaders, so they shard. Returns the device this process uses
    (``cuda:LOCAL_RANK`` for a CUDA device).
    """
    device = torch.device(device)
    env = torchrun_env()
    if env is None:
        return device
    rank, world, local_rank = env
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        log.info("process group ready: rank %d of %d (%s)", rank, world, dist.get_backend())
    return device


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Only rank 0 logs and writes files."""
    return get_rank() == 0


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _gather(obj: Any) -> list[Any]:
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- seeds and RNG state ---------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and random; call before building the model."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every generator's state as tensors and numbers (loadable with weights_only=True)."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "python_version": int(version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": gauss,
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state((
        "MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
        state["numpy_has_gauss"], state["numpy_gauss"],
    ))
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))


# --- optimizer and schedule ------------------------------------------------------------


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


# --- checkpoints -----------------------------------------------------------------------


def input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model takes its images in: the lean runtime's activation dtype, else fp32."""
    return getattr(unwrap(model), "input_dtype", torch.float32)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (checkpoints hold its state_dict, not the wrapper's)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Read an edgetl checkpoint with ``weights_only=True``; one-line DataError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged file
        raise DataError(f"{path} is corrupted or not an edgetl checkpoint: {str(exc).splitlines()[0]}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise DataError(f"{path} is not an edgetl checkpoint (format {CHECKPOINT_FORMAT})")
    return ckpt


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _recipe_differences(saved: dict, current: dict) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    for key, value in ADDED_SETTINGS.items():
        a.setdefault(key, value)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUME_MAY_CHANGE)


def saved_file_bytes(tensors) -> int:
    """Upper bound of the size of a torch.save file holding ``tensors`` (nested dicts/lists)."""
    count = sum(1 for _ in tensors_in(tensors))
    return tensor_bytes(tensors) + FILE_BYTES_PER_TENSOR * count + FILE_BYTES_FIXED


def optimizer_state_shapes(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Empty (meta) tensors shaped like the state the optimizer will hold after its first step.

    Adam/AdamW: two moments like each parameter and a scalar step; SGD: a momentum buffer when
    momentum is on. Other optimizers are assumed to hold two moments (an upper bound for most).
    """
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(optimizer, torch.optim.SGD):
                moments, step = (1 if group.get("momentum") else 0), False
            else:
                moments, step = 2, True
            out += [torch.empty_like(p, device="meta") for _ in range(moments)]
            if step:
                out.append(torch.empty((), dtype=torch.float32, device="meta"))
    return out


def _meta_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def checkpoint_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int = 1) -> int:
    """Upper bound of the size of ``last.pt`` (optimizer given) or ``best.pt`` (weights only)."""
    size = saved_file_bytes(unwrap(model).state_dict())
    if optimizer is not None:
        state = optimizer_state_shapes(optimizer)
        rank_state = {"rng": rng_state(), "sums": torch.zeros(3, dtype=torch.float64)}
        size += _meta_bytes(state) + FILE_BYTES_PER_TENSOR * len(state)
        size += world_size * (saved_file_bytes(rank_state) - FILE_BYTES_FIXED)
    return size


def disk_need(out_dir: str | Path, files: dict[str, int]) -> tuple[int, int]:
    """(bytes a run still needs on disk, bytes free there) for a run folder writing ``files``.

    ``files`` maps file name to its size bound; the first two are last.pt and best.pt,
    rewritten through a temporary copy while the old one still exists, the rest (the
    stage's final artifacts) written once after them. Files already there (a resumed run)
    count as written.
    """
    out_dir = Path(out_dir)
    sizes = list(files.values())
    peak = sum(sizes[:2]) + max([*sizes[:2], sum(sizes[2:])]) + METADATA_BYTES
    present = sum((out_dir / name).stat().st_size for name in files if (out_dir / name).is_file())
    return max(0, peak - present), free_bytes(out_dir)


def check_disk(out_dir: str | Path, files: dict[str, int]) -> int:
    """Refuse (ResourceError, one line) a run whose files would not fit the free disk space."""
    need, free = disk_need(out_dir, files)
    if need > free:
        parts = ", ".join(f"{name} {size / MB:.1f}" for name, size in files.items())
        raise ResourceError(
            f"not enough disk space for run folder {out_dir}: it needs up to {need / MB:.1f} MB ({parts} MB, "
            f"and a checkpoint is written beside the old one before replacing it), "
            f"{free / MB:.1f} MB free in {existing_folder(out_dir)}"
        )
    log.info("disk: the run needs up to %.1f MB, %.1f MB free in %s", need / MB, free / MB, existing_folder(out_dir))
    return need


# --- metrics ---------------------------------------------------------------------------


def _write_metrics(out_dir: Path, history: list[dict]) -> None:
    """Rewrite metrics.jsonl and metrics.csv (one row an epoch), atomically."""
    atomic_write_text(out_dir / METRICS_JSONL, "".join(json.dumps(r) + "\n" for r in history))
    if not history:
        return
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(history[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    atomic_write_text(out_dir / METRICS_CSV, buf.getvalue())


def read_metrics(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / METRICS_JSONL
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- the loop --------------------------------------------------------------------------


def best_checkpoint(ckpt: dict) -> dict:
    """best.pt from a last.pt dict: the weights and where they come from, no optimizer state."""
    keys = ("format", "model", "epoch", "step_in_epoch", "global_step", "best_acc1", "best_epoch",
            "world_size", "recipe")
    return {k: ckpt[k] for k in keys}


def _restore_best(out_dir: Path, ckpt: dict) -> None:
    """Rewrite best.pt from last.pt when last.pt is the best epoch's end and best.pt lags.

    (last.pt is written first; a failure between the two writes leaves best.pt behind.)
    """
    best_epoch = ckpt["best_epoch"]
    if best_epoch is None:
        return
    path = out_dir / BEST
    try:
        held = load_checkpoint(path)["epoch"] if path.is_file() else None
    except DataError:
        held = None
    if held == best_epoch:
        return
    if ckpt["epoch"] == best_epoch and ckpt["step_in_epoch"] == 0:
        log.warning("%s lags %s (epoch %s, best %d): rewriting it from %s", BEST, LAST, held, best_epoch, LAST)
        atomic_torch_save(best_checkpoint(ckpt), path)
    else:
        log.warning("%s does not hold the best epoch %d and %s cannot restore it", path, best_epoch, LAST)


def _after_failure(exc: BaseException, out_dir: Path, created: list[Path], saved: tuple[int, int] | None):
    """Clean up or explain after the loop failed; returns the exception to raise.

    Before the first last.pt (``saved`` None) the files and folder this run made are removed:
    nothing of it could be resumed. Later the folder stays and an EdgetlError's message says
    from where ``--resume`` continues.
    """
    from edgetl.data import worker_error

    exc = worker_error(exc) or exc
    if not is_main_process():
        return exc
    if saved is None:
        for path in created:
            if path != out_dir:
                path.unlink(missing_ok=True)
        for name in (RECIPE_FILE, METRICS_CSV, METRICS_JSONL, LAST, BEST, MANIFEST):
            for tmp in out_dir.glob(f".{name}.*.tmp"):
                tmp.unlink(missing_ok=True)
        if out_dir in created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        return exc
    epoch, step = saved
    where = f"after epoch {epoch}" if step == 0 else f"at epoch {epoch + 1} step {step}"
    note = f"{out_dir} keeps {LAST} ({where}): add --resume to continue once that is fixed"
    if isinstance(exc, DivergedError):  # resuming the same recipe would diverge again
        note = f"{out_dir} keeps {LAST} ({where}), its last finite weights"
    if isinstance(exc, EdgetlError):
        exc.args = (f"{exc}; {note}",)
    else:
        log.warning(note)
    return exc


@dataclass
class FitResult:
    """What a run produced; ``history`` has one metrics dict per epoch (as metrics.jsonl),
    ``skipped`` maps each image the loaders left out (data.on_bad_image: skip) to its fault."""

    out_dir: Path
    best_acc1: float | None
    best_epoch: int | None
    history: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

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
            images = images.to(device, dtype=input_dtype(model), non_blocking=True)
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


def check_run_folder(out_dir: str | Path, resume: bool) -> None:
    """Before any work: the folder can be made and written; a resumed run needs ``last.pt``,
    a new one must not find one."""
    out_dir = Path(out_dir)
    if is_main_process():
        check_output_folder(out_dir, "run folder")
    _check_run_folder(out_dir, resume)


def _check_run_folder(out_dir: Path, resume: bool) -> None:
    """A resumed run needs ``last.pt``; a new one must not find one."""
    last_path = out_dir / LAST
    if resume and not last_path.is_file():
        raise DataError(f"nothing to resume: {last_path} does not exist")
    if not resume and last_path.is_file():
        raise ConfigError(f"{out_dir} already holds a run ({LAST}); resume it or choose another folder")


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


def _start_run_folder(out_dir: Path, recipe: Recipe, model: nn.Module, optimizer, world: int,
                      final_files: dict[str, int] | None, resume: bool, stack: contextlib.ExitStack,
                      created: list[Path]) -> None:
    """Check the disk, make the folder, lock it for the run (``stack`` holds the lock), claim
    the files the run writes (``edgetl.runfolder``) and write recipe.yaml (rank 0); what it
    created is appended to ``created``."""
    if not is_main_process():
        return
    check_disk(out_dir, {LAST: checkpoint_bytes(model, optimizer, world),
                         BEST: checkpoint_bytes(model, None), **(final_files or {})})
    if not out_dir.exists():
        created.append(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stack.enter_context(run_lock(out_dir))
    _check_run_folder(out_dir, resume)  # again, under the lock: a run started meanwhile has its last.pt
    manifest = Manifest(out_dir)
    names = [RECIPE_FILE, METRICS_CSV, METRICS_JSONL, LAST, BEST, *(final_files or {})]
    fresh = [out_dir / n for n in (MANIFEST, RECIPE_FILE, METRICS_CSV, METRICS_JSONL, BEST) if not (out_dir / n).exists()]
    manifest.claim(names)
    created += fresh
    atomic_write_text(out_dir / RECIPE_FILE, recipe.to_yaml())


@dataclass
class _Loop:
    """What a fit call trains with, and its progress; the methods are the loop's parts."""

    model: nn.Module
    net: nn.Module  # ``model``, or its DDP wrapper
    teacher: nn.Module | None
    train_loader: Any
    sampler: Any  # the training loader's
    skipping: bool  # the training set skips unreadable images (data.on_bad_image: skip)
    val_loader: Any
    recipe: Recipe
    out_dir: Path
    device: torch.device
    world: int
    step_spec: Step
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    autocast: Callable
    amp_precision: str
    steps_per_epoch: int
    on_step: Callable[[dict], None] | None
    on_epoch: Callable[[dict], None] | None
    progress: _Progress

    def diverged(self, where: str, what: str) -> DivergedError:
        """The one-line error of a diverged run, with its likely cause."""
        r = self.recipe
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
        p = self.progress
        # Collective (gathers every rank's RNG state), so every rank calls it.
        state = _gather({"rng": rng_state(), "sums": torch.tensor(p.sums, dtype=torch.float64)})
        if not is_main_process():
            return
        ckpt = {
            "format": CHECKPOINT_FORMAT,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": epoch,
            "step_in_epoch": step,
            "global_step": epoch * self.steps_per_epoch + step,
            "best_acc1": p.best_acc1,
            "best_epoch": p.best_epoch,
            "world_size": self.world,
            "rank_state": state,
            "recipe": self.recipe.to_dict(),
            "classes": _class_names(self.train_loader),
        }
        atomic_torch_save(ckpt, self.out_dir / LAST)
        p.saved = (epoch, step)
        p.created.clear()  # from here on the folder is a resumable run
        if best:
            atomic_torch_save(best_checkpoint(ckpt), self.out_dir / BEST)

    def save_mid_epoch(self, epoch: int, step: int) -> None:
        """last.pt after step ``step`` (0-based) when ``train.checkpoint_every`` says so."""
        every = self.recipe.train.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.steps_per_epoch:
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
        set_train_mode(self.net, self.recipe.model.bn)
        t0, seen = time.perf_counter(), 0
        for step, batch in enumerate(batches, start=first):
            seen += self.train_step(epoch, step, batch)
        return t0, seen

    def train_step(self, epoch: int, step: int, batch) -> int:
        """One optimizer step on ``batch`` (skipped if too few of its images were readable);
        returns the images it trained on."""
        p, device = self.progress, self.device
        note_skipped(batch, p.skipped)
        images, labels = batch
        # every image (or all but one: BatchNorm needs two) of this batch was unreadable
        too_few = images is None or len(labels) < min(2, self.train_loader.batch_size)
        if self.world > 1 and self.skipping:  # every rank skips the step, or none (DDP all-reduces)
            too_few = _all_reduce_sum([float(too_few)], device)[0] > 0
        if too_few:
            log.warning("epoch %d step %d: too few readable images left; step skipped", epoch + 1, step + 1)
            self.scheduler.step()
            self.save_mid_epoch(epoch, step)
            return 0
        images = images.to(device, dtype=input_dtype(self.model), non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        mix = None
        if self.recipe.distill is not None:
            mix = _distill_mix(self.recipe.distill, self.teacher, images)
        loss, correct = training_step(self.net, self.step_spec, self.optimizer, images, labels,
                                      autocast=self.autocast, scaler=self.scaler, mix=mix)
        self.scheduler.step()
        loss_value = loss.item()
        bad = not math.isfinite(loss_value)
        if self.world > 1:  # every rank stops, or none (the others would wait in the next all-reduce)
            bad = _all_reduce_sum([float(bad)], device)[0] > 0
        if bad:
            raise self.diverged(f"epoch {epoch + 1} step {step + 1}", f"the loss is {loss_value}")
        n = labels.numel()
        p.sums[0] += loss_value * n
        p.sums[1] += correct.item()
        p.sums[2] += n
        if self.on_step is not None:
            self.on_step({
                "epoch": epoch, "epochs": self.recipe.train.epochs, "step": step + 1,
                "steps": self.steps_per_epoch, "global_step": epoch * self.steps_per_epoch + step + 1,
                "loss": loss_value, "lr": self.optimizer.param_groups[0]["lr"],
            })
        self.save_mid_epoch(epoch, step)
        return n

    def end_epoch(self, epoch: int, t0: float, seen: int) -> None:
        """The epoch's metrics row (evaluated when due), metrics files, last.pt and best.pt."""
        p = self.progress
        loss_sum, correct, count = _all_reduce_sum(p.sums, self.device)
        elapsed = time.perf_counter() - t0
        row: dict[str, Any] = {
            "epoch": epoch + 1,
            "global_step": (epoch + 1) * self.steps_per_epoch,
            "lr": self.optimizer.param_groups[0]["lr"],
            "train_loss": loss_sum / max(count, 1),
            "train_acc1": 100.0 * correct / max(count, 1),
            "val_loss": None,
            "val_acc1": None,
            "epoch_time_s": elapsed,
            "images_per_s": seen * self.world / elapsed if elapsed > 0 else None,
        }
        improved = self.evaluate_epoch(epoch, row)
        p.history.append(row)
        p.sums = [0.0, 0.0, 0.0]
        if is_main_process():
            _write_metrics(self.out_dir, p.history)
            log.info("epoch %d/%d: %s", epoch + 1, self.recipe.train.epochs, row)
        self.save(epoch + 1, 0, best=improved)
        if self.on_epoch is not None:
            self.on_epoch(row)

    def evaluate_epoch(self, epoch: int, row: dict[str, Any]) -> bool:
        """Evaluate when ``train.eval_every`` (or the last epoch) says so, into ``row``;
        returns whether the accuracy is the best yet."""
        p, epochs = self.progress, self.recipe.train.epochs
        if not ((epoch + 1) % self.recipe.train.eval_every == 0 or epoch + 1 == epochs):
            return False
        metrics = evaluate(self.net, self.val_loader, self.device, self.amp_precision, p.skipped)
        row["val_loss"], row["val_acc1"] = metrics["loss"], metrics["acc1"]
        if p.best_acc1 is None or metrics["acc1"] > p.best_acc1:
            p.best_acc1, p.best_epoch = metrics["acc1"], epoch + 1
            return True
        return False


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

            if progress.rank_rng is not None:
                set_rng_state(progress.rank_rng)
            elif not resume or progress.start_step == 0:
                # Dropout etc. differ between ranks but are fixed by the seed.
                seed_everything(recipe.train.seed + rank)

            skipping = getattr(train_loader.dataset, "skip_bad", False)  # data.on_bad_image: skip
            loop = _Loop(model, net, teacher, train_loader, sampler, skipping, val_loader, recipe, out_dir,
                         device, world, step_spec, optimizer, scheduler, scaler, autocast, amp_precision,
                         steps_per_epoch, on_step, on_epoch, progress)
            for epoch in range(progress.start_epoch, recipe.train.epochs):
                t0, seen = loop.train_epoch(epoch)
                loop.end_epoch(epoch, t0, seen)
    except BaseException as exc:
        failure = _after_failure(exc, out_dir, progress.created, progress.saved)
        if failure is not exc:
            raise failure from None
        raise
    return FitResult(out_dir=out_dir, best_acc1=progress.best_acc1, best_epoch=progress.best_epoch,
                     history=progress.history, skipped=progress.skipped)

