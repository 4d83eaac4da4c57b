"""The training step captured as CUDA graphs and replayed (``train.cuda_graph``, on by default;
``edgetl finetune --eager`` turns it off).

An eager step launches every op from Python: thousands of kernel launches per step for the
lean runtime (see docs/lean-runtime.md), which on a Jetson's Cortex-A78AE cost more than the
kernels. A CUDA graph records the launches once and replays them as one. ``CapturedStep`` records
the whole of ``edgetl.step.training_step`` (forward, loss, backward, optimizer step, the
gradients freed) on static input and label buffers:

* The first ``warmup`` steps run eagerly on a side stream (PyTorch's recipe: cuBLAS and cuDNN
  handles, the optimizer's state, autograd's streams exist before capture); then the cached
  blocks those eager steps left are handed back (``empty_cache``), so what the run reserves is
  the weights and optimizer state, the static buffers, and the graphs' one memory pool.
* Every later batch is copied into the static buffers and the graph replayed; a batch size's
  first batch runs eagerly, its second is captured. A batch of another size (one with
  unreadable images left out; the loader drops an epoch's ragged last batch, or it is the only
  one, in a training set smaller than a batch) is captured into the same pool; there are at
  most as many graphs as batch sizes, and they never run at once.
* An eager step never runs beside the graphs: its blocks and the pool's would both be held,
  two steps' memory where a budget counts one. A new size's first batch frees the graphs and
  their pool first; each size is captured again when it next comes (a capture costs about one
  eager step, and new sizes are rare).
* The optimizer runs with tensors where a graph needs them: Adam ``capturable`` (its step
  counts on the device), and each group's learning rate a device tensor that the schedule
  fills in place between replays (Adam; SGD with ``optim.fused``). SGD's other kernels read the rate on
  the host, so an SGD run whose rate changes is not captured (``why_eager`` says so).
* The warm-up's later steps run with PyTorch's sync debug mode set to warn: a step that
  synchronizes with the host (a hook that reads a loss, ``.item()``, a copy to the host, in the
  forward or in the backward) would invalidate any capture, so such a step is never captured;
  the run goes on eagerly and the summary names the synchronizing call. No capture is begun
  that is known to fail: a failed capture can leave PyTorch's RNG and allocator in capture
  state on some versions.
* A capture that fails anyway (something the debug mode does not see, or the pool finds no
  memory) frees the graphs, logs a warning, and the run goes on eagerly from that batch, which
  it trains; the summary says what failed and where.
* The checkpoint's optimizer state is written as an eager run's (rates as numbers,
  ``capturable`` off): a run may resume either way.

``why_eager`` is the one place that decides whether a run can be captured; ``fit`` logs its
reason and records ``train.cuda_graph: false`` in recipe.yaml when it cannot.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgetl.errors import one_line
from edgetl.recipe import Recipe
from edgetl.step import Step

log = logging.getLogger("edgetl.train")

WARMUP_STEPS = 3  # eager steps before the first capture (PyTorch's whole-network example uses 3)


def why_eager(recipe: Recipe, device: torch.device, *, world: int = 1, scaler=None,
              teacher: nn.Module | None = None, model: nn.Module | None = None) -> str | None:
    """Why this run's step cannot be captured as a CUDA graph; None when it can.

    The run asked for graphs (``train.cuda_graph``) and the step has no host synchronisation:
    a CUDA device, one process (DDP's all-reduce hooks run beside backward), no fp16 loss
    scaling (the scaler reads its inf check on the host), no teacher, no BN that counts its
    batches on the host, no compressed storage whose transform comes from the host, and an
    optimizer that takes its learning rate as a device tensor where the schedule changes it.
    """
    o = recipe.optim
    if not recipe.train.cuda_graph:
        return "train.cuda_graph is off (--eager, or a plan whose step runs eagerly)"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this run is on {device.type}"
    if world > 1:
        return f"{world} processes under DDP run the step eagerly"
    if scaler is not None:
        return "fp16 loss scaling reads its inf check on the host every step (use model.precision bf16)"
    if teacher is not None:
        return "distillation runs the teacher eagerly"
    held = uncapturable(model) if model is not None else None
    if held is not None:
        return held
    if o.name == "sgd" and not o.fused and rate_changes(recipe):
        return ("SGD's unfused update reads a changing learning rate on the host "
                "(set optim.fused: true, or a constant schedule without warmup)")
    return None


def uncapturable(model: nn.Module) -> str | None:
    """What in ``model`` reads the host inside the step (``why_eager``'s rules on the network
    alone; the bench asks it before capturing a row): a BN that averages its batch statistics
    cumulatively, or compressed storage whose transform matrices come from host memory."""
    cumulative = [n for n, m in model.named_modules()
                  if getattr(m, "momentum", 0.0) is None and getattr(m, "num_batches_tracked", None) is not None]
    if cumulative:
        return (f"{cumulative[0]} averages its batch statistics cumulatively (momentum None), reading its "
                "batch count on the host")
    transformed = [(n, m.compressor.name) for n, m in model.named_modules()
                   if getattr(getattr(m, "compressor", None), "transforms", False)]
    if transformed:
        name, kind = transformed[0]
        return (f"{name} stores its input through the {kind} transform, whose matrices are copied from the "
                "host at every call (storage threshold has none)")
    return None


def rate_changes(recipe: Recipe) -> bool:
    """Whether the schedule changes the learning rate during the run (warmup or cosine)."""
    return recipe.optim.schedule != "constant" or recipe.optim.warmup_epochs > 0


def capture_error(exc: BaseException) -> str:
    """A failed capture's error in one line. Where the step raised inside the capture, torch's
    graph context still ends the capture on the way out, and the error that ending raises
    replaces the step's own (kept as its ``__context__``): the first error of the chain comes
    first, the one that ended the capture after it."""
    first, seen = exc, {id(exc)}
    while first.__context__ is not None and id(first.__context__) not in seen:
        first = first.__context__
        seen.add(id(first))
    if first is exc:
        return one_line(exc)
    return f"{one_line(first)} (then, ending the capture: {one_line(exc, limit=100)})"


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device, tensor_lr: bool) -> None:
    """Set ``optimizer`` up to be captured: Adam ``capturable`` with its step counts on the
    device (a resumed state's CPU counts moved there), and with ``tensor_lr`` each group's
    learning rate a 0-d device tensor, filled in place by the schedule (a float rate would be
    frozen into the graph)."""
    for group in optimizer.param_groups:
        if "capturable" in group:  # Adam, fused or not (fused keeps its step counts on the device anyway)
            group["capturable"] = True
        if tensor_lr and not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    for p, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(p.device, torch.float32)


def eager_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` as an eager run writes it: learning rates as numbers and
    ``capturable`` off, so a captured run's checkpoint resumes eagerly, on any device."""
    state = optimizer.state_dict()
    groups = []
    for group in state["param_groups"]:
        group = dict(group)
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False
        groups.append(group)
    return {**state, "param_groups": groups}


def graph_autocast(autocast: Callable) -> Callable:
    """The loop's autocast factory without autocast's weight-cast cache, which must not outlive
    a captured region."""
    probe = autocast()
    if isinstance(probe, torch.autocast):
        return lambda: torch.autocast(probe.device, dtype=probe.fast_dtype, cache_enabled=False)
    return autocast


@dataclass
class _Graph:
    """One captured step: its graph, the static buffers it reads and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    images: torch.Tensor
    labels: torch.Tensor
    loss: torch.Tensor
    correct: torch.Tensor


def host_batch(images: torch.Tensor, layout: torch.memory_format, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """A host batch as the device takes it: in ``layout`` and (where given) ``dtype``, changed on
    the host in one copy, into pinned memory where the batch was pinned (the loader's, on CUDA);
    itself where it is both already. A copy to the device that changed either would go through
    temporaries (PyTorch's ``copy_kernel_cuda``): another layout through a plain copy on the
    device, a second batch there; another dtype through a cast on the host into pageable memory,
    whose ``non_blocking`` transfer waits for the stream and overlaps nothing."""
    dtype = images.dtype if dtype is None else dtype
    if images.dtype == dtype and images.is_contiguous(memory_format=layout):
        return images
    return torch.empty_like(images, dtype=dtype, memory_format=layout, pin_memory=images.is_pinned()).copy_(images)


class CapturedStep:
    """``run_step`` (``edgetl.step.training_step``) on ``net``, captured once per batch size and
    replayed; called with a batch as the loader gives it (host memory), it copies the batch into
    the static buffers (the one copy on the device) and returns (loss, correct) as the eager step
    does, as tensors the next call overwrites (read them before it).

    Args:
        run_step: the eager step (called as ``run_step(net, step, optimizer, images, labels,
            autocast=...)``).
        net, step, optimizer: what it trains; ``optimizer`` is made capturable here.
        device: the CUDA device.
        dtype: the dtype the network takes its images in (``edgetl.train.input_dtype``); the
            static buffer keeps the loader's dtype and the graph converts, as the eager step does.
        memory_format: the layout it takes them in (``edgetl.train.input_memory_format``): a
            channels-last batch is converted on the host, so the device (and the static buffer)
            holds it once, in that layout.
        autocast: the loop's autocast factory (mixed precision), or None.
        tensor_lr: whether the learning rate becomes a device tensor (``rate_changes``).
        warmup: eager steps before the first capture. A batch size's first batch also runs
            eagerly (cuDNN and the lean layers meet its shapes outside a capture), and is
            captured the next time that size comes.

    ``release()`` frees the graphs; ``fit`` calls it when the loop ends, however it ends.
    """

    def __init__(self, run_step: Callable, net: nn.Module, step: Step, optimizer: torch.optim.Optimizer,
                 device: torch.device, *, dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format, autocast: Callable | None = None,
                 tensor_lr: bool = True, warmup: int = WARMUP_STEPS) -> None:
        self.run_step, self.net, self.step, self.optimizer = run_step, net, step, optimizer
        self.device, self.dtype, self.memory_format = device, dtype, memory_format
        self.autocast = graph_autocast(autocast) if autocast is not None else None
        self.warmup = warmup
        self.eager_steps = 0
        self.seen: set[tuple] = set()  # batch shapes that have run eagerly once
        self.graphs: dict[tuple, _Graph] = {}
        self.sizes: list[int] = []  # the batch sizes captured, in order (kept after release)
        self.captures = 0  # captures made (a size is captured again after its graph was dropped)
        self.dropped = 0  # times the graphs were dropped for a new batch size's eager step
        # host seconds of each capture (recording the step and instantiating the graph): what a
        # graph of a streamed step's thousands of kernels costs once (scripts/gpu_check.py)
        self.capture_seconds: list[float] = []
        self.pool = None
        self.failed: str | None = None  # why a capture failed: every later step runs eagerly
        self.failed_at = 0  # the batch size whose capture failed
        self.never_captured = False  # failed found by the warm-up's sync check: no capture was begun
        # one side stream for every eager step and every capture: cuBLAS keeps a workspace per
        # handle and stream, so a capture on a stream of its own would add one for this thread
        # and one for autograd's (8 MiB + 128 KiB each on a Jetson) inside the graph's pool; and
        # captures on different streams share no memory through a shared pool
        self.side = None
        make_capturable(optimizer, device, tensor_lr)

    def describe(self) -> str:
        """What ran, for the run's summary."""
        if self.failed is not None and self.never_captured:
            return (f"CUDA graph: not captured ({self.failed}, found at batch {self.failed_at} in the warm-up); "
                    f"the step ran eagerly ({self.eager_steps} eager step(s))")
        if self.failed is not None:
            return (f"CUDA graph: the capture at batch {self.failed_at} failed ({self.failed}); the step ran "
                    f"eagerly from then on ({self.eager_steps} eager step(s), {len(self.sizes)} graph(s) replayed "
                    "before)")
        sizes = ", ".join(str(n) for n in sorted(self.sizes, reverse=True)) or "none"
        again = (f"; {self.captures} captures: the graphs were released {self.dropped} time(s) to run a new "
                 "batch size's first batch eagerly" if self.captures > len(self.sizes) else "")
        return (f"CUDA graph: {self.eager_steps} eager step(s) (warm-up, and each batch size's first), then "
                f"{len(self.sizes)} graph(s) captured and replayed (batch sizes {sizes}){again}")

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = host_batch(images, self.memory_format)  # its dtype kept: the graph casts it
        key = (tuple(images.shape), images.dtype, tuple(labels.shape), labels.dtype)
        with torch.cuda.device(self.device):
            if self.failed is not None:
                return self._eager(images, labels)
            g = self.graphs.get(key)
            if g is None and (self.eager_steps < self.warmup or key not in self.seen):
                self.seen.add(key)
                if self.graphs:  # an eager step never runs beside the graphs' pool: the run's
                    self._drop_graphs()  # memory stays that of one step, eager or captured
                return self._eager(images, labels)
            if g is None:
                g = self._capture_or_give_up(images, labels, key)
                if g is None:  # trained eagerly, out of the failed capture's exception handler
                    return self._eager(images, labels)
            g.images.copy_(images, non_blocking=True)
            g.labels.copy_(labels, non_blocking=True)
            g.graph.replay()
            return g.loss, g.correct

    def _input(self, images: torch.Tensor) -> torch.Tensor:
        """The batch in the network's dtype and layout (itself where it has both)."""
        return images.to(self.dtype, memory_format=self.memory_format)

    def _eager(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager step on a side stream, the batch (as the loader gives it) copied to the device
        first; after the warm-up's last, and after a new batch size's, the blocks the eager steps
        cached go back (the graphs' pool takes their place)."""
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        main, side = torch.cuda.current_stream(self.device), self.side
        side.wait_stream(main)
        # the warm-up's later steps (the first makes handles and state) are what the capture records
        check = self.failed is None and 1 <= self.eager_steps < self.warmup
        with torch.cuda.stream(side), _host_syncs(check) as syncs:
            loss, correct = self.run_step(self.net, self.step, self.optimizer, self._input(images), labels,
                                          autocast=self.autocast)
        main.wait_stream(side)
        self.eager_steps += 1
        if syncs:
            self.failed = f"the step synchronizes with the host, which no capture allows: {syncs[0]}"
            self.failed_at, self.never_captured = int(images.shape[0]), True
            log.warning("the training step is not captured as a CUDA graph (%s); it runs eagerly", self.failed)
        if self.eager_steps >= self.warmup and self.failed is None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return loss, correct

    def _capture(self, images: torch.Tensor, labels: torch.Tensor) -> _Graph:
        """Capture the step on static copies of ``images`` and ``labels`` into the shared pool.

        Capturing records the step without running it; ``__call__`` replays it at once. The
        capture checks only this thread's CUDA calls (``thread_local``): the loader's pinning
        thread goes on calling CUDA meanwhile."""
        # copies, never the caller's own tensors (a batch already on the device would be aliased)
        static_images, static_labels = images.to(self.device, copy=True), labels.to(self.device, copy=True)
        for p in self.net.parameters():  # backward allocates the gradients inside the graph
            p.grad = None
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        gc.collect()  # nothing freed by the collector while the capture runs
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        start = time.perf_counter()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.side, capture_error_mode="thread_local"):
                loss, correct = self.run_step(self.net, self.step, self.optimizer, self._input(static_images),
                                              static_labels, autocast=self.autocast)
        except BaseException:
            # torch < 2.6 ends the capture before it leaves the side stream: a failed end would
            # leave this thread on it
            torch.cuda.set_stream(main)
            raise
        self.capture_seconds.append(time.perf_counter() - start)
        if self.pool is None:
            self.pool = graph.pool()
        self.captures += 1
        if images.shape[0] not in self.sizes:
            self.sizes.append(images.shape[0])
        log.info("captured the training step as a CUDA graph at batch %d", images.shape[0])
        return _Graph(graph, static_images, static_labels, loss, correct)

    def _capture_or_give_up(self, images: torch.Tensor, labels: torch.Tensor, key: tuple) -> _Graph | None:
        """The batch's graph, captured; None where the capture failed (``_give_up``). The give-up
        runs after the handler: the exception's traceback holds the failed capture's frames, and
        with them its tensors in the graph's pool, until the handler ends."""
        try:
            g = self.graphs[key] = self._capture(images, labels)
            return g
        except Exception as exc:  # noqa: BLE001 - the run goes on eagerly; the summary says why
            why = capture_error(exc)
        self._give_up(why, int(images.shape[0]))
        return None

    def _give_up(self, why: str, batch: int) -> None:
        """A capture failed (the step reads the host somewhere ``why_eager`` does not know, or the
        graph's pool found no memory): the graphs go, and every later step runs eagerly, on a new
        side stream (an allocator left in the failed capture's pool on the old one keeps no eager
        block there). Nothing of the failed capture ran, so the batch is trained eagerly next,
        and the run loses no step."""
        self.failed = why
        self.failed_at = batch
        self.side = None
        log.warning("capturing the training step as a CUDA graph at batch %d failed (%s); the step runs "
                    "eagerly from here on", batch, self.failed)
        self.release()
        torch.cuda.synchronize(self.device)
        try:
            torch.cuda.empty_cache()
        except RuntimeError as exc:  # a failed capture some PyTorch versions leave under way
            log.warning("the failed capture's memory pool could not be released (%s)", one_line(exc))

    def _drop_graphs(self) -> None:
        """Free the graphs, their pool and static buffers and hand the pool's segments back,
        before a new batch size's eager step; each size is captured again when it next comes."""
        n = len(self.graphs)
        self.release()
        torch.cuda.empty_cache()
        self.dropped += 1
        log.info("released %d CUDA graph(s) to run a new batch size's first batch eagerly", n)

    def release(self) -> None:
        """Free the graphs and their pool (after the device has finished with them)."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
            for g in self.graphs.values():
                g.graph.reset()
        self.graphs.clear()
        self.pool = None


class _host_syncs:
    """A context in which CUDA operations of this step that synchronize with the host are
    recorded (PyTorch's sync debug mode set to warn, its warnings caught): the list of their
    messages with the Python line that made them, empty when none did. The step's own are
    this thread's and the backward's (autograd runs a CUDA backward, and the Python of its
    Functions and hooks, on a device thread: there it is inside a graph task); another thread's
    (the loader's pinning thread) and every other warning are shown as they would have been.
    Does nothing when ``enabled`` is false; the mode is put back as it was."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.found: list[str] = []

    def __enter__(self) -> list[str]:
        if self.enabled:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")  # first: if it fails, nothing else was changed
            self._caught = warnings.catch_warnings()
            self._caught.__enter__()
            warnings.filterwarnings("always", message=self.MESSAGE)  # each one, not once per line
            shown, owner = warnings.showwarning, threading.get_ident()

            def show(message, category, filename, lineno, file=None, line=None):
                ours = threading.get_ident() == owner or torch._C._current_graph_task_id() != -1
                if ours and self.MESSAGE in str(message):
                    self.found.append(f"{message} ({filename}:{lineno})")
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
        return self.found

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._caught.__exit__(*exc)  # showwarning and the filters as they were
            torch.cuda.set_sync_debug_mode(self._mode)
