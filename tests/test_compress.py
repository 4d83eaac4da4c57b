"""Activation compressors (issue #16 item 3, seed 001): transforms, fixed stored bytes, CompressedConv2d."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetl.errors import ConfigError
from edgetl.memory.leaf import measured_cost
from edgetl.memory.meter import StorageMeter, measure_training_peak
from edgetl.memory.rules import predicted_saved_bytes
from edgetl.memory.runtime import runtime_report
from edgetl.models.backbone import BackboneSpec, EdgeNet
from edgetl.models.compress import (
    COMPRESSORS,
    WAVELET_FILTERS,
    CompressedConv2d,
    _CompressedConv2dFn,
    DCTCompressor,
    block_dct_matrix,
    dct_matrix,
    grad_weight_cosine,
    index_dtype,
    make_compressor,
    wavelet_matrix,
)
from edgetl.models.lean import LeanGlobalAvgPool, count_saved_bytes
from tests.conftest import FMNIST_REASON, HAVE_FMNIST

HAVE_CUDA = torch.cuda.is_available()
CUDA_REASON = "needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine, docs/cuda.md)"
SHAPES = [(2, 3, 8, 6), (2, 3, 7, 7), (1, 2, 16, 16), (1, 1, 3, 2)]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def smooth(shape, seed=0):
    """Smooth maps: 4x4 noise, bicubically upsampled, plus a little noise."""
    n, c, h, w = shape
    coarse = randn(n, c, 4, 4, seed=seed)
    return F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False) + 0.05 * randn(*shape, seed=seed + 1)


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("wavelet,moments", [("haar", 1), ("db3", 3)])
def test_wavelet_filters_are_orthonormal_daubechies(wavelet, moments):
    """An orthonormal scaling filter (sum sqrt 2, unit norm, orthogonal to its even shifts)
    whose wavelet has ``moments`` vanishing moments is Daubechies' (up to reversal)."""
    h = np.array(WAVELET_FILTERS[wavelet])
    g = np.array([(-1) ** k * h[len(h) - 1 - k] for k in range(len(h))])
    assert h.sum() == pytest.approx(math.sqrt(2), abs=1e-12)
    for shift in range(0, len(h), 2):
        assert np.dot(h[shift:], h[: len(h) - shift]) == pytest.approx(1.0 if shift == 0 else 0.0, abs=1e-12)
    k = np.arange(len(h))
    for m in range(moments):
        assert np.dot(g, k**m) == pytest.approx(0.0, abs=1e-12)
    assert abs(np.dot(g, k**moments)) > 1e-3


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 16, 28, 33])
def test_axis_matrices_are_orthonormal(n):
    for m in (wavelet_matrix(n, "haar"), wavelet_matrix(n, "db3"), block_dct_matrix(n, 8), block_dct_matrix(n, 16)):
        assert m.shape == (n, n)
        np.testing.assert_allclose(m @ m.T, np.eye(n), atol=1e-12)


def test_haar_matrix_is_the_three_level_haar_basis():
    s2, s8 = 1 / math.sqrt(2), 1 / math.sqrt(8)
    expected = np.array([
        [s8] * 8,                              # level-3 approximation
        [s8] * 4 + [-s8] * 4,                  # level-3 detail
        [0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0],    # level-2 details
        [0, 0, 0, 0, 0.5, 0.5, -0.5, -0.5],
        *[[s2 if j == 2 * i else -s2 if j == 2 * i + 1 else 0 for j in range(8)] for i in range(4)],
    ])
    np.testing.assert_allclose(wavelet_matrix(8, "haar"), expected, atol=1e-12)


@pytest.mark.parametrize("n", [2, 7, 8, 16])
def test_dct_matrix_matches_fft_dct(n):
    """DCT-II by FFT of the mirrored signal (scipy's dct(norm='ortho')), against the matrix."""
    x = np.random.default_rng(n).standard_normal(n)
    y = np.fft.fft(np.concatenate([x, x[::-1]]))[:n]
    ref = 0.5 * np.real(np.exp(-1j * np.pi * np.arange(n) / (2 * n)) * y) * np.sqrt(2 / n)
    ref[0] /= np.sqrt(2)
    np.testing.assert_allclose(dct_matrix(n) @ x, ref, atol=1e-12)
    blocks = block_dct_matrix(20, 8)  # 8 + 8 + a 4-point DCT, nothing between blocks
    np.testing.assert_allclose(blocks[16:, 16:], dct_matrix(4), atol=1e-15)
    assert not blocks[:8, 8:].any() and not blocks[16:, :16].any()


