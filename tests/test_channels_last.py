"""Channels-last lean runtime (``LeanOptions.channels_last``): the same step as the plain (NCHW)
one, to rounding, holding the same bytes, with its layout kept from the batch to the last
gradient (no lean layer makes a plain copy), and refused where it is not built."""

from __future__ import annotations

import copy
import dataclasses
import traceback
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from edgetl.errors import ConfigError
from edgetl.memory.meter import measure_training_peak, random_batch
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import apply_schedule, prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import pack_mask_, unpack_as, unpack_table
from edgetl.models.lean.convgrad import conv_input_grad
from edgetl.models.lean.frozen import _act_mask
from edgetl.models.lean.layout import empty_as, is_channels_last, memory_flat
from edgetl.models.side import LeanOptions, build_network
from edgetl.options import LeanOptions as Options
from edgetl.recipe import ModelConfig
from edgetl.step import Step, set_train_mode
from edgetl.train import input_memory_format

from tests.conftest import FMNIST_REASON, HAVE_FMNIST

needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)

CL = torch.channels_last
TINY = BackboneSpec(width=0.35, num_classes=10)
PRUNED = BackboneSpec(width=0.35, num_classes=10, hidden={1: 5, 2: 10})
R18 = BackboneSpec(arch="resnet18", num_classes=10)
RES = 64

# (spec, options, batch, mode): every path of the lean layers once (folded and batch BN, int8 and
# fp16 weights, bf16 activations, streamed with and without recompute, the uint8 batch, bias
# modes, ResNet's max pool and residual blocks, micro-batches of one sample)
CONFIGS = {
    "k1-fp32": (TINY, LeanOptions(pool=1), 2, "repnet"),
    "k2-bf16-int8": (TINY, LeanOptions(pool=2, precision="bf16", frozen_weights="int8"), 2, "repnet"),
    "pruned-batch-bn-int8": (PRUNED, LeanOptions(pool=4, frozen_weights="int8", bn="batch"), 3, "repnet"),
    "batch-bn-bf16-fp16": (PRUNED, LeanOptions(pool=2, precision="bf16", frozen_weights="fp16", bn="batch"), 2,
                           "repnet"),
    "stream1": (TINY, LeanOptions(pool=2, stream=1), 3, "repnet"),
    "stream1-recompute-uint8-bf16-int8": (TINY, LeanOptions(pool=2, stream=1, recompute=True, uint8_input=True,
                                                            precision="bf16", frozen_weights="int8"), 3, "repnet"),
    "repnet+bias-bf16-int8": (PRUNED, LeanOptions(pool=1, precision="bf16", frozen_weights="int8"), 3,
                              "repnet+bias"),
    "bias": (TINY, LeanOptions(pool=1), 2, "bias"),
    "resnet18": (R18, LeanOptions(pool=2), 2, "repnet"),
    "resnet18-stream1": (R18, LeanOptions(pool=2, stream=1), 2, "repnet"),
}


def twins(spec, lean: LeanOptions, batch: int, mode: str):
    """The network plain and channels-last, the same weights, each with its fitted schedule."""
    torch.manual_seed(0)
    plain = build_network(spec, mode, lean=lean)
    cl = build_network(spec, mode, lean=dataclasses.replace(lean, channels_last=True))
    cl.load_state_dict(plain.state_dict())
    for net in (plain, cl):
        apply_schedule(net, prepare_step(net, resolution=RES, batch_size=batch))
    return plain, cl


