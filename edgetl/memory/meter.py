"""Measured memory (DESIGN 2c): a network and a training setup in, peak live tensor bytes out.

On CPU and meta, ``StorageMeter`` is a ``TorchDispatchMode`` that sees every aten op
(forward, autograd's backward formulas, optimizer) and tracks each output's
``untyped_storage()`` in a weak dictionary; a weak reference's callback subtracts the bytes
when the storage dies. Storages are counted once, so views and in-place results cost
nothing extra. Tensors that exist before the meter starts (params, buffers, the input
batch) are registered explicitly. The peak is sampled after every op, when the op's
inputs and outputs are both alive; allocations internal to one kernel (scratch space
that never becomes a tensor) are not seen, by definition of "live tensor storage".

On CUDA (DESIGN 2d) the device loses more than live tensor bytes: ``measure_training_memory``
reports the caching allocator's ``max_memory_allocated`` (blocks rounded to 512 B, library
workspaces) and ``max_memory_reserved`` (whole segments, cached free blocks) beside the
storage meter's tensor peak, run over the same steps; ``measure_training_peak`` returns the
allocated peak there. With ``record_trace`` the meter also keeps the order of allocations
and frees, which ``edgetl.memory.cuda.replay_trace`` turns into the allocator's figures.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from edgetl.errors import ConfigError
from edgetl.metaop import meta_call, tensors_in
from edgetl.step import Step, ddp_wrap, resolve_step, set_train_mode, training_step

log = logging.getLogger(__name__)



class StorageMeter(TorchDispatchMode):
    """Current and peak bytes of live tensor storage, one count per storage.

    Use as a context manager; register tensors that already exist with ``register``
    (``register_module`` for params and buffers). ``current_bytes`` and ``peak_bytes``
    are updated after every op; ``reset_peak`` restarts the peak at the current value.
    """

    def __init__(self, *, record_trace: bool = False) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        # id(storage) -> a weak reference whose callback counts the storage's death: a plain
        # weakref.ref (a weakref.finalize, which also registers for interpreter exit, took
        # 11 us a storage against 0.2 us, on every tensor a meta measurement makes)
        self._finalizers: dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.op_count = 0  # aten ops seen
        # ("alloc", key, nbytes) / ("free", key) / ("op", aten op name, in backward, bias gemm) /
        # ("reset",) / ("step", i) (training step i starts) / ("input", key...) (the batch's
        # storages, allocated above), in order; a key is unique for the life of its storage (ids
        # are reused only after a free). "in backward": autograd's engine ran the op (on CUDA, its device thread);
        # "bias gemm": an addmm of a 1-D bias and two matrices of more than one row and column
        # (what CUDA runs through cuBLASLt's bias epilogue)
        self.trace: list[tuple] | None = [] if record_trace else None

    def register(self, *tensors) -> None:
        """Count the storage of every tensor in ``tensors`` (nested containers allowed)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def register_module(self, module: nn.Module) -> None:
        """Count params, their existing grads, and buffers of ``module``."""
        for p in module.parameters():
            self._track(p)
            if p.grad is not None:
                self._track(p.grad)
        for b in module.buffers():
            self._track(b)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        if self.trace is not None:
            self.trace.append(("reset",))

    @property
    def live_storages(self) -> int:
        return len(self._sizes)

    def live_keys(self) -> frozenset[int]:
        """The keys of the storages alive now (the keys the trace names)."""
        return frozenset(self._sizes)

    def _track(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = nbytes
            self.current_bytes += nbytes
            self._finalizers[key] = weakref.ref(storage, functools.partial(self._died, key))
            if self.trace is not None:
                self.trace.append(("alloc", key, nbytes))
        elif old != nbytes:  # resized in place (out= ops, resize_)
            self._sizes[key] = nbytes
            self.current_bytes += nbytes - old
            if self.trace is not None:
                self.trace += [("free", key), ("alloc", key, nbytes)]

    def _died(self, key: int, ref: weakref.ref) -> None:
        if self._finalizers.get(key) is not ref:  # (closed, or the key's storage counted again since)
            return
        if key in self._sizes and self.trace is not None:
            self.trace.append(("free", key))
        self.current_bytes -= self._sizes.pop(key, 0)
        self._finalizers.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = meta_call(func, args, kwargs or {})
        self.op_count += 1
        if type(out) is torch.Tensor:
            self._track(out)
        else:
            for t in tensors_in(out):
                self._track(t)
        # in-place ops that resize an argument (e.g. out=) show up in the args
        mutable = _MUTABLE.get(func)
        if mutable is None:
            mutable = _MUTABLE[func] = func._schema.is_mutable
        if mutable:
            for t in tensors_in((args, kwargs)):
                if id(t.untyped_storage()) in self._sizes:
                    self._track(t)
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        if self.trace is not None:
            name = func._schema.name.split("::")[-1]
            self.trace.append(("op", name, _in_backward(), _bias_gemm(name, args, kwargs)))
        return out

    def close(self) -> None:
        """Drop the weak references; the meter's counts stop changing."""
        self._finalizers.clear()


_MUTABLE: dict = {}  # op -> whether its schema writes an argument


_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _in_backward() -> bool:
    """Whether autograd's engine is running this op (a backward pass is under way)."""
    return _graph_task_id() != -1


def _bias_gemm(name: str, args: tuple, kwargs: dict | None) -> bool:
    """An ``addmm``/``_addmm_activation`` of a 1-D bias, beta 1, and two matrices each of more
    than one row and column: the shapes CUDA's addmm hands to cuBLASLt with a bias epilogue."""
    if name not in ("addmm", "_addmm_activation") or len(args) < 3:
        return False
    bias, a, b = args[:3]
    beta = (kwargs or {}).get("beta", args[3] if len(args) > 3 else 1)
    return (isinstance(bias, torch.Tensor) and bias.dim() == 1 and beta == 1
            and a.dim() == 2 and b.dim() == 2 and min(a.shape[0], b.shape[0], b.shape[1]) > 1)


def _training_steps(net, step: Step, opt, image, labels, steps: int, meter: StorageMeter,
                    counted: nn.Module) -> StepOps | None:
    """``steps`` training steps under ``meter``; the aten ops of the second (once optimizer
    state exists) as ``meter`` counts them, split as ``count_step_ops`` splits them at
    ``counted``'s forward (the network inside ``net``)."""
    ops = None
    for i in range(steps):
        if meter.trace is not None:  # where each step starts (edgetl.memory.cuda.replay_captured)
            meter.trace.append(("step", i))
        if i == 1:
            ops = _counted_step(counted, opt, lambda: training_step(net, step, opt, image, labels), meter)
        else:
            training_step(net, step, opt, image, labels)
    return ops


@dataclass
class MeasuredMemory:
    """Peaks over real training steps (bytes). CUDA fields are None on other devices.

    Attributes:
        device: where the steps ran.
        tensor_bytes: peak of live tensor storage (the storage meter; DESIGN 2c), any device.
        allocated_bytes: CUDA: ``max_memory_allocated`` over the steps less ``other_bytes``
            (rounded blocks, unsplit large blocks, cuBLAS/cuDNN workspaces included).
        reserved_bytes: CUDA: ``max_memory_reserved`` over the steps (what the device loses,
            the CUDA context aside); it includes segments shared with ``other_bytes``.
        other_bytes: CUDA: allocated bytes live before the steps that are neither the
            network's nor the batch's (other tensors of this process), left out of
            ``allocated_bytes``.
        trace: the storage trace when asked for (``StorageMeter.trace``).
        ops: the aten ops the second step dispatched on the device (``StepOps``); None with
            one step.
    """

    device: str
    tensor_bytes: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    other_bytes: int = 0
    trace: list[tuple] | None = field(default=None, repr=False)
    ops: StepOps | None = None

    @property
    def peak_bytes(self) -> int:
        """What the device loses to tensors: the allocated peak on CUDA, the tensor peak elsewhere."""
        return self.allocated_bytes if self.allocated_bytes is not None else self.tensor_bytes


def random_batch(net: nn.Module, *, resolution: int, batch_size: int, seed: int, device: torch.device | str,
                 num_classes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The random batch and labels a measured step trains on, drawn from ``seed`` on the CPU: the
    image in ``net.input_dtype`` when the network has one (lean bf16/fp16 runtime; uint8: the
    same draw as raw pixels), else fp32, and labels below ``num_classes`` (default: the net's)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    image = torch.randn(batch_size, 3, resolution, resolution, generator=gen)
    dtype = getattr(net, "input_dtype", torch.float32)
    if dtype == torch.uint8:  # raw images (LeanOptions.uint8_input): the same draw, as pixels
        image = image.mul_(64).add_(128).clamp_(0, 255)
    image = image.to(device, dtype, memory_format=getattr(net, "input_memory_format", torch.contiguous_format))
    classes = _num_classes(net) if num_classes is None else num_classes
    labels = torch.randint(0, classes, (batch_size,), generator=gen).to(device)
    return image, labels


def measure_training_memory(
    net: nn.Module,
    *,
    resolution: int,
    batch_size: int,
    steps: int = 3,
    optimizer: str | None = None,
    lr: float = 1e-3,
    step: Step | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    record_trace: bool = False,
    capturable: bool = False,
) -> MeasuredMemory:
    """Peak memory over ``steps`` real training steps of ``net``: tensors, and on CUDA the allocator.

    Each step is ``edgetl.step.training_step`` of ``step`` on a random batch and random
    labels: the loss, optimizer (groups, weight decay, foreach) and train mode that
    ``edgetl.train.fit`` runs. Everything is included: params, buffers, grads, optimizer
    state, the input batch and labels, saved activations and temporaries. The network is
    put in the step's train mode and its weights change. The batch is built in
    ``net.input_dtype`` when the network has one (lean bf16/fp16 runtime), else fp32.

    On CUDA the cuBLAS workspaces and the allocator's unused cached segments are released
    first, so the figures do not depend on what ran before in the process; the storage
    meter runs over the same steps.

    Args:
        net: an EdgeNet (or any image classifier) with trainability already set.
        resolution: input side in pixels.
        batch_size: images per step.
        steps: training steps; the peak usually comes in step 2, once optimizer state exists.
        optimizer, lr: shorthand for ``Step.plain(optimizer, lr)`` when no ``step`` is given
            ("adam" or "sgd", plain: no momentum, no weight decay).
        step: the training step (a recipe's: ``Step.from_recipe``); with ``ddp`` the net is
            wrapped in DistributedDataParallel (a process group must exist) as fit wraps it.
        device: where to run; default: the device of ``net``'s parameters.
        seed: seeds the random batch and labels.
        record_trace: keep the storage trace (for ``edgetl.memory.cuda.replay_trace``).
        capturable: run the optimizer as a CUDA-graph step does (``edgetl.train.graph.
            make_capturable``: Adam's step counts on the device), the trace
            ``edgetl.memory.cuda.replay_captured`` replays. CUDA only.
    """
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    param_device = next(net.parameters()).device
    device = torch.device(device) if device is not None else param_device
    if device != param_device:
        raise ConfigError(f"net is on {param_device}, asked to measure on {device}; move it first")
    num_classes = _num_classes(net)
    trainable = [p for p in net.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("nothing trains: no parameter requires grad")
    step = resolve_step(step, optimizer, lr)
    opt = step.optimizer(net)
    if capturable:
        if device.type != "cuda":
            raise ConfigError(f"a capturable optimizer runs on CUDA; asked to measure on {device}")
        from edgetl.train.graph import make_capturable

        make_capturable(opt, device, tensor_lr=False)
    set_train_mode(net, step.bn)
    image, labels = random_batch(net, resolution=resolution, batch_size=batch_size, seed=seed, device=device,
                                 num_classes=num_classes)
    for p in trainable:
        p.grad = None

    meter = StorageMeter(record_trace=record_trace)
    meter.register_module(net)
    meter.register(image, labels)
    if meter.trace is not None:  # the step's input: what a captured step keeps in static buffers
        meter.trace.append(("input", *(id(t.untyped_storage()) for t in (image, labels))))
    cuda = device.type == "cuda"
    other = 0
    if cuda:
        other = _prepare_cuda(device, net, image, labels)
    try:
        with meter:
            # under DDP the wrap allocates the gradient buckets: inside the meter, as in fit
            run = ddp_wrap(net, step, device) if step.ddp else net
            ops = _training_steps(run, step, opt, image, labels, steps, meter, counted=net)
    finally:
        meter.close()
    result = MeasuredMemory(str(device), meter.peak_bytes, other_bytes=other, trace=meter.trace, ops=ops)
    if cuda:
        torch.cuda.synchronize(device)
        result.allocated_bytes = int(torch.cuda.max_memory_allocated(device)) - other
        result.reserved_bytes = int(torch.cuda.max_memory_reserved(device))
    log.debug("measured %s over %d steps", result, steps)
    return result


@dataclass(frozen=True)
class StepOps:
    """Aten ops one training step dispatches: in the network's forward, from there to the
    optimizer (loss, hit count, backward), and in the optimizer's step and ``zero_grad``.

    Every dispatched op counts in ``forward``/``backward``/``optimizer`` (what the storage
    meter sees, so the two counts agree). Not every one is a kernel launch on a GPU: views
    (``view``, ``slice``, ``expand``, ``detach``...) only write a tensor's metadata, ``empty``
    only takes a block from the caching allocator, and the profiler's record ops launch
    nothing. ``kernels`` counts the rest, the ops that launch work on the device (forward,
    backward, optimizer); None where only the total was counted (the storage meter's).
    """

    forward: int
    backward: int
    optimizer: int
    kernels: tuple[int, int, int] | None = None

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.optimizer

    @property
    def kernel_total(self) -> int | None:
        return None if self.kernels is None else sum(self.kernels)


# ops that dispatch but launch no kernel: fresh allocations (the caching allocator's blocks),
# a reshape of a fresh tensor, the profiler's records; views are ``OpOverload.is_view``
_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                        "_record_function_enter", "_record_function_enter_new", "_record_function_exit"})


def launches_kernel(func) -> bool:
    """Whether an aten op launches work on the device (``StepOps.kernels``): not a view, an
    allocation or a profiler record."""
    return not (func.is_view or func.overloadpacket.__name__ in _NO_KERNEL)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.op_count = 0
        self.kernel_count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op_count += 1
        self.kernel_count += launches_kernel(func)
        return meta_call(func, args, kwargs or {})


def count_step_ops(net: nn.Module, *, resolution: int, batch_size: int, step: Step | None = None) -> StepOps:
    """The aten ops of one ``training_step`` of ``net`` as it is set up now (its schedule
    applied), counted on a meta copy: the step after the first, once optimizer state
    exists. ``net`` itself is not touched."""
    import dataclasses

    step = resolve_step(step)
    if step.optim.fused:  # fused kernels have no meta implementation: their ops are counted apart
        # (inside backward too: then "optimizer" is the per-parameter updates backward runs)
        plain = dataclasses.replace(step.optim, fused=False, step_in_backward=False)
        unfused = dataclasses.replace(step, optim=plain)
        ops = count_step_ops(net, resolution=resolution, batch_size=batch_size, step=unfused)
        update = _fused_update_ops(net, step)
        return StepOps(ops.forward, ops.backward, update.op_count,
                       (ops.kernels[0], ops.kernels[1], update.kernel_count))
    meta, opt, run = meta_step(net, resolution=resolution, batch_size=batch_size, step=step)
    counter = _OpCounter()
    with counter:
        return _counted_step(meta, opt, run, counter)


def meta_step(net: nn.Module, *, resolution: int, batch_size: int, step: Step | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], object]]:
    """A meta copy of ``net`` (as it is set up now), its optimizer with state (as after a
    first step) and a callable that runs one ``training_step`` of it on a meta batch: the
    step ``count_step_ops`` counts, for a caller that counts it another way. ``net`` itself
    is not touched; a fused optimizer has no meta implementation."""
    import copy

    step = resolve_step(step)
    meta = copy.deepcopy(net).to("meta")
    opt = step.optimizer(meta)
    set_train_mode(meta, step.bn)
    image = torch.empty(batch_size, 3, resolution, resolution, device="meta",
                        dtype=getattr(meta, "input_dtype", torch.float32),
                        memory_format=getattr(meta, "input_memory_format", torch.contiguous_format))
    labels = torch.zeros(batch_size, dtype=torch.int64, device="meta")
    if step.in_backward:  # the state is created inside backward: a whole first step
        training_step(meta, step, opt, image, labels)
    else:  # the optimizer's state, created by a step of zero gradients (no forward or backward)
        for p in meta.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=not step.ddp)
    return meta, opt, lambda: training_step(meta, step, opt, image, labels)


