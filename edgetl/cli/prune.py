"""``edgetl prune``: remove hidden channels of a backbone's memory-sensitive blocks."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgetl.cli import COMMANDS
from edgetl.cli._common import HelpFormatter, fmt_mb, given_path, positive_float, positive_int, print_table
from edgetl.errors import ConfigError
import edgetl.models.archs as archs
from edgetl.prune import (
    IMPORTANCES,
    PAPER_RATIOS,
    PruneResult,
    auto_ratios,
    calibration_batches,
    default_blocks,
    load_input,
    prune,
    save_pruned,
)


def _number_list(kind, text: str, what: str):
    items = [t.strip() for t in text.split(",")]
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {what}, e.g. "
            + (",".join(map(str, PAPER_RATIOS.values())) if kind is float else ",".join(map(str, PAPER_RATIOS)))
        ) from None


def ratio_list(text: str) -> list[float]:
    ratios = _number_list(float, text, "numbers")
    for r in ratios:
        if not 0 <= r < 1:
            raise argparse.ArgumentTypeError(f"ratio {r} is not allowed; allowed: 0 <= ratio < 1")
    return ratios


def block_list(text: str) -> list[int]:
    return _number_list(int, text, "block numbers")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prune",
        help=COMMANDS["prune"],
        description=(
            "Prune the hidden channels of a backbone's blocks with torch-pruning (MobileNetV2: "
            "the expanded channels; ResNet: a block's inner width), keeping residual widths. Default blocks: the sensitive blocks of the Rep-Net "
            "paper-accounting profile. --auto picks, per block, the smallest ratio whose "
            "temporary memory is at most the target. Memory figures: Rep-Net fine-tuning, "
            "paper accounting, batch 8, 102 classes (as the paper's Table I); MB = 10^6 bytes."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", metavar="DIR|NAME",
                   help="input backbone folder, architecture or torchvision weights name (mobilenet_v2:IMAGENET1K_V1, resnet18, resnet50:random, ...; default: MobileNetV2 with random init)")
    p.add_argument("--weights", metavar="FILE",
                   help="a local torchvision state_dict (.pth) of a registered architecture, recognised by its keys")
    p.add_argument("--width", type=positive_float, default=None,
                   help="width multiplier of the default backbone (default 1.0)")
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--ratios", type=ratio_list, metavar="R1,R2,...",
                      help="pruning ratio per block, in the order of --blocks")
    plan.add_argument("--auto", action="store_true",
                      help="choose ratios so each block's temporary memory is <= --target-bytes")
    p.add_argument("--plan", metavar="PLAN",
                   help="plan.yaml from edgetl plan: supplies --blocks and --ratios (explicit flags win)")
    p.add_argument("--blocks", type=block_list, metavar="B1,B2,...",
                   help="blocks to prune (MobileNetV2 1..17, ResNet-18 1..8, ResNet-34/50 1..16; default: the profile's sensitive blocks)")
    p.add_argument("--target-bytes", type=positive_int, metavar="N",
                   help="with --auto (default: the unpruned overall cumulative gradient memory)")
    p.add_argument("--importance", choices=IMPORTANCES, default="activation-l2")
    p.add_argument("--calib-data", default="fashion-mnist", metavar="PATH|fashion-mnist",
                   help="calibration images for activation-l2: an ImageFolder or fashion-mnist")
    p.add_argument("--calib-batches", type=positive_int, default=8, help="batches of 8 images")
    p.add_argument("--round-to", type=positive_int, default=1, help="round kept channels down to a multiple")
    p.add_argument("--resolution", type=positive_int,
                   help="input size in pixels (default: the plan's with --plan, else 224)")
    p.add_argument("-o", "--output", required=True, type=given_path, metavar="OUT", help="output backbone folder")
    p.set_defaults(run=run)


def print_result(result: PruneResult) -> None:
    before, after = result.before, result.after
    mem_b, mem_a = before["memory"], after["memory"]
    rows = []
    entry = archs.get(result.spec.arch)
    for b in result.blocks:
        for i in entry.affects(b):
            if i != b and str(i) in mem_b["tmp_bytes"]:
                rows.append([f"{i} ({'stem' if i == 0 else entry.block_name(i)}, via {b})", "", "", fmt_mb(mem_b["tmp_bytes"][str(i)]),
                             fmt_mb(mem_a["tmp_bytes"][str(i)])])
    for b, r in zip(result.blocks, result.ratios):
        rows.append([str(b), f"{r:g}", f"{result.channels_before[b]} -> {result.kept[b]}",
                     fmt_mb(mem_b["tmp_bytes"][str(b)]), fmt_mb(mem_a["tmp_bytes"][str(b)])])
    print_table(["block", "ratio", "hidden channels", "temporary MB before", "after"], rows,
                title=(f"pruned with {result.importance} importance"
                       + (f" (calibration: {result.calibration})" if result.calibration else "")
                       + f" | {mem_a['resolution']} px | temporary memory per image, MB = 10^6 B"))
    print()

    def change(a, b):
        return f"{(b / a - 1):+.1%}" if a else "-"

    lines = [
        ("params", f"{before['params']:,}", f"{after['params']:,}", change(before["params"], after["params"])),
        ("MACs (one image)", f"{before['macs'] / 1e6:,.1f} M", f"{after['macs'] / 1e6:,.1f} M",
         change(before["macs"], after["macs"])),
        ("peak activation per image (Rep-Net)", f"{fmt_mb(mem_b['peak_activation_bytes_per_image'])} MB",
         f"{fmt_mb(mem_a['peak_activation_bytes_per_image'])} MB",
         change(mem_b["peak_activation_bytes_per_image"], mem_a["peak_activation_bytes_per_image"])),
        (f"total at batch {mem_a['batch_size']} (Rep-Net)", f"{fmt_mb(mem_b['total_bytes'])} MB",
         f"{fmt_mb(mem_a['total_bytes'])} MB", change(mem_b["total_bytes"], mem_a["total_bytes"])),
    ]
    print_table(["", "before", "after", "change"], [list(x) for x in lines])
    print(f"sensitive blocks after pruning: {', '.join(map(str, mem_a['sensitive_blocks'])) or 'none'}")


def print_auto(plan, paper_ratios: dict[int, float] | None) -> None:
    """The choices of ``--auto``, beside a paper's ratios for the same blocks where there are any."""
    print(f"--auto target: {fmt_mb(plan.target_bytes)} MB per image ({plan.target_source})")
    for c in plan.choices:
        print(f"  block {c.block}: ratio {c.ratio:.3f} - {c.reason}")
    if paper_ratios:
        diffs = [c.ratio - paper_ratios[c.block] for c in plan.choices]
        paper = ", ".join(f"{paper_ratios[c.block]:.2f}" for c in plan.choices)
        chosen = ", ".join(f"{c.ratio:.3f}" for c in plan.choices)
        print(f"  vs the paper's ratios {paper}: chosen {chosen}; "
              f"differences {', '.join(f'{d:+.3f}' for d in diffs)} "
              f"(largest {max(abs(d) for d in diffs):.3f})")
    print()


