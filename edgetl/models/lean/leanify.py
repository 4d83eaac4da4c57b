"""leanify_backbone: a built EdgeNet with frozen features in, the same network with lean frozen layers out
(with the converters by block type it and lean full share, the option tables it resolves and the
activation dtype's capability check)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgetl.errors import CapabilityError, ConfigError
from edgetl.models.lean.act import LeanReLU, LeanReLU6
from edgetl.models.lean.convgrad import conv_input_grad
import edgetl.models.lean.fused as fused
from edgetl.models.lean.frozen import ACT_UPPER, FrozenConvBNAct, check_act
from edgetl.models.lean.maxpool import LeanMaxPool2d
from edgetl.models.lean.pooling import LeanGlobalAvgPool
from edgetl.models.lean.residual import LeanResidualBlock
from edgetl.options import BN_MODES, FROZEN_WEIGHTS, MASK_KERNELS, PRECISIONS

# the torch dtype of each option value (edgetl.options.FROZEN_WEIGHTS, PRECISIONS)
WEIGHT_DTYPES = dict(zip(FROZEN_WEIGHTS, (torch.float32, torch.float16, torch.int8)))
ACT_DTYPES = dict(zip(PRECISIONS, (torch.float32, torch.bfloat16, torch.float16)))


def check_act_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """Fail with CapabilityError if conv forward/backward in ``dtype`` does not run on ``device``."""
    try:
        x = torch.ones(1, 2, 4, 4, dtype=dtype, device=device)
        w = torch.ones(2, 1, 3, 3, dtype=dtype, device=device)
        y = F.conv2d(x, w, None, 1, 1, 1, 2)
        conv_input_grad(x.shape, w, y, 1, 1, 1, 2)
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


# ----------------------------------------------------------------------------- converters by block type


class LeanMake:
    """How a stock piece becomes lean, as a converter asks for it: ``leanify_backbone`` passes
    one that builds frozen layers (``FrozenConvBNAct``), ``edgetl.models.lean_full.leanify_full``
    one that builds trainable ones (a BN-folded stored conv and a ``LeanReLU``)."""

    def conv_bn(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: str | None) -> list[nn.Module]:
        """A conv, the BN after it and an activation kind (``ACT_UPPER``; None: none) as lean layers."""
        raise NotImplementedError

    def act(self, kind: str) -> nn.Module:
        """An activation on its own (after a residual add): a masked ``LeanReLU`` in place."""
        kind = check_act(kind)
        return LeanReLU6() if kind == "relu6" else LeanReLU(ACT_UPPER[kind])

    def max_pool(self, pool: nn.MaxPool2d) -> nn.Module:
        return LeanMaxPool2d.from_pool(pool)


class FrozenMake(LeanMake):
    """Frozen lean layers: each conv + BN (+ activation) one ``FrozenConvBNAct``."""

    def __init__(self, **kw):
        self.kw = kw

    def conv_bn(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: str | None) -> list[nn.Module]:
        return [FrozenConvBNAct(conv, bn, act, **self.kw)]


Converter = Callable[[nn.Module, LeanMake, str], nn.Module]
_CONVERTERS: dict[type, Converter] = {}
_BUILTINS_LOADED = False


def register_converter(block_type: type, converter: Converter) -> None:
    """Make blocks of ``block_type`` (and its subclasses) convertible: ``converter(block, make,
    where)`` returns the block's lean form, built through ``make`` (frozen or full alike);
    ``where`` names the block in errors ("features[3]"). A later registration for the same
    type replaces the earlier one (MobileNetV3 and EfficientNet blocks plug in here)."""
    _CONVERTERS[block_type] = converter


_ACT_KINDS = {nn.ReLU6: "relu6", nn.ReLU: "relu"}


def act_kind(module: nn.Module, where: str) -> str:
    """The lean activation kind of a stock activation module; a one-line ConfigError naming
    any other (a smooth activation needs saving or recomputing, not a mask)."""
    kind = _ACT_KINDS.get(type(module))
    if kind is None:
        raise ConfigError(f"the lean layers have no form of activation {type(module).__name__} ({where}); "
                          f"supported: {', '.join(t.__name__ for t in _ACT_KINDS)}")
    return kind


def _one(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else nn.Sequential(*parts)


def lean_layers(layers: list[nn.Module], make: LeanMake, where: str) -> list[nn.Module]:
    """A run of stock layers (conv, BN[, activation] triples and max pools, as a torchvision
    Conv2dNormActivation, ResNet's stem or a downsample holds them) as lean layers."""
    out: list[nn.Module] = []
    i = 0
    while i < len(layers):
        layer = layers[i]
        if isinstance(layer, nn.Conv2d) and i + 1 < len(layers) and isinstance(layers[i + 1], nn.BatchNorm2d):
            j, act = i + 2, None
            if j < len(layers) and not isinstance(layers[j], (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d)):
                act, j = act_kind(layers[j], f"{where}.{j}"), j + 1
            if act is not None and j < len(layers) and isinstance(layers[j], nn.MaxPool2d):
                # ResNet's stem: max-pool first, then the activation. ReLU (and ReLU6) is monotone,
                # so relu(maxpool(y)) equals maxpool(relu(y)) value for value and gradient for
                # gradient (a window whose max is <= 0 passes no gradient either way), and the
                # 1-bit mask, its backward and the gradient it returns are a quarter the size
                out += make.conv_bn(layer, layers[i + 1], None)
                out += [make.max_pool(layers[j]), make.act(act)]
                i = j + 1
                continue
            out += make.conv_bn(layer, layers[i + 1], act)
            i = j
        elif isinstance(layer, nn.MaxPool2d):
            out.append(make.max_pool(layer))
            i += 1
        else:
            raise ConfigError(f"{where}.{i} ({type(layer).__name__}) has no lean form; "
                              "expected conv + BN [+ activation] or a max pool")
    return out


def _sequential(block: nn.Sequential, make: LeanMake, where: str) -> nn.Module:
    return nn.Sequential(*lean_layers(list(block), make, where))


def _inverted_residual(block: nn.Module, make: LeanMake, where: str) -> nn.Module:
    """torchvision's MobileNetV2 InvertedResidual, kept as the same object (its skip add saves
    nothing): ``block.conv`` becomes ``Sequential(Sequential(lean conv-BN-act), ..., lean
    project conv)``, the module tree (and the conv names schedules store) of before."""
    layers = list(block.conv)
    project, project_bn = layers[-2], layers[-1]
    if not (isinstance(project, nn.Conv2d) and isinstance(project_bn, nn.BatchNorm2d)
            and all(isinstance(layer, nn.Sequential) for layer in layers[:-2])):
        raise ConfigError(f"{where} is not a torchvision InvertedResidual layout")
    new = [_sequential(layer, make, f"{where}.conv.{j}") for j, layer in enumerate(layers[:-2])]
    new += make.conv_bn(project, project_bn, None)
    block.conv = nn.Sequential(*new)
    return block


def _resnet_block(block: nn.Module, make: LeanMake, where: str) -> nn.Module:
    """torchvision's BasicBlock / Bottleneck as a ``LeanResidualBlock``: conv{k} + bn{k} with the
    block's activation on every conv but the last, the downsample's conv + BN, the activation
    after the add."""
    names = [n for n in ("conv1", "conv2", "conv3") if hasattr(block, n)]
    act = act_kind(block.relu, f"{where}.relu")
    body = OrderedDict(
        (name, _one(make.conv_bn(getattr(block, name), getattr(block, f"bn{k}"), act if k < len(names) else None)))
        for k, name in enumerate(names, 1))
    shortcut = None
    if block.downsample is not None:
        shortcut = _one(lean_layers(list(block.downsample), make, f"{where}.downsample"))
    return LeanResidualBlock(nn.Sequential(body), shortcut, make.act(act))


def _load_builtins() -> None:
    """Register torchvision's blocks (imported here, not when edgetl is)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    from torchvision.models.mobilenetv2 import InvertedResidual
    from torchvision.models.resnet import BasicBlock, Bottleneck

    for kind, converter in ((nn.Sequential, _sequential), (InvertedResidual, _inverted_residual),
                            (BasicBlock, _resnet_block), (Bottleneck, _resnet_block)):
        _CONVERTERS.setdefault(kind, converter)
    _BUILTINS_LOADED = True


def lean_block(block: nn.Module, make: LeanMake, where: str) -> nn.Module:
    """``block``'s lean form by the converter registered for its type (the nearest in its MRO);
    a block of no registered type is a one-line ConfigError naming it."""
    _load_builtins()
    for kind in type(block).__mro__:
        converter = _CONVERTERS.get(kind)
        if converter is not None:
            return converter(block, make, where)
    raise ConfigError(f"{where} ({type(block).__name__}) has no lean replacement; registered block types: "
                      f"{', '.join(sorted(t.__name__ for t in _CONVERTERS))}")


def leanify_backbone(
    net: nn.Module,
    *,
    bn: str = "fold",
    weight_dtype: str | torch.dtype = "fp32",
    act_dtype: str | torch.dtype = "fp32",
) -> nn.Module:
    """Convert a built EdgeNet's frozen features to lean layers, in place; returns ``net``.

    Each block becomes its lean form by the converter registered for its type
    (``register_converter``): a torchvision Conv2dNormActivation ``Sequential(FrozenConvBNAct)``,
    an InvertedResidual's project conv + BN a ``FrozenConvBNAct`` without activation, a
    BasicBlock / Bottleneck a ``LeanResidualBlock``, ResNet's stem ``Sequential(FrozenConvBNAct,
    LeanMaxPool2d)``; block indices, the skip adds (which save nothing) and the side taps are
    unchanged.
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
        ConfigError: an unknown option, trainable conv weights / BN scales, or a block or
            activation with no lean form.
    """
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
    make = FrozenMake(bn_mode=bn, weight_dtype=wdt, act_dtype=adt)
    features = net.features
    for i, block in enumerate(features):
        features[i] = lean_block(block, make, f"features[{i}]")
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


def set_mask_kernels(net: torch.nn.Module, kernels: str) -> int:
    """Every masked lean layer of ``net`` (``FrozenConvBNAct``, ``LeanReLU``) packs and applies
    its mask with ``kernels``; "fused" is checked against the network's device and loaded
    first. Returns how many layers were set."""
    if kernels not in MASK_KERNELS:
        raise ConfigError(f"mask_kernels {kernels!r} is not allowed; allowed: {', '.join(MASK_KERNELS)}")
    if kernels == "fused":
        tensor = next(itertools.chain(net.parameters(), net.buffers()), None)
        fused.prepare(tensor.device if tensor is not None else "cpu")
    layers = [m for m in net.modules() if isinstance(m, (FrozenConvBNAct, LeanReLU))]
    for m in layers:
        if kernels == "aten":  # the class default: the layer's cost key as it always was
            m.__dict__.pop("mask_kernels", None)
        else:
            m.mask_kernels = kernels
    return len(layers)
