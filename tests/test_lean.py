"""Lean runtime layers: exactness against stock modules, pooled-gradient quality, saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.mobilenetv2 import InvertedResidual

from edgetl.errors import CapabilityError, ConfigError
from edgetl.memory.rules import predicted_saved_bytes
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import (
    MIN_POOLED_SIDE,
    FrozenConvBNAct,
    LeanAvgPool2d,
    PooledConv2d,
    check_act_dtype,
    count_saved_bytes,
    effective_pool,
    grad_weight_cosine,
    leanify_backbone,
    mask_bytes,
    pack_mask,
    quantize_int8,
    unpack_mask,
)
from edgetl.models.lean_side import LeanSideModule, lean_side_from_stock, leanify_network
from edgetl.models.side import SideModule, build_network
from tests.conftest import FMNIST_REASON, HAVE_FMNIST

TINY = BackboneSpec(width=0.35, num_classes=10)


def smooth(shape, seed, base=8):
    """Low-frequency image-like tensor: base x base noise, bicubic-upsampled."""
    gen = torch.Generator().manual_seed(seed)
    n, c, h, w = shape
    return F.interpolate(torch.randn(n, c, base, base, generator=gen), size=(h, w), mode="bicubic")


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def randomize_bn(net: nn.Module, seed: int = 0) -> None:
    """Non-trivial BN statistics and affine params (bn2's gamma 0 would zero the side gradients)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(c, generator=gen))
                m.weight.copy_(0.5 + torch.rand(c, generator=gen))
                m.bias.copy_(0.1 * torch.randn(c, generator=gen))


def close(a, b, rel=1e-4):
    scale = b.abs().max().clamp_min(1e-12)
    assert (a - b).abs().max() <= rel * scale, float((a - b).abs().max() / scale)


# ----------------------------------------------------------------------------- PooledConv2d


def test_pooled_conv_gradcheck_exact_at_k1():
    torch.manual_seed(0)
    conv = PooledConv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=True, pool=1).double()
    x = torch.randn(2, 4, 7, 6, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(conv, (x,))


def test_pooled_conv_forward_and_grad_input_bit_identical_at_k2():
    torch.manual_seed(0)
    stock = nn.Conv2d(8, 16, 5, padding=2, groups=2, bias=False)
    lean = PooledConv2d.from_conv(stock, pool=2)
    x1 = randn(2, 8, 16, 16).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    gy = randn(2, 16, 16, 16, seed=1)
    y1, y2 = stock(x1), lean(x2)
    assert torch.equal(y1, y2)
    y1.backward(gy)
    y2.backward(gy)
    assert torch.equal(x1.grad, x2.grad)
    assert not torch.equal(stock.weight.grad, lean.weight.grad)  # pooled: approximate


@pytest.mark.parametrize("kernel,groups", [(5, 2), (1, 1)])
def test_grad_weight_cosine_thresholds(kernel, groups):
    # Measured (8 input channels, 32x32, batch 2, 5 seeds): smooth (8x8 noise, bicubic up)
    # k=2 0.950-0.962, k=4 0.877-0.897; white noise k=2 0.45-0.52, k=4 0.19-0.31 (about 1/k).
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, kernel, padding=kernel // 2, groups=groups, bias=False)
    smooth_cos = {k: [grad_weight_cosine(conv, smooth((2, 8, 32, 32), s), k, seed=100 + s) for s in range(3)] for k in (2, 4)}
    white_cos = {k: [grad_weight_cosine(conv, randn(2, 8, 32, 32, seed=s), k, seed=100 + s) for s in range(3)] for k in (2, 4)}
    assert grad_weight_cosine(conv, smooth((2, 8, 32, 32), 0), 1) == pytest.approx(1.0, abs=1e-6)
    assert min(smooth_cos[2]) > 0.94
    assert min(smooth_cos[4]) > 0.86
    assert all(0.40 < c < 0.60 for c in white_cos[2])
    assert all(0.17 < c < 0.35 for c in white_cos[4])


def _independent_pooled_input(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each element replaced by the mean of the real elements of its k x k cell (loops)."""
    out = torch.empty_like(x)
    h, w = x.shape[-2:]
    for i0 in range(0, h, k):
        for j0 in range(0, w, k):
            cell = x[:, :, i0 : i0 + k, j0 : j0 + k]
            out[:, :, i0 : i0 + k, j0 : j0 + k] = cell.mean((2, 3), keepdim=True)
    return out


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (3, 2, 1), (1, 1, 0)])
def test_non_divisible_size_crops_correctly(kernel, stride, padding):
    torch.manual_seed(0)
    conv = PooledConv2d(4, 6, kernel, stride=stride, padding=padding, bias=False, pool=2).double()
    x = torch.randn(2, 4, 9, 9, dtype=torch.double, requires_grad=True)  # pooled 5x5, last cell partial
    y = conv(x)
    gy = torch.randn(y.shape, dtype=torch.double)
    y.backward(gy)
    expected = torch.nn.grad.conv2d_weight(
        _independent_pooled_input(x.detach(), 2), conv.weight.shape, gy, stride, padding
    )
    torch.testing.assert_close(conv.weight.grad, expected, rtol=1e-12, atol=1e-12)
    exact_gx = torch.nn.grad.conv2d_input(x.shape, conv.weight.detach(), gy, stride, padding)
    torch.testing.assert_close(x.grad, exact_gx, rtol=1e-12, atol=1e-12)


def test_pointwise_sum_pool_path_equals_upsampling():
    from edgetl.models.lean import inflate_saved, pool_for_save, pooled_grad_weight

    x = torch.randn(2, 6, 9, 7, dtype=torch.double)
    gy = torch.randn(2, 6, 9, 7, dtype=torch.double)
    for k in (2, 4):
        fast = pooled_grad_weight(pool_for_save(x, k), (9, 7), (6, 3, 1, 1), gy, (1, 1), (0, 0), (1, 1), 2, k)
        slow = torch.nn.grad.conv2d_weight(inflate_saved(pool_for_save(x, k), k, (9, 7)), (6, 3, 1, 1), gy, groups=2)
        torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hw, stored_hw", [
    ((17, 16), (5, 4)),  # k=4 keeps 4 cells on the short side: pooled by 4 (ceil mode)
    ((13, 10), (7, 5)),  # 10 // 4 < 4, 10 // 2 >= 4: pooled by 2
    ((7, 9), (7, 9)),  # 7 // 2 < 4: kept exact
])
def test_pooled_conv_saved_bytes_match_hooks(hw, stored_hw):
    conv = PooledConv2d(8, 16, 3, padding=1, bias=False, pool=4)
    x = randn(2, 8, *hw).requires_grad_()
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        conv(x)
    with count_saved_bytes(conv) as saved:
        conv(x)
    assert (2, 8, *stored_hw) in shapes
    assert saved.bytes == 2 * 8 * stored_hw[0] * stored_hw[1] * 4
    assert predicted_saved_bytes(conv, lambda: conv(x)) == {"": saved.bytes}


@pytest.mark.parametrize("k, hw, expected", [
    (1, (64, 64), 1), (2, (8, 8), 2), (2, (8, 64), 2), (2, (7, 7), 1), (2, (2, 2), 1),
    (4, (16, 16), 4), (4, (15, 40), 2), (4, (8, 8), 2), (4, (7, 7), 1), (4, (1, 1), 1),
])
def test_effective_pool_keeps_small_maps_exact(k, hw, expected):
    # a pooled map keeps at least 4 cells on its short side
    assert MIN_POOLED_SIDE == 4
    assert effective_pool(k, hw) == expected


def test_mask_pack_roundtrip():
    mask = torch.rand(3, 5, 7) > 0.5  # 105 elements: not a multiple of 8
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == mask_bytes(105) == 14
    assert torch.equal(unpack_mask(packed, mask.shape), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("upper", [6.0, None])
@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_act_mask_of_the_clamped_output_is_the_comparisons_mask(dtype, upper, chunk):
    """The frozen layers' mask, built on the clamped output by conversions to bool and integer
    adds on its bits (``frozen._clamped_mask``), holds the bits of ``(y > 0) & (y < upper)`` on
    the unclamped y, packed as ``pack_mask`` packs them; the clamped output comes back
    unchanged bit for bit (the subtraction is added back). Edge values: +-0, the bound and its
    neighbours, the smallest subnormals, infinities."""
    from edgetl.models.lean.frozen import _act_mask

    g = torch.Generator().manual_seed(0)
    y = (torch.randn(4, 3, 5, 8, generator=g) * 5).to(dtype)
    six = torch.tensor(6.0, dtype=dtype)
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    edges = torch.stack([torch.tensor(0.0, dtype=dtype), torch.tensor(-0.0, dtype=dtype), six,
                         torch.nextafter(six, six * 2), torch.nextafter(six, six * 0),
                         torch.tensor(tiny, dtype=dtype), torch.tensor(-tiny, dtype=dtype),
                         torch.tensor(float("inf"), dtype=dtype), torch.tensor(float("-inf"), dtype=dtype),
                         torch.tensor(1e4, dtype=dtype)])
    y.view(-1)[:edges.numel()] = edges
    want = (y > 0) & (y < upper) if upper is not None else y > 0
    clamped = y.clamp(0, upper) if upper is not None else y.clamp(min=0)
    before = clamped.clone()
    packed = _act_mask(clamped, chunk, upper)
    assert torch.equal(packed, pack_mask(want))
    assert torch.equal(clamped.view(torch.uint8), before.view(torch.uint8))
    # a channels-last activation is packed in its memory order, pixel by pixel (no copy;
    # ``unpack_as(..., channels_last=True)`` reads it back so)
    last = clamped.contiguous(memory_format=torch.channels_last)
    assert torch.equal(_act_mask(last, chunk, upper), pack_mask(want.permute(0, 2, 3, 1)))
    # 3 samples of 150 values: the bytes do not align, the whole tensor is packed at once
    odd = y[:3, :, :, :5].contiguous()
    want = (odd > 0) & (odd < upper) if upper is not None else odd > 0
    assert torch.equal(_act_mask(odd.clamp(0, upper) if upper is not None else odd.clamp(min=0), chunk, upper),
                       pack_mask(want))


def test_lean_avg_pool_saves_nothing_and_is_exact():
    x = torch.randn(2, 3, 9, 8, dtype=torch.double, requires_grad=True)
    pool = LeanAvgPool2d(2)
    assert torch.autograd.gradcheck(pool, (x,))
    with count_saved_bytes() as saved:
        y = pool(x)
    assert saved.bytes == 0
    assert torch.equal(y, nn.AvgPool2d(2)(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, w, k", [(8, 8, 2), (9, 7, 2), (17, 13, 4)])
def test_lean_avg_pool_backward_is_stocks_without_a_stand_in_input(dtype, h, w, k):
    """grad_input equals stock avg_pool2d's bit for bit, and is written by a broadcast copy:
    no avg_pool2d_backward, whose CUDA kernel copies a stand-in input to full size (issue 17)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen, self.full_size = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append(func.overloadpacket.__name__)
            if isinstance(out, torch.Tensor) and out.untyped_storage().nbytes() >= x.numel() * x.element_size():
                self.full_size += func.overloadpacket.__name__ in ("new_empty", "new_zeros", "empty", "zeros")
            return out

    x = torch.randn(2, 3, h, w, dtype=dtype, requires_grad=True)
    stock_x = x.detach().clone().requires_grad_()
    y = LeanAvgPool2d(k)(x)
    g = torch.randn_like(y)
    with Ops() as ops:
        y.backward(g)
    F.avg_pool2d(stock_x, k).backward(g)
    assert torch.equal(x.grad, stock_x.grad)
    assert "avg_pool2d_backward" not in ops.seen and ops.full_size == 1  # grad_input only


# ----------------------------------------------------------------------------- side module


def _side_pair(pool: int, image_pool: int = 1, in_ch: int = 6, out_ch: int = 12, kernel: int = 5, groups: int = 2):
    torch.manual_seed(0)
    stock = SideModule(in_ch, out_ch, kernel, groups, image_pool=image_pool)
    randomize_bn(stock)
    lean = LeanSideModule(in_ch, out_ch, kernel, groups, image_pool=image_pool, pool=pool)
    lean.load_state_dict(stock.state_dict())  # same keys and shapes
    return stock, lean


def test_lean_side_state_dict_keys_match_stock():
    stock, lean = _side_pair(2)
    assert list(stock.state_dict()) == list(lean.state_dict())


def test_lean_side_tail_gradcheck():
    _, lean = _side_pair(1)
    lean = lean.double()
    x = torch.randn(2, 6, 12, 12, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: lean(t, (6, 6)), (x,))
    lean.eval()
    assert torch.autograd.gradcheck(lambda t: lean(t, (6, 6)), (x,))


@pytest.mark.parametrize("training", [True, False])
def test_lean_side_k1_equals_stock(training):
    stock, lean = _side_pair(1)
    stock.train(training)
    lean.train(training)
    x1 = randn(2, 6, 16, 16).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    gy = randn(2, 12, 16, 16, seed=3)
    y1, y2 = stock(x1, (16, 16)), lean(x2, (16, 16))
    close(y2, y1, 1e-5)
    y1.backward(gy)
    y2.backward(gy)
    close(x2.grad, x1.grad)
    for (name, p1), (_, p2) in zip(stock.named_parameters(), lean.named_parameters()):
        close(p2.grad, p1.grad), name
    for (name, b1), (_, b2) in zip(stock.named_buffers(), lean.named_buffers()):
        torch.testing.assert_close(b2, b1, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("pool", [1, 2, 4])
def test_lean_side_saved_bytes_drop_and_match_rule(pool):
    stock, lean = _side_pair(pool)
    n, c, h, w = 2, 6, 32, 32
    x = randn(n, c, h, w).requires_grad_()
    with count_saved_bytes(stock) as s_stock:
        stock(x, (16, 16))
    with count_saved_bytes(lean) as s_lean:
        pred = predicted_saved_bytes(lean, lambda: lean(x, (16, 16)))
    mid, out, hp = lean.mid_channels, lean.out_channels, h // 2
    # stock: input (kept by AvgPool2d), conv1 input, bn1 input, ReLU output, bn2 input,
    # BN batch mean and invstd
    stock_bytes = 4 * n * (c * h * w + c * hp * hp + 2 * mid * hp * hp + out * hp * hp) + 4 * 2 * (mid + out)
    assert s_stock.bytes == stock_bytes
    # lean: conv1 input pooled by k, bn1 input, 2 stats per channel of both BNs
    expected = 4 * n * (c * (hp // pool) ** 2 + mid * hp * hp) + 4 * 2 * (mid + out)
    assert s_lean.bytes == sum(pred.values()) == expected
    assert pred["conv1"] == 4 * n * c * (hp // pool) ** 2
    assert s_lean.bytes < s_stock.bytes / 2


def test_lean_side_image_module_saves_only_pooled_conv_input():
    stock, lean = _side_pair(2, image_pool=4, in_ch=3, out_ch=8, kernel=5, groups=1)
    image = randn(2, 3, 64, 64)  # the image needs no grad: the pools keep nothing
    with count_saved_bytes(lean) as saved:
        pred = predicted_saved_bytes(lean, lambda: lean(image, (32, 32)))
    assert saved.bytes == sum(pred.values()) == 4 * 2 * 3 * 4 * 4 + 4 * 2 * 8 * 8 * 8 + 4 * 2 * (8 + 8)


def test_lean_side_from_stock_converts_network():
    net = build_network(TINY, "repnet")
    randomize_bn(net)
    new = lean_side_from_stock(net.side, pool=4)
    assert new is not net.side and all(isinstance(b, LeanSideModule) for b in new.blocks)
    assert all(b.activation_pool == 4 for b in new.blocks)
    assert new.taps == net.side.taps
    for k, v in net.side.state_dict().items():
        assert torch.equal(new.state_dict()[k], v)
    same = lean_side_from_stock(net.side, pool=2, inplace=True)
    assert same is net.side and isinstance(net.side.blocks[0], LeanSideModule)
    with pytest.raises(ConfigError):
        lean_side_from_stock(net.side, pool=3)


# ----------------------------------------------------------------------------- backbone


def _tiny_pair(mode="repnet", **lean_kw):
    torch.manual_seed(0)
    net = build_network(TINY, mode)
    randomize_bn(net)
    lean = leanify_network(copy.deepcopy(net), **{"pool": 1, **lean_kw})
    for m in (net, lean):
        m.train()
        m.features.eval()
        m.classifier.eval()  # dropout off: both see the same head
    return net, lean


def _grads(net):
    return {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


def test_lean_network_k1_folded_gradients_equal_stock():
    net, lean = _tiny_pair()
    x = smooth((2, 3, 64, 64), 0)
    y1, y2 = net(x), lean(x)
    close(y2, y1, 1e-5)
    gy = randn(*y1.shape, seed=1)
    y1.backward(gy)
    y2.backward(gy)
    g1, g2 = _grads(net), _grads(lean)
    assert set(g1) == set(g2) and any(k.startswith("side.") for k in g1)
    for name in g1:
        close(g2[name], g1[name], 1e-3)


def test_lean_network_saved_bytes_match_rule_and_drop():
    net, lean = _tiny_pair(pool=2)
    x = smooth((2, 3, 64, 64), 0)
    with count_saved_bytes(net) as s_stock:
        net(x)
    with count_saved_bytes(lean) as s_lean:
        pred = predicted_saved_bytes(lean, lambda: lean(x))
    head_input = 2 * net.classifier[1].in_features * 4  # stock Linear keeps its input
    assert s_lean.bytes == sum(pred.values()) + head_input
    assert s_lean.bytes * 20 < s_stock.bytes
    # blocks before the first tap need no backward: they save nothing
    assert not any(k.startswith(("features.0.", "features.1.", "features.2.")) for k in pred)


def test_saved_for_backward_224_one_image_readme_figures():
    """README: saved for backward, MobileNetV2 1.0 + Rep-Net, 224 px, one image (frozen BN and dropout in eval mode)."""
    torch.manual_seed(0)
    spec = BackboneSpec(num_classes=102)
    net = build_network(spec, "repnet").train()
    net.features.eval()
    net.classifier.eval()
    x = randn(1, 3, 224, 224)
    with count_saved_bytes(net) as s_stock:
        net(x)
    assert round(s_stock.bytes / 1e6, 2) == 48.77
    for pool, readme_mb in ((1, 0.80), (2, 0.72), (4, 0.70)):
        lean = build_network(spec, "repnet")
        leanify_network(lean, pool=pool)
        lean.train()
        lean.features.eval()
        lean.classifier.eval()
        with count_saved_bytes(lean) as s_lean:
            pred = predicted_saved_bytes(lean, lambda: lean(x))
        head_input = lean.classifier[1].in_features * 4  # stock Linear keeps its input
        assert s_lean.bytes == sum(pred.values()) + head_input
        assert round(s_lean.bytes / 1e6, 2) == readme_mb, (pool, s_lean.bytes)


def test_inverted_residual_block_saved_bytes():
    torch.manual_seed(0)
    block = InvertedResidual(16, 16, 1, 6)
    block.requires_grad_(False)
    randomize_bn(block)
    block.eval()
    wrapper = nn.Module()
    wrapper.side = None  # an EdgeNet's features and side, without the head
    wrapper.features = nn.Sequential(block)
    lean = leanify_backbone(copy.deepcopy(wrapper)).features[0]
    x = randn(2, 16, 8, 8).requires_grad_()
    with count_saved_bytes(block) as s_stock:
        y1 = block(x)
    with count_saved_bytes(lean) as s_lean:
        pred = predicted_saved_bytes(lean, lambda: lean(x))
    hidden = 2 * 96 * 8 * 8
    # stock (torch 2.14): expand conv input; per Conv-BN-ReLU6: BN input, a clone of BN's
    # output (autograd copies it for the inplace ReLU6) and the ReLU6 output (= next conv's
    # input); project BN input
    assert s_stock.bytes == 4 * (2 * 16 * 64 + 6 * hidden + 2 * 16 * 64)
    assert s_lean.bytes == sum(pred.values()) == 2 * mask_bytes(hidden)
    y2 = lean(x)
    close(y2, y1, 1e-5)
    gy = randn(*y1.shape, seed=2)
    (gx1,) = torch.autograd.grad(y1, x, gy)
    (gx2,) = torch.autograd.grad(y2, x, gy)
    close(gx2, gx1, 1e-5)


def test_repnet_bias_folded_bias_grads_equal_beta_grads():
    net, lean = _tiny_pair("repnet+bias")
    x = smooth((2, 3, 64, 64), 1)
    net(x).square().sum().backward()
    lean(x).square().sum().backward()
    stock_bn = [m for m in net.features.modules() if isinstance(m, nn.BatchNorm2d)]
    lean_conv = [m for m in lean.features.modules() if isinstance(m, FrozenConvBNAct)]
    assert len(stock_bn) == len(lean_conv)
    for bn, conv in zip(stock_bn, lean_conv):
        assert conv.bias.requires_grad
        if bn.bias.grad is None:
            assert conv.bias.grad is None or not conv.bias.grad.any()
        else:
            close(conv.bias.grad, bn.bias.grad, 1e-3)


def test_batch_statistics_mode_equals_stock_training_bn():
    net, lean = _tiny_pair(bn="batch")
    net.features.train()
    lean.features.train()
    x = smooth((8, 3, 64, 64), 2)  # batch 2-4 at 2x2 final maps: rounding grows to ~3e-3
    with count_saved_bytes(lean) as s_lean:
        holder = {}
        pred = predicted_saved_bytes(lean, lambda: holder.setdefault("y", lean(x)))
    y2 = holder["y"]
    y1 = net(x)
    close(y2, y1, 1e-4)
    gy = randn(*y1.shape, seed=4)
    y1.backward(gy)
    y2.backward(gy)
    g1, g2 = _grads(net), _grads(lean)
    overall = max(float(g.abs().max()) for g in g1.values())
    for name in g1:
        # a side bn2 bias feeding a batch-statistics BN has a true gradient of 0: compare
        # rounding noise against the largest gradient, not its own
        scale = max(float(g1[name].abs().max()), 1e-3 * overall)
        assert float((g2[name] - g1[name]).abs().max()) <= 1e-3 * scale, name
    head_input = 8 * net.classifier[1].in_features * 4
    assert s_lean.bytes == sum(pred.values()) + head_input
    stock_bn = [m for m in net.features.modules() if isinstance(m, nn.BatchNorm2d)]
    lean_conv = [m for m in lean.features.modules() if isinstance(m, FrozenConvBNAct)]
    for bn, conv in zip(stock_bn, lean_conv):
        torch.testing.assert_close(conv.running_mean, bn.running_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(conv.running_var, bn.running_var, rtol=1e-4, atol=1e-5)


def test_int8_weights_dequantisation_error_bounded():
    w = torch.randn(16, 8, 3, 3) * torch.linspace(0.01, 2.0, 16).view(-1, 1, 1, 1)
    codes, scale = quantize_int8(w)
    assert codes.dtype == torch.int8 and scale.shape == (16,)
    err = (codes.float() * scale.view(-1, 1, 1, 1) - w).abs()
    assert (err <= scale.view(-1, 1, 1, 1) / 2 + 1e-7).all()
    net, lean = _tiny_pair(weight_dtype="int8")
    x = smooth((2, 3, 64, 64), 0)
    assert all(m.weight.dtype == torch.int8 for m in lean.features.modules() if isinstance(m, FrozenConvBNAct))
    y1, y2 = net(x), lean(x)
    rel = float((y2 - y1).norm() / y1.norm())
    assert rel < 0.05, rel


@pytest.mark.parametrize("act_dtype", ["bf16", "fp16"])
def test_low_precision_activations(act_dtype):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[act_dtype]
    try:
        check_act_dtype(dtype, "cpu")
    except CapabilityError as exc:
        pytest.skip(str(exc))
    net, lean = _tiny_pair(pool=1, act_dtype=act_dtype, weight_dtype="fp16")
    # batch 8: the last side module's batch-statistics BN sees one 1x1 value per image;
    # at batch 2 it normalises 2 values per channel and amplifies bf16 rounding to ~6 %
    x = smooth((8, 3, 64, 64), 0)
    with count_saved_bytes(lean) as s_lean:
        holder = {}
        pred = predicted_saved_bytes(lean, lambda: holder.setdefault("y", lean(x)))
    y2 = holder["y"]
    assert y2.dtype == torch.float32
    assert lean.features[3].conv[0][0](torch.zeros(1, 8, 4, 4)).dtype == dtype
    y1 = net(x)
    assert float((y2 - y1).norm() / y1.norm()) < 0.05
    gy = randn(*y1.shape, seed=1)
    y1.backward(gy)
    y2.backward(gy)
    g1, g2 = _grads(net), _grads(lean)
    cos = [float(F.cosine_similarity(g1[n].flatten(), g2[n].flatten(), dim=0)) for n in g1 if g1[n].any()]
    assert min(cos) > 0.95, min(cos)
    assert s_lean.bytes == sum(pred.values()) + 8 * net.classifier[1].in_features * 4


def test_unsupported_act_dtype_fails_clearly(monkeypatch):
    def no_conv(*args, **kwargs):
        raise RuntimeError('"slow_conv2d_cpu" not implemented for \'Half\'')

    monkeypatch.setattr(F, "conv2d", no_conv)
    with pytest.raises(CapabilityError, match="float16 convolution is not supported"):
        check_act_dtype(torch.float16, "cpu")


def test_lean_backbone_rejects_trainable_weights_and_stock_side_with_bf16():
    net = build_network(TINY, "full")
    with pytest.raises(ConfigError, match="frozen"):
        leanify_backbone(net)
    net = build_network(TINY, "repnet")
    with pytest.raises(ConfigError, match="lean side"):
        leanify_backbone(net, act_dtype="bf16")
    with pytest.raises(ConfigError, match="weight_dtype"):
        leanify_backbone(net, weight_dtype="int4")


@pytest.mark.parametrize("resolution, pool, expected", [
    # side conv inputs (after the side pools): 224 px 28, 28, 14, 7, 7, 3; 64 px 8, 8, 4, 2, 2, 1
    (224, 2, [2, 2, 2, 1, 1, 1]),
    (224, 4, [4, 4, 2, 1, 1, 1]),
    (64, 2, [2, 2, 1, 1, 1, 1]),
    (64, 4, [2, 2, 1, 1, 1, 1]),
    (64, 1, [1, 1, 1, 1, 1, 1]),
])
def test_stored_pools_follow_side_map_sizes(resolution, pool, expected):
    from edgetl.models.lean_side import stored_pools

    net = build_network(BackboneSpec(width=1.0, num_classes=10), "repnet", device="meta")
    leanify_network(net, pool=pool)
    net.train()
    assert stored_pools(net, resolution) == expected
    assert net.training and net.side.blocks[0].bn1.training  # modes restored


@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_small_maps_stay_exact_where_pooling_hurts_most(calibrated_backbone):
    """On real images, the side convs effective_pool pools have better k=2 weight gradients than those it keeps exact.

    MobileNetV2 0.35 at 64 px: side conv inputs 8x8, 8x8, 4x4, 2x2, 2x2, 1x1; the rule pools
    the two 8x8 maps. Every BN2 gamma is 1 so the side convs receive gradients. Measured
    (calibrated random backbone): pooled 0.91, 0.77; the three kept exact would be 0.63,
    0.57, 0.64 if pooled.
    """
    from edgetl.models.backbone import load_backbone
    from edgetl.models.side import build_side_network
    from edgetl.prune import calibration_batches

    torch.manual_seed(0)
    net = load_backbone(calibrated_backbone)
    net.attach_side(build_side_network(net))
    for block in net.side.blocks:
        nn.init.ones_(block.bn2.weight)
    captured = {}

    def keep(j):
        def hook(module, args, output):
            captured[j] = [args[0].detach()]
            output.register_hook(lambda g: captured[j].append(g))
        return hook

    for j, block in enumerate(net.side.blocks):
        block.conv1.register_forward_hook(keep(j))
    images = calibration_batches("fashion-mnist", resolution=64, batches=1, batch_size=32)[0]
    net.train()(images).logsumexp(1).sum().backward()
    pooled, exact = [], []
    for j, block in enumerate(net.side.blocks):
        x, gy = captured[j]
        if min(x.shape[-2:]) < 2:
            continue  # a 1x1 map pools to itself: nothing to compare
        cosine = grad_weight_cosine(block.conv1, x, 2, gy)
        (pooled if effective_pool(2, tuple(x.shape[-2:])) == 2 else exact).append(cosine)
    assert len(pooled) == 2 and len(exact) == 3
    assert min(pooled) > max(exact), (pooled, exact)


def test_keeping_small_maps_exact_costs_1_4_kB_an_image_at_64px(monkeypatch):
    """README: at 64 px (width 0.35) the maps kept exact hold 360 more fp32 values an image.

    Side conv inputs 16x4x4, 24x2x2, 32x2x2 stay exact instead of 2x2, 1x1, 1x1:
    16*12 + 24*3 + 32*3 = 360 values.
    """
    import edgetl.models.lean.pooled_conv as lean_module  # the module that reads MIN_POOLED_SIDE

    def saved(min_side: int) -> int:
        monkeypatch.setattr(lean_module, "MIN_POOLED_SIDE", min_side)
        torch.manual_seed(0)
        net = leanify_network(build_network(TINY, "repnet"), pool=2).train()
        with count_saved_bytes(net) as s:
            net(randn(3, 3, 64, 64))
        return s.bytes

    assert saved(MIN_POOLED_SIDE) - saved(1) == 3 * 360 * 4
