"""``edgetl demo``: the whole pipeline on Fashion-MNIST, offline, in minutes on a CPU."""

from __future__ import annotations

from pathlib import Path

import edgetl.models.archs as archs
from edgetl.cli import COMMANDS
from edgetl.cli._common import HelpFormatter, fmt_mb, given_path, positive_int, print_table, torch_device
from edgetl.options import MASK_KERNELS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help=COMMANDS["demo"],
        description=(
            "Pretrain a small MobileNetV2 (or --backbone) on Fashion-MNIST classes 0-4, profile it, "
            "plan for a budget, prune, retrain, fine-tune the Rep-Net side network on classes 5-9 with "
            "pooled storage (beside unpruned Rep-Net and full fine-tuning), export ONNX and verify it. "
            "A rerun reuses finished stages."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small scale (about a minute; used by the tests)")
    p.add_argument("--backbone", choices=archs.registered(), default=archs.DEFAULT_ARCH, metavar="ARCH",
                   help=f"the architecture, pretrained from random init: {', '.join(archs.registered())} "
                        "(MobileNetV2 at width 0.35; one without a width multiplier at 1.0)")
    p.add_argument("--data", metavar="PATH", help="Fashion-MNIST folder (default: the Debian package's)")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device: cpu, cuda, cuda:N")
    p.add_argument("-o", "--out", type=given_path, default=Path("runs/demo"), metavar="DIR", help="demo folder")
    p.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                   help="stages run at once where the pipeline allows (full fine-tuning beside profile, plan and "
                        "prune; the pruned backbone's retraining beside the unpruned one's fine-tunes), each "
                        "beside another in a process of its own; on a 2-core machine (where either way a stage "
                        "has one thread) the figures were the same and two at once ran slower than one")
    p.add_argument("--mask-kernels", choices=("auto", *MASK_KERNELS), default="auto",
                   help="how the lean fine-tunes pack and apply their ReLU masks (model.mask_kernels): fused "
                        "(edgetl's compiled kernels, built on first use with g++ and ninja), aten (torch's ops), "
                        "or auto: fused on a CPU where they build, else aten, saying why; the same weights "
                        "either way, fused the faster streamed stage")
    p.set_defaults(run=run)


def run(args) -> int:
    from tqdm import tqdm

    from edgetl.demo import STAGES, run_demo

    titles = {stage.name: stage.title for stage in STAGES}
    bars: dict[str, tqdm] = {}  # a progress bar per training stage running, one line each
    lines: dict[str, int] = {}  # the line each bar holds (tqdm keeps its own as -position)

    def on_stage(name, event, info):
        if name in bars:
            bars.pop(name).close()
            del lines[name]
        if event == "start":
            tqdm.write(f"== {name}: {titles[name]}")
        elif event == "reused":
            tqdm.write(f"== {name}: reused from {args.out / 'stages' / (name + '.json')}")
        else:
            tqdm.write(f"   {name} done in {info['wall_s']:.0f} s")

    def on_step(info):
        bar = bars.get(info["stage"])
        if bar is None:
            line = lines[info["stage"]] = min(set(range(len(bars) + 1)) - set(lines.values()))
            bar = bars[info["stage"]] = tqdm(
                total=info["steps"] * info["epochs"], initial=info["global_step"] - 1, unit="step",
                dynamic_ncols=True, leave=False, position=line)
        bar.set_description(f"{info['stage']} epoch {info['epoch'] + 1}/{info['epochs']}")
        bar.set_postfix_str(f"loss {info['loss']:.3f}")
        bar.update(1)

    def on_choice(kernels, why):
        names = {"fused": "edgetl's fused kernels", "aten": "torch's ops"}
        tqdm.write(f"mask kernels of the lean fine-tunes: {names[kernels]} ({why})")

    try:
        report = run_demo(out_dir=args.out, quick=args.quick, data=args.data, device=args.device,
                          arch=args.backbone, jobs=args.jobs, mask_kernels=args.mask_kernels, on_stage=on_stage,
                          on_step=on_step, on_choice=on_choice)
    finally:
        for bar in bars.values():
            bar.close()
    print_report(report)
    return 0


def print_report(report) -> None:
    s = report.stages
    print()
    print_table(["stage", "wall time s"], [[name, f"{seconds:.0f}"] for name, seconds in report.wall_s.items()],
                title="Stages")
    print()
    rows = []
    for name, run in report.variants.items():
        how = [f"k={run.pool}"] + ([f"stream {run.stream}"] if run.stream else [])
        how += [lever for lever, on in (("uint8 batch", run.uint8_input), ("recompute", run.recompute)) if on]
        runtime = f"{run.runtime}, fused masks" if run.mask_kernels == "fused" else run.runtime
        rows.append([name, ", ".join(how), f"{run.target_acc1:.1f}",
                     fmt_mb(run.predicted_bytes), fmt_mb(run.measured_bytes), runtime])
    print_table(["fine-tuning on classes 5-9", "pool, streaming", "val top-1 %", "predicted MB", "measured MB", "runtime"],
                rows, title=f"Target task, {archs.get(report.arch).title} (MB = 10^6 B; measured: one real training "
                            "step, storage meter)")
    print()
    pre, ret, plan, prof, exp = s["pretrain"], s["retrain"], s["plan"], s["profile"], s["export"]
    print(f"source task top-1: pretrained {pre.source_acc1:.1f} %, pruned + retrained {ret.source_acc1:.1f} %")
    print(f"Rep-Net profile (paper accounting): total {fmt_mb(prof.paper_total_bytes)} MB, "
          f"sensitive blocks {prof.sensitive_blocks}; plot {prof.plot}")
    print(f"plan for {fmt_mb(plan.budget_bytes)} MB: {plan.describe}")
    pruned = s["prune"]
    kept = f"blocks {pruned.blocks}, hidden channels kept {pruned.hidden}" if pruned.blocks else "nothing to prune"
    print(f"pruning by {report.prune_source}: {kept}")
    print(f"ONNX {exp.onnx} ({exp.onnx_bytes / 1e6:.2f} MB), max abs diff vs PyTorch {exp.max_abs_diff:.1e}")
    print(f"report saved to {report.out_dir / 'report.json'}")
