"""Benchmark stage: fine-tuning methods in, a BenchResult (memory three ways, speed, largest batch) out.

The paper's Table I, measured. Per method: paper accounting (DESIGN 2a), runtime
accounting (DESIGN 2b), measured peak (DESIGN 2c), training throughput, the largest
batch that fits a memory budget and the trainable parameter count. Throughput follows
Liu et al. ("An Evaluation of Memory Optimization Methods", shared/papers/003): memory
methods are compared at the same batch size in the same process, and steps are
interleaved round-robin (one step of each method per round) so machine noise hits all
methods alike; the reported figure is the median step time after warm-up.

On CUDA the measured column is the caching allocator's allocated peak, and a reserved
column (what the device loses, DESIGN 2d) stands beside it; the storage meter's tensor
peak over the same steps is kept in the result too (``tensor_bytes``).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from edgetl.errors import ConfigError
from edgetl.memory.report import MB
from edgetl.models.backbone import BackboneSpec, EdgeNet, build_backbone, hidden_channels
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step, set_train_mode, training_step

log = logging.getLogger(__name__)

# The FMEC paper's pruning ratios for blocks 1-4 (DESIGN 5); at width 1.0 they keep
# 22/21/77/77 hidden channels.
PAPER_PRUNING = {1: 0.3, 2: 0.78, 3: 0.46, 4: 0.46}
REFERENCE = "repnet-stock"
PLAN = "plan"
FROZEN_BITS = 8  # paper accounting: frozen weights stored 8-bit (DESIGN 2a)
MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class Method:
    """One row of the table: what trains, on which runtime, on which backbone."""

    name: str
    label: str
    mode: str
    lean: LeanOptions | None = None  # None: stock torch modules
    pruned: bool = False
    checkpoint: bool = False  # torch.utils.checkpoint over every features block
    planned: bool = False  # storage and pruning come from ``edgetl.plan.plan`` for the budget
    hidden: dict[int, int] | None = None  # explicit kept hidden channels (a plan's pruning)
    unstreamed: str | None = None  # the same row without streaming (a speed ratio against it)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("full", "full fine-tune", "full"),
    Method("full-ckpt", "full fine-tune + gradient checkpointing", "full", checkpoint=True),
    Method("full-lean", "full fine-tune, lean (BN folded), exact storage", "full", LeanOptions(storage="exact")),
    Method("full-lean-pool2", "full lean + conv inputs pooled k=2 (Barley & Froening)", "full",
           LeanOptions(storage="pool2")),
    *(Method(f"full-lean-{c}", f"full lean + {label}, 10 % kept (Vu et al.)", "full",
             LeanOptions(storage=c, keep=0.1))
      for c, label in (("haar", "Haar wavelet"), ("db3", "Daubechies-3 wavelet"), ("dct", "8x8 block DCT"),
                       ("threshold", "thresholding"))),
    Method("last", "last layer", "last"),
    Method("bias", "bias only (TinyTL-B)", "bias"),
    Method("bias-lean", "bias only (TinyTL-B), lean runtime", "bias", LeanOptions(pool=1)),
    Method("bias-lean-stream", "TinyTL-B, lean, streamed by 1, uint8 batch, recompute", "bias",
           LeanOptions(pool=1, stream=1, uint8_input=True, recompute=True), unstreamed="bias-lean"),
    Method(REFERENCE, "Rep-Net, stock modules", "repnet"),
    Method("repnet-lean", "Rep-Net, lean runtime", "repnet", LeanOptions(pool=1)),
    Method("repnet-lean-stream", "Rep-Net, lean, backbone streamed by 1, uint8 batch", "repnet",
           LeanOptions(pool=1, stream=1, uint8_input=True), unstreamed="repnet-lean"),
    Method("repnet-pruned", "Rep-Net, lean, pruned backbone", "repnet", LeanOptions(pool=1), pruned=True),
    Method("repnet-pruned-pool2", "+ pooled storage k=2", "repnet", LeanOptions(pool=2), pruned=True),
    Method("repnet-pruned-pool2-bf16-int8", "+ bf16 activations, int8 frozen weights", "repnet",
           LeanOptions(pool=2, precision="bf16", frozen_weights="int8"), pruned=True),
    Method("repnet-pruned-pool2-bf16-int8-stream", "+ backbone streamed by 1, uint8 batch, recompute", "repnet",
           LeanOptions(pool=2, precision="bf16", frozen_weights="int8", stream=1, uint8_input=True,
                       recompute=True), pruned=True, unstreamed="repnet-pruned-pool2-bf16-int8"),
    Method(PLAN, "edgetl plan's pick for the budget", "repnet", planned=True),
)}


def plan_available() -> bool:
    """Whether the plan stage (edgetl.plan) is installed; without it the ``plan`` row is left out."""
    import importlib.util

    return importlib.util.find_spec("edgetl.plan") is not None


def default_methods() -> list[str]:
    return [n for n in METHODS if n != PLAN or plan_available()]


def planned_method(*, budget_bytes: int, batch_size: int, resolution: int, num_classes: int,
                   width: float) -> tuple[Method, str]:
    """The configuration ``edgetl plan`` picks for the budget at this batch, as a Method."""
    try:
        from edgetl.plan import lean_options, plan
    except ImportError as exc:
        raise ConfigError(f"method {PLAN!r} needs the plan stage (edgetl.plan): {exc}") from None
    chosen = plan(budget_bytes=budget_bytes, batch_size=batch_size, resolution=resolution,
                  num_classes=num_classes, width=width).chosen
    method = Method(PLAN, METHODS[PLAN].label, chosen.mode, lean_options(chosen.storage), pruned=bool(chosen.kept),
                    planned=True, hidden=dict(chosen.kept))
    return method, f"plan: {chosen.describe()}"


@dataclass
class BenchRow:
    """One method's figures. Bytes are whole bytes; ``None`` where a view does not model the method."""

    method: str
    label: str
    mode: str
    runtime: str  # "stock", "lean" or "stock+checkpoint"
    lean: dict | None
    hidden: dict[str, int]
    trainable_params: int
    paper_bytes: int | None
    runtime_bytes: int | None
    measured_bytes: int
    images_per_s: float
    step_seconds: list[float]
    largest_batch: int
    largest_batch_source: str  # "runtime" (accounting) or "measured" (meter bisection)
    largest_batch_bytes: int | None  # at largest_batch, by largest_batch_source
    next_batch_bytes: int | None  # at largest_batch + 1, by largest_batch_source
    largest_batch_measured_bytes: int | None  # measured at largest_batch (verification), if run
    memory_ratio: float | None = None  # measured / reference measured
    throughput_ratio: float | None = None  # images/s / reference images/s
    note: str = ""
    reserved_bytes: int | None = None  # CUDA: max_memory_reserved over the measured steps
    tensor_bytes: int | None = None  # CUDA: live tensor peak (storage meter) over the same steps
    step_ops: int | None = None  # aten ops one training step dispatches (GPU: kernel launches)
    forward_ops: int | None = None  # of which in the network's forward
    unstreamed: str | None = None  # a streamed row's unstreamed twin
    unstreamed_throughput_ratio: float | None = None  # images/s / the twin's images/s
    largest_images_per_s: float | None = None  # throughput at largest_batch (seed 003: what memory buys)
    largest_step_seconds: list[float] = field(default_factory=list)  # the steps it is the median of
    largest_timed_batch: int | None = None  # the batch timed: largest_batch, or the bench's cap


