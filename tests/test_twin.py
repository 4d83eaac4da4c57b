"""Meta twins: ``copy_module`` makes what ``copy.deepcopy`` makes, object for object."""

from __future__ import annotations

import copy
import types
from collections import OrderedDict

import pytest
import torch
from torch import nn

from edgetl.memory.leaf import signature
from edgetl.twin import copy_module, meta_copy, meta_tensors
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import build_network
from edgetl.models.stream import apply_streams
from edgetl.options import LeanOptions

TINY = BackboneSpec(width=0.35, num_classes=10)
NETS = {
    "stock-repnet": (TINY, "repnet", None),
    "lean-repnet-pool2": (TINY, "repnet", dict(pool=2)),
    "lean-streamed-int8-bf16": (TINY, "repnet", dict(pool=2, stream=2, precision="bf16", frozen_weights="int8",
                                                     uint8_input=True, recompute=True)),
    "lean-bias-channels-last": (TINY, "bias", dict(pool=1, channels_last=True)),
    "lean-full-haar": (TINY, "full", dict(pool=1, storage="haar")),
    "lean-resnet18": (BackboneSpec(arch="resnet18", num_classes=10), "repnet", dict(pool=2, stream=1)),
}
_SHARED_ATOMS = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout,
                 types.FunctionType, types.BuiltinFunctionType, type)


def _same(a, b, pairs: dict, back: dict) -> None:
    """``b`` is ``a`` made again: the same types, layouts and values, and an object shared in
    ``a``'s graph (by identity) is shared in ``b``'s, and nothing more is."""
    if isinstance(a, _SHARED_ATOMS):
        assert a is b or (type(a) is type(b) and a == b), (a, b)
        return
    if id(a) in pairs:
        assert pairs[id(a)] is b, f"{type(a).__name__} shared in one copy, not in the other"
        return
    assert id(b) not in back, f"{type(b).__name__} shared in one copy, not in the other"
    pairs[id(a)], back[id(b)] = b, a
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.storage_offset()) == \
               (b.shape, b.stride(), b.dtype, b.device, b.requires_grad, b.storage_offset())
        if a.device.type != "meta":
            assert torch.equal(a, b)
        return
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k], pairs, back)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, pairs, back)
    elif isinstance(a, (set, frozenset)):
        assert a == b
    elif hasattr(a, "__dict__"):
        _same(vars(a), vars(b), pairs, back)
    else:
        assert a == b, (a, b)


def _objects(root) -> set[int]:
    """The ids of the mutable objects reachable from ``root`` (modules, tensors, containers;
    a tuple is looked into, as deepcopy shares a tuple of atoms)."""
    seen, todo, tuples = set(), [root], set()
    while todo:
        x = todo.pop()
        if isinstance(x, _SHARED_ATOMS) or id(x) in seen or id(x) in tuples:
            continue
        (tuples if type(x) is tuple else seen).add(id(x))
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, torch.Tensor):
            todo.append(vars(x))
    return seen


def _check(original: nn.Module, made_by_deepcopy: nn.Module, made: nn.Module) -> None:
    _same(made_by_deepcopy, made, {}, {})
    shared = _objects(original) & _objects(made)
    assert not shared, f"{len(shared)} objects of the original in its copy"


def _checked_meta_copy(net: nn.Module) -> nn.Module:
    """``meta_copy(net)``, checked against ``copy.deepcopy`` with the same meta tensors."""
    memo = meta_tensors([*net.parameters(), *net.buffers()])
    expected = copy.deepcopy(net, dict(memo))
    made = meta_copy(net)
    _check(net, expected, made)
    return made


@pytest.mark.parametrize("name", sorted(NETS))
def test_a_meta_twin_is_the_deepcopy_of_the_network(name):
    spec, mode, lean = NETS[name]
    torch.manual_seed(0)
    net = build_network(spec, mode, lean=None if lean is None else LeanOptions(**lean))
    handle = net.features[1].register_forward_hook(lambda m, a, o: None)  # a hook is copied as deepcopy does
    made = _checked_meta_copy(net)
    assert all(t.device.type == "meta" for t in [*made.parameters(), *made.buffers()])
    assert len(made.features[1]._forward_hooks) == 1
    handle.remove()
    # the twins leaf measurements run: each leaf's tensors meta, its hook tables empty
    for module in [m for m in net.modules() if not m._modules][:40]:
        sig = signature(module)
        memo = {**meta_tensors(sig.tensors), **sig.hook_tables}
        _check(module, copy.deepcopy(module, dict(memo)), copy_module(module, dict(memo)))


