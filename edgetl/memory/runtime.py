"""Runtime accounting (DESIGN 2b): a built network in, what a training step really holds out.

An analytic model, not a measurement: the network is traced once on the meta device
(``edgetl.memory.trace`` for the leaves, plus a data-flow pass here that records which
tensor each op reads and writes), then a training step is *simulated* storage by
storage with per-layer rules saying what autograd keeps:

* static: params and buffers in their dtype, the input batch and labels, optimizer
  state (Adam: 2x trainable bytes + one fp32 step scalar per trainable tensor), and the
  grads of trainable params once backward produces them;
* forward: each op allocates its output (unless in-place or a view) and whatever it
  keeps for backward; a tensor stays alive while Python still refers to it (until its
  last use, or while a module it was passed to is still running — e.g. a residual
  block's input, a ConvBNReLU's input — or, in EdgeNet, the side module's input until
  the next tap) or while a saved-for-backward reference to its storage exists;
  storages are counted once, so views and in-place results are free;
* backward: ops run in reverse order (autograd's sequence-number order); each holds its
  grad_output, allocates grad_input (pass-through for add and views) and param grads,
  then releases its saved tensors; gradients reaching a tensor from two consumers
  (skips, side taps) are summed in place;
* optimizer step: Adam's ``denom`` needs two temporaries of the largest param.

Stock rules (torch 2.14, train mode), checked layer by layer against the meter in
tests/test_runtime_accounting.py: conv saves its input whenever its output needs grad
(frozen or not); BN saves its input plus save_mean/save_invstd (2 x C floats);
in-place ReLU6 (``hardtanh_``) saves a *clone* of its input; in-place ReLU saves its
result (no copy); linear saves its input only if its weight trains; AvgPool2d saves
its input; AdaptiveAvgPool2d to 1x1 is a ``mean`` and saves nothing; dropout saves a
mask as large as its input (input dtype); bilinear resize, add and flatten save nothing.

Lean-layer protocol: a leaf module may define

    def runtime_cost(self, *, in_shape, out_shape, act_bytes, in_bytes, input_requires_grad,
                     output_requires_grad) -> LayerCost

(``act_bytes``/``in_bytes``: element sizes of its output/input) returning a :class:`LayerCost` (what it keeps for backward, whether it is in-place,
forward and backward temporaries, whether its backward produces a grad_input). The rule
table consults this method first, so a frozen conv that saves nothing, a BN folded
into its conv, a ReLU6 that keeps a bit-packed mask, or a side conv that keeps its
input average-pooled by k plugs in without touching this file. ``saved_new_bytes`` is
for tensors the layer allocates and keeps (a packed mask, a pooled input); referenced
input or output storages are declared with ``saves_input`` / ``saves_output`` so a
storage shared with a neighbour is counted once. A leaf that returns the very tensor it
was given is taken as an identity (no op, no grad_fn) unless it has ``inplace = True``,
in which case it is an in-place op whose output shares its input's storage.
Temporaries are the *largest* extra a layer holds at any moment inside its forward
(beyond its output and ``saved_new_bytes``) or backward (beyond grad_input and its
param grads); the lean layers (edgetl.models.lean, lean_side) derive them from the
sequence of allocations their code makes, checked against the meter in
tests/test_lean_runtime.py. A leaf whose parameters are registered elsewhere (the lean
side tail) lists them with ``runtime_parameters()``. The input batch is built in
``net.input_dtype`` when the network has one (the lean runtime feeds bf16/fp16 batches);
a pass-through gradient (add, view) whose input has another dtype is a new cast buffer.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from edgetl.errors import CapabilityError, ConfigError
from edgetl.memory.cost import LayerCost, numel as _numel
from edgetl.memory.paper import sensitive
from edgetl.memory.report import BlockMemory, MemoryReport
from edgetl.memory.trace import Leaf, trace_network
from edgetl.models.backbone import HEAD_BLOCK, EdgeNet
from edgetl.models.stream import mark_shapes_only
from edgetl.step import Step, loss_and_correct, resolve_step, set_train_mode

log = logging.getLogger(__name__)

LABEL_BYTES = 8  # int64 class indices
_DEBUG: list | None = None  # set to a list to record every simulated sample


def stock_cost(module: nn.Module, *, in_shape, out_shape, act_bytes: int,
               input_requires_grad: bool, output_requires_grad: bool,
               in_bytes: int | None = None) -> LayerCost:
    """The rule table for stock torch leaf modules (see the module docstring)."""
    nx = _numel(in_shape) * act_bytes
    grad = output_requires_grad
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return LayerCost(saves_input=grad)
    if isinstance(module, nn.Linear):
        return LayerCost(saves_input=grad and module.weight.requires_grad)
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)):
        if isinstance(module, nn.GroupNorm):
            stats = 2 * in_shape[0] * module.num_groups * 4
        else:
            stats = 2 * in_shape[1] * 4 if module.training else 0
        if grad:
            return LayerCost(saves_input=True, saved_new_bytes=stats)
        return LayerCost(forward_temp_bytes=stats)
    if isinstance(module, (nn.ReLU6, nn.Hardtanh)):
        if module.inplace:
            # hardtanh_'s formula needs the original input: autograd clones it first
            return LayerCost(inplace=True, saved_new_bytes=nx if grad else 0)
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.ReLU, nn.LeakyReLU)):
        if module.inplace:
            return LayerCost(inplace=True, saves_output=grad)
        return LayerCost(saves_output=grad) if isinstance(module, nn.ReLU) else LayerCost(saves_input=grad)
    if isinstance(module, (nn.Sigmoid, nn.Tanh)):
        return LayerCost(saves_output=grad)
    if isinstance(module, (nn.Hardswish, nn.SiLU, nn.GELU, nn.Hardsigmoid)):
        if getattr(module, "inplace", False):
            return LayerCost(inplace=True, saved_new_bytes=nx if grad else 0)
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        return LayerCost(saves_input=grad, saved_new_bytes=_numel(out_shape) * 8 if grad else 0)
    if isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        if all(int(s) == 1 for s in out_shape[2:]):
            return LayerCost()  # lowered to mean(): saves only sizes
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.Dropout, nn.Dropout2d, nn.Dropout1d)):
        if module.training and module.p > 0:
            mask = nx if not isinstance(module, (nn.Dropout1d, nn.Dropout2d)) else (
                _numel(in_shape[:2]) * act_bytes)
            return LayerCost(saved_new_bytes=mask) if grad else LayerCost(forward_temp_bytes=mask)
        return LayerCost(inplace=True, grad_input=False)
    if isinstance(module, (nn.Flatten, nn.Identity)):
        return LayerCost(inplace=True, grad_input=False)
    if isinstance(module, nn.Upsample) or type(module).__name__ == "Resize":
        return LayerCost()  # upsample_*_backward needs only sizes
    raise CapabilityError(
        f"the runtime accounting has no rule for the layer {type(module).__name__}: give it a "
        f"runtime_cost method (see edgetl.memory.runtime) or add a rule to stock_cost")


def layer_cost(module: nn.Module, **kwargs) -> LayerCost:
    """A leaf's own ``runtime_cost`` if it has one, else the stock rule table."""
    own = getattr(module, "runtime_cost", None)
    if callable(own):
        return own(**kwargs)
    return stock_cost(module, **kwargs)