def _counted_step(net: nn.Module, opt, run: Callable[[], object], counter: StorageMeter | _OpCounter) -> StepOps:
    """The aten ops ``run`` (one training step of ``net`` with ``opt``) dispatches, split at
    ``net``'s forward and at ``opt``'s step, as ``counter`` (a dispatch mode the caller has
    entered: the storage meter, or an op counter) counts them."""
    marks: dict[str, tuple[int, int | None]] = {}

    def counts() -> tuple[int, int | None]:
        return counter.op_count, getattr(counter, "kernel_count", None)

    hooks = [net.register_forward_pre_hook(lambda *a: marks.__setitem__("start", counts())),
             net.register_forward_hook(lambda *a: marks.__setitem__("forward", counts())),
             opt.register_step_pre_hook(lambda *a: marks.__setitem__("backward", counts()))]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    (s, ks), (f, kf), (b, kb), (e, ke) = marks["start"], marks["forward"], marks["backward"], counts()
    return StepOps(f - s, b - f, e - b, None if ks is None else (kf - ks, kb - kf, ke - kb))


def _fused_update_ops(net: nn.Module, step: Step) -> "_OpCounter":
    """The aten ops (and kernels) of a fused optimizer's steady update (the second), run on CPU zeros shaped
    like ``net``'s trainable parameters in the step's groups; with ``step_in_backward`` one
    update per parameter, as its hook runs them."""
    optimizer, stand = step.stand_in_optimizer(net)  # CPU zeros: the step is fused
    params = list(stand.values())
    counter = _OpCounter()
    for round_ in range(2):
        batches = [[p] for p in params] if step.in_backward else [params]
        for batch in batches:
            for p in batch:
                p.grad = torch.zeros_like(p)
            if round_:
                with counter:
                    optimizer.step()
            else:
                optimizer.step()
            for p in batch:
                p.grad = None
    return counter