DEFAULT_RESOLUTION = 224  # the papers' input size


def run(args) -> int:
    out = Path(args.output)
    if out.exists():
        raise ConfigError(f"output folder {out} already exists; choose another or remove it")
    if args.target_bytes is not None and not args.auto:
        raise ConfigError("--target-bytes needs --auto")
    net, base = load_input(checkpoint=args.checkpoint, weights=args.weights, width=args.width)
    if args.plan is not None:
        if args.auto:
            raise ConfigError("--plan supplies the ratios; not with --auto")
        plan_blocks, plan_ratios, planned = _from_plan(args.plan, net.spec)
        if args.resolution is not None and args.resolution != planned:
            raise ConfigError(f"{args.plan} was planned at {planned} px; --resolution is {args.resolution}: "
                              f"leave --resolution out, or plan again with --resolution {args.resolution}")
        args.resolution = planned
        if args.blocks is None and args.ratios is None:
            args.blocks, args.ratios = plan_blocks, plan_ratios
        elif args.ratios is None:  # --blocks given: keep the plan's ratio for those it names
            ratio_of = dict(zip(plan_blocks, plan_ratios))
            args.ratios = [ratio_of.get(b, 0.0) for b in args.blocks]
        elif args.blocks is None:
            args.blocks = plan_blocks
    if args.resolution is None:
        args.resolution = DEFAULT_RESOLUTION
    blocks = args.blocks if args.blocks is not None else default_blocks(net.spec, resolution=args.resolution)
    if not blocks:
        raise ConfigError(f"no sensitive block to prune at {args.resolution} px; name some with --blocks")
    auto = None
    if args.auto:
        auto = auto_ratios(net.spec, blocks, resolution=args.resolution,
                           target_bytes=args.target_bytes, round_to=args.round_to)
        ratios = auto.ratios
        paper = archs.get(net.spec.arch).paper_ratios
        comparable = (paper and blocks == sorted(paper) and net.spec.width == 1.0
                      and not net.spec.hidden and args.resolution == 224)
        print_auto(auto, paper if comparable else None)
    elif args.ratios is not None:
        ratios = args.ratios
    else:
        raise ConfigError("give --ratios (one per block) or --auto")
    calib, source = None, None
    if args.importance == "activation-l2":
        from edgetl.prune import check_plan

        check_plan(blocks, ratios, args.round_to, net.spec.arch)  # fail before reading any data
        calib = calibration_batches(args.calib_data, resolution=args.resolution, batches=args.calib_batches)
        source = f"{args.calib_data} ({sum(len(b) for b in calib)} images)"
    result = prune(net=net, blocks=blocks, ratios=ratios, importance=args.importance,
                   calib_batches=calib, calibration=source, round_to=args.round_to,
                   resolution=args.resolution, base=base, auto=auto)
    print_result(result)
    save_pruned(result, out)
    print(f"saved to {out}")
    print(f"next: edgetl profile --checkpoint {out} --num-classes 102")
    return 0


def _from_plan(path, spec) -> tuple[list[int], list[float], int]:
    """Blocks, ratios and resolution of a plan, after checking it was made for this input backbone (its
    architecture, width and hidden channels), naming both sides."""
    from edgetl.models.backbone import BackboneSpec
    from edgetl.plan import load_plan

    plan = load_plan(path)
    planned = BackboneSpec.from_dict(plan.backbone)
    if planned.arch != spec.arch:
        title = archs.get(planned.arch).title
        raise ConfigError(f"{path} was planned for {title}; this input is {archs.get(spec.arch).title}: give "
                          f"--checkpoint {planned.arch} (or a {title} folder or weights name), or plan again")
    if (planned.width, planned.hidden) != (spec.width, spec.hidden):
        raise ConfigError(
            f"{path} was planned for backbone width {planned.width:g} hidden {planned.hidden or 'unpruned'}; "
            f"this input is width {spec.width:g} hidden {spec.hidden or 'unpruned'}: plan again with --backbone "
            "(this input) or --width"
        )
    if not plan.chosen.kept:
        raise ConfigError(f"{path} prunes nothing: fine-tune the input backbone directly "
                          f"(edgetl finetune --plan {path})")
    return plan.chosen.blocks, plan.chosen.ratios, plan.resolution
