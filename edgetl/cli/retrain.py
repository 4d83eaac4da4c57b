"""``edgetl retrain``: retrain a pruned backbone (or pretrain one) on ImageNet; one GPU, many, or a CPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgetl.cli import COMMANDS
from edgetl.cli._common import fmt_image_check, given_path, positive_float, positive_int, print_table
from edgetl.errors import ConfigError
import edgetl.models.archs as archs
from edgetl.recipe import apply_overrides, load_recipe, parse_override

EPILOG = """\
examples:
  # one GPU (or, slowly, the CPU)
  edgetl retrain --backbone runs/pruned --data /data/imagenet -o runs/retrained
  # distil from the unpruned network (temperature 1.0, weight 0.5 unless --set distill.*=...)
  edgetl retrain --backbone runs/pruned --data /data/imagenet \\
      --distill-from runs/mobilenet_v2_unpruned -o runs/retrained
  # start from torchvision's ImageNet weights (torch cache; downloaded once where online)
  edgetl retrain --backbone mobilenet_v2:IMAGENET1K_V1 --data /data/mine -o runs/mine
  # pretrain from scratch, or start from a local torchvision checkpoint file
  edgetl retrain --backbone mobilenet_v2 --width 1.0 --data /data/imagenet \\
      --epochs 300 --lr 0.045 --batch-size 32 -o runs/mobilenet_v2_unpruned
  edgetl retrain --backbone mobilenet_v2 --weights mobilenet_v2-b0353104.pth ...
  # continue a killed run (the recipe is read from the run folder)
  edgetl retrain --resume -o runs/retrained

several GPUs on one machine (--batch-size is per process; scale --lr with the global batch):
  torchrun --nproc_per_node=8 -m edgetl retrain --backbone runs/pruned \\
      --data /data/imagenet --lr 0.16 -o runs/retrained

several machines (run on every node; same data path on each, run folder on shared storage):
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=retrain1 --rdzv_backend=c10d \\
      --rdzv_endpoint=node0.example:29400 -m edgetl retrain --backbone runs/pruned \\
      --data /data/imagenet --lr 0.32 -o /shared/runs/retrained

The run folder is also a backbone folder (backbone.json + backbone.pt, best epoch):
give it to edgetl finetune --backbone, edgetl profile --checkpoint or --distill-from.
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "retrain",
        help=COMMANDS["retrain"],
        description=(
            "Retrain the whole (pruned) backbone on an ImageFolder dataset (train/ and val/\n"
            "class folders) with the shared training loop: SGD with momentum, warmup + cosine,\n"
            "label smoothing, no weight decay on BN and biases, optional distillation from the\n"
            "unpruned network. Resumable; works unchanged under torchrun. The output run folder\n"
            "is also a backbone folder."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backbone", metavar="DIR|NAME",
                   help="backbone folder to retrain (from edgetl prune), a torchvision weights name "
                        "(mobilenet_v2:IMAGENET1K_V1, resnet18:IMAGENET1K_V1, ...), or a bare architecture "
                        "(mobilenet_v2, resnet18, resnet34, resnet50: random init) to pretrain from scratch "
                        "(required unless --resume)")
    p.add_argument("--width", type=positive_float, help="width multiplier for --backbone mobilenet_v2 "
                   "(default: the recipe's model.width)")
    p.add_argument("--weights", metavar="FILE",
                   help="local torchvision state_dict to start a bare architecture (--backbone resnet18) from")
    p.add_argument("--data", metavar="ROOT", help="dataset folder: ROOT/train/<class>/*, ROOT/val/<class>/* "
                   "(sets data.root)")
    p.add_argument("--recipe", help="recipe YAML or bundled name (default: imagenet_retrain; with --resume: "
                   "the run's recipe.yaml)")
    p.add_argument("--epochs", type=positive_int, help="sets train.epochs")
    p.add_argument("--batch-size", type=positive_int, help="images per step per process (train.batch_size)")
    p.add_argument("--lr", type=positive_float, help="base learning rate (optim.lr)")
    distill = p.add_mutually_exclusive_group()
    distill.add_argument("--distill-from", metavar="DIR",
                         help="distil from this teacher: a backbone folder or retrain run on the same classes "
                              "(adds distill.teacher; temperature 1.0 and weight 0.5 unless --set)")
    distill.add_argument("--no-distill", action="store_true",
                         help="drop the recipe's distill section (the bundled recipe has none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a recipe value, e.g. --set train.workers=4 (repeatable)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available, else cpu (default: auto)")
    p.add_argument("--precision", choices=("auto", "fp32", "fp16", "bf16"), default="auto",
                   help="auto: fp16 autocast + GradScaler on CUDA, fp32 on CPU (sets model.precision)")
    p.add_argument("--resume", action="store_true", help="continue the run in -o from its last.pt")
    p.add_argument("-o", "--output", required=True, type=given_path, metavar="RUN", help="run folder")
    p.set_defaults(run=run)


# What --distill-from adds to a recipe without a distill section (Hinton's plain setting).
DISTILL_DEFAULTS = {"distill.temperature": 1.0, "distill.weight": 0.5}


