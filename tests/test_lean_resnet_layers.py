"""Issue #42 build items 1-2: the lean layers serve torchvision's ResNet blocks. A small network of
torchvision BasicBlocks and Bottlenecks (registered here) converted by the block-type converters:
gradients against the stock blocks, the stem max pool's codes against autograd bit for bit, and
a training step's predicted peak against the meter, frozen (Rep-Net, bias) and full."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from edgetl.errors import ConfigError
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models import archs
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import (
    FrozenConvBNAct,
    LeanMaxPool2d,
    LeanReLU,
    LeanResidualBlock,
    count_saved_bytes,
    leanify_backbone,
)
from edgetl.models.lean.maxpool import code_bytes
from edgetl.models.lean_full import leanify_full
from edgetl.models.side import LeanOptions, build_network, make_lean
from tests.test_lean_full import on_torch_leaves

RES, BATCH = 32, 2


def _down(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def _tiny_resnet(spec) -> tuple[nn.Sequential, nn.Sequential]:
    """ResNet's layout at a few channels: the stem (conv 7x7 s2, BN, ReLU, max pool 3x3 s2),
    BasicBlocks with and without a downsample, Bottlenecks with and without one."""
    stem = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1))
    blocks = [BasicBlock(8, 8), BasicBlock(8, 16, 2, _down(8, 16, 2)),
              Bottleneck(16, 8, 2, _down(16, 32, 2)), Bottleneck(32, 8)]
    return nn.Sequential(stem, *blocks), nn.Sequential(nn.Dropout(spec.dropout), nn.Linear(32, spec.num_classes))


def _no_pruning(features, block, channels):
    raise NotImplementedError("the test ResNet is not pruned")


TINY_RESNET = archs.register(archs.Architecture(
    name="tiny_resnet_lean_test", title="TinyResNet", build=_tiny_resnet, prunable=range(1, 5),
    hidden=lambda block: (archs.Hidden(f"{block}.conv1", f"{block}.bn1", "relu"),), set_hidden=_no_pruning,
    taps=(1, 3),
    width_multiplier=False, has_skip=lambda block: isinstance(block, (BasicBlock, Bottleneck, LeanResidualBlock)),
))
SPEC = BackboneSpec(arch=TINY_RESNET.name, num_classes=3)


def calibrated(mode: str, seed: int = 0) -> nn.Module:
    """A stock network with non-trivial BN statistics and betas, in eval mode."""
    torch.manual_seed(seed)
    net = build_network(SPEC, mode)
    with torch.no_grad():
        for m in net.features.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.bias.uniform_(-0.3, 0.3)
    return net.eval()


def input_and_bias_grads(features: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    features(x).backward(g)
    biases = [m.bias.grad for m in features.modules()
              if isinstance(m, (nn.BatchNorm2d, FrozenConvBNAct)) and m.bias.grad is not None]
    return {"input": x.grad, **{f"bias{i}": b for i, b in enumerate(biases)}}


@pytest.mark.parametrize("bn", ["fold", "batch"])
def test_frozen_lean_blocks_give_stock_gradients(bn):
    """Frozen BN-folded (or batch-statistics) lean blocks against the stock blocks: the same
    forward, input gradient and BN-beta gradients (lean: the folded bias's), to rounding; the
    lean module tree keeps the stock names and order."""
    stock = calibrated("bias")
    if bn == "batch":
        stock.features.train()
    lean = copy.deepcopy(stock)
    leanify_backbone(lean, bn=bn)
    assert [type(b).__name__ for b in lean.features] == ["Sequential"] + ["LeanResidualBlock"] * 4
    assert [type(m).__name__ for m in lean.features[0]] == ["FrozenConvBNAct", "LeanMaxPool2d", "LeanReLU"]
    assert [n for n, _ in lean.features[3].named_children()] == ["conv1", "conv2", "conv3", "downsample", "act"]
    assert [m.act for m in lean.features[3].children() if isinstance(m, FrozenConvBNAct)] == ["relu", "relu", None, None]
    assert lean.features[1].downsample is None and isinstance(lean.features[1].act, LeanReLU)
    torch.manual_seed(1)
    x = torch.randn(BATCH, 3, RES, RES)
    g = torch.randn(BATCH, 32, 2, 2)
    ref, got = input_and_bias_grads(stock.features, x, g), input_and_bias_grads(lean.features, x, g)
    assert ref.keys() == got.keys() and len(ref) == 1 + 13  # 13 BNs, each folded into one lean conv
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(lean.features(x), stock.features(x), rtol=1e-4, atol=1e-5)


def test_full_lean_blocks_give_the_folded_networks_gradients():
    """Lean full (BN folded, exact storage): forward and every gradient those of the same
    network on torch's own layers; the forward and input gradient those of the stock blocks."""
    stock = calibrated("full")
    lean = leanify_full(copy.deepcopy(stock), storage="exact")
    ref = on_torch_leaves(lean)
    assert [n for n, _ in lean.features[2].named_children()] == ["conv1", "conv2", "downsample", "act"]
    assert [type(m).__name__ for m in lean.features[0]] == ["PooledConv2d", "LeanMaxPool2d", "LeanReLU"]
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, 3, RES, RES), torch.tensor([0, 2])
    grads = []
    for net in (lean, ref, stock):
        torch.manual_seed(0)
        net.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        nn.functional.cross_entropy(net(xi), y).backward()
        grads.append({"input": xi.grad, **{n: p.grad for n, p in net.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(grads[0]["input"], grads[2]["input"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape,k,s,p", [((2, 5, 17, 16), 3, 2, 1), ((3, 4, 8, 8), 3, 2, 1),
                                         ((2, 3, 9, 7), 2, 2, 0), ((2, 2, 21, 20), 5, 3, 2)])
def test_lean_max_pool_is_autograds_bit_for_bit_and_keeps_four_bits_an_output(shape, k, s, p):
    torch.manual_seed(0)
    x = torch.randn(shape)
    x[:, :, :3, :3] = 0.5  # ties: the first maximum of a window wins in both
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    stock, lean = nn.MaxPool2d(k, s, p), LeanMaxPool2d(k, s, p)
    with count_saved_bytes() as kept_stock:
        y1 = stock(x1)
    with count_saved_bytes() as kept_lean:
        y2 = lean(x2)
    g = torch.randn(y1.shape)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    n, per = y1.shape[0], y1[0].numel()
    assert kept_stock.bytes == x.numel() * 4 + y1.numel() * 8  # the input and int64 indices
    assert kept_lean.bytes == n * ((per + 1) // 2 if k * k <= 16 else per) == n * code_bytes(per, k)


def test_stem_max_pool_keeps_a_sixteenth_of_the_indices():
    """ResNet-18's stem max pool at 224 px, per image: stock keeps its 64x112x112 fp32 input
    (3,211,264 B) and 64x56x56 int64 indices (1,605,632 B); lean 4 bits an output (100,352 B),
    measured on the meta device as the accounting measures it."""
    from edgetl.memory.leaf import measured_cost
    from edgetl.memory.rules import stock_cost

    shape, out = (1, 64, 112, 112), (1, 64, 56, 56)
    stock = stock_cost(nn.MaxPool2d(3, 2, 1), in_shape=shape, out_shape=out, act_bytes=4,
                       input_requires_grad=True, output_requires_grad=True)
    assert stock.saves_input and stock.saved_new_bytes == 1_605_632
    lean = measured_cost(LeanMaxPool2d(3, 2, 1), in_shape=shape, in_dtype=torch.float32,
                         input_requires_grad=True, output_requires_grad=True)
    assert not lean.saves_input and not lean.saves_output and lean.saved_new_bytes == 100_352


HALF = dict(precision="bf16", frozen_weights="int8")


@pytest.mark.parametrize("mode,lean", [
    ("repnet", LeanOptions(pool=2)),
    ("repnet", LeanOptions(pool=2, stream=1, **HALF)),
    ("bias", LeanOptions()),
    ("full", LeanOptions(storage="exact")),
    ("full", LeanOptions(storage="pool2")),
], ids=["repnet", "repnet_streamed_half", "bias", "full_exact", "full_pool2"])
def test_a_resnet_step_on_the_lean_runtime_is_predicted_to_the_byte(mode, lean):
    """The peak of a training step of the lean ResNet: the runtime accounting's prediction is
    what the meter measures, byte for byte (in mode bias the stem and its max pool run backward)."""
    net = calibrated(mode).train()
    make_lean(net, lean)
    assert any(isinstance(m, LeanMaxPool2d) for m in net.modules())
    if mode != "full":
        prepare_step(net, resolution=RES, batch_size=BATCH)
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=BATCH).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2)


def test_a_block_or_activation_without_a_lean_form_is_one_line_naming_it():
    net = calibrated("repnet")
    net.features[2].relu = nn.Hardswish()
    with pytest.raises(ConfigError, match=r"^the lean layers have no form of activation Hardswish "
                                          r"\(features\[2\]\.relu\); supported: ReLU6, ReLU$"):
        leanify_backbone(net)
    full = calibrated("full")
    full.features[2] = nn.Identity()
    with pytest.raises(ConfigError, match=r"^features\[2\] \(Identity\) has no lean replacement; "
                                          r"registered block types: .*BasicBlock.*Sequential$"):
        leanify_full(full, storage="exact")
    with pytest.raises(ConfigError, match=r"^the lean layers have no activation 'silu'"):
        FrozenConvBNAct(nn.Conv2d(2, 2, 1).requires_grad_(False), nn.BatchNorm2d(2).requires_grad_(False), "silu")


def test_merge_for_inference_folds_every_resnet_bn():
    """Export folds conv{N}/bn{N} of BasicBlocks and Bottlenecks (conv3/bn3 too), the stem and
    the downsample shortcuts: no BN left, the same logits as the network in eval mode."""
    from edgetl.export import merge_for_inference

    net = calibrated("repnet")
    merged = merge_for_inference(net)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in merged.modules())
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 13 + 2 * len(net.side.blocks)
    x = torch.randn(BATCH, 3, RES, RES)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), net.eval()(x), rtol=1e-4, atol=1e-5)