def _prepare_cuda(device: torch.device, net: nn.Module, *tensors: torch.Tensor) -> int:
    """Release what earlier work left cached, reset the peaks; returns the foreign allocated bytes."""
    from edgetl.memory.cuda import round_block

    if device.index is None:  # "cuda" names the current device; its tensors say "cuda:0" (never equal)
        device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # a workspace kept from earlier work would hide the one these steps need
        clear()
    torch.cuda.empty_cache()
    storages: dict[int, int] = {}
    for t in [*net.parameters(), *net.buffers(), *tensors]:
        if t.device == device and t.layout == torch.strided:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    ours = sum(round_block(n) for n in storages.values())
    torch.cuda.reset_peak_memory_stats(device)
    return max(0, int(torch.cuda.memory_allocated(device)) - ours)


def measure_training_peak(net: nn.Module, **kwargs) -> int:
    """Peak bytes over real training steps: ``measure_training_memory(...).peak_bytes``.

    Live tensor storage on CPU/meta; on CUDA the allocator's allocated peak (the reserved
    peak is in ``measure_training_memory``).
    """
    return measure_training_memory(net, **kwargs).peak_bytes


def _num_classes(net: nn.Module) -> int:
    spec = getattr(net, "spec", None)
    if spec is not None and getattr(spec, "num_classes", None):
        return int(spec.num_classes)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("cannot tell the number of classes: no spec and no nn.Linear")
    return linears[-1].out_features