def leaf_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters a leaf's backward produces grads for: its own, or ``runtime_parameters()``."""
    own = getattr(module, "runtime_parameters", None)
    if callable(own):
        return list(own())
    return list(module.parameters(recurse=False))


# ----------------------------------------------------------------------------- loss and optimizer


@dataclass(frozen=True)
class LossTrace:
    """The step's loss at one batch size, as the storage meter saw it run on meta.

    ``forward``: the events from the logits to (loss, hit count); ``backward``: the events
    of ``loss.backward()`` down to the logits' gradient. Events are the meter's
    ("alloc", key, bytes) / ("free", key) / ("op", name). ``logits``: the key of the logits
    (their free is Python dropping them); ``held``: keys alive between forward and backward
    (what the loss saved); ``grad``: the key of the logits' gradient; ``kept``: keys alive
    after backward besides it (the loss and the hit count, held until the step returns).
    """

    forward: tuple
    backward: tuple
    logits: int
    held: tuple
    grad: int
    kept: tuple


class _StandIn(torch.autograd.Function):
    """The network's output: a fresh storage in forward, its gradient passed on untouched."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


@functools.lru_cache(maxsize=64)
def _loss_trace(label_smoothing: float, batch_size: int, num_classes: int, dtype: torch.dtype) -> LossTrace:
    from edgetl.memory.meter import StorageMeter

    step = Step.plain(label_smoothing=label_smoothing)
    src = torch.empty(batch_size, num_classes, device="meta", dtype=dtype, requires_grad=True)
    labels = torch.empty(batch_size, device="meta", dtype=torch.int64)
    meter = StorageMeter(record_trace=True)
    meter.register(src, labels)
    try:
        with meter:
            start = len(meter.trace)
            logits = _StandIn.apply(src)
            key = id(logits.untyped_storage())
            loss, correct = loss_and_correct(step, logits, labels)
            del logits
            mid = len(meter.trace)
            live_mid = meter.live_keys()
            loss.backward()
            end = len(meter.trace)
            live_end = meter.live_keys()
            grad = id(src.grad.untyped_storage())
            kept = [id(t.untyped_storage()) for t in (loss, correct)]
    finally:
        meter.close()
    fwd, bwd = meter.trace[start:mid], meter.trace[mid:end]
    fwd = tuple(e for e in fwd if not (e[0] == "alloc" and e[1] == key))  # the logits exist already
    before = {id(t.untyped_storage()) for t in (src, labels)}
    held = tuple(k for k in live_mid - before if k not in kept)
    extra = live_end - before - {grad} - set(kept)
    if extra:
        raise RuntimeError(f"loss trace: {len(extra)} storages outlive backward unexpectedly")
    return LossTrace(fwd, bwd, key, held, grad, tuple(kept))


def loss_trace(step: Step, batch_size: int, num_classes: int, logits_bytes: int = 4) -> LossTrace:
    """What the step's loss allocates and frees at this batch size (cached)."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[logits_bytes]
    return _loss_trace(float(step.optim.label_smoothing), batch_size, num_classes, dtype)


