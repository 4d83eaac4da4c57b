"""``edgetl profile``: per-block activation memory of fine-tuning a backbone."""

from __future__ import annotations

from edgetl.cli import COMMANDS
from edgetl.cli._common import (
    HelpFormatter,
    fmt_mb,
    fmt_side_pools,
    output_file,
    positive_float,
    positive_int,
    print_table,
    torch_device,
)
from edgetl.errors import ConfigError
from edgetl.memory.report import MemoryReport
from edgetl.options import MODES, RUNTIMES, LeanOptions, add_option_flags
from edgetl.profile import ACCOUNTINGS, FROZEN_BITS, plot_profile, profile


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile",
        help=COMMANDS["profile"],
        description=(
            "Profile the activation memory of fine-tuning a backbone (MobileNetV2 unless --backbone "
            "names another: resnet18, resnet34, resnet50, a folder). 'paper' accounting is the "
            "TinyTL/Rep-Net memory model the papers use; 'runtime' is what edgetl's runtime "
            "really holds. --measure runs real training steps and reports the measured peak. "
            "Per-block figures are for one image; totals for the batch. MB = 10^6 bytes."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--mode", choices=MODES, default="repnet", help="what trains")
    p.add_argument("--accounting", choices=ACCOUNTINGS, default="paper")
    p.add_argument("--resolution", type=positive_int, default=224, help="input size in pixels")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--num-classes", type=positive_int, default=1000)
    p.add_argument("--width", type=positive_float, help="MobileNetV2 width multiplier (default 1.0; a backbone folder has its own)")
    p.add_argument("--frozen-bits", type=int, choices=FROZEN_BITS, default=8,
                   help="storage of frozen weights (paper accounting)")
    lean = p.add_argument_group("runtime accounting / --measure: the runtime that trains")
    lean.add_argument("--runtime", choices=RUNTIMES, default="auto",
                      help="lean: edgetl's lean layers; stock: plain torch modules; auto: lean where the mode allows")
    add_option_flags(lean, defaults=LeanOptions())
    lean.add_argument("--fused", action="store_true",
                      help="fused optimizer kernels: no update temporaries (same update up to float rounding)")
    lean.add_argument("--step-in-backward", action="store_true",
                      help="update each parameter inside backward as soon as its gradient is complete and free "
                           "the gradient (not all gradients alive at once; same weights)")
    p.add_argument("--backbone", "--checkpoint", dest="checkpoint", metavar="DIR|NAME",
                   help="a backbone folder (e.g. from edgetl prune), an architecture (resnet18) or a weights name "
                        "(mobilenet_v2:IMAGENET1K_V1); default: MobileNetV2 --width")
    p.add_argument("--measure", action="store_true",
                   help="also run real training steps (forward, backward, Adam) and measure the peak")
    p.add_argument("--device", type=torch_device, help="torch device for --measure: cpu (default), cuda, cuda:N")
    p.add_argument("--json", type=output_file("profile-json"), metavar="PATH", help="save the report as JSON")
    p.add_argument("--plot", type=output_file("png"), metavar="PATH", help="save a per-block PNG chart")
    p.set_defaults(run=run)


def print_report(report: MemoryReport) -> None:
    rows = []
    peak_block = max(report.blocks, key=lambda b: b.peak_bytes).index
    for b in report.blocks:
        mark = ("*" if b.index in report.sensitive_blocks else "") + ("<peak" if b.index == peak_block else "")
        rows.append([b.name, fmt_mb(b.tmp_bytes), fmt_mb(b.cugrd_bytes), fmt_mb(b.peak_bytes), mark])
    print_table(
        ["block", "temporary MB", "cum. grad MB", "peak MB", ""],
        rows,
        title=(f"{report.mode} | {report.accounting} accounting | {_runtime(report)}{report.resolution} px | "
               f"per image (MB = 10^6 B); * = sensitive"),
    )
    print()
    lines = [("peak activation memory per image", report.peak_activation_bytes)]
    lines += [(f"  {name}", value) for name, value in report.breakdown.items()]
    lines.append((f"total at batch {report.batch_size}", report.total_bytes))
    if report.measured_peak_bytes is not None:
        lines.append(("measured peak (training steps)", report.measured_peak_bytes))
    width = max(len(name) for name, _ in lines) + 2
    for name, value in lines:
        print(f"{name:<{width}}{fmt_mb(value):>9} MB  ({fmt_mb(value, 'MiB')} MiB)")
    if report.measured_peak_bytes is not None:
        diff = report.total_bytes / report.measured_peak_bytes - 1
        print(f"prediction vs measured: {diff:+.1%}")
    print(f"sensitive blocks: {', '.join(map(str, report.sensitive_blocks)) or 'none'}")
    if report.schedule is not None:
        print(f"schedule: {describe_schedule(report.schedule)}")
    if report.step_ops is not None:
        ops = report.step_ops
        print(f"aten ops per step (kernel launches on a GPU): forward {ops['forward']:,}, "
              f"backward {ops['backward']:,}, optimizer {ops['optimizer']:,}")


def describe_schedule(schedule: dict) -> str:
    """One line: how many frozen convs run whole-batch backward, chunked mask packing and
    whole converted weights; the streamed segments, which of them recompute and which hold
    their converted weights across micro-batches."""
    from collections import Counter

    whole = len(schedule["whole_batch_backward"])
    left = len(schedule["sample_by_sample_backward"])
    chunks = Counter(c["chunk"] for c in schedule["forward_mask_chunks"].values())
    packed = "".join(f"{c} samples at a time in {n} convs, " for c, n in sorted(chunks.items(), reverse=True))
    streams = schedule.get("streamed_segments", [])
    streamed = ""
    if streams:
        segs = " ".join(f"{s['blocks'][0]}:{s['blocks'][1]}" for s in streams)
        again = [f"{s['blocks'][0]}:{s['blocks'][1]}" for s in streams if s.get("recompute")]

        def chose(setting: str, value: str) -> list[str]:
            return [f"{s['blocks'][0]}:{s['blocks'][1]}" for s in streams
                    if any(e["choices"].get(setting) == value
                           for e in schedule.get("settings", {}).get(f"streams.{s['blocks'][0]}", []))]

        held, whole_micro = chose("weights", "held"), chose("convs", "whole_micro_batch")
        streamed = (f"; backbone streamed in micro-batches of {streams[0]['micro_batch']} "
                    f"(segments {segs}{'; recomputed: ' + ' '.join(again) if again else ''}"
                    f"{'; converted weights held across micro-batches: ' + ' '.join(held) if held else ''}"
                    f"{'; masked convs a micro-batch at a time: ' + ' '.join(whole_micro) if whole_micro else ''})")
    weights = schedule.get("whole_weight_convs", [])
    converted = f"; {len(weights)} large 1x1 weights converted whole per call" if weights else ""
    return (f"masked backward on the whole batch in {whole} frozen convs ({left} sample by sample); "
            f"ReLU6 masks packed {packed}one at a time in the rest{converted}{streamed}")


def _runtime(report: MemoryReport) -> str:
    if report.accounting == "paper":
        return ""
    if report.lean is None:
        return "stock modules | "
    lean = report.lean
    return (f"lean: {fmt_side_pools(lean)}, {lean['precision']} activations, "
            f"{lean['frozen_weights']} frozen weights, BN {lean['bn']} | ")


def run(args) -> int:
    if args.device is not None and not args.measure:
        raise ConfigError(f"--device {args.device} is the device of --measure; add --measure, or drop --device")
    report = profile(
        mode=args.mode,
        accounting=args.accounting,
        resolution=args.resolution,
        batch_size=args.batch_size,
        num_classes=args.num_classes,
        width=args.width,
        frozen_bits=args.frozen_bits,
        checkpoint=args.checkpoint,
        measure=args.measure,
        device=args.device or "cpu",
        runtime=args.runtime,
        lean=LeanOptions.of(args),
        step_in_backward=args.step_in_backward,
        fused=args.fused,
    )
    print_report(report)
    if args.json:
        report.save_json(args.json)
        print(f"saved {args.json}")
    if args.plot:
        plot_profile(report, args.plot)
        print(f"saved {args.plot}")
    return 0