class _PlainMaps(TorchDispatchMode):
    """Counts the ops that make a plain (NCHW) batch-sized map: a tensor of ``batch`` samples of
    more than one channel and pixel that is not channels-last (views only re-read a tensor, and
    the image's three channels are the loader's)."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.made = batch, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(o, torch.Tensor) and o.dim() == 4 and o.shape[0] == self.batch and o.shape[1] > 3
                        and o.shape[2] * o.shape[3] > 1 and not is_channels_last(o)):
                    where = [f for f in traceback.extract_stack() if "/edgetl/" in f.filename]
                    self.made[(func.overloadpacket.__name__, f"{where[-1].filename}:{where[-1].lineno}"
                               if where else "?")] += 1
        return out


def _grads(net, image, labels, watch=None):
    set_train_mode(net, "fold")
    torch.manual_seed(5)  # the classifier's dropout: the same mask for both twins
    with watch if watch is not None else torch.enable_grad():
        logits = net(image.contiguous(memory_format=input_memory_format(net)))
        Step().loss(logits, labels).backward()
    return logits.detach().float(), {k: p.grad.float() for k, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_channels_last_step_is_the_plain_step(name):
    spec, lean, batch, mode = CONFIGS[name]
    plain, cl = twins(spec, lean, batch, mode)
    image, labels = random_batch(plain, resolution=RES, batch_size=batch, seed=1, device="cpu")
    logits, grads = _grads(plain, image, labels)
    watch = _PlainMaps(batch)
    logits_cl, grads_cl = _grads(cl, image, labels, watch)
    # the layout is kept from the batch to the last gradient: no layer made a plain map
    assert not watch.made, dict(watch.made)
    assert grads.keys() == grads_cl.keys()
    if lean.precision == "fp32":  # the same sums in other orders: equal to rounding
        torch.testing.assert_close(logits_cl, logits, rtol=1e-4, atol=1e-5)
        scale = max(g.abs().max().item() for g in grads.values())
        for k in grads:
            torch.testing.assert_close(grads_cl[k], grads[k], rtol=1e-3, atol=1e-5 * scale, msg=k)
    else:  # bf16 rounds each op's result to 8 bits: the gradient as a whole points the same way
        flat, flat_cl = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (grads, grads_cl))
        assert F.cosine_similarity(flat, flat_cl, dim=0) > 0.99
        torch.testing.assert_close(logits_cl, logits, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["k2-bf16-int8", "pruned-batch-bn-int8", "stream1-recompute-uint8-bf16-int8",
                                  "resnet18-stream1"])
def test_channels_last_holds_the_plain_bytes_as_predicted(name):
    """Predicted = measured for the channels-last network, and both equal the plain network's
    measured peak: the layout moves no byte."""
    spec, lean, batch, mode = CONFIGS[name]
    plain, cl = twins(spec, lean, batch, mode)
    predicted = runtime_report(cl, mode=mode, resolution=RES, batch_size=batch).total_bytes
    measured = measure_training_peak(cl, resolution=RES, batch_size=batch, steps=2)
    assert predicted == measured == measure_training_peak(plain, resolution=RES, batch_size=batch, steps=2)


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("shape", [(2, 8, 4, 4), (1, 16, 3, 3), (3, 5, 3, 1)])
@pytest.mark.parametrize("chunk", [1, 8])
def test_masks_are_packed_and_read_in_memory_order(shape, chunk):
    """A channels-last activation's mask is packed pixel by pixel and unpacks to the same mask
    as the plain tensor's (aligned samples chunk by chunk, unaligned ones whole)."""
    torch.manual_seed(0)
    y = torch.randn(shape).mul_(4).clamp_(0, 6)
    y[0, 0, 0, 0] = 6.0
    y_cl = y.contiguous(memory_format=CL)
    packed, packed_cl = _act_mask(y.clone(), chunk), _act_mask(y_cl.clone(), chunk)
    table = unpack_table(torch.float32, "cpu")
    want = ((y > 0) & (y < 6)).float()
    assert torch.equal(unpack_as(packed, shape, table), want)
    got = unpack_as(packed_cl, shape, table, channels_last=is_channels_last(y_cl))
    assert torch.equal(got, want)
    if is_channels_last(y_cl):  # read back laid out as it was packed, no copy
        assert is_channels_last(got)
        assert torch.equal(packed_cl, pack_mask_(memory_flat(want.contiguous(memory_format=CL)).bool().clone()))


