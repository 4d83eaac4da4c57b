"""What a leaf layer holds, measured: a leaf module and its input in, a LayerCost out (and
the same for a function called between leaves).

edgetl's lean layers (``edgetl.models.lean``, ``lean_side``, ``lean_full``, ``compress``)
are autograd Functions whose allocations are chosen by hand. Their cost is not written a
second time beside them: the leaf runs once, forward and backward, on a meta copy of
itself under the storage meter (``edgetl.memory.meter.StorageMeter``), and the
measurement is read off as a :class:`LayerCost`. Any leaf that is not one of torch's own
layers is accounted this way (a streamed segment, a subclass of a stock layer, a user's):

* forward: the bytes alive after the call less the output are what it keeps
  (``saved_new_bytes``); the peak above that is its temporaries; the storages its
  autograd nodes save (``saved_tensors_hooks``) say whether it keeps its input or its
  output by reference; an output that is the input's storage is in place;
* backward: the peak while its backward runs above what it started with, less the
  gradients it returns (input and parameters), is its temporaries; a gradient for the
  input that is grad_output itself is a pass-through (``grad_input=False``).

Measurements are cached by the leaf's *signature*: its class, every plain attribute
(training flags, execution options such as mask chunks), the shape, dtype and
trainability of every tensor it holds (its own and those of modules it refers to
without registering them, like the lean side tail's BNs), and the input's shape, dtype
and flags. Anything that can change what the code allocates is in the key, so a stale
entry cannot be served. The measurement is exact for the code that runs; the whole-step
prediction is checked against the meter in tests/test_lean_runtime.py and
tests/test_moments.py.

A function the network calls between its leaves (a residual add, a flatten, a cast, an
interpolation, whatever its forward calls) is measured the same way (``function_cost``): the
call is recorded with its arguments (``Call``, each tensor replaced by its layout) and run
once on meta inputs under the meter, per input flags included, since a function of several
tensors may keep some of its inputs and pass grad_output on to others.

A loop over the samples of a batch (or chunks of a weight) runs only its first passes
while it is measured, when the layer loops through ``edgetl.cost.repeated``: the
leaf is measured with 2 passes of each such loop, so a search's batch of hundreds is
measured as fast as a batch of two. The first time a leaf's loops are cut for an input
layout (its key, the input's shape but the batch, dtype and flags) it is measured again
with 3 passes, and the two must agree, else every pass runs (a pass that leaves something
to the next shows there). Once they agree, the passes of that leaf's loops are alike,
and at other batches 2 passes are measured alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from edgetl.errors import CapabilityError
from edgetl.cost import FunctionCost, LayerCost, Passes
from edgetl.twin import copy_module, meta_tensors

# nn.Module bookkeeping that does not change what a call allocates (hooks are the meter's,
# the trace's or a user's; a leaf's cost is measured without them)
_SKIPPED = {"_non_persistent_buffers_set", "_is_full_backward_hook"}
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class Signature(NamedTuple):
    """What one walk of a leaf finds (``signature``).

    Attributes:
        key: its cost key: its class, plain attributes and tensors' shapes, dtypes and
            trainability, following the modules it refers to (registered or not); devices
            are left out (the cost is measured on meta).
        tensors: every tensor it holds (each is an empty meta tensor in its twin).
        hook_tables: id of each hook table of it and of the modules it holds -> an empty
            table of the same kind: the deepcopy memo entries that give its twin no hooks
            (it is measured without them, as its key is made, and a hook's objects are
            never copied).
    """

    key: tuple
    tensors: list[torch.Tensor]
    hook_tables: dict[int, dict]


def signature(module: nn.Module) -> Signature:
    """The leaf's cost key, tensors and hook tables, in one walk (``Signature``)."""
    tensors: dict[int, torch.Tensor] = {}
    hook_tables: dict[int, dict] = {}
    seen: dict[int, int] = {}

    def walk(obj) -> object:
        if isinstance(obj, torch.Tensor):
            tensors.setdefault(id(obj), obj)
            return ("tensor", tuple(obj.shape), obj.dtype, obj.requires_grad)
        if isinstance(obj, _PLAIN):
            return obj
        if isinstance(obj, nn.Module):
            if id(obj) in seen:
                return ("module", seen[id(obj)])
            seen[id(obj)] = len(seen)
            for k, v in vars(obj).items():
                if "hook" in k and isinstance(v, dict):
                    hook_tables[id(v)] = type(v)()
            items = sorted((k, walk(v)) for k, v in vars(obj).items()
                           if "hook" not in k and k not in _SKIPPED)
            return (type(obj).__module__, type(obj).__qualname__, tuple(items))
        if isinstance(obj, (tuple, list)):
            return (type(obj).__name__, tuple(walk(v) for v in obj))
        if isinstance(obj, dict):
            return ("dict", tuple(sorted(((repr(k), walk(v)) for k, v in obj.items()), key=lambda kv: kv[0])))
        if isinstance(obj, (set, frozenset)):
            return ("set", tuple(sorted(repr(v) for v in obj)))
        if callable(obj) and hasattr(obj, "__code__"):  # a function set on an instance
            return ("function", obj.__module__, obj.__qualname__, obj.__code__.co_code)
        if hasattr(obj, "__dict__") and not callable(obj):  # a plain object (a compressor)
            if id(obj) in seen:
                return ("object", seen[id(obj)])
            seen[id(obj)] = len(seen)
            return (type(obj).__module__, type(obj).__qualname__,
                    tuple(sorted((k, walk(v)) for k, v in vars(obj).items())))
        raise CapabilityError(
            f"the runtime accounting cannot key a {type(obj).__name__} held by a leaf layer; "
            f"hold plain values, functions, tensors, modules or plain objects")

    key = walk(module)
    return Signature(key, list(tensors.values()), hook_tables)


