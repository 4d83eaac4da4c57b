"""Demo: the whole pipeline on real offline data, a folder in, a report with figures out.

Fashion-MNIST (Debian package ``dataset-fashion-mnist``) gives a real transfer task: the
source task is classes 0-4 (T-shirt, trouser, pullover, dress, coat), the target task
classes 5-9 (sandal, shirt, sneaker, bag, ankle boot). A small MobileNetV2 at a small
resolution keeps it to minutes on a laptop CPU; ``arch`` runs the same pipeline on another
registered backbone from random init (ResNet-18 at width 1.0: its quick pretraining took 110 s
on one core of a 2-core EPYC):

    pretrain  the backbone on the source task (edgetl.retrain)
    profile   paper and runtime memory of Rep-Net on it (edgetl.profile)
    plan      pruning / pooling / batch for a budget scaled to the model (edgetl.plan)
    prune     the planned hidden channels, activation-L2 importance (edgetl.prune); where
              the plan prunes nothing, the paper's ratios, or on a backbone no paper
              pruned, the paper's rule (``auto_ratios``) on the profile's sensitive blocks
    retrain   the pruned backbone on the source task (edgetl.retrain)
    finetune  the side network on the target task, pooled storage (edgetl.finetune),
              beside unpruned Rep-Net (as is, and with its frozen backbone streamed
              in micro-batches of STREAM, the batch kept as uint8 pixels and segments recomputed
              where that lowers the peak: the other route to the memory the pruning
              buys, at no accuracy cost) and full fine-tuning of the same backbone
    export    ONNX, checked against PyTorch with onnxruntime (edgetl.export)

The stages are a table (``STAGES``) of functions, each returning a typed result that the
stages after it read. Each stage records its result in ``DIR/stages/NAME.json``; a rerun
reuses finished stages (delete that file, or the folder, to redo one).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import edgetl.models.archs as archs
import edgetl.options as options
from edgetl.demo_jobs import Stage, run_side_by_side
from edgetl.errors import ConfigError
from edgetl.io import atomic_text_json, read_json
from edgetl.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)

SOURCE_CLASSES = [0, 1, 2, 3, 4]
TARGET_CLASSES = [5, 6, 7, 8, 9]
DEFAULT_ARCH = archs.DEFAULT_ARCH


@dataclass(frozen=True)
class DemoScale:
    """How big the demo is; ``quick`` is for the test suite (about a minute). ``width`` is
    for a backbone with a width multiplier; another (ResNet) runs at 1.0."""

    width: float = 0.35
    resolution: int = 64
    pretrain_samples: int = 6000
    pretrain_epochs: int = 4
    retrain_epochs: int = 2
    target_samples: int = 2000
    finetune_epochs: int = 3
    val_samples: int = 1000
    batch_size: int = 32
    budget_fraction: float = 0.6


QUICK = DemoScale(pretrain_samples=2000, pretrain_epochs=3, retrain_epochs=1, target_samples=1000,
                  finetune_epochs=2, val_samples=500)
FULL = DemoScale()

# The streamed fine-tune's micro-batch: 8 of the batch of 32. At 64 px a sample's blocks are
# tiny kernels and a step's cost is per micro-batch: streamed by 1 a step took 6.6x the
# unstreamed one (232 vs 35 ms) for a 3.91 MB peak, by 4 3.7x (129 ms) for 4.04 MB, by 8 3.0x
# (104 ms) for 5.11 MB (AVX-512 EPYC, 2 threads): by 8 keeps streaming's memory story (under
# half the unstreamed 12.71 MB) with the streamed stage no longer than full fine-tuning's
# (docs/pipeline.md; by 4 it was the longest fine-tune, 82 s against 41 s on a 2-core AVX2 EPYC).
# With the masked convs of most segments run a micro-batch at a time
# (``StreamedSegment.whole_micro_batch``, benchmarks/demo_steps_64.json).
STREAM = 8

# The lean fine-tunes' mask kernels (``LeanOptions.mask_kernels``), as ``run_demo`` is asked:
# "auto" takes edgetl's fused kernels on a CPU where they build (a C++ compiler and ninja) and
# torch's ops elsewhere, saying which and why. Either gives the same weights bit for bit
# (tests/test_fused_masks.py); fused takes fewer ops a step, which a streamed step pays for
# per micro-batch.
MASK_KERNELS = ("auto", *options.MASK_KERNELS)

# finetune variants: name -> (backbone stage, recipe overrides)
VARIANTS = {
    "pruned Rep-Net (the method)": "ft_pruned",
    "unpruned Rep-Net": "ft_repnet",
    "unpruned Rep-Net, streamed": "ft_streamed",
    "full fine-tune": "ft_full",
}


# --- what each stage made: typed results, saved as DIR/stages/NAME.json (a rerun reads them back)


@dataclass(frozen=True)
class Trained:
    """pretrain, retrain: the backbone folder and its source-task top-1 (%)."""

    backbone: str
    source_acc1: float | None


@dataclass(frozen=True)
class Profiled:
    paper_total_bytes: int
    paper_peak_activation_bytes: int
    sensitive_blocks: list[int]
    runtime_total_bytes: int
    measured_bytes: int | None
    plot: str


@dataclass(frozen=True)
class Planned:
    budget_bytes: int
    predicted_bytes: int
    plan: str
    blocks: list[int]
    ratios: list[float]
    pool: int
    describe: str


@dataclass(frozen=True)
class Pruned:
    backbone: str
    blocks: list[int]
    ratios: list[float]
    hidden: dict[str, int]


@dataclass(frozen=True)
class FineTuned:
    run: str
    mode: str
    pool: int
    stream: int
    backbone: str
    uint8_input: bool
    recompute: bool
    target_acc1: float | None
    predicted_bytes: int
    measured_bytes: int | None
    runtime: str
    channels_last: bool = False  # (a stage recorded before the demo ran Rep-Net channels-last ran plain)
    mask_kernels: str = "aten"  # (and before it chose mask kernels, with torch's ops)


@dataclass(frozen=True)
class Exported:
    onnx: str
    max_abs_diff: float
    onnx_bytes: int
    exporter: str


# Where the prune stage's blocks and ratios come from (``prune_rule``), as the demo says it.
PRUNE_RULES = {
    "plan": "the plan's blocks and ratios",
    "paper": "the paper's ratios for {title} (the plan fitted without pruning)",
    "auto": ("the paper's rule (edgetl prune --auto) on the profile's sensitive blocks: no paper pruned "
             "{title}, and the plan fitted without pruning"),
}


def prune_rule(arch: str, planned: Planned) -> str:
    """Which rule the prune stage follows (a ``PRUNE_RULES`` key): the plan's pruning; where it
    prunes nothing, the paper's ratios; on an architecture without them, the paper's rule."""
    if planned.blocks:
        return "plan"
    return "paper" if archs.get(arch).paper_ratios else "auto"


@dataclass
class DemoReport:
    """Every stage's result by name, in pipeline order, and each stage's wall time (s), on the
    backbone ``arch`` (not in report.json: each stage's backbone folder names it)."""

    out_dir: Path
    stages: dict[str, Any] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    arch: str = DEFAULT_ARCH

    @property
    def prune_source(self) -> str:
        """Where the prune stage's blocks and ratios came from, in words."""
        rule = prune_rule(self.arch, self.stages["plan"])
        return PRUNE_RULES[rule].format(title=archs.get(self.arch).title)

    @property
    def variants(self) -> dict[str, FineTuned]:
        return {name: self.stages[stage] for name, stage in VARIANTS.items() if stage in self.stages}

    def to_dict(self) -> dict[str, dict]:
        """report.json: each stage's fields and its wall time."""
        order = [name for name in STAGE_NAMES if name in self.stages]
        order += [name for name in self.stages if name not in STAGE_NAMES]
        return {name: {**dataclasses.asdict(self.stages[name]), "wall_s": self.wall_s[name]} for name in order}


@dataclass(frozen=True)
class _Context:
    """What every stage function reads: the scale, where to train, the data, progress, and the
    results of the stages before it (by name)."""

    scale: DemoScale
    device: str
    data_root: str
    on_step: Callable[[dict], None] | None
    done: dict[str, Any]
    arch: str = DEFAULT_ARCH
    mask_kernels: str = "aten"  # the lean fine-tunes' (``choose_mask_kernels``)

    def recipe(self, classes: list[int], samples: int, epochs: int, **overrides) -> Recipe:
        """The bundled fashion_mnist recipe at the demo's scale, on its data, with ``overrides``."""
        scale = self.scale
        values = {
            "data.root": self.data_root, "data.classes": classes, "data.max_samples": samples,
            "data.max_val_samples": scale.val_samples, "data.resolution": scale.resolution,
            "train.epochs": epochs, "train.batch_size": scale.batch_size, "train.checkpoint_every": 50,
            # one loader process: it decodes and augments the next batch on the core the edgetl
            # program leaves free (``edgetl.cli.thread_policy``), beside the training step
            "train.workers": 1,
        }
        values.update(overrides)
        return load_recipe("fashion_mnist", values)

    def source_recipe(self, epochs: int, backbone: str | None) -> Recipe:
        """Full training of the backbone on the source task (pretrain, retrain)."""
        width = self.scale.width if archs.get(self.arch).width_multiplier else 1.0
        return self.recipe(SOURCE_CLASSES, self.scale.pretrain_samples, epochs, **{
            "model.mode": "full", "model.backbone": backbone, "model.width": width,
            "optim.lr_head": 3e-3, "optim.lr_side": None,
        })

    @property
    def initial_backbone(self) -> str | None:
        """What pretraining starts from: the architecture at random init (None: the default's)."""
        from edgetl.models.backbone import RANDOM_WEIGHTS

        return None if self.arch == DEFAULT_ARCH else f"{self.arch}:{RANDOM_WEIGHTS}"


def _pretrain(ctx: _Context, work: Path) -> Trained:
    from edgetl.retrain import retrain

    recipe = ctx.source_recipe(ctx.scale.pretrain_epochs, ctx.initial_backbone)
    result = retrain(recipe=recipe, out_dir=work, device=ctx.device, on_step=ctx.on_step)
    return Trained(str(work), result.best_acc1)


def _profile(ctx: _Context, work: Path) -> Profiled:
    from edgetl.profile import plot_profile, profile

    scale, pre = ctx.scale, ctx.done["pretrain"]
    work.mkdir(parents=True)
    common = dict(mode="repnet", resolution=scale.resolution, batch_size=scale.batch_size,
                  num_classes=len(TARGET_CLASSES), checkpoint=pre.backbone)
    paper = profile(accounting="paper", **common)
    runtime = profile(accounting="runtime", measure=True, **common)
    paper.save_json(work / "paper.json")
    runtime.save_json(work / "runtime.json")
    plot_profile(paper, work / "profile.png")
    return Profiled(paper.total_bytes, paper.peak_activation_bytes, paper.sensitive_blocks, runtime.total_bytes,
                    runtime.measured_peak_bytes, str(work / "profile.png"))


def _plan(ctx: _Context, work: Path) -> Planned:
    from edgetl.plan import PlanImpossible, plan

    scale = ctx.scale
    work.mkdir(parents=True)
    # A budget the unpruned, unpooled network misses: the plan has to prune or pool (the
    # paper's route: no streaming; the streamed route is a fine-tune variant below).
    budget = int(ctx.done["profile"].runtime_total_bytes * scale.budget_fraction)
    kw = dict(batch_size=scale.batch_size, resolution=scale.resolution, num_classes=len(TARGET_CLASSES),
              backbone=ctx.done["pretrain"].backbone, precision="fp32", frozen_weights="fp32", stream=0)
    try:
        chosen = plan(budget_bytes=budget, **kw)
    except PlanImpossible as exc:
        budget = exc.min_budget_bytes
        chosen = plan(budget_bytes=budget, **kw)
    chosen.save(work / "plan.yaml")
    config = chosen.chosen
    return Planned(budget, chosen.predicted_bytes, str(work / "plan.yaml"), config.blocks, config.ratios,
                   config.pool, config.describe())


def _prune(ctx: _Context, work: Path) -> Pruned:
    from edgetl.models.backbone import load_backbone, save_backbone
    from edgetl.prune import auto_ratios, calibration_batches, default_blocks, prune, save_pruned

    planned, scale = ctx.done["plan"], ctx.scale
    net = load_backbone(ctx.done["pretrain"].backbone)
    rule = prune_rule(net.spec.arch, planned)
    if rule == "plan":
        blocks, ratios = planned.blocks, planned.ratios
    elif rule == "paper":  # the plan fitted without pruning: prune as the paper does
        paper = archs.get(net.spec.arch).paper_ratios
        blocks, ratios = list(paper), list(paper.values())
    else:  # no paper's ratios for this backbone: the paper's rule, as edgetl prune --auto applies it
        auto = auto_ratios(net.spec, default_blocks(net.spec, resolution=scale.resolution),
                           resolution=scale.resolution)
        blocks, ratios = auto.blocks, auto.ratios
    if not any(ratios):  # the rule prunes nothing (ResNet's one sensitive block is its stem, which
        # has no hidden channels): the pipeline goes on with the network as it is
        log.info("prune: nothing to prune by %s", rule)
        work.mkdir(parents=True)
        save_backbone(work, net)
        return Pruned(str(work), [], [], {})
    batches = calibration_batches("fashion-mnist", resolution=scale.resolution, batches=4)
    result = prune(net=net, blocks=blocks, ratios=ratios, importance="activation-l2", calib_batches=batches,
                   calibration="fashion-mnist", resolution=scale.resolution)
    save_pruned(result, work)
    return Pruned(str(work), blocks, ratios, {str(k): v for k, v in result.net.spec.hidden.items()})


def _retrain(ctx: _Context, work: Path) -> Trained:
    from edgetl.retrain import retrain

    recipe = ctx.source_recipe(ctx.scale.retrain_epochs, ctx.done["prune"].backbone)
    result = retrain(recipe=recipe, out_dir=work, device=ctx.device, on_step=ctx.on_step)
    return Trained(str(work), result.best_acc1)


@dataclass(frozen=True)
class _FineTune:
    """A fine-tuning stage on the target task: Rep-Net with the plan's pooling (streamed by
    ``stream`` with the levers that stack on it at no accuracy cost), or full fine-tuning."""

    backbone_stage: str
    mode: str = "repnet"
    stream: int = 0

    def recipe(self, ctx: _Context) -> Recipe:
        """The stage's recipe: the target task, this stage's backbone and levers."""
        import torch

        mode, stream = self.mode, self.stream
        pool = ctx.done["plan"].pool if mode == "repnet" else 1
        # Rep-Net's frozen lean backbone runs channels-last on a CPU, where its conv kernels are
        # faster that way: at 64 px, batch 32 on a 2-core AVX2 EPYC (one thread) the unpruned
        # stage 1.32x and the streamed one 1.10x as fast, the same predicted and measured peaks
        # (docs/pipeline.md). Full fine-tuning trains its convs plain (LeanOptions.channels_last);
        # on CUDA the lean runtime runs plain until channels-last is measured there.
        overrides = {"model.backbone": ctx.done[self.backbone_stage].backbone, "model.mode": mode,
                     "model.pool": pool, "model.stream": stream,
                     "model.channels_last": mode == "repnet" and torch.device(ctx.device).type == "cpu"}
        if stream:
            overrides.update({"model.uint8_input": True, "model.recompute": True})
        if mode == "repnet":
            overrides["model.mask_kernels"] = ctx.mask_kernels
        if mode == "full":
            overrides.update({"optim.lr_head": 1e-3, "optim.lr_side": None})
        return ctx.recipe(TARGET_CLASSES, ctx.scale.target_samples, ctx.scale.finetune_epochs, **overrides)

    def __call__(self, ctx: _Context, work: Path) -> FineTuned:
        from edgetl.finetune import finetune

        recipe = self.recipe(ctx)
        result = finetune(recipe=recipe, out_dir=work, device=ctx.device, on_step=ctx.on_step)
        m = recipe.model  # what the stage ran, as its recipe says
        return FineTuned(str(work), m.mode, m.pool, m.stream, ctx.done[self.backbone_stage].backbone, m.uint8_input,
                         m.recompute, result.best_acc1, result.predicted.total_bytes, result.measured_peak_bytes,
                         result.predicted.runtime, m.channels_last, m.mask_kernels)


def _export(ctx: _Context, work: Path) -> Exported:
    from edgetl.export import export_run
    from edgetl.prune import calibration_batches

    work.mkdir(parents=True)
    images = calibration_batches("fashion-mnist", resolution=ctx.scale.resolution, batches=1, batch_size=8)[0]
    result = export_run(Path(ctx.done["ft_pruned"].run), output=work / "model.onnx", images=images)
    return Exported(str(result.onnx_path), result.max_abs_diff, result.onnx_bytes, result.exporter)


# The demo's stages in pipeline order; each reads the results of the stages it needs. Stages
# whose needs are met run side by side where the demo runs more than one at a time (``jobs``):
# the pruned backbone's retraining beside the unpruned backbone's fine-tunes.
STAGES = (
    Stage("pretrain", "pretrain the backbone on the source task (classes 0-4)", _pretrain, Trained),
    Stage("profile", "profile Rep-Net memory (paper + runtime accounting, measured)", _profile, Profiled,
          ("pretrain",)),
    Stage("plan", "plan pruning / pooling for a budget scaled to the model", _plan, Planned, ("pretrain", "profile")),
    Stage("prune", "prune the planned hidden channels (activation-L2)", _prune, Pruned, ("pretrain", "plan")),
    Stage("retrain", "retrain the pruned backbone on the source task", _retrain, Trained, ("prune",)),
    Stage("ft_pruned", "fine-tune the side network on the target task (classes 5-9), pruned backbone",
          _FineTune("retrain"), FineTuned, ("retrain", "plan")),
    Stage("ft_repnet", "fine-tune the side network, unpruned backbone (comparison)", _FineTune("pretrain"),
          FineTuned, ("pretrain", "plan")),
    Stage("ft_streamed", f"the same, its frozen backbone streamed in micro-batches of {STREAM} (comparison)",
          _FineTune("pretrain", stream=STREAM), FineTuned, ("pretrain", "plan")),
    Stage("ft_full", "full fine-tune of the unpruned backbone (comparison)", _FineTune("pretrain", mode="full"),
          FineTuned, ("pretrain",)),
    Stage("export", "export ONNX and check it against PyTorch", _export, Exported, ("ft_pruned",)),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def choose_mask_kernels(asked: str, device: str) -> tuple[str, str]:
    """The mask kernels the demo's lean fine-tunes run (``MASK_KERNELS``: "aten" or "fused") and
    why, in words. "fused" is built here, or refused in one line (``edgetl.models.lean.fused``);
    "auto" builds it on a CPU and takes torch's ops where it cannot, saying why."""
    import torch

    from edgetl.errors import CapabilityError
    from edgetl.models.lean import fused

    if asked not in MASK_KERNELS:
        raise ConfigError(f"mask_kernels {asked!r} is not allowed; allowed: {', '.join(MASK_KERNELS)}")
    if asked == "aten":
        return "aten", "asked for"
    if asked == "fused":
        fused.prepare(device)
        return "fused", "asked for"
    if torch.device(device).type != "cpu":
        return "aten", f"auto: the fused kernels are the demo's choice on a CPU only, not on {device}"
    lacking = fused.missing()
    if lacking is not None:
        return "aten", f"auto: building the fused kernels needs {lacking}, not found here"
    try:
        fused.prepare(device)
    except CapabilityError as exc:
        return "aten", f"auto: {exc}"
    return "fused", f"auto: built with {fused.compiler()}"


def _claim_folder(out_dir: Path):
    """The demo folder's record of what edgetl made there; a 'stages' folder of the user's is refused."""
    from edgetl.runfolder import Manifest, check_output_folder

    check_output_folder(out_dir, "demo folder")
    manifest = Manifest(out_dir)
    marks = out_dir / "stages"
    if not manifest.path.exists() and (marks / "pretrain.json").is_file():
        manifest.legacy = True  # a demo folder from an edgetl that kept no record
    if marks.exists() and not manifest.owns("stages"):
        raise ConfigError(f"demo folder {out_dir} holds a 'stages' that edgetl did not make; choose an empty "
                          f"or new folder (edgetl never overwrites or removes files it did not create)")
    manifest.claim(["stages", "report.json"])
    marks.mkdir(parents=True, exist_ok=True)
    return manifest


def _check_arch(out_dir: Path, arch: str) -> None:
    """Refuse a demo folder whose pretrained backbone is another architecture (its finished
    stages would be reused for the wrong network)."""
    from edgetl.models.backbone import SPEC_FILE, read_backbone_spec

    mark = out_dir / "stages" / "pretrain.json"
    folder = read_json(mark).get("backbone") if mark.is_file() else None
    if not isinstance(folder, str) or not (Path(folder) / SPEC_FILE).is_file():
        return  # nothing pretrained yet (or gone): the stage runs
    made = read_backbone_spec(folder).arch
    if made != arch:
        raise ConfigError(f"demo folder {out_dir} holds the {made} demo, not {arch}; choose another folder "
                          f"for --backbone {arch}")


def run_demo(
    *,
    out_dir: str | Path,
    quick: bool = False,
    data: str | Path | None = None,
    device: str = "cpu",
    arch: str = DEFAULT_ARCH,
    jobs: int = 1,
    mask_kernels: str = "auto",
    on_stage: Callable[[str, str, dict], None] | None = None,
    on_step: Callable[[dict], None] | None = None,
    on_choice: Callable[[str, str], None] | None = None,
) -> DemoReport:
    """Run (or resume) the demo in ``out_dir``; returns every stage's figures.

    Args:
        out_dir: demo folder; finished stages found there are reused (a folder another
            backbone's demo made is refused).
        quick: the small scale used by the test suite.
        data: Fashion-MNIST folder (default: the Debian package location).
        device: where to train.
        arch: the backbone, a registered architecture (``edgetl.models.archs``), pretrained
            from random init on the source task.
        jobs: stages run at once. A stage that runs beside another runs in a process of its
            own, its torch threads this process's shared out; a stage alone runs here. Results
            do not depend on it. One by default: on a 2-core AVX2 EPYC (2 vCPUs) two at once
            made each stage about 2x slower and the stages 506 s in all, against 433 s.
        mask_kernels: the lean fine-tunes' mask kernels, a ``MASK_KERNELS`` value
            (``choose_mask_kernels``); the same figures either way but a streamed step's speed.
            A fine-tune reused from an earlier run keeps what it ran (its report.json entry).
        on_stage: called with (stage, "start" | "done" | "reused", its report.json entry).
        on_step: progress callback of the training loop (all training stages); its dict's
            "stage" names the stage.
        on_choice: called once, before any stage, with the mask kernels chosen and why.
    """
    from edgetl.data import find_fashion_mnist

    out_dir = Path(out_dir)
    archs.get(arch)  # an unknown name: one line naming the registered ones
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs {jobs!r} is not allowed; give a whole number of stages to run at once, 1 or more")
    root = str(find_fashion_mnist(data))
    kernels, why = choose_mask_kernels(mask_kernels, device)  # a build that fails: before anything is written
    (on_choice or (lambda *a: None))(kernels, why)
    manifest = _claim_folder(out_dir)
    _check_arch(out_dir, arch)
    on_stage = on_stage or (lambda *a: None)
    report = DemoReport(out_dir, arch=arch)
    ctx = _Context(QUICK if quick else FULL, device, root, on_step, {}, arch, kernels)
    run_side_by_side(STAGES, ctx, manifest, report, on_stage, jobs)
    atomic_text_json(out_dir / "report.json", report.to_dict())
    return report
