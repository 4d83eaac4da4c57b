"""``edgetl.metaop``: an op on meta tensors taken from memory gives what torch's own
meta kernel gives, and a measurement made with it is the measurement made without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgetl import metaop
from edgetl.memory.leaf import leaf_parameters, measure, signature
from edgetl.memory.meter import StorageMeter
from edgetl.metaop import MetaMemo, meta_call
from tests.test_leaf import LEAVES

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32, **kwargs) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta", **kwargs)


def layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes())


CALLS = {  # id: (op, args, kwargs) on meta tensors
    "gt": (aten.gt.Scalar, (meta(2, 3, 5, 5), 0), {}),
    "mul_int_by_float": (aten.mul.Tensor, (meta(4, 6, dtype=torch.int32), meta(6)), {}),
    "add_broadcast": (aten.add.Tensor, (meta(3, 1, 4), meta(5, 1)), {"alpha": 2}),
    "channels_last_mul": (aten.mul.Tensor, (meta(2, 8, 4, 4).to(memory_format=torch.channels_last), 3.0), {}),
    "clamp": (aten.clamp.default, (meta(7, 3), 0.0, 6.0), {}),
    "conv": (aten.convolution.default, (meta(2, 4, 9, 9), meta(8, 4, 3, 3), None, [2, 2], [1, 1], [1, 1],
                                        False, [0, 0], 1), {}),
    "batch_norm": (aten.native_batch_norm.default, (meta(3, 4, 5, 5), meta(4), meta(4), meta(4), meta(4),
                                                    True, 0.1, 1e-5), {}),
    "conv_backward_mask": (aten.convolution_backward.default,
                           (meta(2, 8, 5, 5), meta(2, 4, 9, 9), meta(8, 4, 3, 3), None, [2, 2], [1, 1], [1, 1],
                            False, [0, 0], 1, [False, True, False]), {}),
    "empty_strided": (aten.empty_strided.default, ([3, 4], [1, 3]), {"dtype": torch.bfloat16, "device": "meta"}),
    "cat": (aten.cat.default, ([meta(2, 3), meta(4, 3)],), {}),
    "to_bf16": (aten._to_copy.default, (meta(5, 5),), {"dtype": torch.bfloat16}),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_remembered_result_has_the_layout_torch_gives(name):
    func, args, kwargs = CALLS[name]
    metaop._MEMO.clear()
    want = func(*args, **kwargs)  # torch's own meta kernel
    first, again = meta_call(func, args, kwargs), meta_call(func, args, kwargs)
    if isinstance(want, torch.Tensor):
        want, first, again = (want,), (first,), (again,)
    for w, f, a in zip(want, first, again, strict=True):
        if w is None:
            assert f is None and a is None
            continue
        assert layout(f) == layout(w) and layout(a) == layout(w)
        assert a is not f and a.untyped_storage() is not f.untyped_storage()


def test_an_in_place_op_returns_its_argument_and_a_view_is_never_remembered():
    x = meta(4, 6)
    metaop._MEMO.clear()
    for _ in range(2):
        assert meta_call(aten.clamp_.default, (x, 0.0, 6.0), {}) is x
    views = [meta_call(aten.view.default, (x, [6, 4]), {}) for _ in range(2)]
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)
    assert not any(key[0] is aten.view.default for key in metaop._MEMO)


def test_an_op_that_rebinds_its_argument_always_runs():
    x, source = meta(3, 3), meta(3, 3)
    metaop._MEMO.clear()
    for _ in range(2):
        meta_call(aten.set_.source_Tensor, (x, source), {})
        assert x.untyped_storage()._cdata == source.untyped_storage()._cdata
        x = meta(3, 3)


def test_an_in_place_op_that_changes_its_arguments_layout_always_runs():
    metaop._MEMO.clear()
    for _ in range(2):
        x = meta(3, 4)
        assert meta_call(aten.unsqueeze_.default, (x, 0), {}) is x and x.shape == (1, 3, 4)


def test_a_factory_op_follows_the_default_dtype():
    metaop._MEMO.clear()
    before = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            assert meta_call(aten.empty.memory_format, ([2, 3],), {"device": "meta"}).dtype == dtype
    finally:
        torch.set_default_dtype(before)


def test_a_real_tensor_is_never_taken_from_memory():
    x = torch.arange(6.0)
    for _ in range(2):
        assert torch.equal(meta_call(aten.mul.Tensor, (x, 2.0), {}), x * 2)


def test_torchs_meta_kernel_runs_once_per_layout():
    calls = []
    lib = torch.library.Library("edgetl_metaop_test", "FRAGMENT")
    lib.define("twice(Tensor x, int k) -> Tensor")

    def kernel(x, k):
        calls.append((tuple(x.shape), k))
        return x.new_empty(x.shape[0] * 2, *x.shape[1:])

    lib.impl("twice", kernel, "Meta")
    op = torch.ops.edgetl_metaop_test.twice.default
    with MetaMemo():
        for shape, k in [((2, 3), 1), ((2, 3), 1), ((2, 3), 2), ((5, 3), 1), ((2, 3), 1)]:
            assert op(meta(*shape), k).shape == (shape[0] * 2, 3)
    assert calls == [((2, 3), 1), ((2, 3), 2), ((5, 3), 1)]


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_a_leaf_measures_the_same_with_torchs_meta_kernels_every_time(name, monkeypatch):
    """The measurement through the memory against the measurement where every op runs
    torch's meta kernel (the memory turned off), each at batches that reuse its entries."""
    factory, shape, dtype, input_grad = LEAVES[name]
    layer = factory()
    output_grad = input_grad or any(p.requires_grad for p in leaf_parameters(layer))
    sig = signature(layer)
    for batch in (shape[0], shape[0] + 3, shape[0]):
        args = (layer, sig, (batch, *shape[1:]), dtype, input_grad, output_grad)
        remembered = measure(*args)[0]
        with monkeypatch.context() as m:
            m.setattr("edgetl.memory.meter.meta_call", lambda func, a, kw: func(*a, **kw))
            plain = measure(*args)[0]
        assert remembered == plain


def test_a_metered_step_on_meta_counts_the_same_bytes_and_ops(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU6(inplace=True),
                              torch.nn.Flatten(), torch.nn.LazyLinear(4))
    net(torch.empty(2, 3, 10, 10))  # the lazy layer's shape
    net = net.to("meta")

    def step():
        meter = StorageMeter()
        meter.register_module(net)
        x = meta(6, 3, 10, 10)
        meter.register(x)
        with meter:
            for _ in range(2):
                F.cross_entropy(net(x), torch.zeros(6, dtype=torch.long, device="meta")).backward()
                for p in net.parameters():
                    p.grad = None
        meter.close()
        return meter.peak_bytes, meter.current_bytes, meter.op_count

    remembered = step()
    monkeypatch.setattr("edgetl.memory.meter.meta_call", lambda func, a, kw: func(*a, **kw))
    assert remembered == step()
