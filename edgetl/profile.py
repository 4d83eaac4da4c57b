"""Profile stage: a network configuration in, a MemoryReport (per block and totals) out.

``paper`` accounting is the TinyTL/Rep-Net model of DESIGN 2a; ``runtime`` is what the
edgetl runtime really holds (DESIGN 2b); ``measure=True`` adds the peak measured over
real training steps (DESIGN 2c).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from pathlib import Path

import torch

from edgetl.errors import ConfigError
from edgetl.memory.paper import paper_blocks, param_bytes, sensitive
from edgetl.memory.report import MB, MemoryReport
from edgetl.memory.trace import trace_network
from edgetl.models.backbone import BackboneSpec, EdgeNet, input_spec
from edgetl.models.side import TRAIN_MODES, build_network
from edgetl.options import LeanOptions

log = logging.getLogger(__name__)

ACCOUNTINGS = ("paper", "runtime")
FROZEN_BITS = (32, 16, 8)
MIN_RESOLUTION = 32
MIN_RESOLUTION_SIDE = 64  # the last side module pools a stride-32 map 2x2: needs >= 2x2


def check_options(*, mode: str, accounting: str, resolution: int, batch_size: int,
                  frozen_bits: int = 8) -> None:
    """Raise ConfigError naming the first bad value and what is allowed."""
    if mode not in TRAIN_MODES:
        raise ConfigError(f"unknown mode {mode!r}; allowed: {', '.join(TRAIN_MODES)}")
    if accounting not in ACCOUNTINGS:
        raise ConfigError(f"unknown accounting {accounting!r}; allowed: {', '.join(ACCOUNTINGS)}")
    low = MIN_RESOLUTION_SIDE if mode.startswith("repnet") else MIN_RESOLUTION
    if not isinstance(resolution, int) or resolution < low:
        raise ConfigError(f"resolution {resolution} is too small for mode {mode}; allowed: >= {low}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size {batch_size} is not allowed; allowed: >= 1")
    if frozen_bits not in FROZEN_BITS:
        raise ConfigError(f"frozen bits {frozen_bits} not allowed; allowed: {FROZEN_BITS}")


def resolve_spec(
    *, checkpoint: str | Path | None = None, num_classes: int = 1000, width: float | None = None
) -> BackboneSpec:
    """The backbone spec from a backbone folder or weights name, or a stock MobileNetV2 of ``width``
    (default 1.0; refused beside a folder, which has its own: ``input_spec``).

    ``num_classes`` always wins: fine-tuning replaces the classifier.
    """
    return input_spec(checkpoint, width=width, num_classes=num_classes)


def paper_report(net: EdgeNet, *, mode: str, resolution: int, batch_size: int,
                 frozen_bits: int = 8) -> MemoryReport:
    """Paper accounting (DESIGN 2a) of a built network: per image, then batch total."""
    trace = trace_network(net, resolution, batch_size=1)
    blocks = paper_blocks(trace)
    peak = max(b.peak_bytes for b in blocks)
    par = param_bytes(trace, frozen_bits=frozen_bits)
    return MemoryReport(
        accounting="paper",
        mode=mode,
        resolution=resolution,
        batch_size=batch_size,
        num_classes=net.spec.num_classes,
        blocks=blocks,
        peak_activation_bytes=peak,
        param_bytes=par,
        total_bytes=batch_size * peak + par,
        sensitive_blocks=sensitive(blocks),
        breakdown={
            "activations (batch x per-image peak)": batch_size * peak,
            "trainable params (4 B each)": trace.trainable_params * 4,
            f"frozen params ({frozen_bits}-bit)": trace.frozen_params * frozen_bits // 8,
        },
        backbone=net.spec.to_dict(),
    )


def profile(
    *,
    mode: str = "repnet",
    accounting: str = "paper",
    resolution: int = 224,
    batch_size: int = 8,
    num_classes: int = 1000,
    width: float | None = None,
    frozen_bits: int = 8,
    checkpoint: str | Path | None = None,
    measure: bool = False,
    device: str | torch.device = "cpu",
    measure_steps: int = 3,
    runtime: str = "auto",
    lean: LeanOptions | None = None,
    step_in_backward: bool = False,
    fused: bool = False,
) -> MemoryReport:
    """Profile the activation memory of fine-tuning a backbone (default MobileNetV2) in ``mode``.

    Args:
        mode: which parameters train (see ``edgetl.models.side.TRAIN_MODES``).
        accounting: "paper" (DESIGN 2a) or "runtime" (DESIGN 2b).
        resolution: input side in pixels.
        batch_size: images per training step.
        num_classes: classifier outputs.
        width: the default MobileNetV2's width multiplier (default 1.0; refused beside a backbone folder).
        frozen_bits: storage of frozen weights in paper accounting.
        checkpoint: a backbone folder (pruned or retrained) whose spec to profile.
        measure: also run real training steps and record the measured peak.
        device: where to measure.
        measure_steps: training steps to measure over.
        runtime: "lean" (edgetl's lean layers), "stock" (torch modules) or "auto" (lean
            where the mode allows). Paper accounting always walks the stock network.
        lean: lean runtime options (pooling, precision, frozen weights, BN); defaults
            to ``LeanOptions()``.
        step_in_backward: the step updates each parameter inside backward as soon as its
            gradient is complete (``edgetl.step.step_in_backward``; runtime accounting and
            measurement).
        fused: the step's optimizer runs fused kernels (``optim.fused``).
    """
    from edgetl.step import Step

    step = Step.plain(step_in_backward=step_in_backward, fused=fused)
    check_options(mode=mode, accounting=accounting, resolution=resolution,
                  batch_size=batch_size, frozen_bits=frozen_bits)
    spec = resolve_spec(checkpoint=checkpoint, num_classes=num_classes, width=width)
    lean_options = _applicable(mode, runtime, accounting, measure, lean, frozen_bits, step)
    if accounting == "paper":
        net = build_network(spec, mode, device="meta")
        report = paper_report(net, mode=mode, resolution=resolution, batch_size=batch_size,
                              frozen_bits=frozen_bits)
    else:
        from edgetl.memory.meter import count_step_ops
        from edgetl.memory.runtime import runtime_report
        from edgetl.memory.schedule import prepare_step

        net = build_network(spec, mode, device="meta", lean=lean_options)
        schedule = prepare_step(net, resolution=resolution, batch_size=batch_size, step=step)
        report = runtime_report(net, mode=mode, resolution=resolution, batch_size=batch_size, step=step)
        ops = count_step_ops(net, resolution=resolution, batch_size=batch_size, step=step)
        report.step_ops = {"forward": ops.forward, "backward": ops.backward, "optimizer": ops.optimizer}
        if lean_options is not None:
            report.schedule = schedule.to_dict()
    describe_runtime(report, net, lean_options)
    if measure:
        from edgetl.memory.meter import measure_training_peak
        from edgetl.memory.schedule import prepare_step

        real = build_network(spec, mode, device=device, lean=lean_options)
        prepare_step(real, resolution=resolution, batch_size=batch_size, step=step)  # the step predicted above
        report.measured_peak_bytes = measure_training_peak(
            real, resolution=resolution, batch_size=batch_size, steps=measure_steps, step=step
        )
        log.info("measured peak %.2f MB", report.measured_peak_bytes / MB)
    return report


def _applicable(mode: str, runtime: str, accounting: str, measure: bool, lean: LeanOptions | None,
                frozen_bits: int, step) -> LeanOptions | None:
    """The lean options the profile runs with (None: stock modules), after refusing in one line
    every option this profile would ignore (none is dropped silently)."""
    options = lean or LeanOptions()
    given = options.given(LeanOptions())
    runs_steps = accounting == "runtime" or measure  # paper accounting alone runs no runtime
    levers = {**given, **{k: True for k in ("step_in_backward", "fused") if getattr(step.optim, k)}}
    if levers and not runs_steps:
        name, value = next(iter(levers.items()))
        raise ConfigError(f"{name} {value} does not apply to paper accounting (the papers' model of stock "
                          f"modules): it needs accounting runtime or measure")
    if accounting == "runtime" and frozen_bits != 8:
        raise ConfigError(f"frozen_bits {frozen_bits} applies to paper accounting; the runtime's frozen weights "
                          f"are frozen_weights (fp32, fp16, int8)")
    return options.for_mode(mode, runtime, defaults=LeanOptions())


def describe_runtime(report: MemoryReport, net: EdgeNet, lean: LeanOptions | None) -> None:
    """Record in ``report`` which runtime ``net`` (the accounted network) uses, and the lean options.

    ``lean["side_pools"]`` is the factor each side module's conv really stores its input
    with at the report's resolution (small maps pool less than ``pool``).
    """
    report.runtime = "stock" if lean is None else "lean"
    report.lean = None
    if lean is not None:
        from edgetl.models.lean_side import stored_pools

        report.lean = {**dataclasses.asdict(lean), "side_pools": stored_pools(net, report.resolution)}


def plot_profile(report: MemoryReport, path: str | Path) -> None:
    """Save a PNG in the spirit of the paper's Figure 1.

    Per block: temporary and cumulative gradient memory side by side, the peak marked,
    sensitive blocks shaded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgetl.io import PNG_SOFTWARE, atomic_write_bytes
    import edgetl.models.archs as archs

    idx = list(range(len(report.blocks)))
    labels = [str(b.index) if b.name != "head" else "head" for b in report.blocks]
    entry = archs.get(report.backbone.get("arch", archs.DEFAULT_ARCH))
    if entry.block_name(0) != "features.0":  # names that say more than the number: "2 layer1.1"
        labels = [f"{b.index}\n{entry.block_name(b.index)}" if b.name != "head" else "head" for b in report.blocks]
    tmp = [b.tmp_bytes / MB for b in report.blocks]
    cug = [b.cugrd_bytes / MB for b in report.blocks]
    peak = [b.peak_bytes / MB for b in report.blocks]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=120)
    for i, b in enumerate(report.blocks):
        if b.index in report.sensitive_blocks:
            ax.axvspan(i - 0.5, i + 0.5, color="#f6d5d5", zorder=0)
    ax.bar([i - 0.2 for i in idx], tmp, width=0.4, label="temporary (M_tmp)", color="#d9534f")
    ax.bar([i + 0.2 for i in idx], cug, width=0.4, label="cumulative gradient (M_cugrd)", color="#337ab7")
    ax.plot(idx, peak, "k.-", lw=1, label="peak while the block runs")
    top = max(range(len(peak)), key=peak.__getitem__)
    ax.annotate(f"peak {peak[top]:.2f} MB", (top, peak[top]), xytext=(8, 4),
                textcoords="offset points")
    ax.axhline(report.stored_bytes / MB, color="#337ab7", ls="--", lw=0.8)
    ax.set_xticks(idx, labels)
    if any("\n" in label for label in labels):
        ax.tick_params(axis="x", labelsize=7, labelrotation=90)
    ax.set_ylim(0, max(tmp + cug + peak) * 1.3)  # room above the bars for the legend
    ax.set_xlabel("block (features[i]); shaded: sensitive")
    ax.set_ylabel("MB per image (10^6 B)")
    ax.set_title(
        f"{entry.title} {report.mode}, {report.accounting} accounting, {report.resolution} px: "
        f"peak {report.peak_activation_bytes / MB:.2f} MB/image, "
        f"total {report.total_bytes / MB:.1f} MB at batch {report.batch_size}"
    )
    ax.legend(loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": PNG_SOFTWARE})  # edgetl may replace it later
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
