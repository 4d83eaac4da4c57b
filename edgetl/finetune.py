"""Fine-tune stage: a recipe, a backbone folder and data in; a run folder out.

The backbone stays frozen; the Rep-Net side network (and the classifier) train on the
lean runtime (edgetl.models.lean): BN folded into frozen convs that keep no input,
1-bit ReLU6 masks, side-network convs that store their input average-pooled. Before
anything is trained, the runtime accounting predicts the peak for the batch and a run
that would not fit ``budget_bytes`` is refused with the breakdown and the largest batch
that fits.

Before the run folder exists, every image file is checked (``edgetl.data.check_images``,
``data.on_bad_image``), the resolution against the side network's minimum, and the disk
against what the run will write (``edgetl.train.check_disk``).

Run folder: ``recipe.yaml``, ``metrics.csv``/``metrics.jsonl``, ``last.pt``/``best.pt``
(the training loop's resumable checkpoints, lean layout), and at the end ``model.json``
+ ``model.pt``: the best weights in the stock torchvision layout, which ``edgetl export``
reads (contract in edgetl.export.load_run_model).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from edgetl.errors import BudgetError, ConfigError, EdgetlError
from edgetl.io import atomic_text_json, atomic_torch_save, load_state
from edgetl.memory import search
from edgetl.memory.report import MB, MemoryReport
from edgetl.models.backbone import EdgeNet, describe_backbone
from edgetl.models.side import (
    LeanOptions,
    build_side_network,
    check_resolution,
    make_lean,
    set_trainable,
    trains_backbone_convs,
)
from edgetl.profile import describe_runtime
from edgetl.recipe import Recipe
from edgetl.step import Step

if TYPE_CHECKING:
    from edgetl.data import ImageCheck
    from edgetl.memory.cuda_step import CapturedReport

log = logging.getLogger(__name__)

MODEL_JSON = "model.json"
MODEL_WEIGHTS = "model.pt"


def lean_options(recipe: Recipe) -> LeanOptions | None:
    """The lean runtime options a recipe asks for; None where the mode needs stock modules."""
    return recipe.model.lean()


def backbone_ref(recipe: Recipe) -> str:
    """What ``model.backbone`` names; none given: torchvision's ImageNet weights (width 1.0 only)."""
    from edgetl.models.backbone import DEFAULT_WEIGHTS

    m = recipe.model
    if m.backbone is not None:
        return m.backbone
    if m.width != 1.0:
        raise ConfigError(f"no backbone given and model.width is {m.width}: the default {DEFAULT_WEIGHTS} "
                          "is width 1.0; give --backbone DIR, or --backbone mobilenet_v2:random for a "
                          "randomly initialised network of this width")
    return DEFAULT_WEIGHTS


def build_model(recipe: Recipe, num_classes: int, device: torch.device | str = "cpu") -> EdgeNet:
    """The stock network to fine-tune: backbone, new classifier, side network.

    The backbone is what ``backbone_ref`` names: a backbone folder, a torchvision weights
    name or architecture (MobileNetV2's ImageNet weights by default; ``mobilenet_v2:random``
    at ``model.width`` only when asked for; ``resnet18``, ``resnet50:IMAGENET1K_V2``, ...), or a
    torchvision state_dict file of a registered architecture. Its classifier is replaced by a new one with
    ``num_classes`` outputs.
    """
    from edgetl.models.backbone import open_backbone

    m = recipe.model
    ref = backbone_ref(recipe)
    folder = Path(ref).is_dir()
    net, found = open_backbone(ref, width=None if folder else m.width, seed=recipe.train.seed, device=device)
    log.info("backbone: %s", found["source"])
    old = net.classifier[-1]
    net.classifier[-1] = nn.Linear(old.in_features, num_classes, device=old.weight.device)
    net.spec = dataclasses.replace(net.spec, num_classes=num_classes)
    if m.mode.startswith("repnet"):
        net.attach_side(build_side_network(net))
        check_resolution(net, recipe.data.resolution, recipe.train.batch_size)
    set_trainable(net, m.mode)
    return net


def recipe_step(recipe: Recipe) -> Step:
    """The step ``finetune`` runs: the recipe's, under DDP when torchrun started several processes."""
    from edgetl.train import get_world_size

    return Step.from_recipe(recipe, ddp=get_world_size() > 1)


