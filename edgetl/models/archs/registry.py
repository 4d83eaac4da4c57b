"""The registry's types (``Architecture``, ``Hidden``) and its table: ``register``, ``get``,
``registered``; and the layer copies entries use to rebuild a pruned block.

The package ``edgetl.models.archs`` re-exports all of it, with the entries registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from edgetl.errors import ConfigError

Spec = Any  # an edgetl.models.backbone.BackboneSpec (that module reads this registry, not the reverse)


@dataclass(frozen=True)
class Hidden:
    """One layer carrying a block's hidden channels.

    Attributes:
        conv: path under ``features`` of the key convolution whose output channels are the
            hidden channels (torch-pruning's ``pruning_ratio_dict`` key, DESIGN 5).
        activation: path of the module whose output is the hidden activation (the hook of
            activation-L2 importance).
        act: the activation the hook applies to that output ("relu") when the module is
            before its activation (torchvision's ResNet blocks share one ReLU module, called
            two or three times a block, so the hook sits on the BN), or None.
    """

    conv: str
    activation: str
    act: str | None = None


@dataclass(frozen=True)
class Architecture:
    """One backbone architecture.

    Attributes:
        name: ``BackboneSpec.arch`` and the prefix of its weights names ("resnet18").
        title: as plots, captions and help name it ("ResNet-18").
        build: a spec -> (features, classifier), random weights, unpruned; ``features`` is the
            sequence of numbered blocks and ``classifier[-1]`` the linear layer fine-tuning
            replaces. Called under the device the caller chose.
        prunable: the blocks whose hidden channels can be pruned.
        hidden: block -> its hidden layers, pruned to one kept count together (a Bottleneck
            has two: conv1 and conv2 outputs are both its width).
        set_hidden: (features, block, channels) -> None: rebuild the layers that carry a
            block's hidden channels at ``channels`` (a pruned network rebuilt from its spec).
        taps: the blocks the Rep-Net side network adds to (module 0 reads the image).
        side_kernels: the side conv's kernel per tap (None: 5, or 3 where the tap block's
            input is at stride 32 or more).
        affects: block -> the blocks whose temporary memory its hidden count changes
            (MobileNetV2's block 1 shares the stem's output channels).
        width_multiplier: whether ``BackboneSpec.width`` other than 1.0 is allowed.
        dropout: the dropout before the classifier when a spec names none.
        has_skip: block -> whether it adds its input back (paper accounting's R term: the
            TinyTL / Rep-Net profilers hold a residual block's input across it).
        block_name: block number -> the name plots, tables and ``--blocks`` help show.
        weights: torchvision's weights enum for the architecture ("ResNet18_Weights"), or None.
        default_weights: the tag a bare architecture name stands for ("IMAGENET1K_V1").
        from_torchvision: a torchvision state_dict -> this entry's (its keys renamed).
        paper_ratios: block -> pruning ratio a paper used on this architecture, if any.
    """

    name: str
    title: str
    build: Callable[[Spec], tuple[nn.Sequential, nn.Sequential]]
    prunable: range
    hidden: Callable[[int], tuple[Hidden, ...]]
    set_hidden: Callable[[nn.Sequential, int, int], None]
    taps: tuple[int, ...]
    side_kernels: tuple[int, ...] | None = None
    affects: Callable[[int], tuple[int, ...]] = lambda block: (block,)
    width_multiplier: bool = True
    dropout: float = 0.2
    has_skip: Callable[[nn.Module], bool] = lambda block: False
    block_name: Callable[[int], str] = lambda block: f"features.{block}"
    weights: str | None = None
    default_weights: str = "IMAGENET1K_V1"
    from_torchvision: Callable[[dict], dict] = lambda state: state
    paper_ratios: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.side_kernels is not None and len(self.side_kernels) != len(self.taps):
            raise ConfigError(f"{self.name}: {len(self.side_kernels)} side kernels for {len(self.taps)} taps")

    def check_block(self, block: int) -> None:
        """Refuse a block without prunable hidden channels, naming the allowed ones."""
        if block not in self.prunable:
            raise ConfigError(f"block {block} has no hidden channels; allowed blocks: "
                              f"{self.prunable.start}..{self.prunable.stop - 1} ({self.title})")

    def hidden_convs(self, features: nn.Sequential, block: int) -> list[nn.Module]:
        """The key convolutions of ``block`` (their output channels are its hidden channels)."""
        self.check_block(block)
        return [features.get_submodule(h.conv) for h in self.hidden(block)]

    def weights_enum(self):
        """torchvision's weights enum of this architecture (a ConfigError where it has none)."""
        if self.weights is None:
            raise ConfigError(f"{self.title} has no torchvision weights; start from {self.name}:random "
                              "or a backbone folder")
        import torchvision.models

        return getattr(torchvision.models, self.weights)


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


def conv_like(conv: nn.Conv2d, in_channels: int, out_channels: int, groups: int = 1) -> nn.Conv2d:
    """A fresh convolution shaped as ``conv`` but for the channel counts given (a pruned rebuild)."""
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


def bn_like(bn: nn.BatchNorm2d, channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(
        channels, eps=bn.eps, momentum=bn.momentum, device=bn.weight.device, dtype=bn.weight.dtype
    )