@dataclass(frozen=True)
class OptimizerCost:
    """The step's optimizer over a network's trainable parameters, measured on meta.

    ``state_bytes``: its state once created (Adam: two moments and a step counter per
    tensor); ``step_extra_bytes``: the most it allocates on top of params, grads and state
    while ``optimizer.step()`` runs (foreach: a whole group's temporaries; single-tensor:
    one parameter's, plus the previous one's that its loop still holds; weight decay and
    momentum add theirs).
    """

    state_bytes: int
    step_extra_bytes: int
    # step_in_backward: id of each trainable parameter of the network -> what updating it
    # alone allocates on top of params, grads and state (None: the ordinary step)
    param_step_bytes: dict[int, int] | None = None


def optimizer_cost(net: nn.Module, step: Step) -> OptimizerCost:
    """Run the step's real optimizer twice on meta stand-ins of ``net``'s trainable parameters
    (same groups, shapes, dtypes; CPU zeros for fused kernels) under the storage meter:
    exact for any optimizer setting.
    With ``step_in_backward`` each parameter is updated alone, as its hook does."""
    from edgetl.memory.meter import StorageMeter

    optimizer, stand = step.stand_in_optimizer(net)
    params = list(stand.values())
    meter = StorageMeter()
    meter.register(params)
    if step.in_backward:
        return _in_backward_cost(optimizer, meter, stand)
    peaks = []
    try:
        with meter:
            for _ in range(2):
                for p in params:
                    p.grad = torch.empty_like(p)
                base = meter.current_bytes
                meter.reset_peak()
                optimizer.step()
                peaks.append((base, meter.peak_bytes, meter.current_bytes))
                optimizer.zero_grad(set_to_none=True)
    finally:
        meter.close()
    (base1, peak1, after1), (base2, peak2, _) = peaks
    state = after1 - base1
    return OptimizerCost(state, max(peak1 - base1 - state, peak2 - base2, 0))


def _in_backward_cost(optimizer, meter, stand: dict[int, nn.Parameter]) -> OptimizerCost:
    """``optimizer_cost`` of ``edgetl.step.step_in_backward``: each parameter updated alone
    (the first round creates the state, the second is the steady step), its gradient then freed."""
    extra: dict[int, int] = {}
    try:
        with meter:
            base0 = meter.current_bytes
            for round_ in range(2):
                for key, p in stand.items():
                    p.grad = torch.empty_like(p)
                    base = meter.current_bytes
                    meter.reset_peak()
                    optimizer.step()
                    if round_:
                        extra[key] = meter.peak_bytes - base
                    p.grad = None
                if not round_:
                    state = meter.current_bytes - base0
    finally:
        meter.close()
    return OptimizerCost(state, 0, extra)


# ----------------------------------------------------------------------------- data flow


@dataclass
class _Op:
    name: str
    block: int
    part: str
    inputs: list[int]  # value ids
    output: int  # value id
    module: nn.Module | None = None  # original (not meta) module, None for functions
    leaf: Leaf | None = None
    func: str = ""


@dataclass
class _Value:
    storage: int
    nbytes: int  # bytes of the storage
    shape: tuple[int, ...]
    act_bytes: int
    requires_grad: bool = False
    producer: int | None = None  # op index


@dataclass
class _Flow:
    ops: list[_Op]
    values: list[_Value]
    holds: dict[int, int]  # storage -> op index after which Python no longer refers to it
    image: int  # value id of the input batch
    leaves: list[Leaf]


_ALIAS_FUNCS = {"flatten", "view", "reshape", "squeeze", "unsqueeze", "__getitem__", "detach"}
_ADD_FUNCS = {"add", "__add__", "__radd__", "__iadd__", "add_"}
# new output, nothing saved, backward allocates grad_input (a cast back, upsample_*_backward)
_PLAIN_FUNCS = {"to", "float", "half", "bfloat16", "type", "interpolate"}


def _func_name(func) -> str:
    return getattr(func, "__name__", str(func))


def _leaf_now(module: nn.Module, inputs: list[torch.Tensor]) -> bool:
    """A leaf module is one op, except a streamed segment that does not stream at this batch
    (its blocks then run as they are, and are accounted layer by layer)."""
    if getattr(module, "accounting_kind", None) == "streamed_segment":
        return bool(inputs) and inputs[0].shape[0] > module.micro_batch
    return True


def _skey(t: torch.Tensor) -> int:
    """The key of a tensor's storage."""
    return t.untyped_storage()._cdata


def _tensors(args) -> list[torch.Tensor]:
    """The tensors among a call's arguments."""
    return [a for a in args if isinstance(a, torch.Tensor)]


