"""``edgetl plan``: choose pruning, pooling, precision and batch size to fit a memory budget."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from edgetl.cli import COMMANDS
from edgetl.cli._common import (
    HelpFormatter, budget_type, fmt_mb, output_file, positive_float, positive_int, print_table,
)
from edgetl.errors import ConfigError


def batch_type(text: str):
    if text == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"batch size {text!r} is not allowed; allowed: an integer >= 1 or auto") from None


def add_parser(sub) -> None:
    from edgetl.plan import DEVICES, MAX_BATCH_SIZE, MAX_RATIO, PLAN_MODES, PRECISIONS

    p = sub.add_parser(
        "plan",
        help=COMMANDS["plan"],
        description=(
            "Choose, for Rep-Net fine-tuning on the lean runtime, the pruning of the sensitive "
            "blocks (channel granularity), the side pooling k (1, 2, 4), the activation precision, "
            "the frozen-weight storage and the batch size so that the predicted peak of a training "
            "step (runtime accounting, MB = 10^6 B) fits the budget. Objective: fit the budget "
            "removing as few hidden channels as possible, then prefer a smaller k, then a larger "
            "batch. Streaming the frozen backbone on micro-batches (no accuracy cost) comes "
            "first, then recomputing streamed segments, then fused optimizer kernels and the update "
            "inside backward, then storage savings (frozen fp16, int8 frozen weights, half "
            "activations), then pooling, then pruning; a streamed plan keeps the largest "
            "micro-batch that fits. On a device with a GPU (--device orin-nano-*) finetune captures the step "
            "as CUDA graphs by default: the planned step runs so where its tensors and what the graphs reserve "
            "beyond an eager run fit the budget (streamed, or by a smaller micro-batch, if need be), else eagerly "
            "(--eager: always). "
            "With --batch-size auto the batch grows once "
            "the exact configuration fits. All plans lie on one path, so a larger budget never "
            "prunes more, pools coarser or shrinks the batch. --verify measures real training "
            "steps of the planned network. An impossible budget exits with code 2 and the "
            "smallest budget that works. --mode bias plans bias-only TinyTL-B (no pooling or "
            "pruning); --mode full plans lean full fine-tuning (BN folded, every conv trains), whose "
            "lever is what each conv keeps for its weight gradient: exact, then pooled by 2, then by 4."
        ),
        epilog="example: edgetl plan --budget 256MB --device orin-nano-8gb --verify -o plan.yaml",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--budget", type=budget_type, required=True, metavar="SIZE",
                   help="memory budget, e.g. 256MB, 1GiB (units B, kB/KB, MB, GB, KiB, MiB, GiB)")
    p.add_argument("--budget-scope", choices=("tensors", "process"), default="tensors",
                   help="tensors: the budget covers the training tensors; process: it also covers the "
                        "device overheads (CUDA context, allocator slack), subtracted first")
    p.add_argument("--device", default="none", choices=tuple(DEVICES),
                   help="device preset whose overheads are shown (and subtracted with --budget-scope process)")
    p.add_argument("--mode", choices=PLAN_MODES, default="repnet",
                   help="what fine-tunes: Rep-Net side network, bias-only TinyTL-B, or lean full fine-tuning")
    p.add_argument("--batch-size", type=batch_type, default=8, metavar="N|auto",
                   help="fixed batch, or auto: the largest that fits")
    p.add_argument("--max-batch-size", type=positive_int,
                   help=f"upper end for --batch-size auto (default {MAX_BATCH_SIZE})")
    p.add_argument("--resolution", type=positive_int, default=224, help="input size in pixels")
    p.add_argument("--num-classes", type=positive_int, default=102, help="classifier outputs")
    p.add_argument("--precision", choices=(*PRECISIONS, "half"),
                   help="fix the activation precision (half = fp16 where this machine runs fp16 convolutions, else bf16); default: searched")
    p.add_argument("--stream", type=int, metavar="M",
                   help="fix the micro-batch of the streamed frozen backbone (0: never stream); default: searched")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fix fused optimizer kernels (optim.fused) on or off; default: searched")
    p.add_argument("--step-in-backward", action=argparse.BooleanOptionalAction, default=None,
                   help="fix the update inside backward (optim.step_in_backward) on or off; --no-step-in-backward "
                        "for a run under DDP (torchrun), which refuses it; default: searched")
    p.add_argument("--eager", action="store_true",
                   help="plan an eager step: on a device with a GPU (--device orin-nano-*) finetune captures the "
                        "step as CUDA graphs by default, and the plan runs it so where the tensors and what the graphs "
                        "reserve beyond an eager run fit the budget; with --eager finetune --plan runs it eagerly")
    p.add_argument("--backbone", metavar="DIR|NAME", help="backbone folder, architecture or weights name, e.g. resnet18, mobilenet_v2:IMAGENET1K_V1 "
                        "(default: MobileNetV2 --width)")
    p.add_argument("--width", type=positive_float,
                   help="width multiplier of the default backbone or mobilenet_v2:random (default 1.0; a backbone "
                        "folder has its own)")
    p.add_argument("--max-ratio", type=float, default=MAX_RATIO, help="most any block may be pruned")
    p.add_argument("--verify", action="store_true",
                   help="build the planned network (random weights) and measure real training steps")
    p.add_argument("-o", "--output", type=output_file("plan"), metavar="PLAN",
                   help="save the plan as YAML here (what prune --plan and finetune --plan read); "
                        "without -o or --json nothing is written")
    p.add_argument("--json", type=output_file("plan"), metavar="PATH", help="also save the plan as JSON")
    p.set_defaults(run=run)


def _storage(c) -> str:
    if c.mode == "full":
        return f"each conv keeps its input {c.conv_storage}{_step(c)}"
    stream = f", backbone streamed by {c.stream}" if c.stream else ""
    stream += " (recompute)" if c.recompute else ""
    pool = f"k={c.pool}, " if c.mode == "repnet" else ""
    return f"{pool}activations {c.precision}, frozen weights {c.frozen_weights}{stream}{_step(c)}"


def _step(c) -> str:
    """The optimizer's levers the plan takes (they are the step's, not the network's)."""
    step = ", fused Adam" if c.fused else ""
    return step + (", updated inside backward" if c.step_in_backward else "")


