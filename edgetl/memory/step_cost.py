"""What the step's loss and optimizer allocate: a step and shapes in, the allocation trace of the
loss and the optimizer's state and step bytes out, measured by running them on meta stand-ins
under the storage meter."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from edgetl.step import Step, loss_and_correct


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


_COSTS: dict[tuple, tuple[int, int, tuple[int, ...] | None]] = {}  # by _signature
_MAX_COSTS = 256


def _signature(net: nn.Module, step: Step) -> tuple[tuple, list[nn.Parameter]]:
    """What an optimizer's cost depends on, and nothing else: the optimizer's settings and,
    group by group, the group's settings and each trainable tensor's shape and dtype (the
    stand-ins are made from exactly these); with the parameters in that order."""
    groups = step.param_groups(net)
    key = (repr(step.optim), tuple(
        (tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params")),
         tuple((tuple(p.shape), p.dtype) for p in g["params"]))
        for g in groups))
    return key, [p for g in groups for p in g["params"]]


def optimizer_cost(net: nn.Module, step: Step) -> OptimizerCost:
    """Run the step's real optimizer twice on meta stand-ins of ``net``'s trainable parameters
    (same groups, shapes, dtypes; CPU zeros for fused kernels) under the storage meter:
    exact for any optimizer setting. Kept by ``_signature``, so a network whose trainable
    tensors look the same to the optimizer is not measured again.
    With ``step_in_backward`` each parameter is updated alone, as its hook does."""
    key, params = _signature(net, step)
    if key not in _COSTS:
        cost = _measure(net, step)
        per = None if cost.param_step_bytes is None else tuple(cost.param_step_bytes[id(p)] for p in params)
        if len(_COSTS) >= _MAX_COSTS:
            _COSTS.clear()
        _COSTS[key] = (cost.state_bytes, cost.step_extra_bytes, per)
    state, extra, per = _COSTS[key]
    return OptimizerCost(state, extra, None if per is None else {id(p): b for p, b in zip(params, per)})


def _measure(net: nn.Module, step: Step) -> OptimizerCost:
    """``optimizer_cost`` measured."""
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

