"""Benchmark stage: fine-tuning methods in, a BenchResult (memory three ways, speed, largest batch) out.

The paper's Table I, measured, on MobileNetV2 or any registered backbone. Per method: paper accounting (DESIGN 2a), runtime
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

import dataclasses
import functools
import itertools
import logging
import os
import platform
import statistics
import time
from typing import Callable

import torch

from edgetl.errors import ConfigError, one_line
from edgetl.heap import heap_policy
from edgetl.memory.report import MB
from edgetl.memory.schedule import Schedule
from edgetl.memory.search import largest_batch
from edgetl.models.backbone import BackboneSpec, EdgeNet
from edgetl.recipe import MAX_BATCH
from edgetl.step import Step, set_train_mode, training_step
from edgetl.bench.methods import (
    DEFAULT_ARCH, FROZEN_BITS, METHODS, PAPER_PRUNING, PLAN, REFERENCE, Checkpointed, Method, build_method,
    check_methods, count_trainable, default_methods, plan_available, planned_method, pruned_hidden,
)
from edgetl.bench.result import (
    BenchResult, BenchRow, caption, has_reserved, plot_bench, set_ratios, table_rows, to_markdown,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ARCH", "FROZEN_BITS", "METHODS", "PAPER_PRUNING", "PLAN", "REFERENCE", "BenchResult", "BenchRow",
    "Checkpointed", "Method", "bench", "build_method", "caption", "check_methods", "count_trainable", "cpu_cores",
    "cpu_trainers",
    "default_methods", "has_reserved",
    "interleaved_step_times", "plan_available", "planned_method", "plot_bench", "pruned_hidden", "set_ratios",
    "table_rows", "to_markdown",
]


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
        self.image = image.to(device, net.input_dtype, memory_format=net.input_memory_format)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)
        self.device = device

    def step(self) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        sync(self.device)
        start = time.perf_counter()
        training_step(self.net, self.spec, self.opt, self.image, self.labels)
        sync(self.device)
        return time.perf_counter() - start


class _GraphTrainer(_Trainer):
    """The same step captured as CUDA graphs (``edgetl.train.graph.CapturedStep``, what
    ``edgetl finetune`` runs on CUDA): built, warmed up and captured here; ``step()`` returns
    seconds of one replay, the batch copied in from pinned host memory included."""

    def __init__(self, net: EdgeNet, **kwargs):
        from edgetl.train.graph import WARMUP_STEPS, CapturedStep

        super().__init__(net, **kwargs)
        self.host_image = self.image.cpu().pin_memory()
        self.host_labels = self.labels.cpu().pin_memory()
        self.captured = CapturedStep(training_step, net, self.spec, self.opt, self.device,
                                     dtype=self.image.dtype, memory_format=net.input_memory_format, tensor_lr=False)
        for _ in range(WARMUP_STEPS + 1):  # eager warm-up, then the capture and its first replay
            self.captured(self.host_image, self.host_labels)
        torch.cuda.synchronize(self.device)

    def step(self) -> float:
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.captured(self.host_image, self.host_labels)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def _graph_trainer(build: Callable[[], EdgeNet], **kwargs) -> tuple[_GraphTrainer | None, str | None]:
    """A captured twin of a method's trainer, or the one-line reason it could not be captured
    (a network ``edgetl.train.graph.uncapturable`` refuses is not tried; one whose capture
    failed, and which ``CapturedStep`` ran on eagerly, is reported, never timed as a graph)."""
    from edgetl.train.graph import uncapturable

    try:
        net = build()
        reason = uncapturable(net)
        if reason is not None:
            return None, f"not captured: {reason}"
        trainer = _GraphTrainer(net, **kwargs)
        if trainer.captured.failed is not None:  # it ran on eagerly: its times would be no graph's
            return None, trainer.captured.describe()
        return trainer, None
    except Exception as exc:  # noqa: BLE001 - a row that cannot be captured is a finding, reported in its row
        return None, one_line(exc)


def cpu_trainers(names, *, resolution: int, batch_size: int, num_classes: int, width: float = 1.0,
                 arch: str = DEFAULT_ARCH) -> dict[str, _Trainer]:
    """The bench's CPU trainers of the methods ``names``, outside a bench run (the scripts that
    time steps apart from it): each network built and its lean step scheduled as the bench
    builds its rows, a pruned method with the paper's pruning; Adam at 1e-3, seed 0."""
    setting = _Setting(arch=arch, resolution=resolution, batch_size=batch_size, num_classes=num_classes,
                       width=width, budget_bytes=0, device="cpu", verify_images=0, measure_steps=0, lr=1e-3,
                       seed=0, timed_cap=0)
    hidden = pruned_hidden(width, num_classes, arch) if any(METHODS[n].pruned for n in names) else {}
    trainers = {}
    for name in names:
        method = dataclasses.replace(METHODS[name], hidden=hidden) if METHODS[name].pruned else METHODS[name]
        trainers[name] = _Trainer(_build(method, {}, setting, "cpu", batch_size), resolution=resolution,
                                  batch_size=batch_size, num_classes=num_classes, device=torch.device("cpu"),
                                  lr=1e-3, seed=0)
    return trainers


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