def leaf_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters a leaf's backward produces grads for: its own, or ``runtime_parameters()``."""
    own = getattr(module, "runtime_parameters", None)
    if callable(own):
        return list(own())
    return list(module.parameters(recurse=False))


def measured_cost(module: nn.Module, *, in_shape, in_dtype: torch.dtype, input_requires_grad: bool,
                  output_requires_grad: bool, in_channels_last: bool = False) -> LayerCost:
    """The leaf's cost for one call on an input of this shape and dtype, laid out channels-last
    where ``in_channels_last`` (cached by signature)."""
    sig = signature(module)
    shape = tuple(int(d) for d in in_shape)
    args = (in_dtype, bool(input_requires_grad), bool(output_requires_grad), bool(in_channels_last))
    period = getattr(module, "repeats_every", None)
    if period and shape[0] // period > 3:
        return _periodic(sig, module, shape, period, args)
    return _cached(sig, module, shape, *args)


def _periodic(sig, module: nn.Module, shape: tuple, period: int, args: tuple) -> LayerCost:
    """The cost of a leaf whose work repeats every ``period`` samples (a streamed segment's
    micro-batch), at a batch of q full periods and a last part of r samples, q > 3.

    Every full period allocates and keeps the same, so once the passes' own moments outgrow
    what happens once (converting held weights, whole-batch buffers) the temporaries no longer
    depend on the number of periods, and what forward keeps grows by one period's share per
    period. The cost at q is measured at k and k + 1 periods, k = 2, 3, ... while k + 1 is
    below ``_SETTLE_PERIODS`` and q, and extrapolated from the first two that agree on the temporaries
    (the bf16 + int8 streamed segments of MobileNetV2's last blocks settle at 3); where none
    agree below q, the cost is ``_declining``'s."""
    q, r = divmod(shape[0], period)

    def at(k: int) -> LayerCost:
        return _cached(sig, module, (k * period + r, *shape[1:]), *args)

    costs = [at(2), at(3)]  # costs[i]: at i + 2 periods
    while _temps(costs[-2]) != _temps(costs[-1]):
        if len(costs) + 2 >= min(q, _SETTLE_PERIODS):
            return _declining(sig, module, shape, period, args, costs)
        costs.append(at(len(costs) + 2))
    k, low, high = len(costs), costs[-2], costs[-1]
    share = high.saved_new_bytes - low.saved_new_bytes
    return LayerCost(**{f: getattr(low, f) for f in _FLAGS}, saved_new_bytes=low.saved_new_bytes + (q - k) * share,
                     forward_temp_bytes=low.forward_temp_bytes, backward_temp_bytes=low.backward_temp_bytes)