@dataclass
class Job:
    """One fine-tuning run, resolved once before it trains, and handed on as one object: what
    the recipe asks for (its lean options and step, each computed here only), the stock network
    (the export layout), the network that trains (lean where the options say, its schedule
    applied), and the prediction of its step made with that same schedule.

    Attributes:
        recipe: the resolved recipe (written into the run folder).
        options: the lean runtime's options; None where the mode runs on stock modules.
        step: the loss and optimizer (``Step.from_recipe``; under DDP when torchrun started several).
        stock: the stock network (backbone, new classifier, side network), on the CPU.
        net: the network that trains: ``stock`` itself where ``options`` is None, else its lean copy.
        schedule: the lean step's schedule, fitted once (``fit_schedule``) and applied to ``net``.
        predicted: the runtime accounting of the step at the recipe's batch, on that schedule.
    """

    recipe: Recipe
    options: LeanOptions | None
    step: Step
    stock: EdgeNet
    net: EdgeNet
    schedule: object | None  # edgetl.memory.schedule.Schedule
    predicted: MemoryReport


def _predict(net: EdgeNet, recipe: Recipe, options: LeanOptions | None, step: Step,
             batch_size: int) -> tuple[MemoryReport, object | None]:
    """Runtime accounting (DESIGN 2b) of the step on a meta copy of the stock ``net`` made lean
    by ``options``, and the schedule fitted for it (None on stock modules)."""
    from edgetl.memory.runtime import runtime_report
    from edgetl.memory.schedule import apply_schedule, fit_schedule

    meta = copy.deepcopy(net).to("meta")
    if options is not None:
        make_lean(meta, options)
    resolution = recipe.data.resolution
    schedule = fit_schedule(meta, resolution=resolution, batch_size=batch_size, step=step)
    apply_schedule(meta, schedule)
    report = runtime_report(meta, mode=recipe.model.mode, resolution=resolution, batch_size=batch_size, step=step)
    describe_runtime(report, meta, options)
    return report, schedule if options is not None else None


def predict_peak(net: EdgeNet, recipe: Recipe, batch_size: int) -> MemoryReport:
    """Runtime accounting (DESIGN 2b) of the training step ``finetune`` runs on the stock
    ``net``: the recipe's loss and optimizer, the lean runtime and its fitted schedule."""
    return _predict(net, recipe, lean_options(recipe), recipe_step(recipe), batch_size)[0]


def largest_batch(net: EdgeNet, recipe: Recipe, budget_bytes: int, upper: int) -> int:
    """Largest batch size <= ``upper`` whose predicted peak fits; 0 if not even batch 1."""
    return search.largest_batch(lambda b: predict_peak(net, recipe, b).total_bytes, budget_bytes, upper)[0]


def resolve_job(recipe: Recipe, num_classes: int, budget_bytes: int | None = None) -> Job:
    """The run ``recipe`` asks for on ``num_classes`` classes: the stock network built (the
    caller seeds first), the step predicted at the recipe's batch and refused (BudgetError)
    beyond ``budget_bytes``, then the network that trains, made lean with the schedule the
    prediction fitted."""
    options, step = lean_options(recipe), recipe_step(recipe)
    stock = build_model(recipe, num_classes, device="cpu")
    predicted, schedule = _predict(stock, recipe, options, step, recipe.train.batch_size)
    _check_budget(stock, recipe, predicted, budget_bytes)
    net = stock
    if options is not None:
        from edgetl.memory.schedule import apply_schedule

        net = copy.deepcopy(stock)
        make_lean(net, options)
        apply_schedule(net, schedule)
    return Job(recipe, options, step, stock, net, schedule, predicted)


def _check_budget(net: EdgeNet, recipe: Recipe, report: MemoryReport, budget_bytes: int | None) -> None:
    batch = recipe.train.batch_size
    if budget_bytes is not None and report.total_bytes > budget_bytes:
        fits = largest_batch(net, recipe, budget_bytes, batch - 1)
        parts = ", ".join(f"{k} {v / MB:.1f}" for k, v in report.breakdown.items())
        advice = (f"the largest batch that fits is {fits} (--batch-size {fits})" if fits
                  else "not even batch 1 fits: prune the backbone, raise --pool or use --precision bf16")
        raise BudgetError(
            f"predicted peak {report.total_bytes / MB:.1f} MB at batch {batch} exceeds the budget "
            f"{budget_bytes / MB:.1f} MB (MB; {parts}); {advice}"
        )


