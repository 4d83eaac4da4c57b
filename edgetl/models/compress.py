"""Activation compressors (Vu et al., seed 001): a conv input in, a fixed-size sparse copy for its weight gradient out.

Vu et al. store each activation map transformed (a 3-level wavelet transform, Haar or
Daubechies 3; a blockwise DCT-II; or nothing, "simple thresholding"), keep its k largest
coefficients by magnitude in a sparse format, and reconstruct it for the backward. Here:

    name        transform of each (sample, channel) map          coefficients
    haar        3-level Haar wavelet transform, per axis             h x w
    db3         3-level Daubechies-3 wavelet transform, periodized   h x w
    dct         8 x 8 block DCT-II (a last partial block: its own     h x w
                DCT of the remaining size)
    threshold   none (the raw values)                                h x w

Every transform is one orthonormal h x h matrix for the rows and one w x w matrix for
the columns (coefficients = A_h @ X @ A_w^T, reconstruction A_h^T @ Y @ A_w), so any map
size works with no padding, the coefficient count equals the element count, and
keeping all coefficients reconstructs the map exactly.

**Fixed stored bytes.** Each (sample, channel) map keeps exactly k = ceil(fraction * h * w)
coefficients: their values in the input dtype and their positions in the map in the
smallest sufficient integer dtype (uint8 up to 256 positions, int16 up to 32768, else
int32). So ``stored_bytes(shape, dtype) = n * c * k * (value bytes + index bytes)``,
known from the shape alone before the step runs (the planner's promise needs that);
which coefficients are kept depends on the data, how many never does. Where that sparse
format would not be smaller than the input itself (high fractions: with fp32 values and
int16 positions, fraction >= 2/3), the input is kept as it is instead: exact, no
transform, ``n * c * h * w * value bytes`` (``is_sparse``). Vu et al. pick k over the
whole tensor; per map, every channel of every sample keeps the same share, and the
positions fit a small integer type.

**Hand-written, not a library.** Checked on PyPI (issue #16 item 3):
``ptwt`` 1.0.1 (PyTorch wavelet toolbox, pulls PyWavelets) needs Python >= 3.11, while the
Jetson runs Python 3.10 (JetPack 6, DESIGN), where only ptwt <= 0.1.9 installs, with
another API; its orthogonal boundary mode multiplies by ``torch.sparse`` matrices, whose
storage the ``StorageMeter`` does not see (strided tensors only), and its padding modes
give more coefficients than inputs and need cropping. ``torch-dct`` 0.1.6 (last release
2022) computes the DCT through complex FFTs; an 8-point DCT is an 8 x 8 matrix. The
transforms here are dense orthonormal matrices built with numpy (a few lines each,
checked in tests/test_compress.py: orthonormality, the Daubechies filter's vanishing
moments, the DCT's basis), applied with two matmuls that run alike on CPU, CUDA and
meta, with temporaries the runtime accounting can state to the byte
(``compress_phases``, ``decompress_phases``). The price: a dense matrix costs h + w
multiply-adds an element, where a block or filter-bank form would cost O(block)
(224 a value on a 112 x 112 map).

``CompressedConv2d`` is the conv that uses them: an exact forward and an exact input
gradient; only its weight gradient is computed from the reconstructed input, in
``_CompressedConv2dFn.backward``, and nowhere else does the approximation enter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.nn.grad import conv2d_input, conv2d_weight

from edgetl.errors import ConfigError
from edgetl.options import COMPRESSORS
from edgetl.cost import dtype_bytes as _dtype_bytes, repeated

WAVELET_LEVELS = 3  # Vu et al. use a 3-level decomposition in all experiments
DCT_BLOCK = 8  # JPEG's block (Vu et al. use 16; ``DCTCompressor(block=16)``)

# Daubechies scaling filters (orthonormal, sum sqrt(2)), in PyWavelets' rec_lo order;
# db3 in closed form (Daubechies 1988): sqrt(2)/32 (1 + a + b, 5 + a + 3b, 10 - 2a + 2b,
# 10 - 2a - 2b, 5 + a - 3b, 1 + a - b) with a = sqrt(10), b = sqrt(5 + 2 sqrt(10)).
_A, _B = math.sqrt(10.0), math.sqrt(5 + 2 * math.sqrt(10.0))
WAVELET_FILTERS = {
    "haar": (1 / math.sqrt(2), 1 / math.sqrt(2)),
    "db3": tuple(math.sqrt(2) / 32 * v for v in (
        1 + _A + _B, 5 + _A + 3 * _B, 10 - 2 * _A + 2 * _B, 10 - 2 * _A - 2 * _B, 5 + _A - 3 * _B, 1 + _A - _B)),
}
INDEX_BYTES = 8  # torch.topk and scatter work with int64 positions


def check_fraction(fraction) -> float:
    """The kept share of coefficients as a float in (0, 1]; ConfigError otherwise."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1
    if not ok:  # NaN fails the comparison too
        raise ConfigError(f"compression fraction {fraction!r} is not allowed; allowed: a fraction in (0, 1]")
    return float(fraction)


