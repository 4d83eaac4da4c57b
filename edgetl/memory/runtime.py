"""Runtime accounting (DESIGN 2b): a built network in, what a training step really holds out.

An analytic model, not a measurement: the network is traced once on the meta device
(``edgetl.memory.trace`` for the leaves, plus a data-flow pass here that records which
tensor each op reads and writes), then a training step is *simulated* storage by
storage with per-layer rules saying what autograd keeps:

* static: params and buffers in their dtype, the input batch and labels, optimizer
  state (Adam: 2x trainable bytes + one fp32 step scalar per trainable tensor), and the
  grads of trainable params once backward produces them;
* forward: each op allocates its output (unless in-place or a view) and whatever it
  keeps for backward; a tensor stays alive while Python still refers to it (as long as
  the network's own forward, run on meta, kept it: its last reader, a module call it was
  passed to, a local variable rebound later) or while a saved-for-backward reference to
  its storage exists;
  storages are counted once, so views and in-place results are free;
* backward: ops run in reverse order (autograd's sequence-number order); each holds its
  grad_output, allocates grad_input (or passes grad_output on, as an add or a view does)
  and param grads, then releases its saved tensors; gradients reaching a tensor from two
  consumers (skips, side taps) are summed into a new buffer, as they are under the storage
  meter (``_Simulation.deliver``);
* optimizer step: Adam's ``denom`` needs two temporaries of the largest param.

What each leaf layer keeps is ``edgetl.memory.rules``; what a function called between leaves
keeps (an add, a view, a cast, an interpolation: whatever the network calls), measured like a
leaf, ``edgetl.memory.leaf.function_cost``; what the loss and optimizer allocate,
``edgetl.memory.step_cost``; which tensor each op reads and writes, and how long Python
holds it, ``edgetl.memory.flow``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from edgetl.errors import ConfigError
from edgetl.cost import LayerCost
from edgetl.memory.flow import Flow, Op, Value, trace_flow
from edgetl.memory.paper import sensitive
from edgetl.memory.report import BlockMemory, MemoryReport
from edgetl.memory.leaf import function_cost, leaf_parameters
from edgetl.memory.rules import layer_cost
from edgetl.memory.step_cost import LossTrace, OptimizerCost, loss_trace, optimizer_cost
import edgetl.models.archs as archs
from edgetl.models.backbone import EdgeNet
from edgetl.step import Step, resolve_step, set_train_mode

log = logging.getLogger(__name__)

LABEL_BYTES = 8  # int64 class indices
_DEBUG: list | None = None  # set to a list to record every simulated sample


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


def _static_bytes(flow: Flow, net: nn.Module, batch_size: int, opt: OptimizerCost) -> tuple[int, dict[str, int]]:
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


@dataclass
class _Simulation:
    """One simulated step in progress: live storages, what each op keeps, the result so far."""

    flow: Flow
    step: Step
    opt: OptimizerCost
    static: int  # bytes held through the whole step (``_static_bytes``)
    parts: dict[str, int]  # ``static`` by part, for the breakdown at the peak
    # gradient buffers alive; under DDP every gradient is a view into its buckets, which
    # exist from the wrap on (the trainable size; ``edgetl.step.ddp_wrap``)
    grad_bytes: int
    head: int  # the head's block number (the backbone's block count)
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
    summed: list[object] = field(default_factory=list)  # the gradient sums made so far

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

    def op_cost(self, i: int, op: Op, ins: list[Value], out: Value, grad_fn: bool) -> LayerCost:
        """What op ``i`` keeps and allocates: its layer's rule, or the rule of its function."""
        if op.func == "identity":
            return LayerCost(inplace=True, grad_input=False)
        if op.module is not None:
            args = dict(in_shape=ins[0].shape, out_shape=out.shape, act_bytes=out.act_bytes,
                        in_bytes=ins[0].act_bytes, in_dtype=ins[0].dtype, input_requires_grad=ins[0].requires_grad,
                        output_requires_grad=grad_fn, in_channels_last=ins[0].channels_last)
            self.res.layer_args[i] = (op.module, args)
            cost = layer_cost(op.module, **args)
            if cost.inplace and out.storage != ins[0].storage:
                cost.inplace = False  # traced as a new tensor: trust the trace
            return cost
        return function_cost(op.call, tuple(v.requires_grad for v in ins), grad_fn)

    def forward_op(self, i: int, op: Op) -> None:
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
            keep += [v.storage for j, v in enumerate(ins) if cost.keeps_input(j)]
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
                self.sample(f"{where} {event[1]}", self.head, forward)

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

    def backward_op(self, i: int, op: Op) -> None:
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
            self.deliver(v, key, op)
        if g_out is not None and self.opt.param_step_bytes is not None and op.module is not None:
            self.update_in_backward(op)

    def grad_inputs(self, i: int, op: Op, g_out: object) -> list[tuple[int, object]]:
        """Op ``i``'s backward computing: (value id, gradient storage) per input needing grad."""
        mem, values, cost = self.mem, self.flow.values, self.costs[i]
        outs: list[tuple[int, object]] = []
        for j, v in enumerate(op.inputs):
            if not values[v].requires_grad or v in op.inputs[:j]:
                continue
            if not cost.passes_grad(j) or values[v].dtype != values[op.output].dtype:
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

    def deliver(self, v: int, g: object, op: Op) -> None:
        """Gradient ``g`` (from op ``op``'s backward) reaches value ``v``; a second one is summed
        with the first into a new buffer.

        Autograd's ``InputBuffer::accumulate`` adds in place into a buffer nobody else holds,
        but only when the other gradient is no tensor subclass, and with any
        ``TorchDispatchMode`` on (the storage meter is one) torch's ``isTensorSubclassLike``
        says every tensor is: the measured step sums out of place, both gradients and their
        sum alive at once (up to one gradient more than an unmetered step holds)."""
        mem, gbuf = self.mem, self.gbuf
        old = gbuf.get(v)
        if old is None:
            gbuf[v] = g
            return
        key = ("grad", "sum", v, len(self.summed))
        self.summed.append(key)
        mem.alloc(key, self.flow.values[v].nbytes)
        mem.ref(key)
        self.sample(f"backward {op.name} (gradient sum)", op.block, False)
        mem.unref(old)
        mem.unref(g)
        gbuf[v] = key

    def update_in_backward(self, op: Op) -> None:
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