# ----------------------------------------------------------------------------- compressors


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_exact_at_fraction_one(name, shape):
    x = randn(*shape, dtype=torch.float64)
    sparse = make_compressor(name, 1.0, sparse=True)
    packed = sparse.compress(x)
    assert packed.indices is not None and packed.values.shape == (shape[0] * shape[1], shape[2] * shape[3])
    torch.testing.assert_close(sparse.decompress(packed, shape, x.dtype), x, rtol=0, atol=1e-12)
    dense = make_compressor(name, 1.0)  # the input itself: no transform, bit-exact
    packed = dense.compress(x)
    assert packed.indices is None and packed.values is x
    assert dense.decompress(packed, shape, x.dtype) is x


@pytest.mark.parametrize("name", COMPRESSORS)
def test_error_falls_as_fraction_rises(name):
    x = smooth((2, 4, 16, 16))
    errs = []
    for fraction in (0.05, 0.1, 0.25, 0.5, 0.75, 1.0):
        c = make_compressor(name, fraction, sparse=True)
        errs.append(rel_err(c.decompress(c.compress(x), x.shape, x.dtype), x))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 1e-5
    if name != "threshold":  # smooth maps: a transform concentrates the energy
        raw = make_compressor("threshold", 0.25)
        assert errs[2] < 0.5 * rel_err(raw.decompress(raw.compress(x), x.shape, x.dtype), x), errs


def test_kept_count_and_index_dtype():
    assert make_compressor("dct", 0.3).kept((1, 1, 2, 5)) == 3  # not ceil(3.0000000000000004)
    assert make_compressor("dct", 0.25).kept((1, 1, 7, 7)) == 13  # ceil(12.25)
    assert make_compressor("dct", 0.01).kept((1, 1, 3, 3)) == 1
    assert [index_dtype(n) for n in (1, 256, 257, 32768, 32769, 224 * 224)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32, torch.int32]


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("shape,fraction,dtype,expected", [
    ((2, 3, 16, 16), 0.25, torch.float32, 2 * 3 * 64 * (4 + 1)),      # uint8 positions
    ((2, 3, 28, 28), 0.25, torch.float32, 2 * 3 * 196 * (4 + 2)),     # int16 positions
    ((1, 2, 200, 200), 0.1, torch.float32, 2 * 4000 * (4 + 4)),       # int32 positions
    ((2, 3, 28, 28), 0.25, torch.bfloat16, 2 * 3 * 196 * (2 + 2)),
    ((2, 3, 28, 28), 0.7, torch.float32, 2 * 3 * 784 * 4),            # 0.7 * 6 >= 4: the input
    ((2, 3, 28, 28), 0.5, torch.bfloat16, 2 * 3 * 784 * 2),           # 0.5 * 4 >= 2: the input
])
def test_stored_bytes_as_declared_whatever_the_data(name, shape, fraction, dtype, expected):
    c = make_compressor(name, fraction)
    assert c.stored_bytes(shape, dtype) == expected
    n, ch, h, w = shape
    relu_like = randn(*shape, seed=2).clamp(0, 6).to(dtype)  # half zeros: ties
    for x in (randn(*shape).to(dtype), torch.zeros(shape, dtype=dtype), relu_like):
        packed = c.compress(x)
        if packed.indices is None:
            assert packed.values is x
            continue
        assert packed.values.shape == packed.indices.shape == (n * ch, c.kept(shape))
        assert packed.values.dtype == dtype and packed.indices.dtype == index_dtype(h * w)
        assert sum(t.untyped_storage().nbytes() for t in packed.tensors()) == expected


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_compress_and_decompress_temporaries_against_meter(name, shape):
    c = make_compressor(name, 0.25, sparse=True)
    x = randn(*shape)
    meter = StorageMeter()
    meter.register(x)
    base = meter.current_bytes
    with meter:
        packed = c.compress(x)
    assert meter.peak_bytes - base == max(c.compress_phases(shape, x.dtype))
    assert meter.current_bytes - base == c.compress_phases(shape, x.dtype)[-1] == c.stored_bytes(shape, x.dtype)
    meter.close()
    meter = StorageMeter()
    meter.register(x, packed.tensors())
    base = meter.current_bytes
    with meter:
        x_hat = c.decompress(packed, shape, x.dtype)
    assert meter.peak_bytes - base == max(c.decompress_phases(shape, x.dtype))
    assert meter.current_bytes - base == c.decompress_phases(shape, x.dtype)[-1] == x_hat.numel() * 4
    meter.close()