def _temps(cost: LayerCost) -> tuple[int, int]:
    return cost.forward_temp_bytes, cost.backward_temp_bytes


def _declining(sig, module: nn.Module, shape: tuple, period: int, args: tuple, costs: list[LayerCost]) -> LayerCost:
    """The cost at ``shape`` of a periodic leaf that did not settle in ``costs`` (at 2, 3, ...
    periods): measured whole, unless its forward temporaries decline in a straight line.

    Some segments' forward peak is an early moment of fixed size (the first pass, with what
    happens once), while what is alive after the call grows by a period's output and share
    per period: the temporaries then fall by that much per period, for 10 to 150 samples in
    MobileNetV2's bf16 + int8 segments at 64 px, until the last pass's own moment, whose
    size above what is alive after it does not depend on the batch, takes over. At q periods
    they are max(line(q), floor), backward's are constant, and forward keeps a share per
    period. The line is measured; the floor is read off a whole measurement at one batch of
    the same layout (``_WHOLE``): a batch above the line gives the floor, a batch on it
    bounds it (below the line at every smaller batch). Where no whole measurement says, the
    batch is measured whole (or, where the line falls below zero before it, the first batch
    past that: the floor, in fewer samples), and what it shows kept for the next."""
    q, r = divmod(shape[0], period)
    drops = {a.forward_temp_bytes - b.forward_temp_bytes for a, b in zip(costs, costs[1:])}
    shares = {b.saved_new_bytes - a.saved_new_bytes for a, b in zip(costs, costs[1:])}
    first = costs[0]
    straight = (len(costs) >= 3 and len(drops) == 1 and min(drops) > 0 and len(shares) == 1
                and len({c.backward_temp_bytes for c in costs}) == 1
                and len({tuple(getattr(c, f) for f in _FLAGS) for c in costs}) == 1)
    if not straight:
        return _cached(sig, module, shape, *args)
    (drop,), (share,) = drops, shares

    def line(n: int) -> int:
        return first.forward_temp_bytes - (n - 2) * drop

    def expected(n: int) -> dict:
        return dict(**{f: getattr(first, f) for f in _FLAGS}, saved_new_bytes=first.saved_new_bytes + (n - 2) * share,
                    backward_temp_bytes=first.backward_temp_bytes)

    layout = (sig.key, shape[1:], period, r, *args)
    for n, forward in _WHOLE.get(layout, ()):
        if forward > line(n):  # past the line: the floor itself
            return LayerCost(**expected(q), forward_temp_bytes=max(line(q), forward))
        if n >= q:  # on the line at a batch at least this big: the floor is below the line here too
            return LayerCost(**expected(q), forward_temp_bytes=line(q))
    # the line is below zero from ``past`` periods on, so a batch measured whole there is on the
    # floor: a larger batch is measured there instead (1597 samples of a segment took 10 s on
    # meta, the search's first probe; the floor's own batch, 79-531 of them)
    past = first.forward_temp_bytes // drop + 3
    n = min(q, past)
    cost = _cached(sig, module, (n * period + r, *shape[1:]), *args)
    if (cost.forward_temp_bytes >= line(n)
            and all(getattr(cost, f) == v for f, v in expected(n).items())):  # it declines as the line says
        _WHOLE.setdefault(layout, []).append((n, cost.forward_temp_bytes))
        return LayerCost(**expected(q), forward_temp_bytes=max(line(q), cost.forward_temp_bytes))
    return cost if n == q else _cached(sig, module, shape, *args)


