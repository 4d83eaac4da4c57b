"""Frozen backbone layer: a frozen conv + BN (+ ReLU6 or ReLU) in, a FrozenConvBNAct that keeps no input out
(a 1-bit activation mask, or the conv output under batch BN), with its autograd Function and mask helpers."""

from __future__ import annotations

import math
import struct
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from edgetl.errors import ConfigError
from edgetl.cost import (CallShape, Execution, Setting, configured_copy, dtype_bytes as _dtype_bytes,
                         numel as _numel, repeated)
from edgetl.models.lean.fused import clamp_pack_, fusable, mask_mul
from edgetl.models.lean.convgrad import conv_input_grad, pointwise_conv
from edgetl.models.lean.layout import empty_as, is_channels_last, memory_flat, rows_into, rows_of_channels
from edgetl.models.lean.masks import (
    _fold_bits,
    pack_mask_,
    unpack_as,
    unpack_table,
)
from edgetl.models.lean.pooled_conv import _is_pointwise

# fp32 values per chunk when an int8 weight is dequantised into a half one: the fp32 copy of
# the widest frozen conv (1280 x 320) alone would be 1.6 MB at the streamed step's peak
DEQUANT_CHUNK = 1 << 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight in, (int8 codes, fp32 scale per channel) out.

    Dequantised weight = codes * scale; each element is off by at most scale / 2.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=tuple(range(1, w.dim())))
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    view = (-1,) + (1,) * (w.dim() - 1)
    codes = torch.round(w / scale.view(view)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


# activation kinds of the lean layers -> the clamp's upper bound (None: ReLU, no upper bound)
ACT_UPPER: dict[str, float | None] = {"relu6": 6.0, "relu": None}


def check_act(act: str | bool | None) -> str | None:
    """An activation kind of ``ACT_UPPER``, or None; True is the old spelling of "relu6" (and
    False of None). Anything else is a one-line ConfigError naming it."""
    if act is True:
        return "relu6"
    if act is False or act is None:
        return None
    if act not in ACT_UPPER:
        raise ConfigError(f"the lean layers have no activation {act!r}; allowed: {', '.join(ACT_UPPER)}, None")
    return act


def update_running_stats(running: tuple[torch.Tensor, ...], batch: tuple[torch.Tensor, ...], momentum: float) -> None:
    """BN's running-statistics update, ``r = r * (1 - momentum) + momentum * b`` for each pair,
    in place: the arithmetic of ``r.mul_(1 - momentum).add_(b, alpha=momentum)``, in two
    foreach ops for all pairs (two kernel launches on a GPU instead of two per pair)."""
    torch._foreach_mul_(list(running), 1 - momentum)
    torch._foreach_add_(list(running), list(batch), alpha=momentum)


def _bn_scale(bn: nn.BatchNorm2d) -> torch.Tensor:
    return bn.weight.detach().float() * torch.rsqrt(bn.running_var.float() + bn.eps)


class FrozenConvBNAct(nn.Module):
    """A frozen conv (+ BN, + optional ReLU6 or ReLU: ``act``) that never saves its input.

    grad_input comes from the weight alone (``conv_input_grad``). With ``bn="fold"`` the BN
    (eval statistics) is folded into the conv's weight and bias and the only thing saved
    is a 1-bit activation mask (0 < y < 6 for "relu6", y > 0 for "relu"). With
    ``bn="batch"`` the BN uses batch statistics in training (and updates its running
    statistics), which forces keeping the conv output (BN's backward needs it) plus
    per-channel mean and invstd; the activation mask is recomputed from them. The frozen
    weight is stored as fp32, fp16 or per-output-channel int8 and dequantised per call into
    the activation dtype (a large 1x1 weight a chunk at a time, ``chunked``, unless the
    schedule allows it whole). The only trainable parameter allowed is ``bias`` (the BN
    beta, folded or not), for the "repnet+bias" mode.

    How a call runs where there is a choice is the step schedule's (``edgetl.memory.schedule``),
    read from ``execution`` (``edgetl.cost.Tunable``; ``settings`` lists the choices):

    * "backward": "per_sample" (the default: one sample's masked grad_output at a time) or
      "whole_batch" (fewer, larger kernels; every sample's masked copy at once), per output
      shape: a batch of another size (an epoch's last) runs sample by sample;
    * "mask_chunk": samples per chunk while the forward packs the activation mask, 1..n
      (1, the default: the least memory, the most kernel launches), per output shape;
    * "weight": "chunked" (the default where ``chunkable``) or "whole": the stored weight
      converted whole per call (one conv kernel), for every call.
    """

    # set on a meta copy that is only traced forward, never backward (``mark_shapes_only``):
    # only the conv runs (one conv even where it is chunked), since only the output's shape is
    # read; BN, the activation (both in place) and the mask (a large batch's masks, sample by sample,
    # cost minutes on meta) are skipped
    shapes_only = False
    # the converted weight a streamed segment holds across its micro-batches while it runs
    # (``StreamedSegment.hold_weights``): ``dequantized_weight`` returns it instead of converting
    held: torch.Tensor | None = None
    # how the activation mask is packed forward and applied backward (``LeanOptions.mask_kernels``):
    # torch's own ops, or edgetl's fused kernels (``edgetl.models.lean.fused``; set per layer by
    # ``set_mask_kernels``, so a layer's cost key says which)
    mask_kernels = "aten"

    def __init__(
        self,
        conv: nn.Conv2d,
        bn: nn.BatchNorm2d,
        act: str | bool | None,
        *,
        bn_mode: str = "fold",
        weight_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if conv.weight.requires_grad or (conv.bias is not None and conv.bias.requires_grad):
            raise ConfigError("the lean backbone needs frozen conv weights (modes full/bn+last cannot use it)")
        if bn.weight.requires_grad:
            raise ConfigError("the lean backbone needs frozen BN scales (mode bn+last cannot use it)")
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ConfigError("the lean backbone supports numeric zero padding only")
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = conv.kernel_size
        self.pointwise = conv.groups == 1 and _is_pointwise(conv.weight.shape, conv.stride, conv.padding, conv.dilation)
        self.act = check_act(act)  # read by truth value where only "has an activation" matters
        self.upper = ACT_UPPER[self.act] if self.act else None
        # output shape (None: every call) -> setting -> choice (see the class docstring):
        # set by edgetl.memory.schedule.apply_schedule, where the step's peak allows it
        self.execution: dict[tuple[int, ...] | None, dict[str, Hashable]] = {}
        self.bn_mode = bn_mode
        self.act_dtype = act_dtype
        weight = conv.weight.detach().float()
        conv_bias = conv.bias.detach().float() if conv.bias is not None else torch.zeros_like(bn.running_mean, dtype=torch.float32)
        beta = bn.bias.detach().float()
        if bn_mode == "fold":
            scale = _bn_scale(bn)
            weight = weight * scale.view(-1, 1, 1, 1)
            bias = beta + (conv_bias - bn.running_mean.float()) * scale
        else:
            if conv.bias is not None:
                raise ConfigError("bn='batch' expects a conv without bias before the BN")
            bias = beta
            self.register_buffer("bn_weight", bn.weight.detach().float().clone())
            self.register_buffer("running_mean", bn.running_mean.detach().float().clone())
            self.register_buffer("running_var", bn.running_var.detach().float().clone())
            self.register_buffer("num_batches_tracked", bn.num_batches_tracked.detach().clone())
            self.eps, self.momentum = bn.eps, bn.momentum
        self.bias = nn.Parameter(bias.clone(), requires_grad=bn.bias.requires_grad)
        self.weight_dtype = weight_dtype
        if weight_dtype == torch.int8:
            codes, scale = quantize_int8(weight)
            self.register_buffer("weight", codes)
            self.register_buffer("weight_scale", scale)
        else:
            self.register_buffer("weight", weight.to(weight_dtype))
            self.weight_scale = None

    accounting_kind = "lean_frozen_conv"

    def settings(self, call: CallShape) -> tuple[Setting, ...]:
        """The execution settings of this call (``edgetl.cost.Tunable``), in the order the
        schedule fits them: the masked backward, the forward's mask chunk, the weight."""
        shape = call.out_shape
        out = []
        if _masked_per_sample(self, call.input_requires_grad, shape):
            out.append(Setting("backward", ("per_sample", "whole_batch"), "backward"))
        if mask_forward_chunked(self, call.output_requires_grad, shape):
            out.append(Setting("mask_chunk", tuple(range(1, int(shape[0]) + 1)), "forward", bisect=True))
        if self.chunkable:
            out.append(Setting("weight", ("chunked", "whole"), "both", every_shape=True))
        return tuple(out)

    def configured(self, choice: Execution) -> "FrozenConvBNAct":
        """A shallow copy of this layer (its tensors shared) whose ``execution`` is ``choice``."""
        return configured_copy(self, choice)

    def choice(self, name: str, out_shape=None) -> Hashable | None:
        """The schedule's choice for setting ``name`` at this output shape (or for every
        call), None where it made none (the default runs)."""
        if out_shape is not None:
            shape = tuple(int(d) for d in out_shape)
            if name in self.execution.get(shape, {}):
                return self.execution[shape][name]
        return self.execution.get(None, {}).get(name)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.act_dtype
        if self.held is not None and dtype == self.act_dtype:
            return self.held
        if self.weight_scale is None:
            return self.weight.to(dtype)
        scale = self.weight_scale.view(-1, 1, 1, 1)
        if dtype == torch.float32:  # one fp32 buffer, scaled in place (same values as codes * scale)
            return self.weight.float().mul_(scale)
        # a half weight: dequantised a few output channels at a time through a small fp32
        # chunk (the same values as the whole weight in fp32 cast at once)
        out = empty_as(self.weight, self.weight.shape, dtype=dtype)  # laid out as the stored weight
        rows = self._dequant_rows()
        if rows >= out.shape[0]:  # one chunk
            return out.copy_(self.weight.float().mul_(scale))
        outs, codes, scales = out.split(rows), self.weight.split(rows), scale.split(rows)
        for i in repeated(range(len(outs))):
            outs[i].copy_(codes[i].float().mul_(scales[i]))
        return out

    @property
    def converts_weight(self) -> bool:
        """Whether each call converts the stored weight whole into a new tensor in the act
        dtype (int8, or a float dtype other than the activations', not chunked): what a
        streamed segment can convert once and hold across its micro-batches."""
        return not self.chunked and self._dequant_bytes(_dtype_bytes(self.act_dtype))[0] > 0

    def _dequant_rows(self) -> int:
        """Output channels dequantised at a time into a half weight (``DEQUANT_CHUNK`` values)."""
        per_row = math.prod(self.weight.shape[1:])
        return max(1, min(self.weight.shape[0], DEQUANT_CHUNK // per_row))

    @property
    def chunked(self) -> bool:
        """Whether this conv runs on its weight a chunk at a time (``chunkable``, and the
        schedule did not allow the whole weight for it: setting "weight")."""
        return self.choice("weight") != "whole" and self.chunkable

    @property
    def chunkable(self) -> bool:
        """Whether this conv can run on its weight a chunk at a time and never hold it whole
        in the activation dtype: a 1x1 conv whose stored weight (int8, or a float dtype other
        than the activations') needs converting and is larger than one chunk. Its forward
        computes ``DEQUANT_CHUNK`` weights' worth of output channels at a time, its
        grad_input as many input channels at a time (each with the full sum over the other
        side, so no partial sums are rounded), one matrix product per sample written into
        the batch-sized result. Only where a chunk (int8: its fp32 and act-dtype copies)
        peaks below converting the whole weight (int8 under a half dtype: the whole half
        weight plus its fp32 chunk), i.e. above one chunk; a smaller weight is converted
        whole once per call, as before. That compares the conversions alone, which is what
        matters inside a streamed segment's small micro-batches; where a batch-sized output
        sits next to the weight, the whole weight (held with it) can be the smaller one, and
        the schedule chooses per conv (setting "weight")."""
        if not (self.pointwise and self.weight.dtype != self.act_dtype):
            return False
        a = _dtype_bytes(self.act_dtype)
        return max(self.row_chunk_peak(a), self.col_chunk_peak(a)) < self._dequant_bytes(a)[1]

    @staticmethod
    def _chunk_size(other: int) -> int:
        """Rows (or columns) of a chunk: ``DEQUANT_CHUNK`` weights, at least one row."""
        return max(1, DEQUANT_CHUNK // other)

    def weight_chunk(self, rows: slice, cols: slice, dtype: torch.dtype) -> torch.Tensor:
        """``weight[rows, cols]`` of a 1x1 conv as a contiguous (rows, cols) matrix in ``dtype``:
        int8 dequantised through an fp32 chunk (the values of ``dequantized_weight``)."""
        w = self.weight[rows, cols].to(torch.float32 if self.weight_scale is not None else dtype,
                                      memory_format=torch.contiguous_format)
        if self.weight_scale is not None:
            w.mul_(self.weight_scale[rows].view(-1, 1, 1, 1))
            if dtype != torch.float32:
                w = w.to(dtype)
        return w.view(w.shape[0], w.shape[1])

    def chunk_peak_bytes(self, values: int, dtype_bytes: int) -> int:
        """Peak bytes while ``weight_chunk`` converts ``values`` weights into the act dtype."""
        if self.weight_scale is not None and dtype_bytes != 4:
            return values * (4 + dtype_bytes)
        return values * dtype_bytes

    def row_chunk_peak(self, dtype_bytes: int) -> int:
        rows = min(self.out_channels, self._chunk_size(self.in_channels))
        return self.chunk_peak_bytes(rows * self.in_channels, dtype_bytes)

    def col_chunk_peak(self, dtype_bytes: int) -> int:
        cols = min(self.in_channels, self._chunk_size(self.out_channels))
        return self.chunk_peak_bytes(self.out_channels * cols, dtype_bytes)

    def pointwise_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The 1x1 conv of ``x`` (in the act dtype), a chunk of output channels at a time:
        one matrix product per sample, or, channels-last, one for the whole batch (its pixels
        are the rows of one matrix). ``x`` is contiguous or channels-last here (every
        producer's output is); the cost rule counts no copy."""
        n, _, h, w = x.shape
        y = empty_as(x, (n, self.out_channels, h, w))
        step = self._chunk_size(self.in_channels)
        if is_channels_last(y):
            rows = rows_of_channels(x)
            for i in repeated(range(0, self.out_channels, step)):
                wc = self.weight_chunk(slice(i, i + step), slice(None), x.dtype)
                torch.mm(rows, wc.t(), out=rows_into(y[:, i:i + wc.shape[0]]))
                del wc
            return y
        xs = x.reshape(n, self.in_channels, h * w)
        for i in repeated(range(0, self.out_channels, step)):
            wc = self.weight_chunk(slice(i, i + step), slice(None), x.dtype)
            for s in repeated(range(n)):
                torch.mm(wc, xs[s], out=y[s, i:i + wc.shape[0]].view(wc.shape[0], h * w))
            del wc
        return y

    def pointwise_grad_input(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """W^T @ g of a 1x1 conv written into ``out`` (samples of ``g``, same count), a chunk of
        input channels at a time: channels-last as one product of ``g``'s pixels where ``out``
        is channels-last (the input's layout), else a product per sample."""
        n, _, h, w = g.shape
        step = self._chunk_size(self.out_channels)
        if is_channels_last(out):
            rows = rows_of_channels(g)
            for j in repeated(range(0, self.in_channels, step)):
                wc = self.weight_chunk(slice(None), slice(j, j + step), g.dtype)
                torch.mm(rows, wc, out=rows_into(out[:, j:j + wc.shape[1]]))
                del wc
            return
        gs = g.reshape(n, self.out_channels, h * w)
        for j in repeated(range(0, self.in_channels, step)):
            wc = self.weight_chunk(slice(None), slice(j, j + step), g.dtype)
            for s in repeated(range(n)):
                torch.mm(wc.t(), gs[s], out=out[s, j:j + wc.shape[1]].view(wc.shape[1], h * w))
            del wc

    def _uses_batch_stats(self) -> bool:
        return self.bn_mode == "batch" and self.training

    def mask_chunk(self, out_shape) -> int:
        """Samples per chunk with which the forward packs this output shape's activation mask."""
        return max(1, min(self.choice("mask_chunk", out_shape) or 1, int(out_shape[0])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        momentum = 0.0
        if self._uses_batch_stats():
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        return _FrozenConvFn.apply(x, self.bias, self, momentum)

    def _dequant_bytes(self, dtype_bytes: int) -> tuple[int, int]:
        """(bytes of the dequantised weight, peak bytes while dequantising) in the act dtype."""
        w = self.weight.numel()
        if self.weight_scale is not None:  # int8: one fp32 buffer scaled in place, or a half
            if dtype_bytes == 4:           # weight filled through an fp32 chunk
                return w * 4, w * 4
            # the fp32 chunk of ``_dequant_rows`` rows, sized from the shape (no tensor op:
            # ``chunkable`` asks this on the forward's path)
            per_row = w // int(self.weight.shape[0])
            rows = max(1, min(int(self.weight.shape[0]), DEQUANT_CHUNK // per_row))
            return w * dtype_bytes, w * dtype_bytes + rows * per_row * 4
        if self.weight.dtype == self.act_dtype:
            return 0, 0
        return w * dtype_bytes, w * dtype_bytes

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"groups={self.groups}, act={self.act}, bn={self.bn_mode}, "
            f"weight={self.weight_dtype}, act_dtype={self.act_dtype}"
        )


def _scale_shift(m: FrozenConvBNAct, mean: torch.Tensor, invstd: torch.Tensor, beta: torch.Tensor):
    scale = m.bn_weight * invstd
    return scale, beta.float() - mean * scale


class _FrozenConvFn(Function):
    @staticmethod
    def forward(ctx, x, bias, m: FrozenConvBNAct, momentum):
        act = m.act_dtype
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        biased = False  # the folded bias already added (inside a matrix product)
        if m.chunked and not m.shapes_only:
            y = m.pointwise_forward(x.to(act))
        else:
            w = m.dequantized_weight(act)
            xa = x.to(act)
            if m.pointwise and is_channels_last(xa) and xa.device.type != "cuda":  # pixels as rows
                biased = m.bn_mode == "fold" and not m.shapes_only
                y = pointwise_conv(xa, w, bias.to(act) if biased else None)
            else:
                y = F.conv2d(xa, w, None, m.stride, m.padding, m.dilation, m.groups)
            del w, xa
        if m.shapes_only:  # a meta trace: the conv's output is all it reads (BN and the activation are in place)
            return y
        c = (1, -1, 1, 1)
        saved: tuple = ()
        if m.bn_mode == "fold":
            if not biased:
                y.add_(bias.to(act).view(c))
        elif m._uses_batch_stats():
            n = y.numel() // y.shape[1]
            if n <= 1:
                raise ValueError("batch BN needs more than 1 value per channel")
            var, mean = torch.var_mean(y.float(), dim=(0, 2, 3), correction=0)
            invstd = torch.rsqrt(var + m.eps)
            update_running_stats((m.running_mean, m.running_var), (mean, var * (n / (n - 1))), momentum)
            if need:
                saved = (y.clone(), mean, invstd)  # the BN input, before it is overwritten below
            scale, shift = _scale_shift(m, mean, invstd, bias)
            y.mul_(scale.to(act).view(c)).add_(shift.to(act).view(c))
        else:
            invstd = torch.rsqrt(m.running_var + m.eps)
            scale, shift = _scale_shift(m, m.running_mean, invstd, bias)
            y.mul_(scale.to(act).view(c)).add_(shift.to(act).view(c))
        # which kernels pack the mask, and so apply it: fused only where they pack as torch's ops do
        ctx.mask_kernels = "fused" if m.mask_kernels == "fused" and fusable(y) else "aten"
        if m.act:
            if need and not saved and ctx.mask_kernels == "fused":  # clamped and packed in one pass
                saved = (clamp_pack_(y, m.upper),)
            else:
                if m.upper is not None:
                    y.clamp_(0, m.upper)
                else:
                    y.clamp_(min=0)
                if need and not saved:
                    saved = (_act_mask(y, m.mask_chunk(y.shape), m.upper),)
        ctx.m, ctx.in_shape, ctx.in_dtype, ctx.out_shape = m, tuple(x.shape), x.dtype, tuple(y.shape)
        ctx.channels_last, ctx.in_channels_last = is_channels_last(y), is_channels_last(x)
        ctx.kind = "batch" if (saved and len(saved) == 3) else ("mask" if saved else "none")
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, gy):
        m = ctx.m
        act = m.act_dtype
        c = (1, -1, 1, 1)
        gy = gy.to(act)
        gbias = None
        if _per_sample(ctx):
            return _per_sample_backward(ctx, gy)
        if ctx.kind == "batch":
            y, mean, invstd = ctx.saved_tensors
            if m.act:
                scale, shift = _scale_shift(m, mean, invstd, m.bias.detach())
                out = y * scale.to(act).view(c)
                out.add_(shift.to(act).view(c))
                del scale, shift
                keep = out > 0
                if m.upper is not None:
                    keep &= out < m.upper
                del out
                gy = keep.view(torch.uint8).to(act).mul_(gy)  # not gy * keep: see unpack_as
                del keep
            g_conv, _, gbias = torch.ops.aten.native_batch_norm_backward(
                gy.float(), y.float(), m.bn_weight, None, None, mean, invstd, True, m.eps,
                [ctx.needs_input_grad[0], False, ctx.needs_input_grad[1]],
            )
            gy = None
            g_conv = g_conv.to(act) if g_conv is not None else None
        else:
            if ctx.kind == "mask":
                (packed,) = ctx.saved_tensors
                gy = _masked(gy, packed, ctx.out_shape, ctx.mask_kernels, ctx.channels_last)
            if m.bn_mode == "batch":  # eval mode: a fixed per-channel scale
                scale = m.bn_weight * torch.rsqrt(m.running_var + m.eps)
                g_conv = gy * scale.to(act).view(c)
            else:
                g_conv = gy
            if ctx.needs_input_grad[1]:
                # accumulates in fp32 without a visible fp32 copy of gy
                gbias = gy.sum((0, 2, 3), dtype=torch.float32)
        del gy
        gx = None
        if ctx.needs_input_grad[0]:
            if m.chunked:
                gx = empty_as(g_conv, ctx.in_shape, dtype=act, channels_last=ctx.in_channels_last)
                m.pointwise_grad_input(g_conv, gx)
                del g_conv
            else:
                w = m.dequantized_weight(act)
                gx = conv_input_grad(ctx.in_shape, w, g_conv, m.stride, m.padding, m.dilation, m.groups)
                del w, g_conv
            gx = gx.to(ctx.in_dtype)
        return gx, gbias, None, None


def _masked(gy: torch.Tensor, packed: torch.Tensor, shape, kernels: str, channels_last: bool) -> torch.Tensor:
    """``gy`` times the unpacked mask ``packed`` of an output of ``shape``, a new tensor laid out
    as that output was: one fused kernel, or torch's ops (``unpack_as``)."""
    if kernels == "fused":
        return mask_mul(gy, packed, channels_last)
    return unpack_as(packed, shape, unpack_table(gy.dtype, gy.device), channels_last).mul_(gy)


def _sample_aligned(shape) -> bool:
    """More than one sample, and each sample's mask fills whole bytes."""
    n = int(shape[0])
    return n > 1 and (_numel(shape) // n) % 8 == 0


def _act_mask(y: torch.Tensor, chunk: int = 1, upper: float | None = 6.0) -> torch.Tensor:
    """The packed mask of 0 < y < upper (of y > 0 when ``upper`` is None: ReLU) of an activation
    ``y`` already clamped to [0, upper] (``_clamped_mask``), built ``chunk`` samples at a time
    when the bytes align (the byte-per-element masks of a whole batch would sit next to y;
    chunks of several samples launch fewer kernels where the step's peak allows them, issue
    #17)."""
    if not _sample_aligned(y.shape):
        return pack_mask_(_clamped_mask(y, upper))
    n = y.shape[0]
    if chunk >= n:  # one chunk: its folded bytes copied out last, no batch-sized slot to copy into
        # (the packed bytes then live beside the mask and the product, not beside the two
        # masks: the same largest moment, with three ops fewer)
        return _fold_bits(memory_flat(_clamped_mask(y, upper))).contiguous()
    step = y.numel() // n // 8
    packed = torch.empty(n * step, dtype=torch.uint8, device=y.device)
    for i in repeated(range(0, n, chunk)):
        part = y[i : i + chunk]
        mask = _clamped_mask(part, upper)
        packed[i * step : (i + part.shape[0]) * step] = _fold_bits(memory_flat(mask))
        del mask
    return packed


# the integer type of a float's bits, by its size
_BITS = {4: torch.int32, 2: torch.int16}


def _clamped_mask(y: torch.Tensor, upper: float | None) -> torch.Tensor:
    """0 < y < upper of a tensor clamped to [0, upper], as bool: y != 0, and y's bits != the
    bits of ``upper`` (y's bits less upper's, converted, then added back: integer arithmetic
    that wraps, so y comes back bit for bit).

    Why not ``(y > 0) & (y < upper)``: on CPU a float comparison that writes bools runs a
    scalar loop, 5-7x slower than a float-to-bool conversion (``!= 0``) or an integer add, and
    on the clamped tensor the two tests say the same: y > 0 where the clamp left y != 0, y <
    upper where it left y != upper. The same bits for every finite y and infinities (a NaN,
    which the clamp keeps, gets a 1, where a comparison gave a 0; its loss is NaN either way).
    The same bytes at each moment: two byte-per-element masks, as the two comparisons made."""
    mask = y.to(torch.bool)
    if upper is not None:
        bits = y.view(_BITS[y.element_size()])
        code = _upper_bits(upper, y.dtype)
        bits.add_(-code)
        mask &= bits.to(torch.bool)
        bits.add_(code)
    return mask


def _upper_bits(upper: float, dtype: torch.dtype) -> int:
    """The bits of ``upper`` in ``dtype`` as a signed integer of the same size."""
    if dtype == torch.float32:
        return struct.unpack("<i", struct.pack("<f", upper))[0]
    if dtype == torch.float16:
        return struct.unpack("<h", struct.pack("<e", upper))[0]
    if dtype == torch.bfloat16:  # the top half of the fp32 bits (6.0 and 1.0 are exact in bf16)
        f32 = struct.unpack("<I", struct.pack("<f", upper))[0]
        if f32 & 0xFFFF:
            raise ValueError(f"{upper} is not exact in bfloat16")
        return struct.unpack("<h", struct.pack("<H", f32 >> 16))[0]
    raise ValueError(f"no activation mask for dtype {dtype}")


def mask_forward_chunked(m: "FrozenConvBNAct", output_requires_grad: bool, out_shape) -> bool:
    """Whether the forward packs this output's activation mask in chunks of samples (``mask_chunk``):
    not with the fused kernels, which pack it whole with no temporary."""
    return (m.act and m.mask_kernels != "fused" and output_requires_grad and not m._uses_batch_stats()
            and _sample_aligned(out_shape))


def _masked_per_sample(m: "FrozenConvBNAct", needs_input_grad: bool, out_shape) -> bool:
    """Whether the masked backward can run sample by sample: each sample's mask fills whole bytes."""
    return bool(m.act and needs_input_grad and _sample_aligned(out_shape))


def mask_backward_per_sample(m: "FrozenConvBNAct", needs_input_grad: bool, out_shape) -> bool:
    """Whether the masked backward runs sample by sample: it can, and the schedule did not
    choose the whole batch for this shape (setting "backward")."""
    return _masked_per_sample(m, needs_input_grad, out_shape) and m.choice("backward", out_shape) != "whole_batch"


def _per_sample(ctx) -> bool:
    return ctx.kind == "mask" and mask_backward_per_sample(ctx.m, ctx.needs_input_grad[0], ctx.out_shape)


def _per_sample_backward(ctx, gy):
    """Masked backward one sample at a time: only one sample's unpacked mask and masked
    grad_output exist at once (a whole-batch masked copy would coexist with grad_output
    and grad_input). The default; layers whose whole-batch backward stays within the
    step's peak run ``_FrozenConvFn.backward``'s whole-batch path instead
    (``edgetl.memory.schedule``)."""
    m = ctx.m
    act = m.act_dtype
    (packed,) = ctx.saved_tensors
    n = ctx.out_shape[0]
    one_out, one_in = (1,) + tuple(ctx.out_shape[1:]), (1,) + tuple(ctx.in_shape[1:])
    step = _numel(one_out) // 8
    gbias = torch.zeros(m.out_channels, dtype=torch.float32, device=gy.device) if ctx.needs_input_grad[1] else None
    gx = empty_as(gy, ctx.in_shape, dtype=act, channels_last=ctx.in_channels_last)
    scale = None
    if m.bn_mode == "batch":  # eval mode: a fixed per-channel scale
        scale = (m.bn_weight * torch.rsqrt(m.running_var + m.eps)).to(act).view(1, -1, 1, 1)
    w = None if m.chunked else m.dequantized_weight(act)
    table = unpack_table(act, gy.device) if ctx.mask_kernels != "fused" else None
    # a 1x1 conv's grad_input is W^T @ grad_output, written straight into gx: no result
    # to copy, and no batch-1 conv backward (which falls to a slow kernel on CPU)
    wt = w.view(m.out_channels, m.in_channels).t() if m.pointwise and w is not None else None
    for i in repeated(range(n)):
        g = (mask_mul(gy[i : i + 1], packed[i * step : (i + 1) * step], ctx.channels_last) if table is None
             else unpack_as(packed[i * step : (i + 1) * step], one_out, table, ctx.channels_last).mul_(gy[i : i + 1]))
        if gbias is not None:
            gbias.add_(g.sum((0, 2, 3), dtype=torch.float32))
        if scale is not None:
            g.mul_(scale)
        if w is None:  # the weight a chunk of input channels at a time (``chunked``)
            m.pointwise_grad_input(g, gx[i : i + 1])
        elif wt is not None and ctx.in_channels_last:  # pixels as rows: g (h w, out) @ W (out, in)
            torch.mm(rows_of_channels(g), wt.t(), out=rows_into(gx[i : i + 1]))
        elif wt is not None:
            torch.mm(wt, g.reshape(m.out_channels, -1), out=gx[i].view(m.in_channels, -1))
        else:
            gx[i : i + 1] = conv_input_grad(one_in, w, g, m.stride, m.padding, m.dilation, m.groups)
        del g
    del w, wt, table
    return gx.to(ctx.in_dtype), gbias, None, None
