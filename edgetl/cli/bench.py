"""``edgetl bench``: memory (paper, runtime, measured), speed and largest batch of every method side by side."""

from __future__ import annotations

import argparse
import shlex
import sys

import edgetl.models.archs as archs
from edgetl.cli import COMMANDS
from edgetl.bench import (
    DEFAULT_ARCH, METHODS, BenchResult, bench, caption, check_methods, cpu_cores, plot_bench, table_rows, to_markdown,
)
from edgetl.cli._common import HelpFormatter, positive_float, positive_int, output_file, print_table, torch_device
from edgetl.errors import ConfigError
from edgetl.units import parse_bytes

# --quick: a tiny backbone at 64 px, a smoke run of every row (docs/bench.md gives its time on a 2-core CPU);
# the largest batches are re-measured up to 49 images and timed at up to 16 (one step)
QUICK = {"width": 0.35, "resolution": 64, "budget": "24MB", "steps": 2, "warmup": 1, "verify_images": 4,
         "largest_steps": 1, "largest_cap": 16}
# timing on a shared CPU is noisy: fewer than about 10 interleaved rounds can flip a 10 % ratio
DEFAULTS = {"width": 1.0, "resolution": 224, "budget": "256MB", "steps": 10, "warmup": 2, "verify_images": 64,
            "largest_steps": 3, "largest_cap": 256}
# --quick on an architecture without a width multiplier (ResNet) keeps the full-scale network and
# so the full-scale budget: ResNet-18's fp32 weights alone are 47 MB and its full fine-tune holds
# 199 MB at 64 px, batch 8 (24MB would fit no row); only the pixels and the steps shrink
QUICK_FIXED_WIDTH = {**QUICK, "width": 1.0, "budget": DEFAULTS["budget"]}


def method_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(unknown) or text!r}; allowed: {', '.join(METHODS)}")
    return names


def nonnegative_int(text: str) -> int:
    if text == "0":
        return 0
    return positive_int(text)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help=COMMANDS["bench"],
        description=(
            "Benchmark fine-tuning methods side by side on a backbone (--backbone, random weights): "
            "paper accounting, runtime accounting and measured peak memory at --batch-size, training "
            "throughput (median step time, steps of all methods interleaved round-robin), the largest "
            "batch that fits --budget, trainable parameters, and ratios against stock Rep-Net. "
            "MB = 10^6 bytes. "
            f"Methods: {', '.join(METHODS)} (the repnet-pruned rows use a paper's pruning ratios, which "
            f"only {', '.join(archs.get(a).title for a in archs.registered() if archs.get(a).paper_ratios)} has; "
            "on another backbone they are left out). "
            "--from PATH re-renders a saved JSON result without running anything."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--backbone", choices=archs.registered(), default=DEFAULT_ARCH, metavar="ARCH",
                   help=f"the architecture, random weights: {', '.join(archs.registered())}")
    p.add_argument("--resolution", type=positive_int, help=f"input size in pixels (default {DEFAULTS['resolution']})")
    p.add_argument("--batch-size", type=positive_int, default=8, help="images per training step")
    p.add_argument("--num-classes", type=positive_int, default=102, help="classifier outputs (Flowers-102: 102)")
    p.add_argument("--width", type=positive_float,
                   help=f"width multiplier, for a backbone that has one (MobileNetV2; default {DEFAULTS['width']})")
    p.add_argument("--budget", help=f"memory budget for the largest-batch column, e.g. 256MB (default {DEFAULTS['budget']})")
    p.add_argument("--methods", type=method_list, metavar="A,B,...", help="comma-separated methods (default: all; plan only where edgetl.plan is installed, the "
                        "repnet-pruned rows only on a backbone with a paper's ratios)")
    p.add_argument("--steps", type=positive_int, help=f"timed rounds after warm-up (default {DEFAULTS['steps']})")
    p.add_argument("--warmup", type=nonnegative_int, help=f"warm-up rounds (default {DEFAULTS['warmup']})")
    p.add_argument("--verify-images", type=nonnegative_int,
                   help="re-measure the largest batch when batch x resolution^2 <= this x 224^2 "
                        f"(default {DEFAULTS['verify_images']})")
    p.add_argument("--largest-steps", type=nonnegative_int,
                   help="timed steps of each method at its largest batch (images/s at that batch); 0: skip "
                        f"(default {DEFAULTS['largest_steps']})")
    p.add_argument("--largest-cap", type=positive_int,
                   help=f"time at most this batch for the images/s at the largest batch (default {DEFAULTS['largest_cap']})")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny scale: width {QUICK['width']}, {QUICK['resolution']} px, budget {QUICK['budget']}, "
                        f"{QUICK['steps']} steps, largest batch re-measured up to {QUICK['verify_images']} x 224^2 "
                        f"pixels and timed {QUICK['largest_steps']} step at up to {QUICK['largest_cap']}; a backbone "
                        f"without a width multiplier (ResNet) keeps width 1.0 and budget {QUICK_FIXED_WIDTH['budget']} "
                        "(explicit flags still win)")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device: cpu, cuda, cuda:N")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", default=None,
                   help="on CUDA, time only eager steps (default: every row also captured as CUDA graphs, as "
                        "edgetl finetune runs it, timed beside its eager step)")
    p.add_argument("--workers", type=positive_int,
                   help="processes that measure the methods' memory side by side before the timing, "
                        f"which runs alone (default: one per CPU core on a CPU, here {cpu_cores()}; 1 on CUDA)")
    p.add_argument("--from", dest="source", metavar="PATH", help="render a saved JSON result instead of running")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (for the README)")
    p.add_argument("--json", type=output_file("bench-json"), metavar="PATH", help="save the result as JSON")
    p.add_argument("--csv", type=output_file("bench-csv"), metavar="PATH", help="save the rows as CSV")
    p.add_argument("--plot", type=output_file("png"), metavar="PATH", help="save a PNG chart")
    p.set_defaults(run=run)


