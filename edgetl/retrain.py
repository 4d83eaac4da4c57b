"""Retrain stage: a (pruned) backbone and an ImageFolder dataset in, a retrained backbone run folder out.

DESIGN 1 step 4: after pruning, the backbone is retrained on ImageNet (full fine-tuning,
SGD with momentum, warmup + cosine, label smoothing, no weight decay on BN and biases;
all in ``recipes/imagenet_retrain.yaml``) so that it recovers most of its accuracy before
the side network is fine-tuned on the target task. The same command pretrains an
unpruned MobileNetV2 from scratch (the paper trained its own 65.2 % backbone) or starts
from torchvision's ImageNet weights (``--backbone mobilenet_v2:IMAGENET1K_V1``, from the
torch cache; downloaded once where the machine is online) or a local state_dict file.

The run folder is the training loop's (``recipe.yaml``, ``metrics.csv``,
``metrics.jsonl``, ``last.pt``, ``best.pt``) plus ``retrain.json`` (the architecture and
where it came from, written at the start so a killed run can resume) and, once the run
has finished, ``backbone.json`` + ``backbone.pt`` from the best epoch's weights: the run
folder *is* a backbone folder, accepted by ``edgetl finetune --backbone RUN``,
``edgetl profile --checkpoint RUN``, ``edgetl prune --checkpoint RUN`` and
``--distill-from RUN``. Every file is written atomically (temporary name, then rename).

Retraining on ImageNet
----------------------
Lay ImageNet out as an ImageFolder: ``ROOT/train/<wnid>/*.JPEG`` and
``ROOT/val/<wnid>/*.JPEG`` (the validation images sorted into class folders, e.g. with
the usual ``valprep.sh``). Then, on one GPU (or, slowly, on a CPU)::

    edgetl retrain --backbone runs/pruned --data /data/imagenet \\
        --recipe imagenet_retrain -o runs/retrained

With distillation from the unpruned network (a backbone folder or a finished retrain
run; temperature and weight come from the recipe's ``distill`` section)::

    edgetl retrain --backbone runs/pruned --data /data/imagenet \\
        --distill-from runs/mobilenet_v2_unpruned -o runs/retrained

Pretraining the unpruned network from scratch, or starting from a local torchvision
checkpoint file (``mobilenet_v2-b0353104.pth``, loaded with ``weights_only=True``)::

    edgetl retrain --backbone mobilenet_v2 --width 1.0 --data /data/imagenet \\
        --epochs 300 --lr 0.045 --batch-size 32 -o runs/mobilenet_v2_unpruned
    edgetl retrain --backbone mobilenet_v2 --weights mobilenet_v2-b0353104.pth ...

On CUDA the loop uses autocast + GradScaler (``--precision auto`` = fp16 there, fp32 on
a CPU); on every device the network and its batches are channels-last.

Several GPUs, one machine: start the same command under torchrun. Every process reads
its own shard of the training data (DistributedSampler), gradients are averaged by DDP,
metrics are reduced over all processes, and only rank 0 logs and writes files. The batch
size is per process, so scale the learning rate with the global batch (linear rule)::

    torchrun --nproc_per_node=8 -m edgetl retrain --backbone runs/pruned \\
        --data /data/imagenet --lr 0.16 -o runs/retrained

Several machines: run the same torchrun command on every node with a shared rendezvous
(one node's address, reachable from all; the data path must exist on every node, and the
run folder should be on storage every node can read, since only the global rank 0 writes
it and every rank reads ``retrain.json`` on resume)::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=retrain1 --rdzv_backend=c10d \\
        --rdzv_endpoint=node0.example:29400 -m edgetl retrain --backbone runs/pruned \\
        --data /data/imagenet --lr 0.32 -o /shared/runs/retrained

Resuming: ``last.pt`` is written every ``train.checkpoint_every`` steps and at each
epoch end; after a crash or a kill, run the same command with ``--resume`` (the recipe
is then read from the run folder, so ``edgetl retrain --resume -o RUN`` is enough). A
run stopped mid-epoch resumes exactly (same weights as an uninterrupted run) with the
same number of processes; at an epoch boundary it may resume with a different number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from edgetl.errors import ConfigError, DataError
from edgetl.io import atomic_text_json, load_state, read_json
from edgetl.models.backbone import (
    SPEC_FILE,
    WEIGHTS_FILE,
    BackboneSpec,
    EdgeNet,
    build_backbone,
    load_backbone,
    read_backbone_info,
    save_backbone,
)
from edgetl.recipe import Recipe

if TYPE_CHECKING:  # the data stage loads inside retrain()
    from edgetl.data import ImageCheck

log = logging.getLogger(__name__)

RETRAIN_FORMAT = "edgetl-retrain/1"
RETRAIN_FILE = "retrain.json"


def _stock_arch(backbone) -> str | None:
    """The architecture a bare name ("mobilenet_v2", "resnet18") or None starts from at random
    init (pretraining from scratch); None for anything else."""
    import edgetl.models.archs as archs

    if backbone is None:
        return archs.DEFAULT_ARCH
    return str(backbone) if str(backbone) in archs.registered() else None
# Files a retrain run folder may hold; the atomic writers' leftovers are ".<name>.*.tmp".
RUN_FILES = ("recipe.yaml", "metrics.csv", "metrics.jsonl", "last.pt", "best.pt",
             RETRAIN_FILE, SPEC_FILE, WEIGHTS_FILE, ".edgetl-files", ".edgetl.lock")


@dataclass
class RetrainResult:
    """What a retrain run produced.

    Attributes:
        out_dir: the run folder (also a backbone folder once the run has finished).
        best_acc1: best validation top-1 (%) and the epoch (1-based) it was reached in.
        epochs: epochs of the recipe (all of them have run).
        history: one metrics dict per epoch (as metrics.jsonl).
        seconds: wall-clock time of this invocation; ``train_seconds`` sums every epoch's
            training time, also the ones before a resume.
        spec: the retrained architecture (pruned hidden channels carried over).
        source: where the starting weights came from.
        new_head: a trained classifier was replaced by a new one for the data's classes.
        world_size: processes that trained.
        image_check: what the image check before training read and left out (None: not checked).
    """

    out_dir: Path
    best_acc1: float | None
    best_epoch: int | None
    epochs: int
    history: list[dict]
    seconds: float
    train_seconds: float
    spec: BackboneSpec
    source: dict
    classes: list[str]
    new_head: bool = False
    teacher: str | None = None
    world_size: int = 1
    info: dict = field(default_factory=dict)
    image_check: ImageCheck | None = None


# --- models ----------------------------------------------------------------------------


def _set_num_classes(net: EdgeNet, num_classes: int, seed: int) -> None:
    """Replace the classifier's last linear layer (torchvision's init: N(0, 0.01), zero bias)."""
    old = net.classifier[-1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        new = nn.Linear(old.in_features, num_classes, device=old.weight.device)
        nn.init.normal_(new.weight, 0, 0.01)
        nn.init.zeros_(new.bias)
    net.classifier[-1] = new
    net.spec = dataclasses.replace(net.spec, num_classes=num_classes)


def load_student(
    *, backbone: str | Path | None, weights: str | Path | None = None, width: float = 1.0,
    num_classes: int, seed: int = 0,
) -> tuple[EdgeNet, dict, bool]:
    """The network to retrain, where it came from, and whether its head was replaced.

    Args:
        backbone: a backbone folder (from ``edgetl prune`` or ``edgetl retrain``), a
            torchvision weights name ("mobilenet_v2:IMAGENET1K_V1", "mobilenet_v2:random"), or
            None / an architecture name ("mobilenet_v2", "resnet18") for that torchvision
            network at random init (unless ``weights``: pretraining starts from scratch).
        weights: a local torchvision state_dict file of that architecture (``weights_only=True``).
        width: width multiplier of the stock network.
        num_classes: classes of the training data; a classifier with another count is
            replaced by a new one (e.g. an ImageNet-pruned backbone retrained on 10 classes).
        seed: random init seed.
    """
    from edgetl.models.backbone import is_weights_name
    from edgetl.prune import load_input

    stock = _stock_arch(backbone)
    if stock is None and is_weights_name(backbone):
        if weights is not None:
            raise ConfigError(f"--weights is a state_dict file for a bare architecture name (--backbone mobilenet_v2, resnet18, ...); {backbone} names its own")
        net, found = load_input(checkpoint=backbone, width=width, seed=seed)
        source = {"backbone": str(backbone), **found, "description": found["source"]}
    elif stock is None:
        if weights is not None:
            raise ConfigError("--weights is for a bare architecture name (--backbone mobilenet_v2, resnet18, ...); a backbone folder has its own weights")
        net, found = load_input(checkpoint=backbone)
        source = {"backbone": str(backbone), "description": f"backbone folder {backbone}",
                  "arch": found["arch"], "width": found["width"]}
        info = read_backbone_info(backbone)
        for key in ("base", "pruning", "retrain"):
            if key in info:
                source[key] = info[key]
    else:
        net, found = load_input(checkpoint=None if weights is not None else f"{stock}:random",
                                weights=weights, width=width, seed=seed)
        if found["arch"] != stock:
            raise ConfigError(f"--weights {weights} holds a {found['arch']} state_dict, not {stock}")
        source = {"backbone": stock, "description": found["source"], "arch": found["arch"],
                  "width": found["width"], "weights": str(weights) if weights is not None else None}
    # A random classifier is replaced too, but only a trained one is worth reporting.
    new_head = net.spec.num_classes != num_classes
    trained = (stock is None and not str(backbone).endswith(":random")
               or weights is not None)
    if new_head:
        log.info("new classifier: %d -> %d classes", net.spec.num_classes, num_classes)
        _set_num_classes(net, num_classes, seed)
    return net, source, new_head and trained


def load_teacher(path: str | Path) -> tuple[EdgeNet, list[str] | None]:
    """A distillation teacher and its class names when known.

    Args:
        path: a backbone folder (e.g. a finished retrain run), an unfinished retrain run
            (its best.pt), or a retrain run's best.pt / last.pt file.
    """
    from edgetl.train import load_checkpoint

    path = Path(path)
    run, ckpt_file = (path.parent, path) if path.is_file() else (path, path / "best.pt")
    if path.is_dir() and (path / SPEC_FILE).is_file():
        info = read_backbone_info(path)
        return load_backbone(path), info.get("retrain", {}).get("classes")
    if (run / RETRAIN_FILE).is_file() and ckpt_file.is_file():
        meta = read_run_info(run)
        net = build_backbone(BackboneSpec.from_dict(meta["spec"]))
        load_state(net, load_checkpoint(ckpt_file)["model"], ckpt_file, "the network its run describes")
        return net, meta.get("classes")
    if not path.exists():
        raise DataError(f"distillation teacher {path} does not exist; give a backbone folder or a retrain run")
    raise DataError(f"distillation teacher {path} is neither a backbone folder nor a retrain run with best.pt")


def read_run_info(run: str | Path) -> dict:
    """A retrain run's ``retrain.json`` (spec, source, classes)."""
    path = Path(run) / RETRAIN_FILE
    if not path.is_file():
        raise DataError(f"{run} is not a retrain run: {RETRAIN_FILE} is missing")
    info = read_json(path)
    if not isinstance(info, dict) or info.get("format") != RETRAIN_FORMAT:
        raise DataError(f"{path} is not a retrain description (format {RETRAIN_FORMAT})")
    return info