@dataclass
class BenchResult:
    """The benchmark table and how it was made."""

    resolution: int
    batch_size: int
    num_classes: int
    width: float
    budget_bytes: int
    steps: int
    warmup: int
    optimizer: str
    device: str
    threads: int
    torch_version: str
    reference: str
    rows: list[BenchRow] = field(default_factory=list)
    command: str | None = None

    def row(self, method: str) -> BenchRow:
        for r in self.rows:
            if r.method == method:
                return r
        raise KeyError(method)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchResult":
        data = dict(data)
        data["rows"] = [BenchRow(**r) for r in data["rows"]]
        return cls(**data)

    def save_json(self, path: str | Path) -> None:
        from edgetl.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load_json(cls, path: str | Path) -> "BenchResult":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"cannot read bench results {path}: {exc}") from None

    def save_csv(self, path: str | Path) -> None:
        from edgetl.io import atomic_write_text

        lists = ("step_seconds", "largest_step_seconds")
        cols = [f.name for f in dataclasses.fields(BenchRow) if f.name not in ("lean", "hidden", *lists)]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(cols + ["lean", "hidden", *lists])
        for r in self.rows:
            d = dataclasses.asdict(r)
            writer.writerow([("" if d[c] is None else d[c]) for c in cols]
                            + [json.dumps(d["lean"]), json.dumps(d["hidden"])]
                            + [" ".join(f"{s:.4f}" for s in d[name]) for name in lists])
        atomic_write_text(path, buf.getvalue())