class _FlowRecorder(TorchFunctionMode):
    """Records a meta forward as ops and values: leaf modules through their hooks, the
    functions called between them (adds, views, casts) as a torch function mode."""

    def __init__(self, originals: dict[str, nn.Module], leaves: list[Leaf]) -> None:
        super().__init__()
        self.originals = originals
        self.leaf_iter = iter(leaves)
        self.keep: list[torch.Tensor] = []  # keeps meta storages alive so their keys stay unique
        self.values: list[_Value] = []
        self.latest: dict[int, int] = {}  # storage key -> newest value id
        self.ops: list[_Op] = []
        self.spans: list[tuple[int, int, int]] = []  # (storage, first op, last op) of module inputs
        self.stack: list[tuple[int | None, int, bool]] = []
        self.ignored: list[bool] = []  # per module call: inside a streamed segment (its own leaf)
        self.busy = False  # inside a hook: its own tensor calls are no ops
        self.leaf_depth = 0

    def value_of(self, t: torch.Tensor) -> int:
        """The newest value of ``t``'s storage (a new one for a storage not seen yet)."""
        key = _skey(t)
        if key not in self.latest:
            self.keep.append(t)
            self.values.append(_Value(key, t.untyped_storage().nbytes(), tuple(t.shape), t.element_size()))
            self.latest[key] = len(self.values) - 1
        return self.latest[key]

    def new_value(self, t: torch.Tensor, producer: int) -> int:
        """A new value for ``t``, written by op ``producer``."""
        self.keep.append(t)
        self.values.append(_Value(_skey(t), t.untyped_storage().nbytes(), tuple(t.shape), t.element_size(),
                                  producer=producer))
        self.latest[_skey(t)] = len(self.values) - 1
        return len(self.values) - 1

    def pre(self, name: str, is_leaf: bool):
        """The forward pre-hook of module ``name``: opens its call."""
        def hook(module, args):
            self.ignored.append(bool(self.leaf_depth))
            if self.ignored[-1]:
                return
            self.busy = True
            ts = _tensors(args)
            leaf = is_leaf and _leaf_now(module, ts)
            self.stack.append((_skey(ts[0]) if ts else None, len(self.ops), leaf))
            if leaf:
                self.leaf_depth += 1
            self.busy = False

        return hook

    def post(self, name: str, is_leaf: bool):
        """The forward hook of module ``name``: records a leaf's op and the span of its input."""
        def hook(module, args, output):
            if self.ignored.pop():
                return
            self.busy = True
            key, first, leaf_call = self.stack.pop()
            if leaf_call:
                self.leaf_depth -= 1
                self.record_leaf(name, module, args, output)
            if key is not None and len(self.ops) > first:
                self.spans.append((key, first, len(self.ops) - 1))
            self.busy = False

        return hook

    def record_leaf(self, name: str, module: nn.Module, args, output) -> None:
        """The op of a leaf call; a leaf returning its input unchanged is an identity."""
        leaf = next(self.leaf_iter)
        if leaf.name != name:
            raise RuntimeError(f"trace order mismatch: {leaf.name} vs {name}")
        ins = [self.value_of(t) for t in _tensors(args)]
        if any(output is t for t in _tensors(args)) and not getattr(module, "inplace", False):
            self.latest[_skey(output)] = ins[0]  # identity (e.g. Resize to the same size)
            self.ops.append(_Op(name, leaf.block, leaf.part, ins, ins[0], self.originals[name], leaf,
                                func="identity"))
        else:
            self.ops.append(_Op(name, leaf.block, leaf.part, ins, -1, self.originals[name], leaf))
            self.ops[-1].output = self.new_value(output, len(self.ops) - 1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.busy or self.leaf_depth or not isinstance(out, torch.Tensor):
            return out
        if any(out is t for t in _tensors(args)):
            return out  # x.to(x.dtype) and the like: the very same tensor, no op
        ins = [self.value_of(t) for t in _tensors(args)]
        if not ins:
            return out
        block, part = (self.ops[-1].block, self.ops[-1].part) if self.ops else (0, "backbone")
        self.ops.append(_Op(_func_name(func), block, part, ins, -1, func=_func_name(func)))
        self.ops[-1].output = self.new_value(out, len(self.ops) - 1)
        return out

    def run(self, meta: EdgeNet, resolution: int, batch_size: int, dtype: torch.dtype) -> int:
        """Run ``meta`` on a meta batch under the hooks; returns the batch's value id."""
        handles = []
        for name, module in meta.named_modules():
            is_leaf = len(list(module.children())) == 0
            handles.append(module.register_forward_pre_hook(self.pre(name, is_leaf)))
            handles.append(module.register_forward_hook(self.post(name, is_leaf)))
        image_t = torch.empty(batch_size, 3, resolution, resolution, device="meta", dtype=dtype)
        image = self.value_of(image_t)
        try:
            with torch.no_grad(), self:
                logits = meta(image_t)
        finally:
            for h in handles:
                h.remove()
        del logits
        return image


def _meta_copy(net: EdgeNet) -> EdgeNet:
    """``net`` on meta, shapes only, BN in eval mode.

    BN in eval mode for tracing only: shapes are the same, and a batch-1 train-mode BN
    on a 1x1 map refuses to run; the rules read training flags from ``net`` itself.
    """
    meta = copy.deepcopy(net).to("meta")
    mark_shapes_only(meta)
    for m in meta.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return meta


def _flow(net: EdgeNet, resolution: int, batch_size: int) -> _Flow:
    """Trace ``net`` on meta, recording for each op which tensors it reads and writes."""
    meta = _meta_copy(net)
    trace = trace_network(meta, resolution, batch_size=batch_size)
    recorder = _FlowRecorder(dict(net.named_modules()), trace.leaves)
    image = recorder.run(meta, resolution, batch_size, getattr(net, "input_dtype", torch.float32))
    ops, values = recorder.ops, recorder.values
    _mark_requires_grad(ops, values)
    holds = _holds(net, ops, values, recorder.spans)
    return _Flow(ops, values, holds, image, trace.leaves)


def _mark_requires_grad(ops: list[_Op], values: list[_Value]) -> None:
    """Which values need grad: any input that does, or a param of the layer that trains."""
    for op in ops:
        if op.func == "identity":
            continue
        own = op.module is not None and any(p.requires_grad for p in leaf_parameters(op.module))
        values[op.output].requires_grad = own or any(values[v].requires_grad for v in op.inputs)


def _holds(net: EdgeNet, ops: list[_Op], values: list[_Value],
           spans: list[tuple[int, int, int]]) -> dict[int, int]:
    """Storage -> index of the op after which Python no longer refers to it: its last
    reader, the end of a module call it was passed to, a side tap's span, the loss."""
    holds: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.inputs:
            s = values[v].storage
            holds[s] = max(holds.get(s, i), i)
    for key, _, last in spans:
        holds[key] = max(holds.get(key, last), last)
    # EdgeNet.forward keeps ``side_in`` bound until it rebinds it, just before the next tap
    # block (or the streamed segment that ends at it) runs
    side = getattr(net, "side", None)
    if side is not None:
        taps = list(side.taps)
        for j, tap in enumerate(taps):
            name = f"side.blocks.{j}."
            first = next((op for op in ops if op.name.startswith(name)), None)
            if first is None:
                continue
            nxt = taps[j + 1] if j + 1 < len(taps) else None
            end = next((i - 1 for i, op in enumerate(ops) if nxt is not None and op.block == nxt
                        and op.part == "backbone"), len(ops) - 1)
            s = values[first.inputs[0]].storage
            holds[s] = max(holds.get(s, end), end)
    holds[values[ops[-1].output].storage] = len(ops)  # the logits: until the loss has them
    return holds


# ----------------------------------------------------------------------------- simulation


@dataclass
class _Result:
    peak_bytes: int = 0
    peak_at: str = ""
    peak_parts: dict[str, int] = field(default_factory=dict)
    saved_end_bytes: int = 0
    # per block: max temporary, saved at block end, max activation live
    block_tmp: dict[int, int] = field(default_factory=dict)
    block_cugrd: dict[int, int] = field(default_factory=dict)
    block_peak: dict[int, int] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    optimizer_peak_bytes: int = 0
    # per leaf op: (module, the keyword arguments of its layer_cost call)
    layer_args: dict[int, tuple[nn.Module, dict]] = field(default_factory=dict)
    # per op whose backward ran: (total bytes at that moment, its backward temporaries)
    backward_moments: dict[int, tuple[int, int]] = field(default_factory=dict)
    # per leaf op: (total bytes while its forward ran, its forward temporaries)
    forward_moments: dict[int, tuple[int, int]] = field(default_factory=dict)


class _Memory:
    """Reference-counted storages: Python holds, saved references, gradient buffers."""

    def __init__(self) -> None:
        self.size: dict[object, int] = {}
        self.refs: dict[object, int] = {}
        self.saved_refs: dict[object, int] = {}
        self.bytes = 0

    def alloc(self, key, nbytes: int) -> None:
        if key in self.size:
            raise RuntimeError(f"storage {key} allocated twice")
        self.size[key] = nbytes
        self.refs[key] = 0
        self.bytes += nbytes

    def ref(self, key, saved: bool = False) -> None:
        self.refs[key] += 1
        if saved:
            self.saved_refs[key] = self.saved_refs.get(key, 0) + 1

    def unref(self, key, saved: bool = False) -> None:
        self.refs[key] -= 1
        if saved:
            self.saved_refs[key] -= 1
            if not self.saved_refs[key]:
                del self.saved_refs[key]
        if self.refs[key] == 0:
            self.bytes -= self.size.pop(key)
            del self.refs[key]

    def saved_bytes(self) -> int:
        return sum(self.size[k] for k in self.saved_refs)


def _static_bytes(flow: _Flow, net: nn.Module, batch_size: int, opt: OptimizerCost) -> tuple[int, dict[str, int]]:
    """Bytes held through the whole step (params, buffers, optimizer state, the batch and
    its labels), in all and by part."""
    values = flow.values
    trainable = [p for p in net.parameters() if p.requires_grad]
    frozen_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if not p.requires_grad)
    frozen_bytes += sum(b.numel() * b.element_size() for b in net.buffers())
    train_bytes = sum(p.numel() * p.element_size() for p in trainable)
    state_bytes = opt.state_bytes
    input_bytes = values[flow.image].nbytes + batch_size * LABEL_BYTES
    static = frozen_bytes + train_bytes + state_bytes + input_bytes
    parts = {"frozen": frozen_bytes, "weights": train_bytes, "state": state_bytes, "input": input_bytes}
    return static, parts


