"""An aten op on meta tensors, its result's layout remembered: torch's meta kernels, run once.

The accounting measures layers by running them on the meta device (``edgetl.memory.leaf``,
``edgetl.memory.meter``). There torch computes each result's shape, strides and dtype with
its Python meta functions (``torch._meta_registrations``, ``torch._refs``), which replace the
C++ ones for most elementwise ops: a comparison or a multiply of a few hundred elements takes
~0.3 ms and a clamp ~3 ms on meta, against ~0.01 ms on CPU. A measured layer runs the same
few ops on the same shapes again and again (every pass of a loop over samples, every batch a
search tries, every measurement of the same layer at another batch).

``meta_call`` runs an op as torch would, and the first time it sees an op on arguments of a
given layout (shapes, strides, offsets, dtypes and the plain arguments, by type and value;
and torch's default dtype, which a factory op without a dtype takes) it keeps the layout of
the result, when the result can be made again without the op:

* every result is a new tensor (the schema gives it no alias): it is made again as an empty
  meta tensor of the same shape, strides and dtype, checked to have the same storage size
  and offset as the one the op returned;
* or the op writes its first argument in place and returns it (``mul_``, ``clamp_``): it is
  returned again, checked that the op changed none of its layout.

Any other op (a view, an ``out=`` op, one that returns no tensor, one with an argument
the key cannot hold) always runs. The first call on each layout runs the op itself, so an
op that fails on those arguments still fails, and what it returns is what torch returns.
This is FakeTensor's dispatch cache (``torch._subclasses.fake_tensor``) for plain meta
tensors, which edgetl measures with (a FakeTensor would change the tensors the layers see).
On meta nothing but layout exists, so a remembered layout is the op's whole result.
"""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import TorchDispatchMode

_FRESH, _SELF, _RUNS = 0, 1, 2
_MISSING = object()
# (op, argument layout) -> ((shape, stride, dtype) or None of each result, ...) for a _FRESH
#                          op, () for a _SELF op, None: the op always runs
_MEMO: dict[tuple, tuple | None] = {}
_MEMO_LIMIT = 1 << 17
_META = torch.device("meta")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # no subclass that dispatches on its own
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unkeyable(Exception):
    pass


def meta_call(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` (an aten op overload), taken from memory where every tensor
    argument is on meta and this op ran on arguments of the same layout before."""
    form = _FORM.get(func)
    if form is None:
        form = _FORM[func] = _form(func._schema)
    if form == _RUNS or (args and type(args[0]) in _PLAIN_TENSORS and args[0].device != _META):
        return func(*args, **kwargs)  # a view or out= op, or a real op (on a real tensor)
    try:
        # a factory op without a dtype makes torch's default dtype: part of the layout
        key = (func, _key(args), _key(kwargs) if kwargs else None, torch.get_default_dtype())
    except _Unkeyable:
        return _run(func, args, kwargs)
    entry = _MEMO.get(key, _MISSING)
    if entry is None:
        return _run(func, args, kwargs)
    if entry is _MISSING:
        if len(_MEMO) > _MEMO_LIMIT:
            _MEMO.clear()
        before = _layout(args[0]) if form == _SELF and args else None
        out = _run(func, args, kwargs)
        _MEMO[key] = _remember(form, args, out, before, len(func._schema.returns))
        return out
    if form == _SELF:
        return args[0]
    made = tuple(None if layout is None else torch.empty_strided(*layout[:2], dtype=layout[2], device=_META)
                 for layout in entry)
    return made if len(made) != 1 else made[0]


_CONVOLUTION = torch.ops.aten.convolution.default


def _run(func, args: tuple, kwargs: dict):
    """``func`` on meta tensors, a convolution's result laid out as a device lays it out.

    torch's CPU and CUDA kernels write a conv's output channels-last where its input or its
    weight suggests that layout (``suggest_memory_format``: oneDNN, the CPU's own kernels,
    cuDNN); its meta kernel always writes it plain. A channels-last network measured on meta
    would then run its plain paths (``edgetl.models.lean.layout``): the same bytes, other ops.
    The result is made again with the channels-last strides (same shape, dtype and storage size;
    a map of one channel or one pixel too, whose strides differ only in its size-1 dimensions)."""
    out = func(*args, **kwargs)
    if func is not _CONVOLUTION or out.dim() != 4:
        return out
    if torch.channels_last in (suggest_memory_format(args[0]), suggest_memory_format(args[1])):
        laid = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=torch.channels_last)
        if laid.stride() != out.stride():
            return laid
    return out


class MetaMemo(TorchDispatchMode):
    """Every aten op in its scope goes through ``meta_call`` (a forward on meta run only for
    its shapes, as ``edgetl.memory.trace`` does)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return meta_call(func, args, kwargs or {})


_FORM: dict = {}  # op -> _FRESH, _SELF or _RUNS, read off its schema once


def _form(schema) -> int:
    """_FRESH: every result is new (no alias); _SELF: it writes its first argument and returns
    it; _RUNS: anything else (a view, an out= op, several written arguments)."""
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    aliased = [r for r in schema.returns if r.alias_info is not None]
    if not written and not aliased:
        return _FRESH
    if (len(written) == 1 and written[0].name == schema.arguments[0].name and len(schema.returns) == 1
            and aliased and aliased[0].alias_info.is_write and not _rebinds(schema.name)):
        return _SELF
    return _RUNS


def _rebinds(name: str) -> bool:
    """An in-place op that may give its argument another storage or layout (``set_``,
    ``resize_``, ``as_strided_``): always run, whatever the layouts."""
    op = name.split("::")[-1]
    return "set_" in op or op.startswith(("resize", "_resize", "as_strided"))


def _key(value) -> tuple:
    """The layout of an op's arguments: tensors by shape, strides, offset and dtype (meta
    only), plain values by type and value; lists, tuples and dicts of those."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        if value.device != _META or value.layout != torch.strided:
            raise _Unkeyable
        return (value.shape, value.stride(), value.storage_offset(), value.dtype)
    if kind in _PLAIN:
        return (kind, value)
    if kind is tuple or kind is list or kind is torch.Size:
        return (kind, *[_key(v) for v in value])
    if kind is dict:
        return tuple((k, _key(v)) for k, v in value.items())
    raise _Unkeyable  # a tensor subclass, a generator, a SymInt ...


def tensors_in(value):
    """The tensors in an op's output or arguments: a tensor, or tuples, lists (foreach ops)
    and dicts (kwargs) of them, nested. ``tree_leaves`` finds the same; this runs on every op
    the storage meter sees, where pytree's generality cost a quarter of a metered step."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())


def _remember(form: int, args: tuple, out, before, returns: int) -> tuple | None:
    """The entry for this op's result (see the module docstring); None: it cannot be made
    again without the op, so it always runs."""
    if form == _SELF:  # it must have changed none of its first argument's layout
        return () if before is not None and out is args[0] and _layout(out) == before else None
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != returns or all(t is None for t in outs):
        return None
    made = [t for t in outs if t is not None]
    if any(type(t) is not torch.Tensor or t.device != _META or t.layout != torch.strided for t in made):
        return None
    storages = {id(t.untyped_storage()) for t in made}
    if len(storages) != len(made) or any(id(a.untyped_storage()) in storages for a in tensors_in(args)):
        return None
    layouts = tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in outs)
    for t in made:
        again = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
        if t.storage_offset() != 0 or again.untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return None
    return layouts