def _pruning(c) -> str:
    if not c.kept:
        return "none"
    return ", ".join(f"{b}: {c.channels[b]}->{c.kept[b]}" for b in c.blocks)


_MODE_NAMES = {"repnet": "Rep-Net", "bias": "bias-only TinyTL-B", "full": "lean full fine-tuning"}


def print_plan(plan) -> None:
    c = plan.chosen
    print(f"objective: {plan.objective}")
    print_table(["chosen", ""], [
        ["pruning (block: hidden channels)", _pruning(c)],
        ["ratios (edgetl prune)", ", ".join(f"{r:g}" for r in c.ratios) or "-"],
        ["storage", _storage(c)],
        ["batch size", f"{c.batch_size}" + (" (auto)" if plan.request["batch_size"] == "auto" else "")],
        ["input", f"{plan.resolution} px, {plan.num_classes} classes, {_MODE_NAMES[c.mode]}, Adam"],
    ])
    print()
    rows = [[name, fmt_mb(value)] for name, value in plan.breakdown.items()]
    rows.append(["predicted peak (tensors)", fmt_mb(plan.predicted_bytes)])
    if plan.measured_bytes is not None:
        err = plan.measured_bytes / plan.predicted_bytes - 1
        rows.append([f"measured peak ({plan.verify_steps} real steps)", f"{fmt_mb(plan.measured_bytes)} ({err:+.1%})"])
    g = plan.cuda_graph
    if g is not None:
        rows.append([f"CUDA graphs beyond an eager run (predicted, sm{g.capability[0]}{g.capability[1]})",
                     fmt_mb(g.extra_bytes)])
        rows.append(["predicted with CUDA graphs", fmt_mb(g.total_bytes)])
    rows.append(["tensor budget", fmt_mb(plan.tensor_budget_bytes)])
    rows.append(["headroom", fmt_mb(plan.tensor_budget_bytes - plan.counted_bytes)])
    print_table(["breakdown at the peak", "MB"], rows)
    if plan.device != "none":
        lines = [[name, fmt_mb(v)] for name, v in plan.overheads.items()]
        total = plan.counted_bytes + sum(plan.overheads.values())
        what = "tensors + CUDA graphs + overheads" if g is not None else "tensors + overheads"
        lines.append([f"process total ({what})", fmt_mb(total)])
        if plan.budget_scope == "process":
            lines.append(["process budget", fmt_mb(plan.budget_bytes)])
        if plan.device_process_limit_bytes is not None:
            lines.append([f"{plan.device} memory less the OS share", fmt_mb(plan.device_process_limit_bytes)])
        print()
        print_table([f"device {plan.device}", "MB"], lines)
    if plan.runners_up:
        print()
        rows = [[_pruning(r.config), _storage(r.config), r.config.batch_size, fmt_mb(r.predicted_bytes),
                 "yes" if r.fits else "no", r.why] for r in plan.runners_up]
        print_table(["runner-up pruning", "storage", "batch", "predicted MB", "fits", "why not chosen"], rows)
    for note in plan.notes:
        print(f"note: {note}")
    n = plan.graph_replays
    replays = f", {n} CUDA-graph replay{'s' * (n != 1)}" if n else ""
    print(f"search: {plan.evaluations} runtime-accounting evaluations{replays}, {plan.search_seconds:.1f} s")