def _function_cost(func: str) -> LayerCost | None:
    """The rule of a function called between leaves (a view, an add, a cast); None: no rule."""
    if func in _ALIAS_FUNCS:
        return LayerCost(inplace=True, grad_input=False)
    if func in _ADD_FUNCS:
        return LayerCost(grad_input=False)
    if func in _PLAIN_FUNCS:
        return LayerCost()
    return None


@dataclass
class _Simulation:
    """One simulated step in progress: live storages, what each op keeps, the result so far."""

    flow: _Flow
    step: Step
    opt: OptimizerCost
    static: int  # bytes held through the whole step (``_static_bytes``)
    parts: dict[str, int]  # ``static`` by part, for the breakdown at the peak
    # gradient buffers alive; under DDP every gradient is a view into its buckets, which
    # exist from the wrap on (the trainable size; ``edgetl.step.ddp_wrap``)
    grad_bytes: int
    mem: _Memory = field(default_factory=_Memory)
    res: _Result = field(default_factory=_Result)
    py_held: set[object] = field(default_factory=set)  # storages Python still refers to
    saved_by: dict[int, list[object]] = field(default_factory=dict)  # op index -> storages it keeps
    costs: dict[int, LayerCost] = field(default_factory=dict)
    has_grad_fn: dict[int, bool] = field(default_factory=dict)
    loss: LossTrace | None = None
    keys: dict[int, object] = field(default_factory=dict)  # the loss trace's keys -> storages here
    held: list[object] = field(default_factory=list)  # the loss's saved tensors
    gbuf: dict[int, object] = field(default_factory=dict)  # value id -> its gradient so far

    def sample(self, where: str, block: int, forward: bool, saved_before: int | None = None) -> None:
        """Note the bytes alive now in the step's peak and the block's figures."""
        mem, res = self.mem, self.res
        act = mem.bytes
        total = self.static + self.grad_bytes + act
        if _DEBUG is not None:
            _DEBUG.append((where, total, mem.saved_bytes()))
        saved = mem.saved_bytes()
        if total > res.peak_bytes:
            res.peak_bytes, res.peak_at = total, where
            res.peak_parts = {**self.parts, "grads": self.grad_bytes, "saved": saved,
                              "extra": act - saved}
        if block not in res.block_peak:
            res.order.append(block)
            res.block_peak[block] = res.block_tmp[block] = 0
        res.block_peak[block] = max(res.block_peak[block], act)
        if forward:
            tmp = act - (saved if saved_before is None else saved_before)
            res.block_tmp[block] = max(res.block_tmp[block], tmp)

    # ---- forward

    def forward(self) -> None:
        """The network's forward, op by op, up to the logits."""
        img = self.flow.values[self.flow.image].storage
        self.mem.alloc(img, 0)  # the batch is static; a zero-size entry keeps references simple
        self.mem.ref(img)
        for i, op in enumerate(self.flow.ops):
            self.forward_op(i, op)

    def op_cost(self, i: int, op: _Op, ins: list[_Value], out: _Value, grad_fn: bool) -> LayerCost:
        """What op ``i`` keeps and allocates: its layer's rule, or the rule of its function."""
        if op.func == "identity":
            return LayerCost(inplace=True, grad_input=False)
        if op.module is not None:
            args = dict(in_shape=ins[0].shape, out_shape=out.shape, act_bytes=out.act_bytes,
                        in_bytes=ins[0].act_bytes, input_requires_grad=ins[0].requires_grad,
                        output_requires_grad=grad_fn)
            self.res.layer_args[i] = (op.module, args)
            cost = layer_cost(op.module, **args)
            if cost.inplace and out.storage != ins[0].storage:
                cost.inplace = False  # traced as a new tensor: trust the trace
            return cost
        cost = _function_cost(op.func)
        if cost is None:
            ops = self.flow.ops
            raise CapabilityError(
                f"the runtime accounting has no rule for the function {op.func} (called after "
                f"{ops[i - 1].name if i else 'the input'}): add it to the function sets in edgetl.memory.runtime")
        return cost

    def forward_op(self, i: int, op: _Op) -> None:
        """Op ``i``'s forward: its output, what it keeps and its temporaries; then Python
        drops what it no longer refers to."""
        mem, res, values = self.mem, self.res, self.flow.values
        out = values[op.output]
        ins = [values[v] for v in op.inputs]
        grad_fn = out.requires_grad and op.func != "identity"
        self.has_grad_fn[i] = grad_fn
        saved_before = mem.saved_bytes()
        cost = self.op_cost(i, op, ins, out, grad_fn)
        self.costs[i] = cost
        keep: list[object] = []
        if cost.saved_new_bytes:
            mem.alloc(("saved", i), cost.saved_new_bytes)
            keep.append(("saved", i))
        if out.storage not in mem.size:
            mem.alloc(out.storage, out.nbytes)
        if out.storage not in self.py_held:
            self.py_held.add(out.storage)
            mem.ref(out.storage)
        if cost.forward_temp_bytes:
            mem.alloc(("tmp", i), cost.forward_temp_bytes)
        self.sample(f"forward {op.name}", op.block, True, saved_before)
        if op.module is not None:
            res.forward_moments[i] = (self.static + self.grad_bytes + mem.bytes, cost.forward_temp_bytes)
        if cost.forward_temp_bytes:
            _drop(mem, ("tmp", i))
        if grad_fn:
            if cost.saves_input:
                keep.append(ins[0].storage)
            if cost.saves_output:
                keep.append(out.storage)
        for k in keep:
            mem.ref(k, saved=True)
        self.saved_by[i] = keep
        self.release_py(i)
        res.block_cugrd[op.block] = mem.saved_bytes()

    def release_py(self, i: int) -> None:
        """Drop Python's references to the storages it holds no longer after op ``i``."""
        for s in list(self.py_held):
            if self.flow.holds.get(s, -1) <= i:
                self.py_held.discard(s)
                self.mem.unref(s)

    # ---- the loss, replayed from the step's own loss on meta (see ``LossTrace``)

    def replay(self, events, forward: bool, where: str) -> None:
        """Apply the loss trace's ``events`` to the live storages."""
        mem, keys = self.mem, self.keys
        for event in events:
            if event[0] == "alloc":
                keys[event[1]] = ("loss", event[1])
                mem.alloc(keys[event[1]], event[2])
                mem.ref(keys[event[1]])
            elif event[0] == "free":
                key = keys.pop(event[1])
                mem.saved_refs.pop(key, None)
                mem.unref(key)
            elif event[0] == "op":
                self.sample(f"{where} {event[1]}", HEAD_BLOCK, forward)

    def loss_forward(self, batch_size: int, num_classes: int) -> None:
        """The loss's forward from the logits; then forward returns and Python lets go of
        everything but what backward saved."""
        mem, values, ops = self.mem, self.flow.values, self.flow.ops
        logits = values[ops[-1].output].storage
        self.py_held.discard(logits)  # the replay's free of the logits stands for Python dropping them
        self.loss = loss_trace(self.step, batch_size, num_classes, values[ops[-1].output].act_bytes)
        self.keys = {self.loss.logits: logits}
        self.replay(self.loss.forward, True, "forward")
        for s in list(self.py_held):  # nothing else is referenced once forward returns
            self.py_held.discard(s)
            mem.unref(s)
        self.held = [self.keys[k] for k in self.loss.held]  # the loss's saved tensors, for the breakdown
        for k in self.held:
            mem.saved_refs[k] = 1
        self.res.saved_end_bytes = mem.saved_bytes()

    # ---- backward

    def backward(self) -> list[object]:
        """The loss's backward, then every op's in reverse order; returns the storages the
        step holds until it returns (the loss and the hit count)."""
        loss, ops = self.loss, self.flow.ops
        ops_end = max(i for i, e in enumerate(loss.backward) if e[0] == "op") + 1
        self.replay(loss.backward[:ops_end], False, "backward")  # the rest happens when backward ends
        for k in self.held:
            self.mem.saved_refs.pop(k, None)
        self.gbuf = {ops[-1].output: self.keys[loss.grad]}
        step_keys = [self.keys[k] for k in loss.kept]  # the loss and the hit count, until the step returns
        for i in range(len(ops) - 1, -1, -1):
            if self.has_grad_fn[i]:
                self.backward_op(i, ops[i])
        self.replay(loss.backward[ops_end:], False, "backward")  # e.g. the engine's ones_like root grad
        return step_keys

    def backward_op(self, i: int, op: _Op) -> None:
        """Op ``i``'s backward: its grad_input and param grads, then its saved tensors go."""
        mem = self.mem
        g_out = self.gbuf.pop(op.output, None)
        outs: list[tuple[int, object]] = []
        if g_out is not None:
            outs = self.grad_inputs(i, op, g_out)
        for k in self.saved_by[i]:
            mem.unref(k, saved=True)
        if g_out is not None:
            mem.unref(g_out)
        for v, key in outs:
            self.deliver(v, key)
        if g_out is not None and self.opt.param_step_bytes is not None and op.module is not None:
            self.update_in_backward(op)

    def grad_inputs(self, i: int, op: _Op, g_out: object) -> list[tuple[int, object]]:
        """Op ``i``'s backward computing: (value id, gradient storage) per input needing grad."""
        mem, values, cost = self.mem, self.flow.values, self.costs[i]
        outs: list[tuple[int, object]] = []
        for v in dict.fromkeys(op.inputs):
            if not values[v].requires_grad:
                continue
            if cost.grad_input or values[v].act_bytes != values[op.output].act_bytes:
                # (a pass-through grad is cast to the input's dtype by the engine)
                key = ("grad", i, v)
                mem.alloc(key, values[v].nbytes)
            else:
                key = g_out  # views and add pass grad_output through
            mem.ref(key)
            outs.append((v, key))
        if op.module is not None and not self.step.ddp:
            for p in leaf_parameters(op.module):
                if p.requires_grad:
                    self.grad_bytes += p.numel() * p.element_size()
        if cost.backward_temp_bytes:
            mem.alloc(("btmp", i), cost.backward_temp_bytes)
        self.sample(f"backward {op.name}", op.block, False)
        self.res.backward_moments[i] = (self.static + self.grad_bytes + mem.bytes, cost.backward_temp_bytes)
        if cost.backward_temp_bytes:
            _drop(mem, ("btmp", i))
        return outs

    def deliver(self, v: int, g: object) -> None:
        """Gradient ``g`` reaches value ``v``; a second one is summed into the first."""
        mem, gbuf = self.mem, self.gbuf
        old = gbuf.get(v)
        if old is None:
            gbuf[v] = g
            return
        # InputBuffer.accumulate: add in place into a buffer nobody else holds
        if mem.refs[old] == 1:
            mem.unref(g)
        elif mem.refs[g] == 1:
            gbuf[v] = g
            mem.unref(old)
        else:
            key = ("grad", "sum", v, id(g))
            mem.alloc(key, self.flow.values[v].nbytes)
            mem.ref(key)
            mem.unref(old)
            mem.unref(g)
            gbuf[v] = key

    def update_in_backward(self, op: _Op) -> None:
        """step_in_backward: each parameter's hook updates it and frees its gradient, in
        the order the engine reaches them: a layer's backward returns its parameters'
        gradients in their order, except nn.Linear's weight, which comes through a
        transpose node after the bias (checked against the meter, tests/test_step.py)."""
        params = leaf_parameters(op.module)
        if isinstance(op.module, nn.Linear):
            params.reverse()
        for p in params:
            if p.requires_grad:
                self.mem.alloc(("ostep", id(p)), self.opt.param_step_bytes[id(p)])
                self.sample(f"update {op.name}", op.block, False)
                _drop(self.mem, ("ostep", id(p)))
                self.grad_bytes -= p.numel() * p.element_size()

    # ---- optimizer step

    def optimizer_step(self, step_keys: list[object]) -> None:
        """Everything but params' grads and state is gone (``OptimizerCost``); with
        step_in_backward the gradients are gone too and the step finds nothing to do.
        Then the step returns its loss and hit count."""
        mem, res, opt = self.mem, self.res, self.opt
        left = self.parts["weights"] if opt.param_step_bytes is None else self.grad_bytes
        res.optimizer_peak_bytes = self.static + left + opt.step_extra_bytes + mem.bytes
        if res.optimizer_peak_bytes > res.peak_bytes:
            res.peak_bytes, res.peak_at = res.optimizer_peak_bytes, "optimizer step"
            res.peak_parts = {**self.parts, "grads": left, "saved": 0, "extra": opt.step_extra_bytes + mem.bytes}
        for k in step_keys:
            mem.unref(k)


