"""torchvision's MobileNetV2: block 0 the stem, 1..17 inverted residual blocks, 18 the 1x1 conv."""

from __future__ import annotations

from torch import nn

from edgetl.models.archs.registry import Architecture, Hidden, Spec, bn_like, conv_like, register


def _build(spec: Spec) -> tuple[nn.Sequential, nn.Sequential]:
    from torchvision.models import mobilenet_v2

    tv = mobilenet_v2(width_mult=spec.width, num_classes=spec.num_classes, dropout=spec.dropout)
    return tv.features, tv.classifier


def _hidden(block: int) -> tuple[Hidden, ...]:
    """Block 1 has no expand conv: its hidden channels are the stem conv's output (DESIGN 5).
    The conv-BN-ReLU6 holding the key conv is the module whose output is the activation."""
    if block == 1:
        return (Hidden("0.0", "0"),)
    return (Hidden(f"{block}.conv.0.0", f"{block}.conv.0"),)


def _set_hidden(features: nn.Sequential, block: int, channels: int) -> None:
    if block == 1:
        stem, first = features[0], features[1]
        stem[0] = conv_like(stem[0], stem[0].in_channels, channels, 1)
        stem[1] = bn_like(stem[1], channels)
        dw, project = first.conv[0], first.conv[1]
    else:
        expand = features[block].conv[0]
        expand[0] = conv_like(expand[0], expand[0].in_channels, channels, 1)
        expand[1] = bn_like(expand[1], channels)
        dw, project = features[block].conv[1], features[block].conv[2]
    dw[0] = conv_like(dw[0], channels, channels, channels)
    dw[1] = bn_like(dw[1], channels)
    if block == 1:
        features[1].conv[1] = conv_like(project, channels, project.out_channels, 1)
    else:
        features[block].conv[2] = conv_like(project, channels, project.out_channels, 1)


MOBILENET_V2 = register(Architecture(
    name="mobilenet_v2",
    title="MobileNetV2",
    build=_build,
    prunable=range(1, 18),
    hidden=_hidden,
    set_hidden=_set_hidden,
    # Rep-Net's taps: the first block of each stage from the second on (DESIGN 3); the side
    # conv is 3x3 at the last, whose input is at stride 32 (7x7 at 224 px), 5x5 elsewhere
    taps=(2, 4, 7, 11, 14, 17),
    side_kernels=(5, 5, 5, 5, 5, 3),
    # block 1's hidden channels are the stem's output: pruning them changes both blocks
    affects=lambda block: (0, 1) if block == 1 else (block,),
    width_multiplier=True,
    dropout=0.2,
    has_skip=lambda block: bool(getattr(block, "use_res_connect", False)),
    weights="MobileNet_V2_Weights",
    # The FMEC 2023 paper's pruning of MobileNetV2 1.0 at 224 px: block -> ratio of hidden
    # channels removed (DESIGN 5; keeps 22/21/77/77)
    paper_ratios={1: 0.3, 2: 0.78, 3: 0.46, 4: 0.46},
))
