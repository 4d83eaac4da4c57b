"""The data flow of a training step's forward: a network in, each op's inputs and output storages
and how long Python holds each storage out (traced once on the meta device).

How long Python holds a storage is seen, not described: the trace runs the network's own
forward on meta under no_grad, where nothing but Python refers to a tensor, and notes after
which op each storage dies (its last reader, the end of a module call it was passed to, a
local variable rebound later: whatever the code does)."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from edgetl.memory.leaf import Call, call_of, leaf_parameters
from edgetl.memory.trace import Leaf, trace_meta
from edgetl.twin import meta_copy
from edgetl.metaop import tensors_in
from edgetl.models.backbone import EdgeNet
from edgetl.models.lean.layout import is_channels_last
from edgetl.models.stream import mark_shapes_only


@dataclass
class Op:
    name: str
    block: int
    part: str
    inputs: list[int]  # value ids, one per distinct tensor input (two views of one storage: its value twice)
    output: int  # value id
    module: nn.Module | None = None  # original (not meta) module, None for functions
    leaf: Leaf | None = None
    func: str = ""
    call: Call | None = None  # a function's call, None for leaves


@dataclass
class Value:
    storage: int  # the storage's number in the trace (one per storage, never reused)
    nbytes: int  # bytes of the storage
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    producer: int | None = None  # op index
    channels_last: bool = False  # laid out channels-last (edgetl.models.lean.layout): a leaf is measured so

    @property
    def act_bytes(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize


@dataclass
class Flow:
    ops: list[Op]
    values: list[Value]
    holds: dict[int, int]  # storage -> op index after which Python no longer refers to it
    image: int  # value id of the input batch
    leaves: list[Leaf]


def _func_name(func) -> str:
    return getattr(func, "__name__", str(func))


def _leaf_now(module: nn.Module, inputs: list[torch.Tensor]) -> bool:
    """A leaf module is one op, except a streamed segment that does not stream at this batch
    (its blocks then run as they are, and are accounted layer by layer)."""
    if getattr(module, "accounting_kind", None) == "streamed_segment":
        return bool(inputs) and inputs[0].shape[0] > module.micro_batch
    return True


def _tensors(args) -> list[torch.Tensor]:
    """The tensors among a call's arguments."""
    return [a for a in args if isinstance(a, torch.Tensor)]