def test_a_streamed_network_and_a_module_of_its_own_copy_are_deep_copies():
    """Streams wrap blocks in segments that refer back to modules; a module with its own
    ``__deepcopy__``, a plain tensor attribute, a module held twice and a set of names."""

    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.copies = 0

        def __deepcopy__(self, memo):
            new = memo[id(self)] = Own()
            new.conv = copy.deepcopy(self.conv, memo)
            new.copies = self.copies + 1
            return new

    net = build_network(TINY, "repnet", device="meta", lean=LeanOptions(pool=2))
    apply_streams(net, {0: (3, 2), 5: (7, 1)})
    net.extra = nn.ModuleList([Own(), net.features[2]])  # a block held twice
    net.scale = torch.ones(3)  # a plain tensor attribute: copied, not made meta (as deepcopy does)
    net.names = {"a", "b"}
    net.table = OrderedDict(x=[1, 2])
    made = _checked_meta_copy(net)
    assert made.extra[1] is made.features[2] and made.extra[0].copies == 1
    assert made.extra[0].conv.weight.device.type == "meta"
    assert made.scale.device.type == "cpu" and made.scale is not net.scale


def test_a_module_with_its_own_setstate_is_handed_its_state_as_deepcopy_hands_it():
    """torch's convs restore a default in ``__setstate__``; a module's own ``__setstate__`` runs on
    the copied state, as in ``copy.deepcopy``."""

    class Restores(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 1)
            self.restored = 0

        def __setstate__(self, state):
            super().__setstate__(state)
            self.restored += 1

    net = nn.Sequential(Restores(), nn.Conv2d(3, 4, 3, padding_mode="reflect", padding=1))
    made = _checked_meta_copy(net)
    assert made[0].restored == 1 and net[0].restored == 0 and made[1].padding_mode == "reflect"


def test_a_meta_backbone_is_a_fresh_copy_of_one_built_per_spec():
    """``build_backbone(spec, "meta")`` copies a network built once per spec (and default dtype):
    the network a build makes, its tensors its own, its spec the caller's, and a change to one
    copy is not in the next."""
    from edgetl.models import backbone as B

    spec = BackboneSpec(width=0.35, num_classes=7, hidden={3: 20})
    state = torch.random.get_rng_state()
    first, fresh = B.build_backbone(spec, device="meta"), B._build(spec, "meta")
    assert torch.equal(state, torch.random.get_rng_state())  # a meta build draws nothing
    assert first.spec is spec and repr(first) == repr(fresh)
    _same(fresh, first, {}, {})
    first.features[3].conv[0][0].weight.requires_grad_(False)
    first.features[0] = nn.Identity()
    second = B.build_backbone(spec, device="meta")
    _same(fresh, second, {}, {})
    assert not {id(t) for t in first.parameters()} & {id(t) for t in second.parameters()}
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float64)
        try:
            doubled = B.build_backbone(spec, device="meta")
        finally:
            torch.set_default_dtype(torch.float32)
    assert {p.dtype for p in doubled.parameters()} == {torch.float64}


def test_meta_tensors_keep_layout_and_trainability():
    weight = nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last), requires_grad=False)
    depthwise = torch.randn(4, 1, 3, 3).to(memory_format=torch.channels_last)  # contiguous, yet its own strides
    assert depthwise.is_contiguous() and depthwise.stride() != torch.empty(4, 1, 3, 3).stride()
    tensors = [weight, depthwise, torch.randn(5, 6).t(), torch.zeros(3, dtype=torch.int8), nn.Parameter(torch.ones(2))]
    memo = meta_tensors(tensors)
    for t in tensors:
        m = memo[id(t)]
        expected = torch.empty_like(t, device="meta")
        assert (m.shape, m.stride(), m.dtype, m.device.type) == (t.shape, expected.stride(), t.dtype, "meta")
        assert type(m) is type(t) and m.requires_grad == t.requires_grad