def index_dtype(positions: int) -> torch.dtype:
    """The smallest integer dtype that holds positions 0 .. positions - 1 (uint8, int16, int32, int64)."""
    for dtype, limit in ((torch.uint8, 1 << 8), (torch.int16, 1 << 15), (torch.int32, 1 << 31)):
        if positions <= limit:
            return dtype
    return torch.int64


# --------------------------------------------------------------------------- transforms


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal n-point DCT-II: row k holds basis k (scipy's ``dct(norm='ortho')``)."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m


def block_dct_matrix(n: int, block: int) -> np.ndarray:
    """Block-diagonal n x n: a ``block``-point DCT per block, the last partial block its own size."""
    m = np.zeros((n, n))
    for start in range(0, n, block):
        size = min(block, n - start)
        m[start:start + size, start:start + size] = dct_matrix(size)
    return m


def _dwt_level(n: int, h: tuple[float, ...]) -> tuple[np.ndarray, int]:
    """One periodized wavelet analysis level on n samples: (n x n orthonormal, approximation length).

    Rows: approximation coefficients first, then details. Periodization (filter taps wrap
    around the even part of the signal) keeps the count at n and the matrix orthonormal
    for any even length, however short; an odd last sample passes into the
    approximation band unchanged.
    """
    g = [(-1) ** k * h[len(h) - 1 - k] for k in range(len(h))]  # quadrature mirror
    even = n - n % 2
    half = even // 2
    approx = half + n % 2
    m = np.zeros((n, n))
    for i in range(half):
        for k, (hk, gk) in enumerate(zip(h, g)):
            j = (2 * i + k) % even
            m[i, j] += hk
            m[approx + i, j] += gk
    if n % 2:
        m[half, n - 1] = 1.0
    return m, approx


def wavelet_matrix(n: int, wavelet: str, levels: int = WAVELET_LEVELS) -> np.ndarray:
    """The n x n orthonormal matrix of a ``levels``-level periodized discrete wavelet transform.

    Each level transforms the previous level's approximation band; levels stop early
    once that band has fewer than 2 samples.
    """
    h = WAVELET_FILTERS[wavelet]
    m = np.eye(n)
    length = n
    for _ in range(levels):
        if length < 2:
            break
        step, approx = _dwt_level(length, h)
        m[:length] = step @ m[:length]
        length = approx
    return m


@functools.lru_cache(maxsize=256)
def _axis_matrix(kind: str, n: int, param: int) -> np.ndarray:
    # numpy, not torch: a cached torch tensor created under a StorageMeter would count
    # as live memory forever; each call copies it to the input's device and dtype
    # (never written to: ``_mats`` always copies)
    m = block_dct_matrix(n, param) if kind == "dct" else wavelet_matrix(n, kind, param)
    return m


# --------------------------------------------------------------------------- compressors


@dataclass(frozen=True)
class Packed:
    """A compressed (N, C, H, W) tensor.

    Attributes:
        values: sparse format: (N * C, k) kept coefficients in the input dtype; dense
            format: the input itself.
        indices: (N * C, k) positions of ``values`` in each flattened (H * W) coefficient
            map, in ``index_dtype(H * W)``; None in the dense format.
    """

    values: torch.Tensor
    indices: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.values,) if self.indices is None else (self.values, self.indices)


