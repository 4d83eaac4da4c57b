"""torchvision's ResNet-18, -34 and -50 as numbered blocks.

Block 0 is the stem (conv1, bn1, relu, maxpool), then every BasicBlock / Bottleneck of
layer1..layer4 in order (ResNet-18: blocks 1..8, head 9; ResNet-34 and -50: 1..16, head 17).
The classifier is ``Sequential(Dropout, fc)``; the global pool is ``EdgeNet.pool``, the same
``AdaptiveAvgPool2d(1)`` torchvision's has, so a torchvision state_dict maps onto the network
key by key (``from_torchvision``) and computes the same function.

A block's hidden channels are its inner width (BasicBlock: conv1's output; Bottleneck:
conv1's and conv2's, pruned together); the residual widths never change (DESIGN 5: keying
torch-pruning on conv1 (and conv2) prunes the inner width only, as verified in
docs/design/backbones.md section 3). The Rep-Net taps are the stem (side module 0 reads the
image pooled 4x) and the first block of each stage, as the Rep-Net authors' code taps ResNet.
"""

from __future__ import annotations

from torch import nn

from edgetl.errors import DataError
from edgetl.models.archs.registry import Architecture, Hidden, Spec, bn_like, conv_like, register


def _block_class(bottleneck: bool):
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return Bottleneck if bottleneck else BasicBlock


def _builder(depths: tuple[int, ...], bottleneck: bool):
    def build(spec: Spec) -> tuple[nn.Sequential, nn.Sequential]:
        from torchvision.models.resnet import ResNet

        tv = ResNet(_block_class(bottleneck), list(depths), num_classes=spec.num_classes)
        stem = nn.Sequential(tv.conv1, tv.bn1, tv.relu, tv.maxpool)
        features = nn.Sequential(stem, *tv.layer1, *tv.layer2, *tv.layer3, *tv.layer4)
        return features, nn.Sequential(nn.Dropout(spec.dropout), tv.fc)

    return build


def _starts(depths: tuple[int, ...]) -> tuple[int, ...]:
    """The block number of each stage's first block (layer1[0] is block 1)."""
    return tuple(1 + sum(depths[:i]) for i in range(len(depths)))


def _block_namer(depths: tuple[int, ...]):
    names = ["stem"] + [f"layer{stage + 1}.{k}" for stage, depth in enumerate(depths) for k in range(depth)]

    def name(block: int) -> str:
        return names[block] if 0 <= block < len(names) else f"features.{block}"

    return name


def _remapper(depths: tuple[int, ...]):
    """torchvision's keys -> this entry's: conv1/bn1 -> features.0.0/1, layerL.k -> features.N, fc -> classifier.1."""
    starts = _starts(depths)

    def remap(state: dict) -> dict:
        out = {}
        for key, value in state.items():
            head, _, rest = key.partition(".")
            if head == "conv1":
                out[f"features.0.0.{rest}"] = value
            elif head == "bn1":
                out[f"features.0.1.{rest}"] = value
            elif head == "fc":
                out[f"classifier.1.{rest}"] = value
            elif head.startswith("layer") and head[5:].isdigit() and 1 <= int(head[5:]) <= len(depths):
                index, _, tail = rest.partition(".")
                if not index.isdigit() or int(index) >= depths[int(head[5:]) - 1]:
                    raise DataError(f"state_dict key {key!r} names no block of this ResNet")
                out[f"features.{starts[int(head[5:]) - 1] + int(index)}.{tail}"] = value
            else:
                raise DataError(f"state_dict key {key!r} is not a torchvision ResNet key")
        return out

    return remap


def _hidden_of(bottleneck: bool):
    def hidden(block: int) -> tuple[Hidden, ...]:
        one = (Hidden(f"{block}.conv1", f"{block}.bn1", "relu"),)
        return one + (Hidden(f"{block}.conv2", f"{block}.bn2", "relu"),) if bottleneck else one

    return hidden


def _set_hidden(features: nn.Sequential, block: int, channels: int) -> None:
    """Rebuild a BasicBlock's or Bottleneck's inner layers at ``channels``."""
    b = features[block]
    b.conv1 = conv_like(b.conv1, b.conv1.in_channels, channels, b.conv1.groups)
    b.bn1 = bn_like(b.bn1, channels)
    if hasattr(b, "conv3"):  # Bottleneck: conv2 is channels -> channels, conv3 back to the residual width
        b.conv2 = conv_like(b.conv2, channels, channels, b.conv2.groups)
        b.bn2 = bn_like(b.bn2, channels)
        b.conv3 = conv_like(b.conv3, channels, b.conv3.out_channels, b.conv3.groups)
    else:
        b.conv2 = conv_like(b.conv2, channels, b.conv2.out_channels, b.conv2.groups)


def _has_skip(block: nn.Module) -> bool:
    """TinyTL's profiler holds the input of ``type(m) in [BasicBlock, Bottleneck]``; a lean
    residual block says so by its ``residual`` attribute."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return isinstance(block, (BasicBlock, Bottleneck)) or bool(getattr(block, "residual", False))


def _resnet(name: str, title: str, depths: tuple[int, ...], bottleneck: bool, weights: str,
            default: str) -> Architecture:
    return register(Architecture(
        name=name,
        title=title,
        build=_builder(depths, bottleneck),
        prunable=range(1, 1 + sum(depths)),
        hidden=_hidden_of(bottleneck),
        set_hidden=_set_hidden,
        # the stem (module 0 reads the image) and each stage's first block; the side conv is
        # 3x3 at layer4's, 5x5 elsewhere, as in the Rep-Net authors' ResProgramNet
        taps=(0, *_starts(depths)),
        side_kernels=(5, 5, 5, 5, 3),
        width_multiplier=False,
        dropout=0.0,
        has_skip=_has_skip,
        block_name=_block_namer(depths),
        weights=weights,
        default_weights=default,
        from_torchvision=_remapper(depths),
    ))


RESNET18 = _resnet("resnet18", "ResNet-18", (2, 2, 2, 2), False, "ResNet18_Weights", "IMAGENET1K_V1")
RESNET34 = _resnet("resnet34", "ResNet-34", (3, 4, 6, 3), False, "ResNet34_Weights", "IMAGENET1K_V1")
RESNET50 = _resnet("resnet50", "ResNet-50", (3, 4, 6, 3), True, "ResNet50_Weights", "IMAGENET1K_V2")
