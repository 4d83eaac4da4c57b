"""Lean full fine-tuning (issue #16 item 2): every backbone conv trains, and what each keeps for its weight gradient is a storage choice.

BN statistics are frozen and folded, as is usual for small-batch transfer: each
torchvision Conv2dNormActivation (conv, BN, ReLU6) becomes ``Sequential(conv', LeanReLU6)``,
each project conv + BN a ``conv'``, each BasicBlock / Bottleneck a ``LeanResidualBlock`` of
``Sequential(conv', LeanReLU)`` / ``conv'`` layers and a ``LeanReLU`` after the add, and ResNet's
stem ``Sequential(conv', LeanMaxPool2d, LeanReLU)`` (max-pool first: exact, and the mask a
quarter the size), where conv' is the conv with the BN's eval
statistics folded in (``torch.nn.utils.fusion.fuse_conv_bn_weights``: weight w * s, bias
beta + (b - mean) * s, s = gamma / sqrt(var + eps)). The folded weight and bias train
(so Adam's per-element steps act on w * s rather than w; the stock "full" mode keeps BN
in training mode and is the other method, see docs/lean-runtime.md). Block indices, the residual adds
and the classifier are unchanged.

What each part keeps for backward:

    conv' (storage "exact")     its input itself, no copy        PooledConv2d(pool=1)
    conv' ("pool2", "pool4")    its input average-pooled by k    PooledConv2d(pool=k), seed 000
                                (small maps by less, ``effective_pool``)
    conv' (haar, db3, dct,      a fixed share ``keep`` of each   CompressedConv2d, seed 001
          threshold)            map's largest coefficients
    LeanReLU6, LeanReLU         a 1-bit mask of 0 < y (< 6)      (stock ReLU6 in place clones
                                                                  its whole input, ReLU keeps
                                                                  its output)
    LeanMaxPool2d               4 bits an output                 (stock: input + int64 indices)

Forward and every input gradient are exact; the approximation enters only the weight
gradients, in ``edgetl.models.lean.pooled_grad_weight`` and
``edgetl.models.compress._CompressedConv2dFn.backward``. Every stored size is a function
of the shapes alone, so the runtime accounting (each leaf measured on a meta twin,
``edgetl.memory.leaf``) knows the step's peak before it runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

from edgetl.errors import ConfigError
from edgetl.models.compress import CompressedConv2d, check_fraction, make_compressor
from edgetl.models.lean import LeanGlobalAvgPool, LeanMake, PooledConv2d, lean_block
from edgetl.models.lean import LeanReLU6  # noqa: F401  (imported from here before it moved to lean.act)
from edgetl.options import COMPRESSORS, STORAGES

POOLED_STORAGES = {"pool2": 2, "pool4": 4}
DEFAULT_KEEP = 0.1  # share of coefficients a compressor keeps per map (Vu et al.: up to 95 % saved)


def check_storage(storage: str, keep: float) -> tuple[str, float]:
    """Raise a one-line ConfigError for an unknown storage or a fraction outside (0, 1]."""
    if storage not in STORAGES:
        raise ConfigError(f"unknown storage {storage!r}; allowed: {', '.join(STORAGES)}")
    return storage, check_fraction(keep)


def stored_conv(conv: nn.Conv2d, storage: str, keep: float = DEFAULT_KEEP) -> nn.Conv2d:
    """``conv`` (weights, trainability kept) as the conv that keeps its input by ``storage``."""
    check_storage(storage, keep)
    if storage in COMPRESSORS:
        return CompressedConv2d.from_conv(conv, make_compressor(storage, keep))
    return PooledConv2d.from_conv(conv, pool=POOLED_STORAGES.get(storage, 1))


def fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new conv with bias computing ``bn(conv(x))`` with the BN's running statistics.

    Weight and bias train where the conv's weight does (the fused bias would not).
    """
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                      padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=True,
                      padding_mode=conv.padding_mode, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        w, b = fuse_conv_bn_weights(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps,
                                    bn.weight, bn.bias)
        fused.weight.copy_(w)
        fused.bias.copy_(b)
    trains = conv.weight.requires_grad
    fused.weight.requires_grad_(trains)
    fused.bias.requires_grad_(trains)
    return fused