@dataclasses.dataclass(frozen=True)
class _Setting:
    """What every row of one bench shares (sent to the processes that measure rows)."""

    arch: str
    resolution: int
    batch_size: int
    num_classes: int
    width: float
    budget_bytes: int
    device: str
    verify_images: int
    measure_steps: int
    lr: float
    seed: int
    timed_cap: int  # the largest batch timed (0: no step timed at the largest batch)


def bench(
    *,
    arch: str = DEFAULT_ARCH,
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
    workers: int = 1,
    graphs: bool | None = None,
) -> BenchResult:
    """Measure every method side by side.

    Args:
        arch: the backbone, a registered architecture (``edgetl.models.archs``), random weights.
        resolution: input side in pixels.
        batch_size: images per step for the memory figures and the throughput.
        num_classes: classifier outputs.
        width: width multiplier (1.0 where the architecture has none).
        budget_bytes: memory budget for the largest-batch column.
        methods: names from ``METHODS`` (default: ``default_methods(arch)``: all, less the
            paper-pruned rows on an architecture no paper pruned), in table order.
        steps: measured throughput rounds (one step of every method per round).
        warmup: throughput rounds run first and dropped.
        device: where to measure and time.
        verify_images: the largest batch found by runtime accounting is re-measured with
            the meter when batch x resolution^2 <= verify_images x 224^2 (cheap enough).
        measure_steps: training steps per meter measurement (>= 2: the peak comes in step 2,
            once optimizer state exists, and step 2's ops are the row's ops per step).
        lr: Adam learning rate of the timed and measured steps.
        seed: seeds the random batches.
        command: the command line that made this result, stored with it.
        largest_steps: timed steps (after one warm-up step) of each method at its largest
            batch, for the throughput that batch buys (Liu et al., seed 003); 0: skip.
        largest_cap: time at most this batch (a streamed row's largest batch can run to
            thousands of small-input images); the row records the batch it timed.
        workers: processes that measure the rows' memory side by side before any step is
            timed (the accounting is single-threaded Python; ``cpu_cores()`` on a CPU is what
            ``edgetl bench`` runs). They are spawned: a script that calls ``bench`` with more
            than one must guard its entry point (``if __name__ == "__main__":``). On CUDA
            only 1 (one device, each row's peak measured alone). The timing always runs in
            this process, alone.
        graphs: also time every row's step captured as CUDA graphs (``edgetl.train.graph``),
            interleaved with the eager steps, and at the largest batch; None: on CUDA.
    """
    BackboneSpec(arch=arch, width=width, num_classes=num_classes)  # one line for an unknown arch or width
    names = list(methods) if methods is not None else default_methods(arch, device)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    check_methods(names, arch, device)
    if not names:
        raise ConfigError("no methods to bench")
    if len(set(names)) != len(names):
        raise ConfigError(f"methods repeat: {', '.join(names)}")
    if steps < 1 or warmup < 0 or measure_steps < 2 or largest_steps < 0 or largest_cap < 1:
        raise ConfigError(f"need steps >= 1, warmup >= 0, measure_steps >= 2, largest_steps >= 0, largest_cap >= 1; "
                          f"got {steps}, {warmup}, {measure_steps}, {largest_steps}, {largest_cap}")
    if budget_bytes < 1:
        raise ConfigError(f"budget {budget_bytes} bytes is not allowed; give a positive size")
    if workers < 1:
        raise ConfigError(f"workers {workers} is not allowed; give 1 or more")
    from edgetl.profile import check_options

    for name in names:
        check_options(mode=METHODS[name].mode, accounting="runtime", resolution=resolution,
                      batch_size=batch_size)
    device = torch.device(device)
    graphs = device.type == "cuda" if graphs is None else graphs
    if graphs and device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA device; this bench runs on {device.type}: leave graphs off")
    setting = _Setting(arch=arch, resolution=resolution, batch_size=batch_size, num_classes=num_classes, width=width,
                       budget_bytes=budget_bytes, device=str(device), verify_images=verify_images,
                       measure_steps=measure_steps, lr=lr, seed=seed,
                       timed_cap=largest_cap if largest_steps else 0)
    result = BenchResult(
        arch=arch, resolution=resolution, batch_size=batch_size, num_classes=num_classes, width=width,
        budget_bytes=budget_bytes, steps=steps, warmup=warmup, optimizer="adam", device=str(device),
        threads=torch.get_num_threads(), torch_version=torch.__version__, reference=REFERENCE,
        command=command, cpu=cpu_name() if device.type == "cpu" else None,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset") if device.type == "cpu" else None,
        heap=heap_policy() if device.type == "cpu" else None,
    )
    if workers > 1 and device.type != "cpu":
        raise ConfigError(f"workers {workers} is not allowed on {device}: its rows are measured one at a time; give 1")
    hidden = pruned_hidden(width, num_classes, arch) if any(METHODS[n].pruned for n in names) else {}
    measured = _memory_rows(names, setting, hidden, min(workers, len(names)))
    trainers: dict[str, _Trainer] = {}
    builders: dict[str, Callable[[int], EdgeNet]] = {}
    kwargs = dict(resolution=resolution, batch_size=batch_size, num_classes=num_classes, device=device,
                  lr=lr, seed=seed)
    for row, method, fitted in measured:
        builders[row.method] = functools.partial(_build, method, fitted, setting, device)
        result.rows.append(row)
        trainers[row.method] = _Trainer(builders[row.method](batch_size), **kwargs)
        if graphs:
            trainers[(row.method, "graph")], row.graph_error = _graph_trainer(
                functools.partial(builders[row.method], batch_size), **kwargs)
    trainers = {k: t for k, t in trainers.items() if t is not None}
    log.info("throughput: %d warm-up + %d rounds of %d steps", warmup, steps, len(trainers))
    times = interleaved_step_times(trainers, steps=steps, warmup=warmup)
    for row in result.rows:
        row.step_seconds = times[row.method]
        row.images_per_s = batch_size / statistics.median(row.step_seconds)
        if (row.method, "graph") in times:
            row.graph_step_seconds = times[(row.method, "graph")]
            row.graph_images_per_s = batch_size / statistics.median(row.graph_step_seconds)
    trainers.clear()
    if largest_steps:
        for row in result.rows:
            if row.largest_batch < 1:
                continue
            timed = min(row.largest_batch, largest_cap)
            log.info("%s: %d steps at batch %d (largest %d)", row.method, largest_steps, timed, row.largest_batch)
            kwargs = dict(resolution=resolution, batch_size=timed, num_classes=num_classes, device=device,
                          lr=lr, seed=seed)
            trainer = _Trainer(builders[row.method](timed), **kwargs)
            trainer.step()  # warm-up
            seconds = [trainer.step() for _ in range(largest_steps)]
            row.largest_timed_batch = timed
            row.largest_step_seconds = seconds
            row.largest_images_per_s = timed / statistics.median(seconds)
            del trainer
            if graphs and row.graph_error is None:
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the eager trainer's blocks: the graph's pool takes their place
                trainer, error = _graph_trainer(functools.partial(builders[row.method], timed), **kwargs)
                if trainer is None:
                    row.graph_error = f"at batch {timed}: {error}"
                    continue
                seconds = [trainer.step() for _ in range(largest_steps)]
                row.largest_graph_images_per_s = timed / statistics.median(seconds)
                del trainer
    set_ratios(result)
    return result


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The processor the steps are timed on: its model (Linux's ``cpuinfo``), the vector
    instructions torch's kernels use here, and whether it has bf16 instructions (without
    them, bf16 arithmetic on a CPU is emulated and many times slower)."""
    model, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    parts = [model or platform.processor() or platform.machine(), torch.backends.cpu.get_cpu_capability()]
    if flags:
        parts.append("bf16 instructions" if flags & {"avx512_bf16", "amx_bf16"} else "no bf16 instructions")
    return ", ".join(p for p in parts if p)


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _memory_rows(names: list[str], setting: _Setting, hidden: dict[int, int],
                 workers: int) -> list[tuple[BenchRow, Method, dict[int, Schedule]]]:
    """``_memory_row`` of every method, in order: here, or in ``workers`` processes (spawned:
    a fresh interpreter each, torch's threads shared out among them)."""
    if workers <= 1:
        return [_memory_row(name, setting, hidden) for name in names]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    log.info("measuring %d methods in %d processes", len(names), workers)
    threads = max(1, torch.get_num_threads() // workers)
    level = logging.getLogger("edgetl").getEffectiveLevel()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start_worker, initargs=(threads, level)) as pool:
        return list(pool.map(_memory_row, names, itertools.repeat(setting), itertools.repeat(hidden)))


def _start_worker(threads: int, level: int) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _build(method: Method, fitted: dict[int, Schedule], setting: _Setting, device, b: int) -> EdgeNet:
    """The network of ``method`` at batch ``b`` on ``device``, its lean step scheduled as
    ``edgetl finetune`` runs it (``_schedule``)."""
    net = build_method(method, arch=setting.arch, width=setting.width, num_classes=setting.num_classes,
                       device=device, hidden=method.hidden)
    _schedule(net, method, fitted, setting, b)
    return net


def _schedule(net: EdgeNet, method: Method, fitted: dict[int, Schedule], setting: _Setting, b: int) -> None:
    """Schedule ``net``'s lean step at batch ``b`` as ``edgetl finetune`` runs it (whole-batch
    backward where the peak allows, the streamed segments and which of them recompute). A
    schedule is fitted once per batch into ``fitted``: it reads shapes and trainability,
    never weights or the device, so every build of the method shares it. Each batch gets its
    own: one fitted at another batch can keep too little (a recompute set fitted at batch 8
    is too small at batch 300) and names its layers' settings by that batch's shapes."""
    from edgetl.memory.schedule import apply_schedule, prepare_step

    if method.lean is None:
        return
    if b in fitted:
        apply_schedule(net, fitted[b])
    else:
        fitted[b] = prepare_step(net, resolution=setting.resolution, batch_size=b)


def _memory_row(name: str, s: _Setting, hidden: dict[int, int]) -> tuple[BenchRow, Method, dict[int, Schedule]]:
    """One method's memory columns: paper and runtime accounting at the batch, the measured
    peak, the largest batch in the budget (re-measured where cheap enough). Returns the row
    (no timing yet), the method (a plan's pick for ``plan``) and its fitted schedules by
    batch: every batch the largest-batch search tried and the timed batches."""
    from edgetl.memory.meter import measure_training_memory
    from edgetl.memory.runtime import runtime_peak_bytes
    from edgetl.profile import paper_report

    method, note = METHODS[name], ""
    if method.planned:
        method, note = planned_method(budget_bytes=s.budget_bytes, batch_size=s.batch_size,
                                      resolution=s.resolution, num_classes=s.num_classes, width=s.width,
                                      arch=s.arch)
    if method.hidden is None:
        method = dataclasses.replace(method, hidden=hidden if method.pruned else {})
    device = torch.device(s.device)
    fitted: dict[int, Schedule] = {}
    build = functools.partial(_build, method, fitted, s)
    log.info("%s: accounting", name)

    def measure(b: int):
        return measure_training_memory(build(device, b), resolution=s.resolution, batch_size=b,
                                       steps=s.measure_steps, lr=s.lr, seed=s.seed)

    def measured(b: int) -> int:
        return measure(b).peak_bytes

    meta = build("meta", s.batch_size)
    if method.checkpoint:
        # Neither accounting models recomputation: the paper walk and the runtime
        # simulation would both describe the plain full fine-tune.
        paper_bytes = runtime_bytes = None
        note = "accountings do not model recomputation; largest batch by measurement"
    else:
        stock_meta = build_method(dataclasses.replace(method, lean=None), arch=s.arch, width=s.width,
                                  num_classes=s.num_classes, device="meta", hidden=method.hidden)
        paper_bytes = paper_report(stock_meta, mode=method.mode, resolution=s.resolution,
                                   batch_size=s.batch_size, frozen_bits=FROZEN_BITS).total_bytes

        def accounted(b: int, meta=meta) -> int:
            # the step finetune would run at b: its schedule fitted at b, as finetune.largest_batch does
            _schedule(meta, method, fitted, s, b)
            return runtime_peak_bytes(meta, resolution=s.resolution, batch_size=b)

        runtime_bytes = accounted(s.batch_size)
    log.info("%s: measuring the peak", name)
    at_size = measure(s.batch_size)
    measured_bytes = at_size.peak_bytes
    log.info("%s: largest batch in %.1f MB", name, s.budget_bytes / MB)
    if method.checkpoint:
        source, total_fn, at_batch = "measured", measured, measured_bytes
    else:
        source, total_fn, at_batch = "runtime", accounted, runtime_bytes
    largest, seen = largest_batch(total_fn, s.budget_bytes, MAX_BATCH, {s.batch_size: at_batch})
    verify = None
    if source == "measured":
        verify = seen.get(largest)
    elif 1 <= largest and largest * s.resolution**2 <= s.verify_images * 224 * 224:
        verify = measured(largest)
    if method.lean is not None and s.timed_cap and largest >= 1:  # the timed batch's schedule, here too
        build("meta", min(largest, s.timed_cap))
    row = BenchRow(
        method=name, label=method.label, mode=method.mode,
        runtime="lean" if method.lean else ("stock+checkpoint" if method.checkpoint else "stock"),
        lean=None if method.lean is None else dataclasses.asdict(method.lean),
        hidden={str(k): v for k, v in sorted(method.hidden.items())},
        trainable_params=count_trainable(meta),
        paper_bytes=paper_bytes, runtime_bytes=runtime_bytes, measured_bytes=measured_bytes,
        images_per_s=0.0, step_seconds=[],
        largest_batch=largest, largest_batch_source=source,
        largest_batch_bytes=seen.get(largest), next_batch_bytes=seen.get(largest + 1),
        largest_batch_measured_bytes=verify, note=note,
        reserved_bytes=at_size.reserved_bytes,
        tensor_bytes=at_size.tensor_bytes if at_size.allocated_bytes is not None else None,
        step_ops=at_size.ops.total, forward_ops=at_size.ops.forward, unstreamed=method.unstreamed,
    )
    return row, method, fitted