def _simulate(flow: Flow, net: EdgeNet, batch_size: int, num_classes: int, step: Step,
              opt: OptimizerCost) -> _Result:
    """One training step of ``flow``'s network, storage by storage (see the module docstring)."""
    static, parts = _static_bytes(flow, net, batch_size, opt)
    sim = _Simulation(flow, step, opt, static, parts, grad_bytes=parts["weights"] if step.ddp else 0,
                      head=len(net.features))
    sim.forward()
    sim.loss_forward(batch_size, num_classes)
    step_keys = sim.backward()
    sim.optimizer_step(step_keys)
    return sim.res


def _drop(mem: _Memory, key) -> None:
    mem.refs[key] = 1
    mem.unref(key)


def simulate(net: EdgeNet, *, resolution: int, batch_size: int, step: Step | None = None,
             opt: OptimizerCost | None = None, flow: Flow | None = None) -> _Result:
    """One simulated training step of ``net`` (in its current train mode): the peak and, per
    leaf op, the arguments of its cost rule and its backward moment (``edgetl.memory.schedule``
    chooses execution options from these). ``opt``: ``optimizer_cost(net, step)`` when the
    caller has it already (it does not depend on the schedule or the batch). ``flow``:
    ``trace_flow(net, resolution, batch_size)`` when the caller has it: the trace names the
    leaves, their shapes and who holds what, not how a leaf runs inside, so a caller trying
    the execution settings of a leaf's own layers (the convs inside a streamed segment) traces
    once; each leaf's cost is still its rule's, read from ``net``'s module now."""
    step = resolve_step(step)
    opt = opt if opt is not None else optimizer_cost(net, step)
    flow = flow if flow is not None else trace_flow(net, resolution, batch_size)
    return _simulate(flow, net, batch_size, net.spec.num_classes, step, opt)


# ----------------------------------------------------------------------------- report


def _step_of(net: EdgeNet, step: Step | None, optimizer: str | None) -> tuple[Step, OptimizerCost]:
    """The step to account and its optimizer's cost; ``net`` set to the step's train mode."""
    step = resolve_step(step, optimizer)
    if not any(p.requires_grad for p in net.parameters()):
        raise ConfigError("nothing trains: no parameter requires grad")
    set_train_mode(net, step.bn)
    return step, optimizer_cost(net, step)


def runtime_peak_bytes(net: EdgeNet, *, resolution: int, batch_size: int, optimizer: str | None = None,
                       step: Step | None = None) -> int:
    """``runtime_report(...).total_bytes`` alone: the step at ``batch_size`` simulated, without
    the per-image block figures (a second simulation, at batch 1). For searches over the batch."""
    step, opt = _step_of(net, step, optimizer)
    flow = trace_flow(net, resolution, batch_size)
    return _simulate(flow, net, batch_size, net.spec.num_classes, step, opt).peak_bytes


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
    step, opt = _step_of(net, step, optimizer)
    num_classes = net.spec.num_classes
    one = _simulate(trace_flow(net, resolution, 1), net, 1, num_classes, step, opt)
    full = one
    if batch_size != 1:
        full = _simulate(trace_flow(net, resolution, batch_size), net, batch_size, num_classes, step, opt)
    arch = archs.get(net.spec.arch)
    names = {len(net.features): "head"}
    names.update({i: arch.block_name(i) for i in range(len(net.features))})
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