def unfold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> dict[str, torch.Tensor]:
    """A folded conv's weights in the stock conv + BN layout of ``conv`` and ``bn`` (state_dict
    entries under "conv." and "bn."): the conv weight as trained, BN running mean 0 and
    scale sqrt(var + eps) (an exact identity with the BN's own variance), beta the folded
    bias. ``bn(conv(x))`` in eval mode is then the folded conv again, up to float rounding."""
    var = bn.running_var.detach().float()
    out = {"conv.weight": conv.weight.detach().clone()}
    out["bn.weight"] = torch.sqrt(var + bn.eps).to(bn.weight.dtype)
    out["bn.bias"] = conv.bias.detach().to(bn.bias.dtype).clone()
    out["bn.running_mean"] = torch.zeros_like(bn.running_mean)
    out["bn.running_var"] = bn.running_var.detach().clone()
    out["bn.num_batches_tracked"] = bn.num_batches_tracked.detach().clone()
    return out


class FullMake(LeanMake):
    """Lean full layers (``edgetl.models.lean.LeanMake``): each conv + BN one BN-folded conv
    that keeps its input by ``storage``, followed by a ``LeanReLU`` where the stock layer had
    an activation."""

    def __init__(self, storage: str, keep: float):
        self.storage, self.keep = storage, keep

    def conv_bn(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: str | None) -> list[nn.Module]:
        layers: list[nn.Module] = [stored_conv(fold_bn(conv, bn), self.storage, self.keep)]
        if act is not None:
            layers.append(self.act(act))
        return layers


def leanify_full(net: nn.Module, *, storage: str = "exact", keep: float = DEFAULT_KEEP) -> nn.Module:
    """Convert a built EdgeNet whose convs all train (mode full) to lean full fine-tuning, in place.

    Each block becomes its lean form by the converter registered for its type
    (``edgetl.models.lean.register_converter``, shared with the frozen lean backbone), built
    from ``FullMake``'s layers.

    Raises:
        ConfigError: an unknown storage, a fraction outside (0, 1], a side network (mode
            full trains the backbone itself), or a block or activation with no lean form.
    """
    check_storage(storage, keep)
    if net.side is not None:
        raise ConfigError("lean full fine-tuning trains the backbone itself; a network with a side network "
                          "cannot use it (allowed modes: full)")
    make = FullMake(storage, keep)
    features = net.features
    for i, block in enumerate(features):
        features[i] = lean_block(block, make, f"features[{i}]")
    net.pool = LeanGlobalAvgPool(torch.float32)
    net.input_dtype = torch.float32
    return net


def full_state_dict(lean_net: nn.Module, stock_net: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a lean full network in the stock torchvision layout of ``stock_net``.

    Each folded conv corresponds, in order, to one stock conv + BN pair (``unfold_bn``);
    the classifier keys are the same in both layouts.
    """
    state = {k: v.detach().clone() for k, v in stock_net.state_dict().items()}
    for key, value in lean_net.state_dict().items():
        if key.startswith("classifier."):
            state[key] = value.detach().clone()
    folded = [m for m in lean_net.features.modules() if isinstance(m, nn.Conv2d)]
    names = {m: n for n, m in stock_net.features.named_modules()}
    convs = [m for m in stock_net.features.modules() if isinstance(m, nn.Conv2d)]
    bns = [m for m in stock_net.features.modules() if isinstance(m, nn.BatchNorm2d)]
    if not (len(folded) == len(convs) == len(bns)):
        raise ConfigError("lean full and stock networks do not correspond layer for layer")
    for lean, conv, bn in zip(folded, convs, bns):
        for key, value in unfold_bn(lean, bn).items():
            part, attr = key.split(".")
            state[f"features.{names[conv if part == 'conv' else bn]}.{attr}"] = value
    return state