# _periodic measures a leaf at k < _SETTLE_PERIODS periods (and below the batch's q) before
# it leaves the leaf to _declining
_SETTLE_PERIODS = 8


_FLAGS = ("saves_input", "saves_output", "inplace", "grad_input")


_CACHE: dict[tuple, LayerCost] = {}
# entries kept before the caches start again: ``edgetl bench``'s every row at 64 px measures
# about 7,000 leaf inputs (it cleared once at 4,096 and measured a row's leaves again, 7 % of
# its time); an entry is a small cost record and its key
_CACHE_ENTRIES = 16384
# (key, input shape but the batch, dtype, flags) of the leaves whose cut loops were checked:
# the passes of their loops are alike (3 passes measured as 2), whatever the batch
_ALIKE: set[tuple] = set()
# (key, input shape but the batch, period, last part, dtype, flags) of periodic leaves whose
# temporaries decline (``_declining``) -> (periods, forward temporaries) of each batch measured whole
_WHOLE: dict[tuple, list[tuple[int, int]]] = {}


def _cached(sig, module, in_shape, in_dtype, input_grad, output_grad, channels_last) -> LayerCost:
    """``measure`` once per (``signature(module)``'s key, input); ``sig``: that signature."""
    key = sig.key
    full = (key, in_shape, in_dtype, input_grad, output_grad, channels_last)
    cost = _CACHE.get(full)
    if cost is None:
        if len(_CACHE) > _CACHE_ENTRIES:
            _CACHE.clear()
            _ALIKE.clear()
            _WHOLE.clear()
        args = (module, sig, in_shape, in_dtype, input_grad, output_grad, channels_last)
        cost, cut = measure(*args, passes=2)
        layout = (key, in_shape[1:], in_dtype, input_grad, output_grad, channels_last)
        if cut and layout not in _ALIKE:
            if measure(*args, passes=3)[0] == cost:
                _ALIKE.add(layout)
            else:
                cost = measure(*args)[0]
        _CACHE[full] = cost
    return copy.copy(cost)  # callers may adjust their copy (the simulator's in-place check)


def measure(module: nn.Module, sig: Signature, in_shape: tuple, in_dtype: torch.dtype,
            input_grad: bool, output_grad: bool, channels_last: bool = False, *,
            passes: int | None = None) -> tuple[LayerCost, bool]:
    """Run a meta twin of ``module`` once, forward (and backward when ``output_grad``), under
    the storage meter (see the module docstring): (its cost, whether a loop was cut short).
    ``sig``: ``signature(module)`` (the tensors and hook tables the twin replaces).
    ``passes``: how many passes of each of its ``repeated`` loops run (all when None)."""
    Passes.limit, Passes.cut = passes, False
    try:
        return _measure(module, sig, in_shape, in_dtype, input_grad, output_grad, channels_last), Passes.cut
    finally:
        Passes.limit = None


def _measure(module, sig: Signature, in_shape, in_dtype, input_grad, output_grad, channels_last) -> LayerCost:
    copies = meta_tensors(sig.tensors)
    # (copy_module adds its own entries to a memo); the twin's hook tables start empty
    twin = copy_module(module, {**copies, **sig.hook_tables})
    params = [copies[id(p)] for p in leaf_parameters(module) if p.requires_grad]
    layout = torch.channels_last if channels_last and len(in_shape) == 4 else torch.contiguous_format
    x = torch.empty(in_shape, dtype=in_dtype, device="meta", requires_grad=input_grad, memory_format=layout)
    c = _metered(twin, [x], output_grad, held=list(copies.values()), params=params)
    return LayerCost(saves_input=c.inputs_kept[0], saves_output=c.saves_output, saved_new_bytes=c.saved_new_bytes,
                     inplace=c.inplace, forward_temp_bytes=c.forward_temp_bytes,
                     backward_temp_bytes=c.backward_temp_bytes, grad_input=not c.inputs_passed[0])


