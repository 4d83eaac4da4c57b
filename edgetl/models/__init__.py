"""Networks edgetl builds: the MobileNetV2 backbone adapter and the Rep-Net side network."""

from edgetl.models.backbone import (
    BackboneSpec,
    EdgeNet,
    build_backbone,
    hidden_channels,
    prunable_blocks,
)
from edgetl.models.side import TAPS, build_side_network

__all__ = [
    "BackboneSpec",
    "EdgeNet",
    "TAPS",
    "build_backbone",
    "build_side_network",
    "hidden_channels",
    "prunable_blocks",
]