@pytest.mark.parametrize("name,fraction,bad", [
    ("wavelet", 0.5, "'wavelet'"), ("DCT", 0.5, "'DCT'"), ("haar", 0, "0"), ("haar", -0.25, "-0.25"),
    ("db3", 1.5, "1.5"), ("dct", float("nan"), "nan"), ("threshold", "0.5", "'0.5'"), ("haar", True, "True"),
])
def test_bad_name_or_fraction_is_one_line_config_error(name, fraction, bad):
    with pytest.raises(ConfigError) as info:
        make_compressor(name, fraction)
    msg = str(info.value)
    assert "\n" not in msg and bad in msg
    assert ("allowed: haar, db3, dct, threshold" in msg) if name not in COMPRESSORS else ("(0, 1]" in msg)
    with pytest.raises(ConfigError, match="block"):
        DCTCompressor(0.5, block=1)
    with pytest.raises(ConfigError, match="Compressor"):
        CompressedConv2d(2, 2, 3, compressor="dct")


# ----------------------------------------------------------------------------- CompressedConv2d

CONVS = [  # in, out, kernel, stride, padding, groups, bias, in_hw
    (4, 6, 3, 1, 1, 1, False, (12, 10)),
    (6, 6, 3, 2, 1, 6, False, (13, 13)),  # depthwise, stride 2, odd map
    (8, 4, 1, 1, 0, 1, True, (8, 8)),     # pointwise with bias
]


def pair(args, compressor):
    cin, cout, k, s, p, g, b, _ = args
    torch.manual_seed(0)
    stock = nn.Conv2d(cin, cout, k, stride=s, padding=p, groups=g, bias=b)
    return stock, CompressedConv2d.from_conv(stock, compressor)