class Compressor:
    """Keeps a fixed share of each (sample, channel) map's largest coefficients.

    Subclasses name an orthonormal per-axis transform (``_matrix``); ``threshold`` has
    none. All sizes are functions of the shape and dtype only.

    Args:
        fraction: share of coefficients kept per map, in (0, 1].
        sparse: None (default) stores the cheaper of the sparse format and the input
            itself (``is_sparse``); True always stores the sparse format (to measure it
            at high fractions).
    """

    name = ""
    transforms = True

    def __init__(self, fraction: float, *, sparse: bool | None = None):
        self.fraction = check_fraction(fraction)
        if sparse not in (None, True):
            raise ConfigError(f"sparse must be None or True, got {sparse!r}")
        self.force_sparse = sparse is True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fraction={self.fraction})"

    # ---- sizes (shape and dtype only)

    def kept(self, shape) -> int:
        """Coefficients kept per (sample, channel) map: ceil(fraction * H * W), at least 1."""
        hw = int(shape[-2]) * int(shape[-1])
        # round first so that 0.3 * 10 is 3, not 3.0000000000000004 -> 4
        return max(1, min(hw, math.ceil(round(self.fraction * hw, 9))))

    def is_sparse(self, shape, dtype: torch.dtype) -> bool:
        """Whether the sparse format is stored: it is smaller than the input (or forced)."""
        hw = int(shape[-2]) * int(shape[-1])
        e = _dtype_bytes(dtype)
        sparse = self.kept(shape) * (e + _dtype_bytes(index_dtype(hw)))
        return self.force_sparse or sparse < hw * e

    def stored_bytes(self, shape, dtype: torch.dtype) -> int:
        """Bytes of the packed copy of an (N, C, H, W) tensor of ``dtype``.

        Sparse: N * C * k * (value bytes + index bytes); dense: N * C * H * W * value bytes.
        """
        n, c, h, w = (int(s) for s in shape)
        e = _dtype_bytes(dtype)
        if not self.is_sparse(shape, dtype):
            return n * c * h * w * e
        return n * c * self.kept(shape) * (e + _dtype_bytes(index_dtype(h * w)))

    def _matrix(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def _matrices_bytes(self, shape, e: int) -> int:
        h, w = int(shape[-2]), int(shape[-1])
        return (h * h + (w * w if w != h else 0)) * e

    def compress_phases(self, shape, dtype: torch.dtype) -> list[int]:
        """Bytes ``compress`` holds after each allocation or free (the input not counted).

        The packed copy is allocated first and filled one sample at a time, so the
        transform's and top-k's temporaries are one sample's. The last entry is
        ``stored_bytes`` (0 in the dense format: the input itself).
        """
        if not self.is_sparse(shape, dtype):
            return [0]
        n, c, h, w = (int(s) for s in shape)
        e = _dtype_bytes(dtype)
        stored = self.stored_bytes(shape, dtype)
        one, kk = c * h * w * e, c * self.kept(shape)  # one sample's map bytes, kept coefficients
        mats = self._matrices_bytes(shape, e) if self.transforms else 0
        base = stored + mats
        phases = [stored, base]
        y = 0
        if self.transforms:
            phases += [base + one, base + 2 * one, base + one]  # X A^T, A (.), the first freed
            y = one
        phases += [base + y + one, base + y + one + kk * (e + INDEX_BYTES),  # |Y|, top-k
                   base + y + kk * INDEX_BYTES]  # |Y| and the top-k values freed
        phases.append(stored)  # the sample's positions and transform freed, then the matrices
        return phases

    def decompress_phases(self, shape, dtype: torch.dtype) -> list[int]:
        """Bytes ``decompress`` holds after each allocation or free (the packed copy not
        counted): the result first, then one sample's positions, scattered map and inverse
        transform at a time. The last entry is the result (0 in the dense format: the
        input itself)."""
        if not self.is_sparse(shape, dtype):
            return [0]
        n, c, h, w = (int(s) for s in shape)
        e = _dtype_bytes(dtype)
        full, one, kk = n * c * h * w * e, c * h * w * e, c * self.kept(shape)
        if not self.transforms:  # scattered straight into the result
            return [full, full + kk * INDEX_BYTES, full]
        mats = self._matrices_bytes(shape, e)
        base = full + mats
        return [full, base, base + kk * INDEX_BYTES, base + kk * INDEX_BYTES + one, base + one,  # positions, scatter
                base + 2 * one, base + one, base + 2 * one, base, full]  # Y A, A^T (.), copied in

    # ---- work

    def _mats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = x.shape[-2], x.shape[-1]
        # copy=True: always a fresh tensor (float64 would otherwise share the cache)
        a_h = torch.as_tensor(self._matrix(h)).to(device=x.device, dtype=x.dtype, copy=True)
        a_w = a_h if w == h else torch.as_tensor(self._matrix(w)).to(device=x.device, dtype=x.dtype, copy=True)
        return a_h, a_w

    def compress(self, x: torch.Tensor) -> Packed:
        """An (N, C, H, W) tensor in, its packed copy out (``stored_bytes`` of new storage).

        One sample at a time: the transform and the top-k of a whole batch would hold
        several batch-sized temporaries next to the activations (issue #16).
        """
        if x.dim() != 4:
            raise ConfigError(f"compressors take (N, C, H, W) tensors, got shape {tuple(x.shape)}")
        if not self.is_sparse(x.shape, x.dtype):
            return Packed(x, None)
        n, c, h, w = x.shape
        k = self.kept(x.shape)
        values = x.new_empty((n * c, k))
        index = torch.empty((n * c, k), dtype=index_dtype(h * w), device=x.device)
        a_h, a_w = self._mats(x) if self.transforms else (None, None)
        for i in repeated(range(n)):
            y = torch.matmul(a_h, torch.matmul(x[i], a_w.t())) if self.transforms else x[i]
            flat = y.reshape(c, h * w)
            pos = torch.topk(flat.abs(), k, dim=1, sorted=False).indices
            torch.gather(flat, 1, pos, out=values[i * c:(i + 1) * c])
            index[i * c:(i + 1) * c] = pos
            del y, flat, pos
        return Packed(values, index)

    def decompress(self, packed: Packed, shape, dtype: torch.dtype) -> torch.Tensor:
        """The packed copy, the original shape and dtype in, the reconstructed tensor out
        (written one sample at a time)."""
        if packed.indices is None:
            return packed.values
        n, c, h, w = (int(s) for s in shape)
        out = torch.empty((n, c, h, w), dtype=dtype, device=packed.values.device)
        a_h, a_w = self._mats(out) if self.transforms else (None, None)
        for i in repeated(range(n)):
            rows = slice(i * c, (i + 1) * c)
            pos = packed.indices[rows].long()
            if not self.transforms:
                out[i].view(c, h * w).zero_().scatter_(1, pos, packed.values[rows].to(dtype))
                del pos
                continue
            y = torch.zeros(c, h * w, dtype=dtype, device=out.device).scatter_(1, pos, packed.values[rows].to(dtype))
            del pos
            t = torch.matmul(y.view(c, h, w), a_w)
            del y
            out[i] = torch.matmul(a_h.t(), t)
            del t
        return out


class WaveletCompressor(Compressor):
    """3-level periodized discrete wavelet transform per axis (``haar`` or ``db3``)."""

    def __init__(self, fraction: float, *, wavelet: str = "haar", levels: int = WAVELET_LEVELS,
                 sparse: bool | None = None):
        super().__init__(fraction, sparse=sparse)
        if wavelet not in WAVELET_FILTERS:
            raise ConfigError(f"unknown wavelet {wavelet!r}; allowed: {', '.join(WAVELET_FILTERS)}")
        if not (isinstance(levels, int) and levels >= 1):
            raise ConfigError(f"wavelet levels must be an integer >= 1, got {levels!r}")
        self.name, self.wavelet, self.levels = wavelet, wavelet, levels

    def __repr__(self) -> str:
        return f"WaveletCompressor({self.wavelet!r}, fraction={self.fraction}, levels={self.levels})"

    def _matrix(self, n: int) -> np.ndarray:
        return _axis_matrix(self.wavelet, n, self.levels)


class DCTCompressor(Compressor):
    """Block DCT-II (``block`` x ``block``; a partial last block gets a DCT of its own size)."""

    name = "dct"

    def __init__(self, fraction: float, *, block: int = DCT_BLOCK, sparse: bool | None = None):
        super().__init__(fraction, sparse=sparse)
        if not (isinstance(block, int) and block >= 2):
            raise ConfigError(f"DCT block must be an integer >= 2, got {block!r}")
        self.block = block

    def __repr__(self) -> str:
        return f"DCTCompressor(fraction={self.fraction}, block={self.block})"

    def _matrix(self, n: int) -> np.ndarray:
        return _axis_matrix("dct", n, self.block)


class ThresholdCompressor(Compressor):
    """Simple thresholding: the largest raw values, no transform."""

    name = "threshold"
    transforms = False


def make_compressor(name: str, fraction: float, *, sparse: bool | None = None) -> Compressor:
    """A compressor by name (one of COMPRESSORS) keeping ``fraction`` of each map's coefficients.

    Raises:
        ConfigError: an unknown name or a fraction outside (0, 1].
    """
    if name in WAVELET_FILTERS:
        return WaveletCompressor(fraction, wavelet=name, sparse=sparse)
    if name == "dct":
        return DCTCompressor(fraction, sparse=sparse)
    if name == "threshold":
        return ThresholdCompressor(fraction, sparse=sparse)
    raise ConfigError(f"unknown compressor {name!r}; allowed: {', '.join(COMPRESSORS)}")


# --------------------------------------------------------------------------- compressed conv


class _CompressedConv2dFn(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, compressor, shapes_only=False):
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.conf = (stride, padding, dilation, groups, compressor, tuple(x.shape), x.dtype)
        ctx.has_bias = bias is not None
        ctx.sparse = False
        saved: tuple = ()
        if ctx.needs_input_grad[1] and not shapes_only:
            packed = compressor.compress(x)
            ctx.sparse = packed.indices is not None
            saved = packed.tensors()
        ctx.save_for_backward(weight, *saved)
        return y

    @staticmethod
    def backward(ctx, gy):
        weight, *saved = ctx.saved_tensors
        stride, padding, dilation, groups, compressor, in_shape, in_dtype = ctx.conf
        gx = gw = gb = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.sum((0, 2, 3))  # first: the accounting counts parameter gradients from the start
        if ctx.needs_input_grad[1]:
            # the only approximation: grad_weight from the reconstructed input. First, so
            # that the reconstruction is gone before grad_input exists.
            packed = Packed(saved[0], saved[1] if ctx.sparse else None)
            x_hat = compressor.decompress(packed, in_shape, in_dtype)
            del packed, saved
            gw = conv2d_weight(x_hat, weight.shape, gy, stride, padding, dilation, groups)
            del x_hat
        if ctx.needs_input_grad[0]:
            # exact: the input gradient needs only the weight
            gx = conv2d_input(in_shape, weight, gy, stride, padding, dilation, groups)
        return gx, gw, gb, None, None, None, None, None, None


class CompressedConv2d(nn.Conv2d):
    """nn.Conv2d with an exact forward that keeps its input compressed for the weight gradient.

    grad_input is exact; grad_weight comes from ``compressor.decompress`` of the copy
    kept in forward (Vu et al.'s X_l in place of X). Without a trainable weight nothing
    is kept. Same parameters and state_dict keys as nn.Conv2d.

    Args:
        compressor: a ``Compressor`` (``make_compressor(name, fraction)``).
    """

    # a meta copy only traced forward (``mark_shapes_only``): its input is not compressed
    shapes_only = False

    def __init__(self, *args, compressor: Compressor, **kwargs):
        super().__init__(*args, **kwargs)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            raise ConfigError("CompressedConv2d supports numeric zero padding only")
        if not isinstance(compressor, Compressor):
            raise ConfigError(f"compressor must be a Compressor (make_compressor), got {compressor!r}")
        self.compressor = compressor

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, compressor: Compressor) -> "CompressedConv2d":
        new = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
            padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
            bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype,
            compressor=compressor,
        )
        new.load_state_dict(conv.state_dict())
        new.weight.requires_grad_(conv.weight.requires_grad)
        if conv.bias is not None:
            new.bias.requires_grad_(conv.bias.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CompressedConv2dFn.apply(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
            self.compressor, self.shapes_only,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", compressor={self.compressor!r}"


def grad_weight_cosine(conv: nn.Conv2d, x: torch.Tensor, compressor: Compressor,
                       grad_output: torch.Tensor | None = None, seed: int = 0) -> float:
    """Cosine similarity between a conv's exact grad_weight and the one from ``compressor``'s copy of ``x``.

    ``grad_output`` defaults to seeded Gaussian noise of the output's shape.
    """
    with torch.no_grad():
        if grad_output is None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            out_shape = conv(x).shape
            grad_output = torch.randn(out_shape, generator=gen, dtype=x.dtype).to(x.device)
        args = (conv.weight.shape, grad_output, conv.stride, conv.padding, conv.dilation, conv.groups)
        exact = conv2d_weight(x, *args)
        x_hat = compressor.decompress(compressor.compress(x), x.shape, x.dtype)
        approx = conv2d_weight(x_hat, *args)
        return F.cosine_similarity(exact.flatten(), approx.flatten(), dim=0).item()