def check_teacher(teacher: EdgeNet, teacher_classes: list[str] | None, classes: list[str], where: str) -> None:
    if teacher.spec.num_classes != len(classes):
        raise ConfigError(
            f"distillation teacher {where} predicts {teacher.spec.num_classes} classes but the data has "
            f"{len(classes)}; the teacher must be trained on the same classes"
        )
    if teacher_classes is not None and list(teacher_classes) != list(classes):
        diff = next(i for i, (a, b) in enumerate(zip(teacher_classes, classes)) if a != b)
        raise ConfigError(
            f"distillation teacher {where} has class {teacher_classes[diff]!r} where the data has "
            f"{classes[diff]!r} (label {diff}); the teacher must be trained on the same classes"
        )


# --- the run folder --------------------------------------------------------------------


def _clean_leftovers(out_dir: Path) -> None:
    """Remove temporary files a killed atomic write left behind (the real files are whole)."""
    for name in RUN_FILES:
        for tmp in out_dir.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


def _check_out_dir(out_dir: Path, resume: bool) -> None:
    from edgetl.runfolder import check_output_folder
    from edgetl.train import LAST

    check_output_folder(out_dir, "run folder")
    if resume:
        if not (out_dir / LAST).is_file():
            raise DataError(f"nothing to resume: {out_dir / LAST} does not exist")
        if not (out_dir / RETRAIN_FILE).is_file():
            raise DataError(f"{out_dir} is not a retrain run ({RETRAIN_FILE} is missing); cannot resume it")
        return
    if (out_dir / LAST).is_file():
        raise ConfigError(f"{out_dir} already holds a run; add --resume to continue it, or choose another folder")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConfigError(f"output {out_dir} is a file; give a folder")
        others = [p.name for p in out_dir.iterdir() if p.name not in RUN_FILES and not p.name.endswith(".tmp")]
        if others or (out_dir / SPEC_FILE).exists():
            raise ConfigError(f"output folder {out_dir} already exists and is not an unstarted retrain run; "
                              "choose another or remove it")


