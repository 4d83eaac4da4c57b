"""leanify_backbone: a built EdgeNet with frozen features in, the same network with lean frozen layers out
(with the option tables it resolves and the activation dtype's capability check)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_input

from edgetl.errors import CapabilityError, ConfigError
from edgetl.models.lean.frozen import FrozenConvBNAct
from edgetl.models.lean.pooling import LeanGlobalAvgPool
from edgetl.options import BN_MODES, FROZEN_WEIGHTS, PRECISIONS

# the torch dtype of each option value (edgetl.options.FROZEN_WEIGHTS, PRECISIONS)
WEIGHT_DTYPES = dict(zip(FROZEN_WEIGHTS, (torch.float32, torch.float16, torch.int8)))
ACT_DTYPES = dict(zip(PRECISIONS, (torch.float32, torch.bfloat16, torch.float16)))


def check_act_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """Fail with CapabilityError if conv forward/backward in ``dtype`` does not run on ``device``."""
    try:
        x = torch.ones(1, 2, 4, 4, dtype=dtype, device=device)
        w = torch.ones(2, 1, 3, 3, dtype=dtype, device=device)
        y = F.conv2d(x, w, None, 1, 1, 1, 2)
        conv2d_input(x.shape, w, y, 1, 1, 1, 2)
    except (RuntimeError, NotImplementedError) as exc:
        raise CapabilityError(
            f"{dtype} convolution is not supported on {device} by this torch build "
            f"({str(exc).splitlines()[0]}); choose act_dtype fp32 or another device"
        ) from None


def _resolve(name_or_dtype, table: dict, what: str) -> torch.dtype:
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype in table.values():
            return name_or_dtype
    elif name_or_dtype in table:
        return table[name_or_dtype]
    raise ConfigError(f"unknown {what} {name_or_dtype!r}; allowed: {', '.join(table)}")


def _lean_cna(cna: nn.Sequential, **kw) -> nn.Sequential:
    """torchvision Conv2dNormActivation (conv, BN, ReLU6) -> Sequential(FrozenConvBNAct)."""
    conv, bn = cna[0], cna[1]
    act = len(cna) > 2
    if act and not isinstance(cna[2], nn.ReLU6):
        raise ConfigError(f"lean backbone supports ReLU6 activations only, found {type(cna[2]).__name__}")
    return nn.Sequential(FrozenConvBNAct(conv, bn, act, **kw))


def leanify_backbone(
    net: nn.Module,
    *,
    bn: str = "fold",
    weight_dtype: str | torch.dtype = "fp32",
    act_dtype: str | torch.dtype = "fp32",
) -> nn.Module:
    """Convert a built EdgeNet's frozen features to lean layers, in place; returns ``net``.

    Each torchvision Conv2dNormActivation becomes ``Sequential(FrozenConvBNAct)`` and each
    project conv + BN a ``FrozenConvBNAct`` without activation, so block indices, the
    InvertedResidual skip adds (which save nothing) and the side taps are unchanged.
    ``net.pool`` becomes a ``LeanGlobalAvgPool`` returning fp32 (stock adaptive pooling
    saves its input). The side network and classifier are not touched; with
    ``act_dtype`` other than fp32 the side modules must be lean ones (they cast their
    input to fp32), see ``edgetl.models.lean_side``.

    Args:
        net: an EdgeNet whose feature conv weights and BN scales are frozen.
        bn: "fold" (eval statistics folded into the conv) or "batch" (batch statistics in
            training mode, running statistics updated; keeps the BN input for backward).
        weight_dtype: storage of the frozen weights: "fp32", "fp16" or "int8".
        act_dtype: dtype of backbone activations: "fp32", "bf16" or "fp16".

    Raises:
        CapabilityError: the activation dtype's convolutions do not run on this device.
        ConfigError: an unknown option, or trainable conv weights / BN scales.
    """
    from torchvision.models.mobilenetv2 import InvertedResidual

    if bn not in BN_MODES:
        raise ConfigError(f"unknown bn mode {bn!r}; allowed: {', '.join(BN_MODES)}")
    wdt = _resolve(weight_dtype, WEIGHT_DTYPES, "weight_dtype")
    adt = _resolve(act_dtype, ACT_DTYPES, "act_dtype")
    device = next(net.features.parameters()).device
    if adt != torch.float32:
        check_act_dtype(adt, device)
        side = net.side
        if side is not None and not all(getattr(b, "lean", False) for b in side.blocks):
            raise ConfigError(
                "act_dtype other than fp32 needs lean side modules: convert with "
                "edgetl.models.lean_side.lean_side_from_stock first"
            )
    kw = dict(bn_mode=bn, weight_dtype=wdt, act_dtype=adt)
    features = net.features
    for i, block in enumerate(features):
        if isinstance(block, InvertedResidual):
            layers = list(block.conv)
            new = [_lean_cna(layer, **kw) if isinstance(layer, nn.Sequential) else layer for layer in layers[:-2]]
            project, project_bn = layers[-2], layers[-1]
            if not (isinstance(project, nn.Conv2d) and isinstance(project_bn, nn.BatchNorm2d)):
                raise ConfigError(f"features[{i}] is not a torchvision InvertedResidual layout")
            new.append(FrozenConvBNAct(project, project_bn, False, **kw))
            block.conv = nn.Sequential(*new)
        elif isinstance(block, nn.Sequential) and isinstance(block[0], nn.Conv2d):
            features[i] = _lean_cna(block, **kw)
        else:
            raise ConfigError(f"features[{i}] ({type(block).__name__}) has no lean replacement")
    net.pool = LeanGlobalAvgPool(torch.float32)
    side = net.side
    if side is not None:
        for b in side.blocks:
            if getattr(b, "lean", False):
                b.out_dtype = adt
    # the batch can be fed in the activation dtype (the stem casts otherwise): the meter
    # and the runtime accounting build their batch in this dtype
    net.input_dtype = adt
    return net
