"""``edgetl finetune``: train the Rep-Net side network on the lean runtime inside a memory budget."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

from edgetl.cli import COMMANDS
from edgetl.cli._common import (
    HelpFormatter,
    budget_type,
    fmt_image_check,
    fmt_mb,
    fmt_side_pools,
    given_path,
    positive_int,
    print_table,
    torch_device,
)
from edgetl.errors import ConfigError
import edgetl.models.archs as archs
from edgetl.memory.report import MemoryReport
from edgetl.options import MODES, RUNTIMES, LeanOptions, add_option_flags


def override(text: str):
    from edgetl.recipe import parse_override

    try:
        return parse_override(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help=COMMANDS["finetune"],
        description=(
            "Fine-tune only the Rep-Net side network and the classifier on a frozen backbone, on "
            "edgetl's lean runtime (BN folded, frozen convs keep no input, 1-bit ReLU6 masks, "
            "side activations stored average-pooled by --pool); or, with --mode, another method "
            "(--mode full --runtime lean: every conv trains with BN folded, its input kept by "
            "--storage). Before training, the runtime "
            "accounting predicts the peak memory of a step; above --budget the run is refused "
            "with the breakdown and the largest batch that fits. Resumable with --resume."
        ),
        epilog="example: edgetl finetune --recipe fashion_mnist -o runs/fmnist --budget 256MB",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--recipe", required=True, metavar="NAME|PATH",
                   help="recipe YAML (bundled: cifar10, flowers102, pets, cub200, imagefolder, fashion_mnist)")
    backbone = p.add_mutually_exclusive_group()
    backbone.add_argument("--backbone", metavar="DIR|NAME",
                          help="backbone folder (edgetl prune / retrain output) or torchvision weights name "
                               "or architecture (mobilenet_v2:IMAGENET1K_V1, resnet18 = resnet18:IMAGENET1K_V1, "
                               "resnet50:IMAGENET1K_V2, resnet34:random, ...); default: mobilenet_v2:IMAGENET1K_V1 "
                               "from the torch cache (downloaded once where online)")
    backbone.add_argument("--weights", metavar="FILE",
                          help="a local torchvision state_dict file of a registered architecture (e.g. "
                               "mobilenet_v2-b0353104.pth, resnet18-f37072fd.pth; recognised by its keys) instead of --backbone")
    p.add_argument("--data", metavar="PATH", help="dataset root (data.root)")
    p.add_argument("--plan", metavar="PLAN",
                   help="plan.yaml from edgetl plan: supplies --mode, --runtime, --storage, --pool, --precision, "
                        "--frozen-weights, --stream, --recompute, --uint8-input, --fused, --step-in-backward, "
                        "--batch-size, --budget and, for a plan that runs eagerly (made with --eager, or its CUDA "
                        "graphs did not fit), --eager (explicit flags win; an eager plan stays eager: plan again "
                        "for graphs); checks the backbone's pruning")
    p.add_argument("--budget", type=budget_type, metavar="SIZE",
                   help="memory budget for the training tensors, e.g. 256MB, 1GiB (MB = 10^6 B); a step "
                        "captured as CUDA graphs also counts the device memory the graphs reserve beyond an "
                        "eager run's")
    p.add_argument("--batch-size", type=positive_int, help="train.batch_size")
    p.add_argument("--epochs", type=positive_int, help="train.epochs")
    p.add_argument("--mode", choices=MODES, help="model.mode: what trains")
    p.add_argument("--runtime", choices=RUNTIMES,
                   help="model.runtime: lean (edgetl's lean layers), stock (torch modules) or auto (lean where "
                        "the mode allows, except full, whose stock form trains BN)")
    lean = p.add_argument_group("lean runtime options (recipe keys model.*; not given: the recipe's)")
    add_option_flags(lean, defaults=None, key_prefix="model.")
    p.add_argument("--fused", action="store_true", default=None,
                   help="optim.fused: fused optimizer kernels, no update temporaries (same update up to float "
                        "rounding; not with foreach)")
    p.add_argument("--step-in-backward", action="store_true", default=None,
                   help="optim.step_in_backward: update each parameter inside backward as soon as its gradient "
                        "is complete and free the gradient (same weights; not with DDP, foreach or fp16 scaling)")
    p.add_argument("--set", dest="overrides", action="append", type=override, default=[],
                   metavar="KEY=VALUE", help="any recipe value, e.g. --set optim.lr_side=1e-3")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device: cpu, cuda, cuda:N")
    p.add_argument("--eager", action="store_true", default=None,
                   help="train.cuda_graph false: on CUDA, launch every op of the step from Python instead of "
                        "capturing the step as CUDA graphs and replaying them (the default where the step can "
                        "be captured; the summary and recipe.yaml say which ran)")
    p.add_argument("--resume", action="store_true", help="continue the run in -o from its last checkpoint")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="skip the one-step memory measurement before training (CPU)")
    p.add_argument("-o", "--out", required=True, type=given_path, metavar="RUN", help="run folder")
    p.set_defaults(run=run)


class Request(NamedTuple):
    """What the command line asks ``finetune`` for, resolved once: the recipe (file, ``--set``,
    the plan's values, the flags: later wins), the plan it was checked against (None without
    ``--plan``) and the budget (``--budget``, else the plan's tensor budget, else None)."""

    recipe: object  # edgetl.recipe.Recipe
    plan: object | None  # edgetl.plan.Plan
    budget: int | None


def planned_values(plan) -> dict[str, object]:
    """The recipe values a plan fixes, as dotted keys (None: the plan leaves it to the recipe)."""
    c = plan.chosen
    return {"model.pool": c.pool, "model.precision": c.precision, "model.frozen_weights": c.frozen_weights,
            "model.stream": c.stream, "train.batch_size": c.batch_size, "model.mode": c.mode,
            "model.runtime": "lean", "model.storage": c.conv_storage, "model.uint8_input": c.uint8_input or None,
            "model.recompute": c.recompute or None, "optim.fused": c.fused or None,
            "optim.step_in_backward": c.step_in_backward or None,
            # an eager plan (asked with --eager, or its graphs did not fit) counted no CUDA graphs
            "train.cuda_graph": False if plan.eager else None}


def check_planned(plan, recipe, where) -> None:
    """Refuse, naming both sides, a plan made for another network than the one the recipe
    trains: its width, hidden channels and resolution (the class count is the data's, checked
    by ``finetune`` once the data is read)."""
    from edgetl.models.backbone import backbone_spec

    m = recipe.model  # the backbone as the flags resolve it (--backbone, --weights, --set, the recipe)
    have = backbone_spec(m.backbone, width=None if m.backbone and Path(m.backbone).is_dir() else m.width)
    name = m.backbone or "MobileNetV2 (model.width)"
    want = plan.spec
    if have.arch != want.arch:
        title = archs.get(want.arch).title
        raise ConfigError(f"{where} was planned for {title}; the backbone {name} is {archs.get(have.arch).title}: "
                          f"give --backbone {want.arch} (or a {title} folder or weights name)")
    if have.width != want.width:
        again = f"--backbone {m.backbone}" if m.backbone else f"--width {have.width:g}"
        raise ConfigError(f"{where} was planned for {archs.get(want.arch).title} width {want.width:g}; the backbone {name} is "
                          f"width {have.width:g}: plan again with {again}, or give a width-{want.width:g} backbone")
    if have.hidden != want.hidden:
        hint = f"edgetl prune --plan {where} -o pruned, then --backbone pruned" if plan.chosen.kept else \
            "the unpruned backbone"
        raise ConfigError(f"{where} plans hidden channels {want.hidden or 'unpruned'}; the backbone {name} has "
                          f"{have.hidden or 'unpruned'}: use {hint}")
    if recipe.data.resolution != plan.resolution:
        raise ConfigError(f"{where} was planned at {plan.resolution} px; the recipe trains at "
                          f"{recipe.data.resolution} px: plan again with --resolution {recipe.data.resolution}")


def recipe_from_args(args) -> Request:
    """The recipe, plan and budget the command line resolves (``args`` is only read)."""
    from edgetl.plan import load_plan
    from edgetl.recipe import load_recipe

    plan = load_plan(args.plan) if getattr(args, "plan", None) is not None else None
    overrides = dict(args.overrides)
    if plan is not None:
        overrides.update({k: v for k, v in planned_values(plan).items() if v is not None})
    flags = {"model.backbone": args.backbone if args.weights is None else args.weights, "data.root": args.data,
             "train.batch_size": args.batch_size, "train.epochs": args.epochs,
             "model.mode": args.mode, "model.runtime": args.runtime, "optim.fused": args.fused,
             "optim.step_in_backward": args.step_in_backward,
             "train.cuda_graph": None if not getattr(args, "eager", None) else False,
             **{f"model.{name}": getattr(args, name) for name in LeanOptions.names()}}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    recipe = load_recipe(args.recipe, overrides=overrides)
    if plan is not None:
        check_planned(plan, recipe, args.plan)
    budget = args.budget if args.budget is not None else plan.tensor_budget_bytes if plan is not None else None
    return Request(recipe, plan, budget)


def print_preflight(report: MemoryReport, measured: int | None, budget: int | None) -> None:
    rows = [[name, fmt_mb(value)] for name, value in report.breakdown.items()]
    rows.append(["predicted peak", fmt_mb(report.total_bytes)])
    if measured is not None:
        rows.append(["measured peak (one real step)", fmt_mb(measured)])
    if budget is not None:
        rows.append(["budget", fmt_mb(budget)])
    print_table(["pre-flight, batch %d" % report.batch_size, "MB"], rows)
    if report.lean:
        print(f"side activations: {fmt_side_pools(report.lean)}")


def run(args) -> int:
    from tqdm import tqdm

    from edgetl.finetune import finetune

    from edgetl.runfolder import check_not_in_use, check_output_folder

    check_output_folder(args.out, "run folder")
    check_not_in_use(args.out)
    if args.out.exists() and not args.resume and any(args.out.iterdir()):
        raise ConfigError(f"run folder {args.out} is not empty; use --resume or choose another -o")
    if args.resume and not args.out.is_dir():
        raise ConfigError(f"nothing to resume: run folder {args.out} does not exist")
    recipe, plan, budget = recipe_from_args(args)
    bar = None
    state = {"t0": None, "images": 0, "acc": "-", "measured": None}

    def on_preflight(report, measured):
        state["measured"] = measured
        from edgetl.finetune import backbone_ref

        print(f"backbone: {backbone_ref(recipe)}")
        print_preflight(report, measured, budget)

    def on_images(check):
        if check.checked:  # presets held in arrays have no files to check
            print(fmt_image_check(check))

    def on_step(info):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=info["steps"] * info["epochs"], initial=info["global_step"] - 1,
                       unit="step", dynamic_ncols=True)
            # images/s counts from the end of the first step (which includes warm-up)
            state["t0"], state["images"] = time.perf_counter(), 0
        else:
            state["images"] += recipe.train.batch_size
        elapsed = time.perf_counter() - state["t0"]
        rate = f"{state['images'] / elapsed:.0f}" if state["images"] else "-"
        peak = _peak_text(args.device, state["measured"])
        bar.set_description(f"epoch {info['epoch'] + 1}/{info['epochs']}")
        bar.set_postfix_str(f"loss {info['loss']:.3f} acc {state['acc']} {rate} img/s peak {peak}")
        bar.update(1)

    def on_epoch(row):
        if row.get("val_acc1") is not None:
            state["acc"] = f"{row['val_acc1']:.1f}%"

    start = time.perf_counter()
    try:
        result = finetune(recipe=recipe, out_dir=args.out, budget_bytes=budget, resume=args.resume,
                          device=args.device, measure=args.measure, on_step=on_step,
                          planned=None if plan is None else (args.plan, plan.spec.num_classes),
                          on_epoch=on_epoch, on_preflight=on_preflight, on_images=on_images)
    finally:
        if bar is not None:
            bar.close()
    rows = [[r["epoch"], f"{r.get('train_loss', float('nan')):.4f}",
             "-" if r.get("val_acc1") is None else f"{r['val_acc1']:.2f}"] for r in result.history]
    print_table(["epoch", "train loss", "val top-1 %"], rows)
    best = "-" if result.best_acc1 is None else f"{result.best_acc1:.2f}% (epoch {result.best_epoch})"
    print(f"best val top-1: {best}   wall time {time.perf_counter() - start:.0f} s")
    print(f"step: {result.execution}")
    if result.graph_memory is not None:
        g = result.graph_memory
        print(f"CUDA graph memory (predicted, counted against --budget): {fmt_mb(g.total_bytes)} MB = "
              f"{fmt_mb(g.runtime_bytes)} MB of tensors + {fmt_mb(g.extra_bytes)} MB the graphs reserve beyond an "
              "eager run")
    before = len(result.image_check.bad) if result.image_check and result.image_check.policy == "skip" else 0
    if before or result.skipped:
        n = before + len(result.skipped)
        print(f"skipped {n} unreadable image{'' if n == 1 else 's'} ({before} found before training, "
              f"{len(result.skipped)} while training; each named in a warning above)")
    print(f"saved to {args.out}")
    print(f"next: edgetl export --run {args.out}")
    return 0


def _peak_text(device: str, measured: int | None) -> str:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.max_memory_allocated() / 1e6:.0f}MB"
    return "-" if measured is None else f"{measured / 1e6:.0f}MB"