def _metered(fn, inputs: list[torch.Tensor], output_grad: bool, *, held: list[torch.Tensor] = (),
             params: list[torch.Tensor] = ()) -> FunctionCost:
    """Run ``fn(*inputs)`` once under the storage meter, forward (and backward when
    ``output_grad``): what it keeps and allocates, per input (a leaf is a function of one).

    ``inputs``: meta tensors, requiring grad where the input needs it; ``held``: other tensors
    alive meanwhile (a leaf twin's weights); ``params``: trainable tensors whose gradients
    backward also returns (counted as its results, not temporaries). Forward: the bytes alive
    after the call less the output are what it keeps; the peak above that its temporaries; the
    storages its autograd nodes save (``saved_tensors_hooks``) say which inputs, or the output,
    it keeps by reference; an output sharing an input's storage (a view, an in-place op) is in
    place. Backward: the peak above what it started with, less the gradients it returns, is
    its temporaries; an input whose gradient is grad_output itself is passed through."""
    from edgetl.memory.meter import StorageMeter

    # non-leaf inputs (as in a network), so an in-place function may write them; their
    # gradients are read at their edges, which the clones' backward never runs past
    xs = [b.clone() if b.requires_grad else b for b in inputs]
    edges = [get_gradient_edge(x) for x in xs if x.requires_grad]
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(id(t.untyped_storage()))
        return t

    meter = StorageMeter()
    meter.register(inputs, xs, list(held))
    try:
        with meter:
            start = meter.current_bytes
            meter.reset_peak()
            with torch.enable_grad() if output_grad else torch.no_grad():
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = fn(*xs)
            kept = meter.current_bytes - start
            storages = [x.untyped_storage() for x in xs]
            inplace = any(out.untyped_storage() is s for s in storages)
            new_out = 0 if inplace else out.untyped_storage().nbytes()
            forward_temp = meter.peak_bytes - start - kept
            if not (output_grad and out.requires_grad):  # (an argmax's output has no gradient)
                return FunctionCost(inplace=inplace, forward_temp_bytes=forward_temp,
                                    inputs_kept=(False,) * len(xs), inputs_passed=(False,) * len(xs))
            # an input written in place is the output (``saves_output``)
            kept_inputs = tuple(id(s) in saved and s is not out.untyped_storage() for s in storages)
            cost = FunctionCost(saves_output=id(out.untyped_storage()) in saved, saved_new_bytes=kept - new_out,
                                inplace=inplace, forward_temp_bytes=forward_temp, inputs_kept=kept_inputs)
            gy = torch.empty_like(out)
            start = meter.current_bytes
            meter.reset_peak()
            grads = torch.autograd.grad([out], edges + list(params), grad_outputs=[gy])
            g_key = id(gy.untyped_storage())
            input_grads = iter(grads[:len(edges)])
            cost.inputs_passed = tuple(x.requires_grad and id(next(input_grads).untyped_storage()) == g_key
                                       for x in inputs)
            results = {id(g.untyped_storage()): g.untyped_storage().nbytes() for g in grads}
            results.pop(g_key, None)  # a pass-through gradient is grad_output itself
            cost.backward_temp_bytes = meter.peak_bytes - start - sum(results.values())
            del grads, input_grads, gy, out
    finally:
        meter.close()
    return cost


# ----------------------------------------------------------------------------- functions between leaves


@dataclass(frozen=True)
class Call:
    """A function called between leaves, as it was called: ``func`` with ``args`` and
    ``kwargs`` in which each tensor is ``Arg(i)``, tensor input ``i``, of the layout
    ``layouts[i]`` (shape, strides, dtype). Hashable: the key of its measured cost."""

    func: object
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs
    layouts: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True)
class Arg:
    """Tensor input ``index`` of a ``Call``."""

    index: int