# ----------------------------------------------------------------------------- building


def pruned_hidden(width: float, num_classes: int) -> dict[int, int]:
    """Hidden channels kept by the paper's ratios: int(C * (1 - ratio)) (DESIGN 5)."""
    net = build_backbone(BackboneSpec(width=width, num_classes=num_classes), device="meta")
    return {b: max(1, int(hidden_channels(net, b) * (1 - r))) for b, r in PAPER_PRUNING.items()}


class Checkpointed(nn.Module):
    """A features block whose activations are recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        # Non-reentrant: works with inputs that do not require grad (the image) and
        # with nested autograd Functions. BN running statistics are updated twice per
        # step (forward and recompute); harmless for a memory/speed benchmark.
        return checkpoint(self.block, x, use_reentrant=False)


def build_method(method: Method, *, width: float, num_classes: int, device: str | torch.device,
                 hidden: dict[int, int] | None = None) -> EdgeNet:
    """The network of ``method``, trainability set (random weights: memory and speed only)."""
    spec = BackboneSpec(width=width, num_classes=num_classes, hidden=dict(hidden or {}))
    net = build_network(spec, method.mode, device=device, lean=method.lean)
    if method.checkpoint:
        for i in range(len(net.features)):
            net.features[i] = Checkpointed(net.features[i])
    return net


def count_trainable(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- largest batch


def largest_fitting(total: Callable[[int], int], budget_bytes: int, known: dict[int, int],
                    upper: int = MAX_BATCH) -> tuple[int, dict[int, int]]:
    """Largest batch b <= upper with total(b) <= budget; 0 if not even batch 1 fits.

    ``total`` must be non-decreasing in b; ``known`` holds totals already computed (at
    least two batches). A training step's peak is the largest of a few moments, each
    affine in the batch, so the total is convex and piecewise affine: secant steps
    through the two latest points land on the answer in a few calls (a straight
    bisection would need about 16); bisection finishes if they do not. Returns the
    batch and every total computed, ``known`` included.
    """
    seen = dict(known)
    if len(seen) < 2:
        raise ValueError("largest_fitting needs totals at two batches")

    def bounds() -> tuple[int, int]:
        lo = max((b for b, t in seen.items() if t <= budget_bytes), default=0)
        hi = min((b for b, t in seen.items() if t > budget_bytes), default=upper + 1)
        return lo, hi

    recent = sorted(seen)[-2:]
    for _ in range(8):
        lo, hi = bounds()
        if hi - lo <= 1:
            break
        (a, c) = recent[-2:]
        slope = (seen[c] - seen[a]) / (c - a)
        if slope <= 0:
            break
        guess = c + int((budget_bytes - seen[c]) // slope)
        guess = min(max(guess, lo + 1), hi - 1)
        if guess not in seen:
            seen[guess] = total(guess)
        if seen[guess] <= budget_bytes and guess + 1 not in seen and guess + 1 <= upper:
            seen[guess + 1] = total(guess + 1)  # the secant usually hits the answer: check its neighbour
        if seen[guess] > budget_bytes:
            recent = [c, guess]
        else:
            recent = [guess, guess + 1] if guess + 1 in seen else [c, guess]
    lo, hi = bounds()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen[mid] = total(mid)
        lo, hi = bounds()
    return lo, seen


# ----------------------------------------------------------------------------- throughput


class _Trainer:
    """One method's network, Adam and a fixed random batch; ``step()`` returns seconds of
    ``edgetl.step.training_step``, the step the meter measures and fit runs."""

    def __init__(self, net: EdgeNet, *, resolution: int, batch_size: int, num_classes: int,
                 device: torch.device, lr: float, seed: int):
        self.spec = Step.plain("adam", lr)
        set_train_mode(net, self.spec.bn)
        self.net = net
        self.opt = self.spec.optimizer(net)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        image = torch.randn(batch_size, 3, resolution, resolution, generator=gen)
        self.image = image.to(device, getattr(net, "input_dtype", torch.float32))
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)
        self.device = device

    def step(self) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        sync(self.device)
        start = time.perf_counter()
        training_step(self.net, self.spec, self.opt, self.image, self.labels)
        sync(self.device)
        return time.perf_counter() - start


def interleaved_step_times(trainers: dict[str, _Trainer], *, steps: int, warmup: int) -> dict[str, list[float]]:
    """Round-robin: each round runs one step of every method; warm-up rounds are dropped."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for round_ in range(warmup + steps):
        for name, trainer in trainers.items():
            seconds = trainer.step()
            if round_ >= warmup:
                times[name].append(seconds)
        log.info("throughput round %d/%d done", round_ + 1, warmup + steps)
    return times