def resolve_recipe(args, device: str):
    """The recipe file, then --set, then the named flags (the named flags win)."""
    out = Path(args.output)
    if args.recipe is None and args.resume and (out / "recipe.yaml").is_file():
        recipe = load_recipe(out / "recipe.yaml")
    else:
        recipe = load_recipe(args.recipe or "imagenet_retrain")
    overrides = dict(parse_override(text) for text in args.overrides)
    if args.backbone is not None:
        overrides["model.backbone"] = None if args.backbone == archs.DEFAULT_ARCH else args.backbone
    if args.width is not None:
        stock = args.backbone is None or args.backbone in archs.registered() or str(args.backbone).endswith(":random")
        if not stock or (args.backbone is None and recipe.model.backbone):
            raise ConfigError("--width is for --backbone mobilenet_v2; a backbone folder has its own width")
        overrides["model.width"] = args.width
    if args.data is not None:
        overrides["data.root"] = args.data
    if args.epochs is not None:
        overrides["train.epochs"] = args.epochs
    if args.batch_size is not None:
        overrides["train.batch_size"] = args.batch_size
    if args.lr is not None:
        overrides["optim.lr"] = args.lr
    if args.distill_from is not None:
        overrides["distill.teacher"] = args.distill_from
        if recipe.distill is None:  # opt-in: the section's defaults, unless --set names them
            for key, value in DISTILL_DEFAULTS.items():
                overrides.setdefault(key, value)
    if args.no_distill:
        overrides["distill"] = None
    if "model.precision" not in overrides:
        if args.precision == "auto":
            overrides["model.precision"] = "fp16" if device == "cuda" else "fp32"
        else:
            overrides["model.precision"] = args.precision
    return apply_overrides(recipe, overrides, source="retrain")


class Progress:
    """A tqdm bar per epoch (rank 0 only), fed by the loop's on_step / on_epoch callbacks."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def step(self, info: dict) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=info["steps"], initial=info["step"] - 1, unit="step", leave=False,
                            desc=f"epoch {info['epoch'] + 1}/{info['epochs']}", file=sys.stderr)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{info['loss']:.3f}", lr=f"{info['lr']:.2e}", refresh=False)

    def epoch(self, row: dict) -> None:
        if not self.enabled:
            return
        self.close()
        from tqdm import tqdm

        val = f"val top-1 {row['val_acc1']:.2f} %" if row["val_acc1"] is not None else "not evaluated"
        tqdm.write(f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, {val}, "
                   f"{row['epoch_time_s']:.0f} s", file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run(args) -> int:
    import torch

    from edgetl.retrain import retrain
    from edgetl.train import cleanup_distributed, is_main_process, torchrun_env

    if args.backbone is None and not args.resume:
        raise ConfigError("give --backbone DIR (a pruned backbone folder), --backbone mobilenet_v2:IMAGENET1K_V1 "
                          "or --backbone mobilenet_v2 / resnet18 / ... (random init)")
    if args.weights is not None and args.backbone is not None and args.backbone not in archs.registered():
        raise ConfigError("--weights is for a bare architecture name (--backbone mobilenet_v2, resnet18, ...); "
                          f"{args.backbone} has its own weights")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        from edgetl.errors import CapabilityError

        raise CapabilityError("--device cuda: no CUDA device is available here (use --device cpu)")
    recipe = resolve_recipe(args, device)
    env = torchrun_env()
    main = env is None or env[0] == 0
    progress = Progress(enabled=main)
    try:
        result = retrain(recipe=recipe, out_dir=args.output, weights=args.weights, device=device,
                         resume=args.resume, on_step=progress.step, on_epoch=progress.epoch)
    finally:
        progress.close()
        main = main and is_main_process()
        cleanup_distributed()
    if not main:
        return 0
    rows = [["backbone", str(result.source.get("backbone"))],
            ["hidden channels", ", ".join(f"{b}: {c}" for b, c in sorted(result.spec.hidden.items())) or "unpruned"],
            ["classes", f"{len(result.classes)}" + (" (new classifier)" if result.new_head else "")],
            ["teacher", result.teacher or "-"],
            ["processes", str(result.world_size)],
            ["epochs", str(result.epochs)],
            ["best val top-1", f"{result.best_acc1:.2f} % (epoch {result.best_epoch})"
             if result.best_acc1 is not None else "-"],
            ["last val top-1", f"{result.history[-1]['val_acc1']:.2f} %" if result.history else "-"],
            ["training time", f"{result.train_seconds / 60:.1f} min (this call {result.seconds / 60:.1f} min)"],
            ["data", fmt_image_check(result.image_check) if result.image_check and result.image_check.checked else "-"]]
    print()
    print_table(["", "retrain"], rows)
    out = result.out_dir
    print(f"saved to {out} (backbone.json + backbone.pt: best epoch; last.pt, best.pt: checkpoints)")
    print(f"next: edgetl finetune --backbone {out} ...  |  edgetl profile --checkpoint {out}")
    return 0
