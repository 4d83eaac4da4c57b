"""Each leaf's cost measured on a meta twin (``edgetl.memory.leaf``) against the same layer
run for real on CPU under the meter, and the key its measurements are cached by."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgetl.cost import repeated
from edgetl.memory.leaf import leaf_parameters, measure, measured_cost, signature
from edgetl.memory.meter import StorageMeter
from edgetl.models.lean import ImagePool, InputNorm, LeanAvgPool2d, LeanGlobalAvgPool, PooledConv2d
from edgetl.models.lean_full import LeanReLU6
from edgetl.models.lean_side import LeanSideTail
from tests.test_lean_runtime import frozen

CH, RES = 8, 12


def side_tail(train: bool) -> LeanSideTail:
    torch.manual_seed(0)
    bn1, conv2, bn2 = nn.BatchNorm2d(CH), nn.Conv2d(CH, CH, 1, bias=False), nn.BatchNorm2d(CH)
    return LeanSideTail(bn1, conv2, bn2).train(train).apply(lambda m: m.train(train))


def image_pool(micro_batch: int, out_dtype: torch.dtype) -> ImagePool:
    pool = ImagePool(2)
    pool.set_input(InputNorm(out_dtype=out_dtype), micro_batch)
    return pool


F32, BF16, U8 = torch.float32, torch.bfloat16, torch.uint8
LEAVES = {  # id: (layer factory, input shape, input dtype, input requires grad)
    "frozen_fold_relu6": (lambda: frozen(), (2, CH, RES, RES), F32, True),
    "frozen_fold_linear": (lambda: frozen(act=False), (2, CH, RES, RES), F32, True),
    "frozen_depthwise_int8": (lambda: frozen(weight="int8", groups=CH), (3, CH, RES, RES), F32, True),
    "frozen_pointwise_bf16_int8": (lambda: frozen(act_dtype="bf16", weight="int8", kernel=1), (2, CH, 9, 9), BF16, True),
    "frozen_first_layer": (lambda: frozen(), (2, CH, RES, RES), F32, False),
    "frozen_batch_bn": (lambda: frozen(bn="batch"), (2, CH, RES, RES), F32, True),
    "frozen_batch_bn_bf16": (lambda: frozen(bn="batch", act_dtype="bf16", weight="int8"), (2, CH, RES, RES), BF16, True),
    "relu6_mask_in_place": (LeanReLU6, (2, CH, 7, 7), F32, True),
    "pooled_conv_k1": (lambda: PooledConv2d(CH, CH, 3, padding=1, bias=False, pool=1), (2, CH, RES, RES), F32, True),
    "pooled_conv_k2": (lambda: PooledConv2d(CH, CH, 5, padding=2, groups=2, pool=2), (2, CH, RES, RES), F32, True),
    "avg_pool": (lambda: LeanAvgPool2d(2), (2, CH, 9, 9), F32, True),
    "global_pool_bf16": (lambda: LeanGlobalAvgPool(F32), (2, CH, RES, RES), BF16, True),
    "input_norm_bf16": (lambda: InputNorm(out_dtype=BF16), (3, 3, RES, RES), U8, False),
    "image_pool_one_part": (lambda: image_pool(2, BF16), (1, 3, RES, RES), U8, False),
    "image_pool_by_two": (lambda: image_pool(2, F32), (5, 3, RES, RES), U8, False),
    "side_tail_batch_bn": (lambda: side_tail(True), (2, CH, 4, 4), F32, True),
    "side_tail_eval_bn": (lambda: side_tail(False), (2, CH, 4, 4), F32, True),
    "side_tail_one_sample": (lambda: side_tail(True), (1, CH, 2, 2), F32, True),
}


def _real_input(shape, dtype, grad: bool) -> torch.Tensor:
    torch.manual_seed(1)
    if dtype == U8:
        return torch.randint(0, 256, shape, dtype=U8)
    x = torch.randn(shape).to(dtype)
    return x.requires_grad_() if grad else x


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_measured_cost_is_what_the_layer_holds_running_for_real(name):
    make, shape, dtype, input_grad = LEAVES[name]
    layer = make()
    params = [p for p in leaf_parameters(layer) if p.requires_grad]
    output_grad = input_grad or bool(params)
    cost = measured_cost(layer, in_shape=shape, in_dtype=dtype, input_requires_grad=input_grad,
                         output_requires_grad=output_grad)
    base = _real_input(shape, dtype, input_grad)
    x = base.clone() if input_grad else base  # a non-leaf input, as in a network (ReLU6 writes it)
    meter = StorageMeter()
    meter.register(base, x, list(layer.parameters()), list(layer.buffers()))
    for m in getattr(layer, "parts", ()):  # the side tail's modules, held unregistered
        meter.register_module(m)
    start = meter.current_bytes
    with meter:
        y = layer(x)
    out = 0 if y.untyped_storage() is x.untyped_storage() else y.untyped_storage().nbytes()
    assert cost.inplace == (out == 0)
    assert meter.current_bytes - start == out + cost.saved_new_bytes
    assert meter.peak_bytes - start == out + cost.saved_new_bytes + cost.forward_temp_bytes
    if not output_grad:
        return
    gy = torch.randn(y.shape).to(y.dtype)
    meter.register(gy)
    meter.reset_peak()
    start = meter.current_bytes
    with meter:
        y.backward(gy)
    grads = sum(p.numel() * p.element_size() for p in params)
    if input_grad and cost.grad_input:
        grads += base.numel() * base.element_size()
    assert meter.peak_bytes - start == grads + cost.backward_temp_bytes
    meter.close()


def test_a_batch_statistics_layer_is_measured_at_one_sample_on_meta_only():
    """The per-image figures ask for a side tail's cost at one sample; on a 1x1 map a real
    call refuses it (batch BN over one value per channel), its meta measurement runs the
    same code (the 2x2 map's one-sample case, which does run, is checked above)."""
    tail = side_tail(True)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        tail(torch.randn(1, CH, 1, 1, requires_grad=True))
    cost = measured_cost(tail, in_shape=(1, CH, 1, 1), in_dtype=F32, input_requires_grad=True,
                         output_requires_grad=True)
    assert cost.saves_input and cost.saved_new_bytes == 4 * CH * 4  # both BNs' mean and invstd


def test_the_key_names_every_setting_that_changes_what_a_layer_allocates():
    conv = frozen(act_dtype="bf16", weight="int8", kernel=1)
    key, tensors, _ = signature(conv)
    assert signature(copy.deepcopy(conv))[0] == key
    assert {id(t) for t in tensors} == {id(t) for t in (*conv.parameters(), *conv.buffers())}
    shape = (4, CH, 9, 9)
    changes = {
        "mask_chunk": lambda m: setattr(m, "execution", {shape: {"mask_chunk": 2}}),
        "backward": lambda m: setattr(m, "execution", {shape: {"backward": "whole_batch"}}),
        "weight": lambda m: setattr(m, "execution", {None: {"weight": "whole"}}),
        "training": lambda m: m.eval(),
        "bias trains": lambda m: m.bias.requires_grad_(not m.bias.requires_grad),
        "weight dtype": lambda m: setattr(m, "weight", m.weight.to(torch.int16)),
    }
    for what, change in changes.items():
        other = copy.deepcopy(conv)
        change(other)
        assert signature(other)[0] != key, what
    tail = side_tail(True)
    hidden = copy.deepcopy(tail)
    hidden.parts[1].weight.requires_grad_(False)  # a module the tail holds without registering
    assert signature(hidden)[0] != signature(tail)[0]


def test_a_chunk_setting_changes_the_measured_forward():
    """The cache serves a new measurement when a setting changes, not the old one."""
    conv = frozen()
    shape = (4, CH, RES, RES)
    one = measured_cost(conv, in_shape=shape, in_dtype=F32, input_requires_grad=True, output_requires_grad=True)
    four = measured_cost(conv.configured({(4, conv.out_channels, RES, RES): {"mask_chunk": 4}}), in_shape=shape, in_dtype=F32, input_requires_grad=True, output_requires_grad=True)
    assert four.forward_temp_bytes > one.forward_temp_bytes
    assert four.saved_new_bytes == one.saved_new_bytes


FROZEN = sorted(name for name in LEAVES if name.startswith("frozen_"))


@pytest.mark.parametrize("name", FROZEN)
@pytest.mark.parametrize("batch", [1, 2, 5, 9])
def test_a_loop_cut_short_measures_what_the_whole_loop_does(name, batch):
    """The frozen conv loops over samples (its mask, its masked backward, a chunked 1x1
    weight); measured, those loops run 2 and 3 passes. The cost must be the one of the
    same call with every pass run (a meta measurement too: the real run is checked above),
    with the schedule's settings (mask chunks, whole-batch backward, whole weight) too."""
    make, shape, dtype, input_grad = LEAVES[name]
    conv = make()
    shape = (batch, *shape[1:])
    out_shape = (batch, conv.out_channels, *shape[2:])
    settings = [{}, {out_shape: {"mask_chunk": 2}}, {out_shape: {"mask_chunk": 2, "backward": "whole_batch"}},
                {out_shape: {"mask_chunk": 2, "backward": "whole_batch"}, None: {"weight": "whole"}}]
    output_grad = input_grad or conv.bias.requires_grad
    for setting in settings:
        conv = conv.configured(setting)
        cut = measured_cost(conv, in_shape=shape, in_dtype=dtype, input_requires_grad=input_grad,
                            output_requires_grad=output_grad)
        sig = signature(conv)
        whole, was_cut = measure(conv, sig, shape, dtype, input_grad, output_grad)
        assert not was_cut
        assert cut == whole, (setting, cut, whole)


def test_repeated_runs_every_pass_unless_measuring():
    passes = range(0, 10, 3)
    assert repeated(passes) is passes
    for name in ("frozen_fold_relu6", "frozen_pointwise_bf16_int8"):
        make, shape, dtype, input_grad = LEAVES[name]
        conv = make()
        sig = signature(conv)
        assert measure(conv, sig, (6, *shape[1:]), dtype, input_grad, True, passes=2)[1]
        assert not measure(conv, sig, (2, *shape[1:]), dtype, input_grad, True, passes=2)[1]
    assert repeated(passes) is passes  # the limit ends with the measurement


def test_a_leaf_is_measured_without_its_hooks():
    """A hook on the layer (a user's, or predicted_saved_bytes' own) is not run by the meta
    twin, and does not change the cost (the key leaves hooks out too)."""
    conv = frozen()
    shape = (2, CH, RES, RES)
    args = dict(in_shape=shape, in_dtype=F32, input_requires_grad=True, output_requires_grad=True)
    plain = measured_cost(conv, **args)

    def refuse(*_):
        raise AssertionError("a hook ran while the layer was measured")

    class Watcher:  # a hook's object (a recorder, a meter) is not copied into the twin either
        def __deepcopy__(self, memo):
            raise AssertionError("a hook's object was copied")

        def hook(self, *_):
            refuse()

    conv.register_forward_hook(refuse)
    hooked = copy.deepcopy(conv)
    hooked.register_forward_hook(Watcher().hook)
    hooked.execution = {(2, CH, RES, RES): {"mask_chunk": 2}}  # a new key: measured again, with the hook in place
    measured_cost(hooked, **args)
    assert measured_cost(conv, **args) == plain


class _Carries(nn.Module):
    """A loop whose passes are not alike: each leaves its product alive until the end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = []
        for i in repeated(range(x.shape[0])):
            kept.append(x[i:i + 1] * 2)
        return torch.cat(kept)


@pytest.mark.parametrize("batch", [7, 9])
def test_a_loop_whose_passes_differ_is_measured_whole(batch):
    layer = _Carries()
    shape = (batch, CH, 4, 4)
    cost = measured_cost(layer, in_shape=shape, in_dtype=F32, input_requires_grad=True, output_requires_grad=True)
    sig = signature(layer)
    cut, _ = measure(layer, sig, shape, F32, True, True, passes=2)
    whole, _ = measure(layer, sig, shape, F32, True, True)
    assert cost == whole != cut