def _write_backbone(out_dir: Path, spec: BackboneSpec, info: dict) -> None:
    """backbone.pt (best weights) then backbone.json: a folder with backbone.json is complete."""
    from edgetl.train import BEST, LAST, load_checkpoint

    source = out_dir / (BEST if (out_dir / BEST).is_file() else LAST)
    net = build_backbone(spec)
    load_state(net, load_checkpoint(source)["model"], source, "the retrained backbone")
    save_backbone(out_dir, net, info)


# --- the stage -------------------------------------------------------------------------


def retrain(
    *,
    recipe: Recipe,
    out_dir: str | Path,
    weights: str | Path | None = None,
    device: torch.device | str = "cpu",
    resume: bool = False,
    on_step: Callable[[dict], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
) -> RetrainResult:
    """Retrain (or pretrain) a backbone per ``recipe``; write the run + backbone folder.

    Args:
        recipe: the resolved recipe; ``model.backbone`` is the backbone folder to start
            from (None: torchvision MobileNetV2 at ``model.width``), ``model.mode`` must be
            "full", and a ``distill`` section distils from ``distill.teacher``.
        out_dir: the run folder.
        weights: a local torchvision state_dict to start the stock network from.
        device: "cpu" or "cuda"; under torchrun each process takes ``cuda:LOCAL_RANK``.
        resume: continue ``out_dir`` from its last.pt (the architecture from retrain.json).
        on_step, on_epoch: progress callbacks, passed to ``edgetl.train.fit``.

    Under torchrun this joins the process group itself (gloo on CPU, nccl on CUDA).
    """
    from edgetl import data as D
    from edgetl import train as T

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    if recipe.model.mode != "full":
        raise ConfigError(f"model.mode is {recipe.model.mode!r}; retraining trains the whole backbone: use 'full'")
    if recipe.model.uint8_input:
        raise ConfigError("model.uint8_input is for finetune's lean runtime; retrain trains stock modules on the "
                          "normalised float batch (allowed here: false)")
    if weights is not None and _stock_arch(recipe.model.backbone) is None:
        raise ConfigError("--weights is for a bare architecture name (--backbone mobilenet_v2, resnet18, ...); a backbone folder has its own weights")
    _check_out_dir(out_dir, resume)

    device = T.setup_distributed(device)
    rank, world = T.get_rank(), T.get_world_size()
    seed = recipe.train.seed
    splits = D.datasets_from_recipe(recipe)
    classes = splits.classes

    if resume:
        meta = read_run_info(out_dir)
        spec = BackboneSpec.from_dict(meta["spec"])
        if spec.num_classes != len(classes):
            raise ConfigError(f"{out_dir} was started on {spec.num_classes} classes; the data has {len(classes)}")
        T.seed_everything(seed)
        net = build_backbone(spec)  # weights come from last.pt
        source, new_head = meta["source"], meta["new_head"]
    else:
        T.seed_everything(seed)
        net, source, new_head = load_student(
            backbone=recipe.model.backbone, weights=weights, width=recipe.model.width,
            num_classes=len(classes), seed=seed,
        )
        spec = net.spec
        meta = {"format": RETRAIN_FORMAT, "spec": spec.to_dict(), "source": source, "classes": classes,
                "new_head": new_head}

    teacher, teacher_path = None, None
    if recipe.distill is not None:
        teacher_path = recipe.distill.teacher
        teacher, teacher_classes = load_teacher(teacher_path)
        check_teacher(teacher, teacher_classes, classes, teacher_path)

    train_loader, val_loader = D.loaders_from_recipe(recipe, splits, pin_memory=device.type == "cuda")
    made_here = rank == 0 and not out_dir.exists()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(out_dir)
        if not resume:
            atomic_text_json(out_dir / RETRAIN_FILE, meta)

    # channels-last weights and batches (converted on the host, edgetl.train.loop.device_batch):
    # faster convolution kernels on CUDA and on a CPU alike (MobileNetV2 0.35, 64 px, batch 32:
    # a training step 1.27x as fast on a 2-core AVX2 EPYC, benchmarks/demo_steps_64.json)
    net.to_channels_last()
    if teacher is not None:
        teacher.to_channels_last()
    log.info("retraining %s on %d classes, %d train / %d val images, %d process(es)",
             source.get("backbone"), len(classes), len(splits.train), len(splits.val), world)
    try:
        fitted = T.fit(
            model=net, train_loader=train_loader, val_loader=val_loader, recipe=recipe, out_dir=out_dir,
            device=device, resume=resume, on_step=on_step, on_epoch=on_epoch, teacher=teacher,
            final_files={SPEC_FILE: 1 << 20, WEIGHTS_FILE: T.saved_file_bytes(net.state_dict())},
        )
    except BaseException:
        # Nothing to resume before the first last.pt: leave no half-made run folder behind.
        if rank == 0 and not resume and not (out_dir / T.LAST).exists():
            (out_dir / RETRAIN_FILE).unlink(missing_ok=True)
            if made_here:
                with contextlib.suppress(OSError):
                    out_dir.rmdir()
        raise
    history = fitted.history
    info = {k: v for k, v in source.items() if k in ("base", "pruning")}
    info["retrain"] = {
        "source": {k: v for k, v in source.items() if k not in ("base", "pruning")},
        "epochs": recipe.train.epochs,
        "best_acc1": fitted.best_acc1,
        "best_epoch": fitted.best_epoch,
        "data": {"preset": recipe.data.preset, "root": recipe.data.root, "resolution": recipe.data.resolution,
                 "train_images": len(splits.train), "val_images": len(splits.val)},
        "classes": classes,
        "new_head": new_head,
        "distill": dataclasses.asdict(recipe.distill) if recipe.distill is not None else None,
        "world_size": world,
        "weights": "best.pt",
    }
    if rank == 0:
        _write_backbone(out_dir, spec, info)
    if world > 1:
        torch.distributed.barrier()  # the backbone folder is complete when any rank returns
    return RetrainResult(
        out_dir=out_dir, best_acc1=fitted.best_acc1, best_epoch=fitted.best_epoch,
        epochs=recipe.train.epochs, history=history, seconds=time.perf_counter() - t0,
        train_seconds=sum(r["epoch_time_s"] for r in history), spec=spec, source=source,
        classes=classes, new_head=new_head, teacher=teacher_path, world_size=world, info=info,
        image_check=splits.image_check,
    )