# ----------------------------------------------------------------------------- the bench


def bench(
    *,
    resolution: int = 224,
    batch_size: int = 8,
    num_classes: int = 102,
    width: float = 1.0,
    budget_bytes: int = 256 * 10**6,
    methods: list[str] | tuple[str, ...] | None = None,
    steps: int = 10,
    warmup: int = 2,
    device: str | torch.device = "cpu",
    verify_images: int = 64,
    measure_steps: int = 2,
    lr: float = 1e-3,
    seed: int = 0,
    command: str | None = None,
    largest_steps: int = 3,
    largest_cap: int = 256,
) -> BenchResult:
    """Measure every method side by side.

    Args:
        resolution: input side in pixels.
        batch_size: images per step for the memory figures and the throughput.
        num_classes: classifier outputs.
        width: MobileNetV2 width multiplier.
        budget_bytes: memory budget for the largest-batch column.
        methods: names from ``METHODS`` (default: all), in table order.
        steps: measured throughput rounds (one step of every method per round).
        warmup: throughput rounds run first and dropped.
        device: where to measure and time.
        verify_images: the largest batch found by runtime accounting is re-measured with
            the meter when batch x resolution^2 <= verify_images x 224^2 (cheap enough).
        measure_steps: training steps per meter measurement (the peak comes in step 2,
            once optimizer state exists).
        lr: Adam learning rate of the timed and measured steps.
        seed: seeds the random batches.
        command: the command line that made this result, stored with it.
        largest_steps: timed steps (after one warm-up step) of each method at its largest
            batch, for the throughput that batch buys (Liu et al., seed 003); 0: skip.
        largest_cap: time at most this batch (a streamed row's largest batch can run to
            thousands of small-input images); the row records the batch it timed.
    """
    from edgetl.memory.meter import count_step_ops, measure_training_memory
    from edgetl.memory.runtime import runtime_report
    from edgetl.memory.schedule import prepare_step
    from edgetl.profile import check_options, paper_report

    names = list(methods) if methods is not None else default_methods()
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    if not names:
        raise ConfigError("no methods to bench")
    if len(set(names)) != len(names):
        raise ConfigError(f"methods repeat: {', '.join(names)}")
    if steps < 1 or warmup < 0 or measure_steps < 1 or largest_steps < 0 or largest_cap < 1:
        raise ConfigError(f"need steps >= 1, warmup >= 0, measure_steps >= 1, largest_steps >= 0, largest_cap >= 1; "
                          f"got {steps}, {warmup}, {measure_steps}, {largest_steps}, {largest_cap}")
    if budget_bytes < 1:
        raise ConfigError(f"budget {budget_bytes} bytes is not allowed; give a positive size")
    for name in names:
        check_options(mode=METHODS[name].mode, accounting="runtime", resolution=resolution,
                      batch_size=batch_size)
    device = torch.device(device)
    hidden = pruned_hidden(width, num_classes)
    result = BenchResult(
        resolution=resolution, batch_size=batch_size, num_classes=num_classes, width=width,
        budget_bytes=budget_bytes, steps=steps, warmup=warmup, optimizer="adam", device=str(device),
        threads=torch.get_num_threads(), torch_version=torch.__version__, reference=REFERENCE,
        command=command,
    )
    verify_pixels = verify_images * 224 * 224
    trainers: dict[str, _Trainer] = {}
    builders: dict[str, Callable[[torch.device, int], EdgeNet]] = {}
    for name in names:
        method, plan_note = METHODS[name], ""
        if method.planned:
            method, plan_note = planned_method(budget_bytes=budget_bytes, batch_size=batch_size,
                                               resolution=resolution, num_classes=num_classes, width=width)
        method_hidden = method.hidden if method.hidden is not None else (hidden if method.pruned else {})
        def build(dev, b: int, m=method, h=method_hidden) -> EdgeNet:
            net = build_method(m, width=width, num_classes=num_classes, device=dev, hidden=h)
            if m.lean is not None:  # as edgetl finetune runs it: whole-batch backward where the peak allows
                prepare_step(net, resolution=resolution, batch_size=b)
            return net

        log.info("%s: accounting", name)

        def measure(b: int, build=build):
            return measure_training_memory(build(device, b), resolution=resolution, batch_size=b,
                                           steps=measure_steps, lr=lr, seed=seed)

        def measured(b: int) -> int:
            return measure(b).peak_bytes

        if method.checkpoint:
            # Neither accounting models recomputation: the paper walk and the runtime
            # simulation would both describe the plain full fine-tune.
            paper_bytes = runtime_bytes = None
            note = "accountings do not model recomputation; largest batch by measurement"
        else:
            stock_meta = build_method(
                dataclasses.replace(method, lean=None), width=width, num_classes=num_classes,
                device="meta", hidden=method_hidden)
            paper_bytes = paper_report(stock_meta, mode=method.mode, resolution=resolution,
                                       batch_size=batch_size, frozen_bits=FROZEN_BITS).total_bytes
            meta = build("meta", batch_size)

            def accounted(b: int, meta=meta, mode=method.mode) -> int:
                return runtime_report(meta, mode=mode, resolution=resolution, batch_size=b).total_bytes

            runtime_bytes = accounted(batch_size)
            note = plan_note
        log.info("%s: measuring the peak", name)
        at_size = measure(batch_size)
        measured_bytes = at_size.peak_bytes
        log.info("%s: largest batch in %.1f MB", name, budget_bytes / MB)
        if method.checkpoint:
            source, total_fn, at_batch = "measured", measured, measured_bytes
        else:
            source, total_fn, at_batch = "runtime", accounted, runtime_bytes
        known = {batch_size: at_batch, 1: at_batch if batch_size == 1 else total_fn(1)}
        if batch_size == 1:
            known[2] = total_fn(2)
        largest, seen = largest_fitting(total_fn, budget_bytes, known)
        verify = None
        if source == "measured":
            verify = seen.get(largest)
        elif 1 <= largest and largest * resolution**2 <= verify_pixels:
            verify = measured(largest)
        # the meta network the accounting used, its schedule applied (checkpointed rows have none)
        counted = build("meta", batch_size) if method.checkpoint else meta
        ops = count_step_ops(counted, resolution=resolution, batch_size=batch_size)
        builders[name] = build
        real = build(device, batch_size)
        trainers[name] = _Trainer(real, resolution=resolution, batch_size=batch_size,
                                  num_classes=num_classes, device=device, lr=lr, seed=seed)
        result.rows.append(BenchRow(
            method=name, label=method.label, mode=method.mode,
            runtime="lean" if method.lean else ("stock+checkpoint" if method.checkpoint else "stock"),
            lean=None if method.lean is None else dataclasses.asdict(method.lean),
            hidden={str(k): v for k, v in sorted(method_hidden.items())},
            trainable_params=count_trainable(real),
            paper_bytes=paper_bytes, runtime_bytes=runtime_bytes, measured_bytes=measured_bytes,
            images_per_s=0.0, step_seconds=[],
            largest_batch=largest, largest_batch_source=source,
            largest_batch_bytes=seen.get(largest), next_batch_bytes=seen.get(largest + 1),
            largest_batch_measured_bytes=verify, note=note,
            reserved_bytes=at_size.reserved_bytes,
            tensor_bytes=at_size.tensor_bytes if at_size.allocated_bytes is not None else None,
            step_ops=ops.total, forward_ops=ops.forward, unstreamed=method.unstreamed,
        ))
    log.info("throughput: %d warm-up + %d rounds of %d methods", warmup, steps, len(trainers))
    times = interleaved_step_times(trainers, steps=steps, warmup=warmup)
    for row in result.rows:
        row.step_seconds = times[row.method]
        row.images_per_s = batch_size / statistics.median(row.step_seconds)
    trainers.clear()
    if largest_steps:
        for row in result.rows:
            if row.largest_batch < 1:
                continue
            timed = min(row.largest_batch, largest_cap)
            log.info("%s: %d steps at batch %d (largest %d)", row.method, largest_steps, timed, row.largest_batch)
            trainer = _Trainer(builders[row.method](device, timed), resolution=resolution,
                               batch_size=timed, num_classes=num_classes, device=device, lr=lr, seed=seed)
            trainer.step()  # warm-up
            seconds = [trainer.step() for _ in range(largest_steps)]
            row.largest_timed_batch = timed
            row.largest_step_seconds = seconds
            row.largest_images_per_s = timed / statistics.median(seconds)
            del trainer
    set_ratios(result)
    return result