def stock_state_dict(lean_net: EdgeNet, stock_net: EdgeNet) -> dict[str, torch.Tensor]:
    """The weights of a lean network in the stock torchvision layout of ``stock_net``.

    Side network and classifier keys are the same in both layouts. Each lean
    FrozenConvBNAct corresponds, in order, to one stock conv + BN pair; what training
    can change there is the BN beta (repnet+bias: the folded bias) and, with batch
    statistics, the running statistics. The frozen conv weights are ``stock_net``'s.
    """
    from edgetl.models.lean import FrozenConvBNAct

    state = {k: v.detach().clone() for k, v in stock_net.state_dict().items()}
    for key, value in lean_net.state_dict().items():
        if key.startswith(("side.", "classifier.")):
            state[key] = value.detach().clone()
    lean_layers = [m for m in lean_net.features.modules() if isinstance(m, FrozenConvBNAct)]
    stock_bns = [m for m in stock_net.features.modules() if isinstance(m, nn.BatchNorm2d)]
    if len(lean_layers) != len(stock_bns):
        raise ConfigError("lean and stock networks do not correspond layer for layer")
    bn_names = {m: n for n, m in stock_net.named_modules() if isinstance(m, nn.BatchNorm2d)}
    for lean, bn in zip(lean_layers, stock_bns):
        name = bn_names[bn]
        bias = lean.bias.detach().float()
        if lean.bn_mode == "fold":
            scale = bn.weight.detach().float() / torch.sqrt(bn.running_var.float() + bn.eps)
            beta = bias + bn.running_mean.float() * scale  # undo bias' = beta - mean * scale
        else:
            beta = bias
            for stat in ("running_mean", "running_var", "num_batches_tracked"):
                state[f"{name}.{stat}"] = getattr(lean, stat).detach().clone()
        state[f"{name}.bias"] = beta.to(bn.bias.dtype)
    return state


@dataclass
class FinetuneResult:
    out_dir: Path
    best_acc1: float | None
    best_epoch: int | None
    predicted: MemoryReport
    measured_peak_bytes: int | None
    history: list[dict] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    image_check: ImageCheck | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # images left out while training
    execution: str = "eager"  # how the step ran (edgetl.train.FitResult.execution)
    graph_memory: CapturedReport | None = None  # a budget run captured as CUDA graphs: its predicted memory