def _simulate(flow: _Flow, net: nn.Module, batch_size: int, num_classes: int, step: Step,
              opt: OptimizerCost) -> _Result:
    """One training step of ``flow``'s network, storage by storage (see the module docstring)."""
    static, parts = _static_bytes(flow, net, batch_size, opt)
    sim = _Simulation(flow, step, opt, static, parts, grad_bytes=parts["weights"] if step.ddp else 0)
    sim.forward()
    sim.loss_forward(batch_size, num_classes)
    step_keys = sim.backward()
    sim.optimizer_step(step_keys)
    return sim.res


def _drop(mem: _Memory, key) -> None:
    mem.refs[key] = 1
    mem.unref(key)


def simulate(net: EdgeNet, *, resolution: int, batch_size: int, step: Step | None = None,
             opt: OptimizerCost | None = None) -> _Result:
    """One simulated training step of ``net`` (in its current train mode): the peak and, per
    leaf op, the arguments of its cost rule and its backward moment (``edgetl.memory.schedule``
    chooses execution options from these). ``opt``: ``optimizer_cost(net, step)`` when the
    caller has it already (it does not depend on the schedule or the batch)."""
    step = resolve_step(step)
    opt = opt if opt is not None else optimizer_cost(net, step)
    return _simulate(_flow(net, resolution, batch_size), net, batch_size, net.spec.num_classes, step, opt)