def print_result(result: BenchResult) -> None:
    headers, rows = table_rows(result)
    print_table(headers, rows, title=caption(result))
    for r in result.rows:
        if r.note:
            print(f"note: {r.label}: {r.note}")


def _command(args, pick) -> str:
    """The resolved command line (every value explicit), stored with the result."""
    width = ["--width", f"{pick('width'):g}"] if archs.get(args.backbone).width_multiplier else []
    parts = ["edgetl", "bench", "--backbone", args.backbone, "--resolution", pick("resolution"),
             "--batch-size", args.batch_size, "--num-classes", args.num_classes, *width, "--budget", pick("budget"),
             "--steps", pick("steps"), "--warmup", pick("warmup"), "--verify-images", pick("verify_images"),
             "--largest-steps", pick("largest_steps"), "--largest-cap", pick("largest_cap")]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.graphs is False:
        parts.append("--no-graphs")
    if args.methods is not None:
        parts += ["--methods", ",".join(args.methods)]
    for flag in ("json", "csv", "plot"):
        if getattr(args, flag):
            parts += [f"--{flag}", getattr(args, flag)]
    return " ".join(shlex.quote(str(p)) for p in parts)


def run(args) -> int:
    if args.source:
        result = BenchResult.load_json(args.source)
    else:
        entry = archs.get(args.backbone)
        if args.width not in (None, 1.0) and not entry.width_multiplier:
            raise ConfigError(f"--width {args.width:g} is not allowed: {entry.title} has no width multiplier; "
                              "allowed: 1.0, or leave --width out")
        preset = DEFAULTS if not args.quick else QUICK if entry.width_multiplier else QUICK_FIXED_WIDTH
        pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
        budget = parse_bytes(pick("budget"))
        if args.methods is not None and len(set(args.methods)) != len(args.methods):
            raise ConfigError(f"methods repeat: {','.join(args.methods)}")
        if args.methods is not None:
            check_methods(args.methods, args.backbone, args.device)
        print("benchmarking (memory of each method, then interleaved timed steps) ...", file=sys.stderr)
        result = bench(
            arch=args.backbone, resolution=pick("resolution"), batch_size=args.batch_size, num_classes=args.num_classes,
            width=pick("width"), budget_bytes=budget, methods=args.methods, steps=pick("steps"),
            warmup=pick("warmup"), device=args.device, verify_images=pick("verify_images"),
            command=_command(args, pick), largest_steps=pick("largest_steps"), largest_cap=pick("largest_cap"),
            workers=args.workers or (cpu_cores() if args.device == "cpu" else 1), graphs=args.graphs,
        )
    if args.markdown:
        print(to_markdown(result), end="")
    else:
        print_result(result)
    if args.json:
        result.save_json(args.json)
        print(f"saved {args.json}")
    if args.csv:
        result.save_csv(args.csv)
        print(f"saved {args.csv}")
    if args.plot:
        plot_bench(result, args.plot)
        print(f"saved {args.plot}")
    return 0