def set_ratios(result: BenchResult) -> None:
    """Memory and throughput ratios against the reference row (None without it), and each
    streamed row's throughput against its unstreamed twin."""
    _set_unstreamed_ratios(result)
    try:
        ref = result.row(result.reference)
    except KeyError:
        return
    for row in result.rows:
        row.memory_ratio = row.measured_bytes / ref.measured_bytes
        row.throughput_ratio = row.images_per_s / ref.images_per_s


def _set_unstreamed_ratios(result: BenchResult) -> None:
    """A streamed row's speed against its unstreamed twin, where the twin ran too."""
    names = {r.method: r for r in result.rows}
    for row in result.rows:
        twin = names.get(row.unstreamed) if row.unstreamed else None
        row.unstreamed_throughput_ratio = None if twin is None else row.images_per_s / twin.images_per_s


# ----------------------------------------------------------------------------- rendering


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / MB:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _unstreamed(row: BenchRow) -> str:
    if row.unstreamed_throughput_ratio is None:
        return ""
    return f" ({row.unstreamed_throughput_ratio:.2f}x unstreamed)"


def _ops(row: BenchRow) -> str:
    return "-" if row.step_ops is None else f"{row.step_ops:,} ({row.forward_ops:,})"


def _at_largest(row: BenchRow) -> str:
    if row.largest_images_per_s is None:
        return "-"
    capped = f" (at batch {row.largest_timed_batch})" if row.largest_timed_batch != row.largest_batch else ""
    return f"{row.largest_images_per_s:.1f}{capped}"