class _FlowRecorder(TorchFunctionMode):
    """Records a meta forward as ops and values: leaf modules as the tracer reports them (a
    ``TraceObserver``), the functions called between them (adds, views, casts) as a torch
    function mode."""

    def __init__(self, originals: dict[str, nn.Module]) -> None:
        super().__init__()
        self.originals = originals
        self.image = -1  # the batch's value id, once ``run`` has run
        self.values: list[Value] = []
        self.numbers: dict[int, int] = {}  # id of a live storage -> its number
        self.seen = 0  # storages numbered so far
        self.latest: dict[int, int] = {}  # storage number -> newest value id
        self.holds: dict[int, int] = {}  # storage number -> the last op recorded before it died
        self.finalizers: list[weakref.ref] = []  # a plain ref's callback, as the storage meter's
        self.ops: list[Op] = []
        self.stack: list[bool] = []  # per module call: a leaf call
        self.ignored: list[bool] = []  # per module call: inside a streamed segment (its own leaf)
        self.busy = False  # inside ``leaf``: its own tensor calls are no ops
        self.leaf_depth = 0
        # the leaf calls seen here, in the order they began, and how many the tracer reported:
        # both views must agree on what one leaf call is
        self.opened: list[nn.Module] = []
        self.reported = 0

    def number(self, t: torch.Tensor) -> int:
        """The number of ``t``'s storage: a new one for a storage not seen yet, noted dead (in
        ``holds``) when the storage goes."""
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self.numbers:
            self.numbers[key] = self.seen
            self.seen += 1
            self.finalizers.append(weakref.ref(storage, functools.partial(self.died, key)))
        return self.numbers[key]

    def died(self, key: int, _ref: weakref.ref | None = None) -> None:
        """A storage's last reference went: Python held it up to the last op recorded."""
        self.holds[self.numbers.pop(key)] = len(self.ops) - 1

    def value_of(self, t: torch.Tensor) -> int:
        """The newest value of ``t``'s storage (a new one for a storage not seen yet)."""
        key = self.number(t)
        if key not in self.latest:
            self.values.append(Value(key, t.untyped_storage().nbytes(), tuple(t.shape), t.dtype,
                                     channels_last=is_channels_last(t)))
            self.latest[key] = len(self.values) - 1
        return self.latest[key]

    def new_value(self, t: torch.Tensor, producer: int) -> int:
        """A new value for ``t``, written by op ``producer``."""
        key = self.number(t)
        self.values.append(Value(key, t.untyped_storage().nbytes(), tuple(t.shape), t.dtype,
                                  producer=producer, channels_last=is_channels_last(t)))
        self.latest[key] = len(self.values) - 1
        return len(self.values) - 1

    def pre(self, module: nn.Module, args) -> None:
        """Every module's forward pre-hook: opens its call (the torch functions a leaf calls
        are inside it, no ops of their own)."""
        self.ignored.append(bool(self.leaf_depth))
        if self.ignored[-1]:
            return
        leaf = len(list(module.children())) == 0 and _leaf_now(module, _tensors(args))
        self.stack.append(leaf)
        if leaf:
            self.leaf_depth += 1
            self.opened.append(module)

    def post(self, module: nn.Module, args, output) -> None:
        """Every module's forward hook: closes its call."""
        if self.ignored.pop():
            return
        if self.stack.pop():
            self.leaf_depth -= 1

    def leaf(self, leaf: Leaf, module: nn.Module, args, output) -> None:
        """The op of a leaf call the tracer has just recorded (``TraceObserver``); a leaf
        returning its input unchanged is an identity."""
        if self.reported >= len(self.opened) or self.opened[self.reported] is not module:
            raise RuntimeError(f"trace order mismatch: {leaf.name} is not the next leaf call")
        self.reported += 1
        name = leaf.name
        self.busy = True
        ins = [self.value_of(t) for t in _tensors(args)]
        if any(output is t for t in _tensors(args)) and not getattr(module, "inplace", False):
            self.latest[self.number(output)] = ins[0]  # identity (e.g. Resize to the same size)
            self.ops.append(Op(name, leaf.block, leaf.part, ins, ins[0], self.originals[name], leaf,
                                func="identity"))
        else:
            self.ops.append(Op(name, leaf.block, leaf.part, ins, -1, self.originals[name], leaf))
            self.ops[-1].output = self.new_value(output, len(self.ops) - 1)
        self.busy = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # an input's version counter says whether the function wrote it in place
        outside = not (self.busy or self.leaf_depth)
        versions = {id(t): t._version for t in tensors_in((args, kwargs))} if outside else {}
        out = func(*args, **(kwargs or {}))
        if not outside or not isinstance(out, torch.Tensor):
            return out
        call, tensors = call_of(func, args, kwargs)
        if any(out is t for t in tensors) and out._version == versions.get(id(out)):
            return out  # x.to(x.dtype) and the like: the very same tensor, unwritten, no op
        if not tensors:
            return out
        # an in-place function (``y += identity``, a residual add written in place) is an op
        # like any other: its output is a new value of the storage it wrote
        ins = [self.value_of(t) for t in tensors]
        block, part = (self.ops[-1].block, self.ops[-1].part) if self.ops else (0, "backbone")
        self.ops.append(Op(_func_name(func), block, part, ins, -1, func=_func_name(func), call=call))
        self.ops[-1].output = self.new_value(out, len(self.ops) - 1)
        return out

    def run(self, meta: EdgeNet, image_t: torch.Tensor) -> torch.Tensor:
        """Run ``meta`` on the meta batch ``image_t`` under the hooks (``TraceObserver``);
        returns the logits."""
        handles = []
        for module in meta.modules():
            handles.append(module.register_forward_pre_hook(self.pre))
            handles.append(module.register_forward_hook(self.post))
        try:
            self.image = self.value_of(image_t)
            with torch.no_grad(), self:
                logits = meta(image_t)
        finally:
            for h in handles:
                h.remove()
            self.finalizers.clear()  # a dropped ref calls nothing: later deaths are not recorded
        if self.reported != len(self.opened):
            raise RuntimeError(f"trace order mismatch: {len(self.opened) - self.reported} leaf calls not traced")
        # the logits: until the loss has them; anything else still alive, until forward returns
        for key in self.numbers.values():
            self.holds[key] = len(self.ops)
        return logits


def _meta_copy(net: EdgeNet) -> EdgeNet:
    """``net`` on meta, shapes only, BN in eval mode.

    BN in eval mode for tracing only: shapes are the same, and a batch-1 train-mode BN
    on a 1x1 map refuses to run; the rules read training flags from ``net`` itself.
    """
    meta = meta_copy(net)
    mark_shapes_only(meta)
    for m in meta.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return meta


def trace_flow(net: EdgeNet, resolution: int, batch_size: int) -> Flow:
    """Trace ``net`` on meta, recording for each op which tensors it reads and writes and how
    long Python holds them: one meta forward, seen by the leaf trace (``trace_meta``) and the
    flow recorder (its observer) alike."""
    meta = _meta_copy(net)
    recorder = _FlowRecorder(dict(net.named_modules()))
    trace = trace_meta(meta, dict(meta.named_modules()), resolution, batch_size, observer=recorder)
    ops, values = recorder.ops, recorder.values
    _mark_requires_grad(ops, values)
    return Flow(ops, values, recorder.holds, recorder.image, trace.leaves)


def _mark_requires_grad(ops: list[Op], values: list[Value]) -> None:
    """Which values need grad: any input that does, or a param of the layer that trains."""
    for op in ops:
        if op.func == "identity":
            continue
        own = op.module is not None and any(p.requires_grad for p in leaf_parameters(op.module))
        values[op.output].requires_grad = own or any(values[v].requires_grad for v in op.inputs)
