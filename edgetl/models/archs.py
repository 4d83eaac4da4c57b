"""The architecture registry: a backbone's name in, what edgetl needs to know of it out.

A backbone is data (issue #42): each architecture is one ``Architecture`` entry, registered by
name as timm's ``register_model`` registers a model, and everything that differs between
networks (how to build it, its numbered blocks' prunable hidden channels, the Rep-Net taps,
the paper's pruning) is read from the entry of ``BackboneSpec.arch``. MobileNetV2 is the
first entry; docs/design/backbones.md plans the rest (ResNet-18/34/50, then MobileNetV3 and
EfficientNet-B0) and the fields still to move here (weights, lean layers, block names).

Block i is ``features[i]`` of the built network; its head (global pool, dropout, classifier)
is reported as block ``len(features)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from edgetl.errors import ConfigError

Spec = Any  # an edgetl.models.backbone.BackboneSpec (that module reads this registry, not the reverse)


@dataclass(frozen=True)
class Architecture:
    """One backbone architecture.

    Attributes:
        name: ``BackboneSpec.arch`` and the prefix of its weights names ("mobilenet_v2").
        title: as plots, captions and help name it ("MobileNetV2").
        build: a spec -> (features, classifier), random weights, unpruned; ``features`` is the
            sequence of numbered blocks and ``classifier[-1]`` the linear layer fine-tuning
            replaces. Called under the device the caller chose.
        prunable: the blocks whose hidden channels can be pruned.
        hidden_conv: (features, block) -> the key convolution whose output channels are the
            block's hidden channels (torch-pruning's ``pruning_ratio_dict`` key, DESIGN 5).
        set_hidden: (features, block, channels) -> None: rebuild the layers that carry a
            block's hidden channels at ``channels`` (a pruned network rebuilt from its spec).
        taps: the blocks the Rep-Net side network adds to (module 0 reads the image).
        width_multiplier: whether ``BackboneSpec.width`` other than 1.0 is allowed.
        has_skip: block -> whether it adds its input back (paper accounting's R term: the
            TinyTL / Rep-Net profilers hold a residual block's input across it).
        block_name: block number -> the name plots, tables and ``--blocks`` help show.
        paper_ratios: block -> pruning ratio a paper used on this architecture, if any.
    """

    name: str
    title: str
    build: Callable[[Spec], tuple[nn.Sequential, nn.Sequential]]
    prunable: range
    hidden_conv: Callable[[nn.Sequential, int], nn.Conv2d]
    set_hidden: Callable[[nn.Sequential, int, int], None]
    taps: tuple[int, ...]
    width_multiplier: bool = True
    has_skip: Callable[[nn.Module], bool] = lambda block: False
    block_name: Callable[[int], str] = lambda block: f"features.{block}"
    paper_ratios: dict[int, float] = field(default_factory=dict)

    def check_block(self, block: int) -> None:
        """Refuse a block without prunable hidden channels, naming the allowed ones."""
        if block not in self.prunable:
            raise ConfigError(f"block {block} has no hidden channels; allowed blocks: "
                              f"{self.prunable.start}..{self.prunable.stop - 1} ({self.title})")


_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Add ``arch`` to the registry under its name (a name already taken is refused)."""
    if arch.name in _REGISTRY:
        raise ConfigError(f"backbone arch {arch.name!r} is registered already")
    _REGISTRY[arch.name] = arch
    return arch


def get(name: str) -> Architecture:
    """The entry of ``name``; an unknown name is one ConfigError line listing the registered ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown backbone arch {name!r}; allowed: {', '.join(registered())}") from None


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# --- MobileNetV2 (torchvision): block 0 the stem, 1..17 inverted residual blocks, 18 the 1x1 conv


def _conv_like(conv: nn.Conv2d, in_channels: int, out_channels: int, groups: int) -> nn.Conv2d:
    return nn.Conv2d(
        in_channels,
        out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=groups,
        bias=conv.bias is not None,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )


def _bn_like(bn: nn.BatchNorm2d, channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(
        channels, eps=bn.eps, momentum=bn.momentum, device=bn.weight.device, dtype=bn.weight.dtype
    )


def _mobilenet_v2(spec: Spec) -> tuple[nn.Sequential, nn.Sequential]:
    from torchvision.models import mobilenet_v2

    tv = mobilenet_v2(width_mult=spec.width, num_classes=spec.num_classes, dropout=spec.dropout)
    return tv.features, tv.classifier


def _mobilenet_v2_hidden_conv(features: nn.Sequential, block: int) -> nn.Conv2d:
    """Block 1 has no expand conv: its hidden channels are the stem conv's output (DESIGN 5)."""
    return features[0][0] if block == 1 else features[block].conv[0][0]


def _mobilenet_v2_set_hidden(features: nn.Sequential, block: int, channels: int) -> None:
    if block == 1:
        stem, first = features[0], features[1]
        stem[0] = _conv_like(stem[0], stem[0].in_channels, channels, 1)
        stem[1] = _bn_like(stem[1], channels)
        dw, project = first.conv[0], first.conv[1]
    else:
        expand = features[block].conv[0]
        expand[0] = _conv_like(expand[0], expand[0].in_channels, channels, 1)
        expand[1] = _bn_like(expand[1], channels)
        dw, project = features[block].conv[1], features[block].conv[2]
    dw[0] = _conv_like(dw[0], channels, channels, channels)
    dw[1] = _bn_like(dw[1], channels)
    if block == 1:
        features[1].conv[1] = _conv_like(project, channels, project.out_channels, 1)
    else:
        features[block].conv[2] = _conv_like(project, channels, project.out_channels, 1)


MOBILENET_V2 = register(Architecture(
    name="mobilenet_v2",
    title="MobileNetV2",
    build=_mobilenet_v2,
    prunable=range(1, 18),
    hidden_conv=_mobilenet_v2_hidden_conv,
    set_hidden=_mobilenet_v2_set_hidden,
    # Rep-Net's taps: the first block of each stage from the second on (DESIGN 3)
    taps=(2, 4, 7, 11, 14, 17),
    has_skip=lambda block: bool(getattr(block, "use_res_connect", False)),
    # The FMEC 2023 paper's pruning of MobileNetV2 1.0 at 224 px: block -> ratio of hidden
    # channels removed (DESIGN 5; keeps 22/21/77/77)
    paper_ratios={1: 0.3, 2: 0.78, 3: 0.46, 4: 0.46},
))