@pytest.mark.parametrize("args", CONVS)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_forward_and_grad_input_exact_grad_weight_approximate(args, name):
    stock, lean = pair(args, make_compressor(name, 0.25))
    x1 = smooth((2, args[0], *args[-1])).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = stock(x1), lean(x2)
    assert torch.equal(y1, y2)
    gy = randn(*y1.shape, seed=3)
    y1.backward(gy)
    y2.backward(gy)
    assert torch.equal(x1.grad, x2.grad)
    if stock.bias is not None:  # exact, summed in another order
        torch.testing.assert_close(lean.bias.grad, stock.bias.grad, rtol=1e-5, atol=1e-5)
    assert not torch.equal(stock.weight.grad, lean.weight.grad)
    cos = F.cosine_similarity(stock.weight.grad.flatten(), lean.weight.grad.flatten(), dim=0)
    assert cos > (0.6 if name == "threshold" else 0.9)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_grad_weight_exact_at_fraction_one(name):
    args = CONVS[1]
    for compressor in (make_compressor(name, 1.0), make_compressor(name, 1.0, sparse=True)):
        # gradcheck of input, weight and bias on a small case (numerical Jacobians are slow)
        x = randn(1, 2, 5, 4, dtype=torch.float64, seed=6).requires_grad_()
        w = randn(4, 1, 3, 3, dtype=torch.float64, seed=7).requires_grad_()
        b = randn(4, dtype=torch.float64, seed=8).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda x, w, b: _CompressedConv2dFn.apply(x, w, b, (2, 1), (1, 1), (1, 1), 2, compressor), (x, w, b))
        stock, lean = pair(args, compressor)
        stock, lean = stock.double(), lean.double()
        x = randn(2, args[0], *args[-1], dtype=torch.float64, seed=4).requires_grad_()
        gy = randn(*stock(x).shape, dtype=torch.float64, seed=5)
        stock(x).backward(gy)
        lean(x).backward(gy)
        torch.testing.assert_close(lean.weight.grad, stock.weight.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_grad_weight_cosine_on_fashion_mnist():
    """Real images (3 per sample as channels, 28 x 28) and a conv's ReLU6 maps of them.
    Measured at fraction 0.25: transforms 0.993-0.997, thresholding 0.80-0.84; at 0.1:
    transforms 0.972-0.982, thresholding 0.56-0.59."""
    from edgetl.data import fashion_mnist

    images = torch.tensor(fashion_mnist(None, "train").images[:24], dtype=torch.float32).div(255)
    x = images.view(8, 3, 28, 28)
    torch.manual_seed(0)
    stem, conv, conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
    with torch.no_grad():
        feat = F.relu6(stem(x) * 3)
    for name in COMPRESSORS:
        for fraction, floor in ((0.25, 0.98 if name != "threshold" else 0.75), (0.5, 0.99 if name != "threshold" else 0.95)):
            c = make_compressor(name, fraction)
            assert grad_weight_cosine(conv, x, c) > floor, (name, fraction)
            assert grad_weight_cosine(conv2, feat, c) > floor, (name, fraction)


@pytest.mark.parametrize("name,fraction", [(n, 0.25) for n in COMPRESSORS] + [("dct", 1.0), ("haar", 0.6)])
def test_saved_bytes_predicted_equals_measured(name, fraction):
    compressor = make_compressor(name, fraction)
    for args in CONVS:
        _, lean = pair(args, compressor)
        x = smooth((2, args[0], *args[-1])).requires_grad_()
        with count_saved_bytes(lean) as measured:
            lean(x)
        assert measured.bytes == compressor.stored_bytes(tuple(x.shape), x.dtype) > 0
        assert predicted_saved_bytes(lean, lambda: lean(x)) == {"": measured.bytes}
        lean.weight.requires_grad_(False)  # frozen: nothing kept
        with count_saved_bytes(lean) as frozen:
            lean(x)
        assert frozen.bytes == 0
        assert predicted_saved_bytes(lean, lambda: lean(x)) == {"": 0}


@pytest.mark.parametrize("args", CONVS)
@pytest.mark.parametrize("name,fraction", [(n, 0.25) for n in COMPRESSORS] + [("haar", 1.0)])
@pytest.mark.parametrize("input_grad", [True, False])
def test_runtime_cost_forward_and_backward_against_meter(args, name, fraction, input_grad):
    """One layer run for real under the meter: forward holds output + saved + forward_temp_bytes
    at its peak, backward grad_input + param grads + backward_temp_bytes, the terms of its cost
    measured on a meta twin."""
    _, lean = pair(args, make_compressor(name, fraction))
    x = smooth((2, args[0], *args[-1])).requires_grad_(input_grad)
    meter = StorageMeter()
    meter.register_module(lean)
    meter.register(x)
    base = meter.current_bytes
    with meter:
        y = lean(x)
    # what the runtime accounting uses: the layer measured on a meta twin (edgetl.memory.leaf)
    cost = measured_cost(lean, in_shape=tuple(x.shape), in_dtype=torch.float32,
                         input_requires_grad=input_grad, output_requires_grad=True)
    assert meter.current_bytes - base == y.numel() * 4 + cost.saved_new_bytes
    assert meter.peak_bytes - base == y.numel() * 4 + cost.saved_new_bytes + cost.forward_temp_bytes
    assert cost.saves_input == (fraction == 1.0)
    gy = randn(*y.shape, seed=9)
    meter.register(gy)
    meter.reset_peak()
    base = meter.current_bytes
    with meter:
        y.backward(gy)
    grads = sum(p.numel() * 4 for p in lean.parameters()) + (x.numel() * 4 if input_grad else 0)
    assert meter.peak_bytes - base == grads + cost.backward_temp_bytes
    meter.close()


CH, RES = 8, 16


@pytest.mark.parametrize("name,fraction,kernel,bias", [
    ("haar", 0.25, 3, False), ("db3", 0.25, 3, False), ("dct", 0.1, 5, False),
    ("threshold", 0.25, 1, True), ("dct", 1.0, 3, False),
])
def test_training_step_runtime_accounting_against_meter(name, fraction, kernel, bias):
    """image -> conv 3->8 -> CompressedConv2d -> global pool -> linear, in full training:
    the runtime accounting (the layer's cost measured on meta) and the measured step peak agree to the byte."""
    torch.manual_seed(0)
    layer = CompressedConv2d(CH, CH, kernel, padding=kernel // 2, bias=bias, compressor=make_compressor(name, fraction))
    net = EdgeNet(nn.Sequential(nn.Sequential(nn.Conv2d(3, CH, 3, padding=1, bias=False), layer)),
                  nn.Sequential(nn.Linear(CH, 3)), BackboneSpec(width=0.35, num_classes=3))
    net.pool = LeanGlobalAvgPool(torch.float32)
    report = runtime_report(net, mode="full", resolution=RES, batch_size=2)
    measured = measure_training_peak(net, resolution=RES, batch_size=2, steps=2)
    assert report.total_bytes == measured
    # per image: the first conv keeps the image (static), the layer its packed input,
    # the linear its input (8 fp32)
    per_image = layer.compressor.stored_bytes((1, CH, RES, RES), torch.float32)
    assert report.block(len(net.features)).cugrd_bytes == per_image + CH * 4  # the head


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason=CUDA_REASON)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_cuda_matches_cpu(name):
    x = smooth((2, 6, 13, 13))
    c = make_compressor(name, 0.25)
    cpu = c.decompress(c.compress(x), x.shape, x.dtype)
    packed = c.compress(x.cuda())
    assert sum(t.untyped_storage().nbytes() for t in packed.tensors()) == c.stored_bytes(x.shape, x.dtype)
    torch.testing.assert_close(c.decompress(packed, x.shape, x.dtype).cpu(), cpu, rtol=1e-4, atol=1e-5)
    stock, lean = pair(CONVS[1], c)
    stock, lean = stock.cuda(), lean.cuda()
    xg = x.cuda().requires_grad_()
    y = lean(xg)
    torch.testing.assert_close(y, stock(xg))
    y.backward(torch.ones_like(y))
    gx = xg.grad.clone()
    xg.grad = None
    stock(xg).backward(torch.ones_like(y))
    torch.testing.assert_close(gx, xg.grad)