@pytest.mark.parametrize("groups,kernel,stride", [(1, 1, 1), (16, 3, 1), (16, 3, 2), (1, 3, 1)])
def test_conv_input_grad_keeps_channels_last(groups, kernel, stride):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 9, 9)
    w = torch.randn(32 if groups == 1 else 16, 16 // groups, kernel, kernel)
    y = F.conv2d(x, w, None, stride, kernel // 2, 1, groups)
    g = torch.randn(y.shape)
    want = conv_input_grad(x.shape, w, g, stride, kernel // 2, 1, groups)
    got = conv_input_grad(x.shape, w, g.contiguous(memory_format=CL), stride, kernel // 2, 1, groups)
    assert is_channels_last(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layout_helpers():
    t = torch.empty(2, 3, 4, 5).contiguous(memory_format=CL)
    assert is_channels_last(t) and not is_channels_last(t.contiguous())
    # one channel or one pixel: both orders are the same, read as plain
    assert not is_channels_last(torch.empty(2, 1, 4, 5).contiguous(memory_format=CL))
    assert not is_channels_last(torch.empty(2, 3, 1, 1).contiguous(memory_format=CL))
    assert is_channels_last(empty_as(t, (2, 6, 2, 2))) and not is_channels_last(empty_as(t, (2, 6, 2, 2),
                                                                                         channels_last=False))
    assert empty_as(t, (4, 5)).is_contiguous()
    flat = memory_flat(t)
    assert flat.data_ptr() == t.data_ptr()  # a view, in memory order
    ref = torch.arange(120.).view(2, 4, 5, 3).permute(0, 3, 1, 2)
    assert torch.equal(memory_flat(ref), torch.arange(120.))


# ----------------------------------------------------------------------------- the option


def test_channels_last_network_and_batch():
    net = build_network(TINY, "repnet", lean=LeanOptions(channels_last=True))
    assert net.input_memory_format == CL and input_memory_format(net) == CL
    assert all(p.is_contiguous(memory_format=CL) for p in net.parameters() if p.dim() == 4)
    image, _ = random_batch(net, resolution=RES, batch_size=2, seed=0, device="cpu")
    assert is_channels_last(image)
    # the loop's batch: one copy on a CPU; on another device (meta stands in for one here)
    # converted on the host first, so the device holds it once, channels-last
    from edgetl.train.loop import device_batch

    loaded = torch.rand(2, 3, RES, RES)
    for device in ("cpu", "meta"):
        assert is_channels_last(device_batch(loaded, net, torch.device(device)))
    plain = build_network(TINY, "repnet", lean=LeanOptions())
    assert device_batch(loaded, plain, torch.device("cpu")) is loaded
    assert input_memory_format(plain) == torch.contiguous_format
    assert random_batch(plain, resolution=RES, batch_size=2, seed=0, device="cpu")[0].is_contiguous()


def test_channels_last_is_refused_where_it_is_not_built():
    with pytest.raises(ConfigError, match="channels_last is for a frozen lean backbone"):
        build_network(TINY, "full", lean=LeanOptions(channels_last=True))
    with pytest.raises(ConfigError, match="model.channels_last True does not apply to mode repnet on stock"):
        ModelConfig(mode="repnet", runtime="stock", channels_last=True).lean()
    assert ModelConfig(mode="repnet", channels_last=True).lean().channels_last
    with pytest.raises(ConfigError, match="channels_last"):
        Options(channels_last="yes")


def test_the_deepcopy_and_meta_copy_keep_the_layout():
    """The accounting's meta copies (and ``copy.deepcopy``) keep the weights' layout."""
    net = build_network(TINY, "repnet", lean=LeanOptions(channels_last=True))
    for twin in (copy.deepcopy(net), copy.deepcopy(net).to("meta")):
        assert all(p.is_contiguous(memory_format=CL) for p in twin.parameters() if p.dim() == 4)
        assert twin.input_memory_format == CL


def test_the_accounting_measures_each_leaf_laid_out_as_it_runs():
    """The runtime accounting's trace keeps the layout (torch's meta kernel writes a conv's
    output plain; ``edgetl.metaop`` lays it out as a device does), so every frozen conv of a
    channels-last network is measured on a channels-last input, running the code it runs, and
    the meta op count is the real step's."""
    from edgetl.memory.meter import count_step_ops
    from edgetl.memory.runtime import simulate
    from edgetl.models.lean import FrozenConvBNAct

    spec, lean, batch, mode = CONFIGS["k1-fp32"]
    plain, cl = twins(spec, lean, batch, mode)
    for net, want in ((plain, False), (cl, True)):
        res = simulate(net, resolution=RES, batch_size=batch)
        layouts = {args["in_channels_last"] for m, args in res.layer_args.values() if isinstance(m, FrozenConvBNAct)}
        assert layouts == {want}
    counted = count_step_ops(cl, resolution=RES, batch_size=batch)

    class _Count(TorchDispatchMode):  # every op of a real CPU step, as the meta counter splits them
        op_count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.op_count += 1
            return func(*args, **(kwargs or {}))

    from edgetl.memory.meter import _counted_step
    from edgetl.step import training_step

    step = Step()
    opt = step.optimizer(cl)
    set_train_mode(cl, step.bn)
    image, labels = random_batch(cl, resolution=RES, batch_size=batch, seed=0, device="cpu")
    training_step(cl, step, opt, image, labels)  # the optimizer's state exists, as counted
    counter = _Count()
    with counter:
        real = _counted_step(cl, opt, lambda: training_step(cl, step, opt, image, labels), counter)
    assert (real.forward, real.backward, real.optimizer) == (counted.forward, counted.backward, counted.optimizer)


@needs_fmnist
def test_finetune_channels_last_trains_as_the_plain_run(calibrated_backbone, tmp_path, monkeypatch):
    """`finetune` on real data, channels-last against plain: every batch (training, validation)
    reaches the network channels-last, the pre-flight measurement holds, the recipe records the
    option, and the run's losses are the plain run's to rounding (weights after Adam are not a
    fair comparison: its first updates are the sign of each gradient entry, and an entry near
    zero may round to either sign)."""
    from edgetl.finetune import finetune
    from edgetl.models.backbone import EdgeNet
    from edgetl.recipe import load_recipe

    layouts = []
    forward = EdgeNet.forward

    def watched(self, image):
        layouts.append((self.input_memory_format == CL, is_channels_last(image)))
        return forward(self, image)

    monkeypatch.setattr(EdgeNet, "forward", watched)
    runs = {}
    for cl in (False, True):
        recipe = load_recipe("fashion_mnist", {
            "model.backbone": str(calibrated_backbone), "data.max_samples": 96, "data.max_val_samples": 32,
            "train.epochs": 2, "train.checkpoint_every": 100, "model.pool": 2, "model.channels_last": cl})
        runs[cl] = finetune(recipe=recipe, out_dir=tmp_path / f"cl{int(cl)}", measure=True).history
    assert "channels_last: true" in (tmp_path / "cl1" / "recipe.yaml").read_text()
    assert {net_cl for net_cl, _ in layouts} == {False, True}
    assert all(net_cl == image_cl for net_cl, image_cl in layouts if image_cl or net_cl)
    assert sum(net_cl for net_cl, _ in layouts) >= 8  # 3 steps and a validation pass an epoch
    assert len(runs[True]) == len(runs[False]) == 2
    for a, b in zip(runs[True], runs[False]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)


def test_a_run_saved_before_the_option_resumes_as_plain():
    """A checkpoint's recipe from before ``channels_last`` existed resumes as a plain run, and
    a channels-last resume of a plain run is refused (the results differ to rounding)."""
    from edgetl.recipe import load_recipe
    from edgetl.train.checkpoint import _recipe_differences

    current = load_recipe("fashion_mnist", {}).to_dict()
    saved = copy.deepcopy(current)
    del saved["model"]["channels_last"]
    assert _recipe_differences(saved, current) == []
    asked = load_recipe("fashion_mnist", {"model.channels_last": True}).to_dict()
    assert _recipe_differences(saved, asked) == ["model.channels_last"]


def test_a_chunked_pointwise_conv_writes_its_gradient_whatever_the_layouts():
    """A chunked 1x1 conv (int8 weight over one chunk, no activation) whose input is plain and
    whose incoming gradient is channels-last (or the other way) writes its whole input gradient,
    in the input's layout: never into a copy that is then lost."""
    from torch import nn

    from edgetl.models.lean import FrozenConvBNAct

    torch.manual_seed(0)
    conv = nn.Conv2d(256, 512, 1, bias=False).requires_grad_(False)
    bn = nn.BatchNorm2d(512).requires_grad_(False).eval()
    layer = FrozenConvBNAct(conv, bn, None, weight_dtype=torch.int8)
    assert layer.chunked
    x = torch.randn(3, 256, 2, 2)
    g = torch.randn(3, 512, 2, 2)
    grads = []
    for x_cl, g_cl in ((False, False), (False, True), (True, False), (True, True)):
        xx = (x.contiguous(memory_format=CL) if x_cl else x.clone()).requires_grad_()
        y = layer(xx)
        y.backward(g.contiguous(memory_format=CL) if g_cl else g)
        assert is_channels_last(xx.grad) == x_cl
        grads.append(xx.grad)
    for got in grads[1:]:
        torch.testing.assert_close(got, grads[0], rtol=1e-5, atol=1e-5)