@contextlib.contextmanager
def search_progress():
    """On a terminal, a line on stderr counting the configurations the search has evaluated and
    its time while it runs (a pruning search at 224 px took 24 s here, longer on a slower CPU),
    cleared when it ends: the summary's "search:" line says the same. Yields the planner's
    ``on_evaluation``; None where stderr is no terminal (logs and pipes stay clean)."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(file=sys.stderr, leave=False, bar_format="searching: {n} configurations evaluated, {elapsed}") as bar:
        yield lambda count: bar.update(count - bar.n)


def run(args) -> int:
    from edgetl.plan import DEVICES, MAX_BATCH_SIZE, VERIFY_TOLERANCE, plan, verify_plan

    if args.device not in DEVICES:
        raise ConfigError(f"unknown device {args.device!r}; allowed: {', '.join(DEVICES)}")
    if args.max_batch_size is not None and args.batch_size != "auto":
        raise ConfigError(f"--max-batch-size {args.max_batch_size} needs --batch-size auto (the batch is fixed "
                          f"at {args.batch_size})")
    with search_progress() as on_evaluation:
        result = plan(budget_bytes=args.budget, device_preset=args.device, budget_scope=args.budget_scope,
                      batch_size=args.batch_size, resolution=args.resolution, num_classes=args.num_classes,
                      precision=args.precision, stream=args.stream, backbone=args.backbone, width=args.width,
                      max_ratio=args.max_ratio, max_batch_size=args.max_batch_size or MAX_BATCH_SIZE,
                      mode=args.mode, fused=args.fused, step_in_backward=args.step_in_backward, eager=args.eager,
                      on_evaluation=on_evaluation)
    if args.verify:
        verify_plan(result)
    print_plan(result)
    if args.output is not None:
        result.save(args.output)
    if args.json is not None:
        from edgetl.io import atomic_write_text

        atomic_write_text(args.json, json.dumps(result.to_dict(), indent=2) + "\n")
    status = 0
    if args.verify:
        m, pred = result.measured_bytes, result.predicted_bytes
        if m > result.tensor_budget_bytes or abs(m / pred - 1) > VERIFY_TOLERANCE:
            print(f"edgetl plan: measured {fmt_mb(m)} MB vs predicted {fmt_mb(pred)} MB, budget "
                  f"{fmt_mb(result.tensor_budget_bytes)} MB: the prediction is off by more than "
                  f"{VERIFY_TOLERANCE:.0%} or the measurement exceeds the budget")
            status = 1
    saved = [str(p) for p in (args.output, args.json) if p is not None]
    print(f"saved to {' and '.join(saved)}" if saved else "not saved: add -o plan.yaml to keep it")
    if args.output is None:
        return status
    backbone = f" --backbone {args.backbone}" if args.backbone else ""
    if result.chosen.kept:
        source = f" --checkpoint {args.backbone}" if args.backbone else ""
        print(f"next: edgetl prune --plan {args.output}{source} -o pruned && "
              f"edgetl finetune --plan {args.output} --backbone pruned --recipe RECIPE -o runs/NAME")
    else:
        print(f"next: edgetl finetune --plan {args.output}{backbone} --recipe RECIPE -o runs/NAME "
              "(the plan prunes nothing)")
    return status
