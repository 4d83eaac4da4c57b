"""The second instrument (issue #42 item 4): the CPU allocator's own events against the runtime
accounting's prediction and the storage meter, for stock Rep-Net, the lean runtime and lean full
fine-tuning. The allocator's peak is the meter's plus what the meter cannot see by design, and
each byte of the difference is named."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetl.memory.alloc_events import measure_allocator_memory, record_allocations
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network, make_lean

SPEC = BackboneSpec(width=0.35, num_classes=10)
RES, BATCH = 64, 2

# The ops whose kernels allocate blocks they free before returning (each checked below only
# as a set: a new op here is a new blind spot of the meter, to be explained before it is added):
SCRATCH_OPS = {
    # oneDNN (through ideep, whose engine allocator is c10's CPU allocator): plain-layout
    # source, weights and destination reordered into blocked copies, and the primitive's
    # scratchpad
    "aten::convolution", "aten::convolution_backward",
    # per-channel scale and shift (eval forward), per-channel sums (backward)
    "aten::native_batch_norm", "aten::native_batch_norm_backward",
    "aten::upsample_bilinear2d",  # source indices and interpolation weights
    # TensorIterator's 0-dim CPU copy of a scalar operand in another dtype (Adam's step math,
    # the lean runtime's mask packing, BN running statistics updated with foreach ops)
    "aten::add_", "aten::add", "aten::mul_", "aten::mul", "aten::div", "aten::div_", "aten::sum",
    "aten::mean", "aten::__rshift__", "aten::gt", "aten::lt", "aten::bitwise_and_",
    "aten::_foreach_mul_", "aten::_foreach_add_",
}


def stock() -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    return build_network(SPEC, "repnet"), "repnet"


def lean() -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2))
    prepare_step(net, resolution=RES, batch_size=BATCH)
    return net, "repnet"


def lean_channels_last() -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2, channels_last=True))
    prepare_step(net, resolution=RES, batch_size=BATCH)
    return net, "repnet"


def lean_full() -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    net = build_network(SPEC, "full").eval()
    make_lean(net, LeanOptions(storage="pool2", keep=0.25))
    return net, "full"


def _like(t: torch.Tensor) -> torch.Tensor:
    """A random tensor laid out as ``t`` (shape, strides, offset: an expanded gradient stays
    expanded, as the kernel's scratch depends on the layout)."""
    base = torch.randn(t.untyped_storage().nbytes() // t.element_size()).to(t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


class _CaptureCalls(TorchDispatchMode):
    """Notes every call of ``names``: the op and its arguments with each tensor replaced by a
    fresh random one of the same shape, strides and dtype (to replay the call alone)."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names, self.calls = names, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.names:
            fresh = [_like(a) if isinstance(a, torch.Tensor) else a for a in args]
            self.calls.append((func, fresh, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _replay_scratch(net: torch.nn.Module, op: str, call: int, shapes: tuple) -> list[int]:
    """The scratch blocks live at the peak of call ``call`` of ``op`` in two training steps of
    ``net``, replayed alone (outside the step, on fresh tensors) under the allocator's events."""
    capture = _CaptureCalls({op})
    with capture:
        measure_training_peak(copy.deepcopy(net), resolution=RES, batch_size=BATCH, steps=2)
    func, args, kwargs = capture.calls[call]
    assert tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args) == shapes[:len(args)]
    _, events = record_allocations(lambda: func(*args, **kwargs))
    return sorted(a.nbytes for a in events.live_at(events.peak_index()) if a.kind == "scratch")


@pytest.mark.parametrize("build", [stock, lean, lean_channels_last, lean_full],
                         ids=["stock-repnet", "lean-repnet", "lean-repnet-channels-last", "lean-full"])
def test_allocator_events_are_the_meter_plus_what_it_cannot_see(build):
    net, mode = build()
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=BATCH).total_bytes
    twin = copy.deepcopy(net)  # the same weights and schedule for the second instrument
    measured = measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2)
    alloc = measure_allocator_memory(twin, resolution=RES, batch_size=BATCH, steps=2)
    events = alloc.events
    assert predicted == measured

    # (1) the blocks that outlive the op that made them are the meter's tensors: same peak
    assert alloc.tensor_peak_bytes == measured

    # (2) what the meter cannot see: scratch freed inside its op, and Python numbers wrapped in
    # 0-dim tensors (float64 or int64: 8 bytes) for an op's Tensor argument
    assert {a.op for a in events.allocations if a.kind == "scratch"} <= SCRATCH_OPS
    wrapped = [a for a in events.allocations if a.kind == "wrapped"]
    assert wrapped and {a.nbytes for a in wrapped} == {8} and all(a.freed for a in wrapped)
    # nothing of the run outlives it but the optimizer's state, dropped with the optimizer
    assert not [a for a in events.allocations if not a.freed]

    # (3) the allocator's peak = the tensors live then + the scratch of one op call live then
    peak = events.peak_index()
    live = events.live_at(peak)
    kinds = Counter()
    for a in live:
        kinds[a.kind] += a.nbytes
    assert alloc.peak_bytes == alloc.baseline_bytes + kinds["tensor"] + kinds["scratch"] + kinds["wrapped"]
    assert alloc.baseline_bytes + kinds["tensor"] <= measured < alloc.peak_bytes
    scratch = [a for a in live if a.kind == "scratch"]
    calls = {(a.op, a.call, a.op_shapes) for a in scratch}
    assert len(calls) == 1
    (op, call, shapes), = calls
    assert op in ("aten::convolution", "aten::convolution_backward")
    # ... and that call, replayed alone, holds exactly those blocks of scratch at its own peak
    assert sorted(a.nbytes for a in scratch) == _replay_scratch(twin, op, call, shapes)

    # (4) wrapped numbers live at the tensors' peak are the only other difference
    at_tensor_peak = events.live_at(events.peak_index(("tensor", "wrapped")))
    wrapped_then = sum(a.nbytes for a in at_tensor_peak if a.kind == "wrapped")
    assert alloc.baseline_bytes + events.peak_bytes(("tensor", "wrapped")) == measured + wrapped_then


def test_the_baseline_is_the_networks_weights_and_buffers():
    """What the allocator events cannot see of a run (blocks allocated before it) is counted from
    the tensors; building the network under the events gives the same bytes still live."""
    net, events = record_allocations(lambda: stock()[0])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*net.parameters(), *net.buffers()]}
    assert events.live_bytes()[-1] == sum(storages.values())