def has_reserved(result: BenchResult) -> bool:
    """Whether the result comes from a CUDA device (allocated and reserved columns)."""
    return any(r.reserved_bytes is not None for r in result.rows)


def table_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells (MB = 10^6 B) shared by the terminal and markdown tables.

    On CUDA "measured" is split into the allocator's allocated and reserved peaks.
    """
    cuda = has_reserved(result)
    measured = ["allocated MB", "reserved MB"] if cuda else ["measured MB"]
    headers = ["method", "trainable params", "paper MB", "runtime MB", *measured, "memory vs Rep-Net",
               "images/s", "speed vs Rep-Net", "ops/step (forward)",
               f"largest batch in {result.budget_bytes / MB:g} MB", "images/s at largest batch"]
    rows = []
    for r in result.rows:
        batch = str(r.largest_batch) + (" (measured)" if r.largest_batch_source == "measured" else "")
        cells = [_mb(r.measured_bytes), _mb(r.reserved_bytes)] if cuda else [_mb(r.measured_bytes)]
        rows.append([r.label, f"{r.trainable_params:,}", _mb(r.paper_bytes), _mb(r.runtime_bytes),
                     *cells, _ratio(r.memory_ratio), f"{r.images_per_s:.1f}",
                     _ratio(r.throughput_ratio) + _unstreamed(r), _ops(r), batch,
                     _at_largest(r)])
    return headers, rows


def caption(result: BenchResult) -> str:
    return (f"MobileNetV2 {result.width:g}, {result.resolution} px, batch {result.batch_size}, "
            f"{result.num_classes} classes, Adam, {result.device} ({result.threads} thread"
            f"{'s' if result.threads != 1 else ''}, torch {result.torch_version}); throughput: median of "
            f"{result.steps} interleaved steps after {result.warmup} warm-up; MB = 10^6 bytes")


def _measured_text(result: BenchResult) -> str:
    if has_reserved(result):
        return ("Allocated / reserved: the CUDA caching allocator's max_memory_allocated / "
                "max_memory_reserved over real training steps (the CUDA context excluded).")
    return "Measured: peak live tensor bytes over real training steps."


def to_markdown(result: BenchResult) -> str:
    """The bench table (docs/bench.md), rendered from a result (e.g. a committed JSON)."""
    headers, rows = table_rows(result)
    right = [":---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    lines.append(caption(result) + ".")
    lines.append("Paper accounting: the TinyTL/Rep-Net profiler (4 B activations, 8-bit frozen weights, "
                 "stock modules: it models neither pooling, bf16 nor the lean layers). Runtime accounting: "
                 "edgetl's model of what its runtime holds. " + _measured_text(result)
                 + " Ops/step: the aten ops one training step dispatches (each a kernel launch on a "
                 "GPU), counted on the meta device, the forward's in brackets."
                 + " Largest batch by runtime accounting (\"measured\": by the meter); images/s at "
                 "largest batch: the median of a few steps at that batch (at most the bench's cap), each "
                 "method on its own (Liu et al.: what the memory saved buys).")
    notes = [f"{r.label}: {r.note}" for r in result.rows if r.note]
    if notes:
        lines.append("Notes: " + "; ".join(notes) + ".")
    if result.command:
        lines.append("")
        lines.append(f"Made with `{result.command}`.")
    return "\n".join(lines) + "\n"


def plot_bench(result: BenchResult, path: str | Path) -> None:
    """PNG: measured peak per method as bars with paper/runtime markers; throughput beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgetl.io import atomic_write_bytes

    rows = result.rows
    idx = list(range(len(rows)))
    labels = [r.label.replace(", ", ",\n").replace(" + ", "\n+ ") for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(17, 7.5), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    ax.bar(idx, [r.measured_bytes / MB for r in rows], color="#337ab7",
           label="allocated peak (CUDA)" if has_reserved(result) else "measured peak")
    pi = [i for i, r in enumerate(rows) if r.paper_bytes is not None]
    ri = [i for i, r in enumerate(rows) if r.runtime_bytes is not None]
    ax.plot(pi, [rows[i].paper_bytes / MB for i in pi], "o", color="#d9534f", label="paper accounting")
    ax.plot(ri, [rows[i].runtime_bytes / MB for i in ri], "x", color="k", ms=9, label="runtime accounting")
    si = [i for i, r in enumerate(rows) if r.reserved_bytes is not None]
    if si:
        ax.plot(si, [rows[i].reserved_bytes / MB for i in si], "_", color="#f0ad4e", ms=22, mew=3,
                label="CUDA reserved")
    for i, r in enumerate(rows):
        ax.annotate(f"{r.measured_bytes / MB:.0f}", (i, r.measured_bytes / MB), ha="center",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("training memory, MB (10^6 B), log scale")
    ax.set_xticks(idx, labels, rotation=70, ha="right", fontsize=7)
    ax.set_title(f"memory at batch {result.batch_size}")
    ax.legend(fontsize=8)
    bx.barh([i - 0.2 for i in idx], [r.images_per_s for r in rows], height=0.4, color="#5cb85c",
            label=f"at batch {result.batch_size}")
    li = [i for i, r in enumerate(rows) if r.largest_images_per_s is not None]
    if li:
        bx.barh([i + 0.2 for i in li], [rows[i].largest_images_per_s for i in li], height=0.4,
                color="#9fd49f", hatch="//", label=f"at the largest batch in {result.budget_bytes / MB:g} MB")
    for i, r in enumerate(rows):
        bx.annotate(f"{r.images_per_s:.1f}", (r.images_per_s, i - 0.2), va="center", xytext=(3, 0),
                    textcoords="offset points", fontsize=7)
        if r.largest_images_per_s is not None:
            bx.annotate(f"{r.largest_images_per_s:.1f} (b{r.largest_timed_batch})", (r.largest_images_per_s, i + 0.2),
                        va="center", xytext=(3, 0), textcoords="offset points", fontsize=7)
    bx.legend(fontsize=7, loc="lower right")
    bx.set_yticks(idx, [r.label for r in rows], fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("training throughput, images/s (median)")
    bx.set_title("speed")
    fig.suptitle(caption(result), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