# ----------------------------------------------------------------------------- report


def runtime_report(net: EdgeNet, *, mode: str, resolution: int, batch_size: int,
                   optimizer: str | None = None, step: Step | None = None) -> MemoryReport:
    """Runtime accounting (DESIGN 2b) of a built network (any device, meta is enough).

    Per-block figures are for one image: ``tmp_bytes`` the largest activation memory
    not kept for backward while one of the block's ops runs, ``cugrd_bytes`` the bytes
    kept for backward at the block's end, ``peak_bytes`` the largest activation memory
    (kept + temporary + gradient buffers, forward or backward) while the block's ops
    run. ``total_bytes`` is the predicted peak of a whole training step at
    ``batch_size``, static memory included; ``breakdown`` splits it at the moment of
    the peak and sums to it.
    """
    step = resolve_step(step, optimizer)
    if not any(p.requires_grad for p in net.parameters()):
        raise ConfigError("nothing trains: no parameter requires grad")
    set_train_mode(net, step.bn)
    num_classes = net.spec.num_classes
    opt = optimizer_cost(net, step)
    one = _simulate(_flow(net, resolution, 1), net, 1, num_classes, step, opt)
    full = one
    if batch_size != 1:
        full = _simulate(_flow(net, resolution, batch_size), net, batch_size, num_classes, step, opt)
    names = {HEAD_BLOCK: "head"}
    names.update({i: f"features.{i}" for i in range(HEAD_BLOCK)})
    blocks = [
        BlockMemory(index=b, name=names.get(b, str(b)), tmp_bytes=one.block_tmp[b],
                    cugrd_bytes=one.block_cugrd.get(b, one.saved_end_bytes), peak_bytes=one.block_peak[b])
        for b in sorted(one.order, key=lambda b: one.order.index(b))
    ]
    p = full.peak_parts
    breakdown = {
        "frozen weights + buffers": p["frozen"],
        f"trainable weights + grads + {step.optimizer_name} state": p["weights"] + p["grads"] + p["state"],
        "input batch + labels": p["input"],
        "stored activations": p["saved"],
        "forward/backward peak extra": p["extra"],
    }
    log.debug("runtime peak %d bytes at %s", full.peak_bytes, full.peak_at)
    return MemoryReport(
        accounting="runtime",
        mode=mode,
        resolution=resolution,
        batch_size=batch_size,
        num_classes=num_classes,
        blocks=blocks,
        peak_activation_bytes=max(b.peak_bytes for b in blocks),
        param_bytes=p["frozen"] + 2 * p["weights"] + p["state"],
        total_bytes=full.peak_bytes,
        sensitive_blocks=sensitive(blocks),
        breakdown=breakdown,
        backbone=net.spec.to_dict(),
    )