def call_of(func, args, kwargs) -> tuple[Call, list[torch.Tensor]]:
    """``func``'s call as a ``Call`` and its tensor inputs, in the order of their ``Arg``s
    (tensors found in nested tuples, lists and dicts too; one ``Arg`` per distinct tensor)."""
    tensors: list[torch.Tensor] = []
    targs = _template(tuple(args), tensors, func)
    tkwargs = tuple(sorted((k, _template(v, tensors, func)) for k, v in (kwargs or {}).items()))
    layouts = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors)
    return Call(func, targs, tkwargs, layouts), tensors


def _template(obj, tensors: list[torch.Tensor], func):
    """``obj`` with each tensor replaced by its ``Arg`` (appended to ``tensors`` when new).
    A plain recursive function, not a closure: a closure calling itself is a reference cycle,
    which would keep the tensors alive until the next garbage collection, past the moment the
    flow trace must see them die."""
    if isinstance(obj, torch.Tensor):
        for i, t in enumerate(tensors):
            if t is obj:
                return Arg(i)
        tensors.append(obj)
        return Arg(len(tensors) - 1)
    if isinstance(obj, (tuple, list)):  # a torch.Size comes back a tuple
        return ("list" if isinstance(obj, list) else "tuple", tuple(_template(v, tensors, func) for v in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, _template(v, tensors, func)) for k, v in obj.items())))
    if isinstance(obj, slice):
        return ("slice", *(_template(v, tensors, func) for v in (obj.start, obj.stop, obj.step)))
    try:
        hash(obj)
    except TypeError:
        name = getattr(func, "__name__", str(func))
        raise CapabilityError(
            f"the runtime accounting cannot key the {type(obj).__name__} argument of {name} "
            f"(between layers): pass plain values and tensors") from None
    return ("value", obj)


def rebuild(template, tensors: list[torch.Tensor]):
    """A ``Call``'s argument (``Call.args`` or a kwargs value) with its ``Arg``s replaced by
    ``tensors``."""
    if isinstance(template, Arg):
        return tensors[template.index]
    kind = template[0]
    if kind == "value":
        return template[1]
    if kind == "slice":
        return slice(*(rebuild(t, tensors) for t in template[1:]))
    if kind == "dict":
        return {k: rebuild(v, tensors) for k, v in template[1]}
    items = [rebuild(v, tensors) for v in template[1]]
    return tuple(items) if kind == "tuple" else items


_FUNCTION_CACHE: dict[tuple, FunctionCost] = {}


def function_cost(call: Call, inputs_grad: tuple[bool, ...], output_grad: bool) -> FunctionCost:
    """What one call of a function between leaves holds (``Call``: the function, its
    arguments, its tensor inputs' layouts), with these inputs needing grad:
    measured like a leaf, once per call and flags (see ``measure_function``)."""
    flags = (tuple(bool(g) for g in inputs_grad), bool(output_grad))
    key = (call, *flags, torch.get_default_dtype())  # a factory inside a function follows the default
    cost = _FUNCTION_CACHE.get(key)
    if cost is None:
        if len(_FUNCTION_CACHE) > 4096:
            _FUNCTION_CACHE.clear()
        cost = _FUNCTION_CACHE[key] = measure_function(call, *flags)
    return copy.copy(cost)


def measure_function(call: Call, inputs_grad: tuple[bool, ...], output_grad: bool) -> FunctionCost:
    """Run ``call`` once on meta inputs of its layouts, forward (and backward when
    ``output_grad``), under the storage meter (``_metered``, as a leaf is measured): what it
    keeps and allocates, per input where a function of several tensors can differ (which
    inputs it keeps, whose gradient is grad_output itself)."""
    inputs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=g)
              for (shape, stride, dtype), g in zip(call.layouts, inputs_grad)]

    def run(*xs: torch.Tensor) -> torch.Tensor:
        return call.func(*rebuild(call.args, list(xs)), **{k: rebuild(v, list(xs)) for k, v in call.kwargs})

    try:
        return _metered(run, inputs, output_grad)
    except Exception as exc:
        name = getattr(call.func, "__name__", str(call.func))
        raise CapabilityError(f"the runtime accounting cannot measure {name} (called between "
                              f"layers) on the meta device: {exc}") from None