def finetune(
    *,
    recipe: Recipe,
    out_dir: str | Path,
    budget_bytes: int | None = None,
    resume: bool = False,
    device: torch.device | str = "cpu",
    measure: bool = True,
    on_step: Callable[[dict], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    on_preflight: Callable[[MemoryReport, int | None], None] | None = None,
    on_images: Callable[[ImageCheck], None] | None = None,
    planned: tuple[str, int] | None = None,
) -> FinetuneResult:
    """Fine-tune per ``recipe`` into ``out_dir`` (resumable), within ``budget_bytes``.

    Args:
        recipe: resolved recipe (data, model incl. backbone folder and lean options, optim, train).
        out_dir: run folder; must not hold a run unless ``resume``.
        budget_bytes: refuse to start if the predicted peak exceeds it.
        resume: continue the run in ``out_dir`` from its last checkpoint.
        device: where to train.
        measure: on CPU, measure one real training step with the storage meter before
            training (the measured peak shown beside the prediction).
        on_step, on_epoch: progress callbacks of edgetl.train.fit.
        on_preflight: called with the prediction and the measured peak before training.
        on_images: called with what the check of every image file found, before training.
        planned: (the plan's name, the class count it was planned for): data with another
            count is refused before anything is written (the classifier's memory differs).
    """
    from edgetl.data import check_images, datasets_from_recipe, loaders_from_recipe
    from edgetl.train import (check_run_folder, fit, is_main_process, saved_file_bytes, seed_everything,
                              setup_distributed)

    if recipe.model.mask_kernels == "fused":  # the network is made lean on the CPU, then moved: check and build here
        from edgetl.models.lean.fused import prepare

        prepare(device)
    device = setup_distributed(device)
    out_dir = Path(out_dir)
    check_run_folder(out_dir, resume)
    splits = datasets_from_recipe(recipe, check=False)
    if planned is not None and planned[1] != splits.num_classes:
        raise ConfigError(f"{planned[0]} was planned for {planned[1]} classes; the data has {splits.num_classes}: "
                          f"plan again with --num-classes {splits.num_classes}")
    seed_everything(recipe.train.seed)
    job = resolve_job(recipe, splits.num_classes, budget_bytes)
    net, stock, options, predicted = job.net, job.stock, job.options, job.predicted
    splits = check_images(splits, recipe.data.on_bad_image)
    measured = None
    if measure and device.type == "cpu":
        from edgetl.memory.meter import measure_training_peak

        probe = copy.deepcopy(net)
        measured = measure_training_peak(probe, resolution=recipe.data.resolution,
                                         batch_size=recipe.train.batch_size, steps=2, step=job.step)
        del probe
    if on_preflight is not None:
        on_preflight(predicted, measured)
    if on_images is not None:
        on_images(splits.image_check)

    train_loader, val_loader = loaders_from_recipe(recipe, splits, pin_memory=device.type == "cuda")
    graphs: list[CapturedReport] = []

    def before_capture(model: nn.Module) -> None:  # the step will run as CUDA graphs: a budget counts their memory
        if budget_bytes is not None:
            graphs.append(check_graph_budget(job, torch.cuda.get_device_capability(device), budget_bytes))

    # The lean layers run the backbone in the activation dtype themselves; autocast on top
    # would also cast the side network and break the memory plan. The recipe keeps the
    # precision it asked for (recipe.yaml, checkpoints), so --resume continues the same way.
    result = fit(model=net, train_loader=train_loader, val_loader=val_loader, recipe=recipe,
                 out_dir=out_dir, device=device, resume=resume, on_step=on_step, on_epoch=on_epoch,
                 final_files={MODEL_WEIGHTS: saved_file_bytes(stock.state_dict()), MODEL_JSON: 1 << 16},
                 amp=options is None, before_capture=before_capture)
    if is_main_process():
        lean = None if predicted.lean is None else {**predicted.lean, "schedule": job.schedule.to_dict()}
        try:
            _write_model(out_dir, net, stock, recipe, splits.classes, options, lean)
        except EdgetlError as exc:
            exc.args = (f"{exc}; training finished and {out_dir} keeps last.pt: fix the cause and add "
                        f"--resume to write {MODEL_WEIGHTS} and {MODEL_JSON}",)
            raise
    return FinetuneResult(out_dir, result.best_acc1, result.best_epoch, predicted, measured,
                          result.history, splits.classes, splits.image_check, result.skipped, result.execution,
                          graphs[0] if graphs else None)


def check_graph_budget(job: Job, capability: tuple[int, int], budget_bytes: int) -> CapturedReport:
    """The job's step captured as CUDA graphs on a GPU of ``capability``: its predicted memory
    (the eager step's tensors and what the graphs reserve beyond an eager run, ``captured_report``:
    three steps on a meta copy), refused (BudgetError) beyond ``budget_bytes``."""
    from edgetl.memory.cuda_step import captured_report

    recipe = job.recipe
    batch = recipe.train.batch_size
    log.info("predicting the memory of the step captured as CUDA graphs")
    report = captured_report(job.net, runtime_bytes=job.predicted.total_bytes, resolution=recipe.data.resolution,
                             batch_size=batch, step=job.step, capability=tuple(capability))
    if report.total_bytes > budget_bytes:
        raise BudgetError(
            f"with CUDA graphs the step at batch {batch} holds a predicted {report.total_bytes / MB:.1f} MB "
            f"({report.runtime_bytes / MB:.1f} MB of tensors + {report.extra_bytes / MB:.1f} MB the graphs reserve "
            f"beyond an eager run), over the budget {budget_bytes / MB:.1f} MB; --eager runs it in "
            f"{report.runtime_bytes / MB:.1f} MB")
    return report


def _write_model(out_dir: Path, net: EdgeNet, stock: EdgeNet, recipe: Recipe, classes: list[str],
                 options: LeanOptions | None, lean: dict | None) -> None:
    """model.pt (best weights, stock layout) + model.json: what edgetl export reads.

    ``lean`` is the pre-flight report's description of the lean runtime (options and the
    pool each side conv really stored with); None for stock modules.
    """
    from edgetl.train import BEST, LAST, load_checkpoint

    source = out_dir / BEST if (out_dir / BEST).is_file() else out_dir / LAST
    load_state(net, load_checkpoint(source)["model"], source, "the fine-tuned network")
    net.to("cpu")
    stock.to("cpu")
    if options is None:
        weights = net.state_dict()
    elif trains_backbone_convs(stock):
        from edgetl.models.lean_full import full_state_dict

        weights = full_state_dict(net, stock)
    else:
        weights = stock_state_dict(net, stock)
    atomic_torch_save({"model": weights, "source": source.name}, out_dir / MODEL_WEIGHTS)
    atomic_text_json(out_dir / MODEL_JSON, {
        "backbone": stock.spec.to_dict(),
        "mode": recipe.model.mode,
        "labels": list(classes),
        "recipe": recipe.to_dict(),
        "lean": lean,
        "backbone_source": describe_backbone(backbone_ref(recipe)),
        "preprocessing": {"resolution": recipe.data.resolution,
                          "resize": int(round(recipe.data.resolution / 0.875))},
    })
