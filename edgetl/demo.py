"""Demo: the whole pipeline on real offline data, a folder in, a report with figures out.

Fashion-MNIST (Debian package ``dataset-fashion-mnist``) gives a real transfer task: the
source task is classes 0-4 (T-shirt, trouser, pullover, dress, coat), the target task
classes 5-9 (sandal, shirt, sneaker, bag, ankle boot). A small MobileNetV2 at a small
resolution keeps it to minutes on a laptop CPU:

    pretrain  the backbone on the source task (edgetl.retrain)
    profile   paper and runtime memory of Rep-Net on it (edgetl.profile)
    plan      pruning / pooling / batch for a budget scaled to the model (edgetl.plan)
    prune     the planned hidden channels, activation-L2 importance (edgetl.prune)
    retrain   the pruned backbone on the source task (edgetl.retrain)
    finetune  the side network on the target task, pooled storage (edgetl.finetune),
              beside unpruned Rep-Net (as is, and with its frozen backbone streamed
              sample by sample, the batch kept as uint8 pixels and segments recomputed
              where that lowers the peak: the other route to the memory the pruning
              buys, at no accuracy cost) and full fine-tuning of the same backbone
    export    ONNX, checked against PyTorch with onnxruntime (edgetl.export)

Each stage records what it made in ``DIR/stages/NAME.json``; a rerun reuses finished
stages (delete that file, or the folder, to redo one).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from edgetl.errors import ConfigError
from edgetl.io import atomic_text_json
from edgetl.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)

SOURCE_CLASSES = [0, 1, 2, 3, 4]
TARGET_CLASSES = [5, 6, 7, 8, 9]


@dataclass(frozen=True)
class DemoScale:
    """How big the demo is; ``quick`` is for the test suite (about a minute)."""

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

# finetune variants: name -> (backbone stage, recipe overrides)
VARIANTS = {
    "pruned Rep-Net (the method)": "ft_pruned",
    "unpruned Rep-Net": "ft_repnet",
    "unpruned Rep-Net, streamed (micro-batch 1)": "ft_streamed",
    "full fine-tune": "ft_full",
}


@dataclass
class DemoReport:
    out_dir: Path
    stages: dict[str, dict] = field(default_factory=dict)

    @property
    def variants(self) -> dict[str, dict]:
        return {name: self.stages[stage] for name, stage in VARIANTS.items() if stage in self.stages}


def _recipe(scale: DemoScale, classes: list[int], samples: int, epochs: int, **overrides) -> Recipe:
    values = {
        "data.classes": classes, "data.max_samples": samples, "data.max_val_samples": scale.val_samples,
        "data.resolution": scale.resolution, "train.epochs": epochs, "train.batch_size": scale.batch_size,
        "train.checkpoint_every": 50, "train.workers": 0,
    }
    values.update(overrides)
    return load_recipe("fashion_mnist", values)


def _source_recipe(scale: DemoScale, epochs: int, backbone: str | None) -> Recipe:
    return _recipe(scale, SOURCE_CLASSES, scale.pretrain_samples, epochs, **{
        "model.mode": "full", "model.backbone": backbone, "model.width": scale.width,
        "optim.lr_head": 3e-3, "optim.lr_side": None,
    })


class _Stages:
    """Runs stages in order, each at most once per output folder."""

    def __init__(self, out_dir: Path, on_stage: Callable[[str, str, dict], None] | None):
        from edgetl.runfolder import Manifest, check_output_folder

        check_output_folder(out_dir, "demo folder")
        self.out_dir = out_dir
        self.manifest = Manifest(out_dir)
        self.marks = out_dir / "stages"
        if not self.manifest.path.exists() and (self.marks / "pretrain.json").is_file():
            self.manifest.legacy = True  # a demo folder from an edgetl that kept no record
        if self.marks.exists() and not self.manifest.owns("stages"):
            raise ConfigError(f"demo folder {out_dir} holds a 'stages' that edgetl did not make; choose an empty "
                              f"or new folder (edgetl never overwrites or removes files it did not create)")
        self.manifest.claim(["stages", "report.json"])
        self.marks.mkdir(parents=True, exist_ok=True)
        self.on_stage = on_stage or (lambda *a: None)
        self.report = DemoReport(out_dir)

    def run(self, name: str, fn: Callable[[Path], dict]) -> dict:
        mark = self.marks / f"{name}.json"
        if mark.is_file():
            info = json.loads(mark.read_text())
            self.on_stage(name, "reused", info)
        else:
            work = self.out_dir / name
            self.manifest.claim([name])  # refuses a folder of the user's by that name
            if work.exists():  # a stage of this demo killed part-way: start it again
                shutil.rmtree(work)
            self.on_stage(name, "start", {})
            start = time.perf_counter()
            info = fn(work)
            info["wall_s"] = round(time.perf_counter() - start, 1)
            atomic_text_json(mark, info)
            self.on_stage(name, "done", info)
        self.report.stages[name] = info
        return info


def run_demo(
    *,
    out_dir: str | Path,
    quick: bool = False,
    data: str | Path | None = None,
    device: str = "cpu",
    on_stage: Callable[[str, str, dict], None] | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> DemoReport:
    """Run (or resume) the demo in ``out_dir``; returns every stage's figures.

    Args:
        out_dir: demo folder; finished stages found there are reused.
        quick: the small scale used by the test suite.
        data: Fashion-MNIST folder (default: the Debian package location).
        device: where to train.
        on_stage: called with (stage, "start" | "done" | "reused", info).
        on_step: progress callback of the training loop (all training stages).
    """
    from edgetl.data import find_fashion_mnist

    scale = QUICK if quick else FULL
    out_dir = Path(out_dir)
    root = str(find_fashion_mnist(data))
    stages = _Stages(out_dir, on_stage)
    common = {"data.root": root}

    def pretrain(work: Path) -> dict:
        from edgetl.retrain import retrain

        recipe = _with(_source_recipe(scale, scale.pretrain_epochs, None), common)
        result = retrain(recipe=recipe, out_dir=work, device=device, on_step=on_step)
        return {"backbone": str(work), "source_acc1": result.best_acc1}

    pre = stages.run("pretrain", pretrain)

    def profile_stage(work: Path) -> dict:
        from edgetl.profile import plot_profile, profile

        work.mkdir(parents=True)
        paper = profile(mode="repnet", accounting="paper", resolution=scale.resolution, batch_size=scale.batch_size,
                        num_classes=len(TARGET_CLASSES), checkpoint=pre["backbone"])
        runtime = profile(mode="repnet", accounting="runtime", resolution=scale.resolution,
                          batch_size=scale.batch_size, num_classes=len(TARGET_CLASSES), checkpoint=pre["backbone"],
                          measure=True)
        paper.save_json(work / "paper.json")
        runtime.save_json(work / "runtime.json")
        plot_profile(paper, work / "profile.png")
        return {"paper_total_bytes": paper.total_bytes, "paper_peak_activation_bytes": paper.peak_activation_bytes,
                "sensitive_blocks": paper.sensitive_blocks, "runtime_total_bytes": runtime.total_bytes,
                "measured_bytes": runtime.measured_peak_bytes, "plot": str(work / "profile.png")}

    prof = stages.run("profile", profile_stage)

    def plan_stage(work: Path) -> dict:
        from edgetl.plan import PlanImpossible, plan

        work.mkdir(parents=True)
        # A budget the unpruned, unpooled network misses: the plan has to prune or pool (the
        # paper's route: no streaming; the streamed route is a fine-tune variant below).
        budget = int(prof["runtime_total_bytes"] * scale.budget_fraction)
        kw = dict(batch_size=scale.batch_size, resolution=scale.resolution, num_classes=len(TARGET_CLASSES),
                  backbone=pre["backbone"], precision="fp32", frozen_weights="fp32", stream=0)
        try:
            chosen = plan(budget_bytes=budget, **kw)
        except PlanImpossible as exc:
            budget = exc.min_budget_bytes
            chosen = plan(budget_bytes=budget, **kw)
        chosen.save(work / "plan.yaml")
        config = chosen.chosen
        return {"budget_bytes": budget, "predicted_bytes": chosen.predicted_bytes, "plan": str(work / "plan.yaml"),
                "blocks": config.blocks, "ratios": config.ratios, "pool": config.pool,
                "describe": config.describe()}

    planned = stages.run("plan", plan_stage)

    def prune_stage(work: Path) -> dict:
        from edgetl.models.backbone import PAPER_RATIOS, load_backbone
        from edgetl.prune import calibration_batches, prune, save_pruned

        blocks, ratios = planned["blocks"], planned["ratios"]
        if not blocks:  # the plan fitted without pruning: prune as the paper does
            blocks, ratios = list(PAPER_RATIOS), list(PAPER_RATIOS.values())
        net = load_backbone(pre["backbone"])
        batches = calibration_batches("fashion-mnist", resolution=scale.resolution, batches=4)
        result = prune(net=net, blocks=blocks, ratios=ratios, importance="activation-l2", calib_batches=batches,
                       calibration="fashion-mnist", resolution=scale.resolution)
        save_pruned(result, work)
        return {"backbone": str(work), "blocks": blocks, "ratios": ratios,
                "hidden": {str(k): v for k, v in result.net.spec.hidden.items()}}

    pruned = stages.run("prune", prune_stage)

    def retrain_stage(work: Path) -> dict:
        from edgetl.retrain import retrain

        recipe = _with(_source_recipe(scale, scale.retrain_epochs, pruned["backbone"]), common)
        result = retrain(recipe=recipe, out_dir=work, device=device, on_step=on_step)
        return {"backbone": str(work), "source_acc1": result.best_acc1}

    retrained = stages.run("retrain", retrain_stage)

    def finetune_stage(backbone: str, mode: str, pool: int, stream: int = 0):
        def run(work: Path) -> dict:
            from edgetl.finetune import finetune

            overrides = {"model.backbone": backbone, "model.mode": mode, "model.pool": pool,
                         "model.stream": stream}
            if stream:  # the levers that stack on streaming and cost no accuracy
                overrides.update({"model.uint8_input": True, "model.recompute": True})
            if mode == "full":
                overrides.update({"optim.lr_head": 1e-3, "optim.lr_side": None})
            recipe = _with(_recipe(scale, TARGET_CLASSES, scale.target_samples, scale.finetune_epochs,
                                   **overrides), common)
            result = finetune(recipe=recipe, out_dir=work, device=device, on_step=on_step)
            return {"run": str(work), "mode": mode, "pool": pool, "stream": stream, "backbone": backbone,
                    "uint8_input": bool(stream), "recompute": bool(stream),
                    "target_acc1": result.best_acc1, "predicted_bytes": result.predicted.total_bytes,
                    "measured_bytes": result.measured_peak_bytes, "runtime": result.predicted.runtime}
        return run

    stages.run("ft_pruned", finetune_stage(retrained["backbone"], "repnet", planned["pool"]))
    stages.run("ft_repnet", finetune_stage(pre["backbone"], "repnet", planned["pool"]))
    stages.run("ft_streamed", finetune_stage(pre["backbone"], "repnet", planned["pool"], stream=1))
    stages.run("ft_full", finetune_stage(pre["backbone"], "full", 1))

    def export_stage(work: Path) -> dict:
        from edgetl.export import export_run
        from edgetl.prune import calibration_batches

        work.mkdir(parents=True)
        images = calibration_batches("fashion-mnist", resolution=scale.resolution, batches=1, batch_size=8)[0]
        result = export_run(out_dir / "ft_pruned", output=work / "model.onnx", images=images)
        return {"onnx": str(result.onnx_path), "max_abs_diff": result.max_abs_diff,
                "onnx_bytes": result.onnx_bytes, "exporter": result.exporter}

    stages.run("export", export_stage)
    atomic_text_json(out_dir / "report.json", {k: v for k, v in stages.report.stages.items()})
    return stages.report


def _with(recipe: Recipe, overrides: dict) -> Recipe:
    from edgetl.recipe import apply_overrides

    return apply_overrides(recipe, overrides)
