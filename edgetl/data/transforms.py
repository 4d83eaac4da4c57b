"""Transforms (DESIGN 3): a resolution in, the training and evaluation pipelines out.

Both end in ImageNet normalisation, or in the uint8 pixels themselves for a network that
normalises its own batch.
"""

from __future__ import annotations

import math

from edgetl.imagenet import IMAGENET_MEAN, IMAGENET_STD


def _to_tensor(uint8: bool) -> list:
    """The last steps: ImageNet normalisation into fp32, or the uint8 pixels themselves for a
    network that normalises its own batch (``edgetl.models.lean.InputNorm``, the same values)."""
    from torchvision import transforms as T

    if uint8:
        return [T.PILToTensor()]
    return [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


def train_transform(resolution: int, uint8: bool = False):
    """RandomResizedCrop(scale 0.22-1) + horizontal flip + ImageNet normalisation (``uint8``:
    left to the network)."""
    from torchvision import transforms as T

    return T.Compose([
        T.RandomResizedCrop(resolution, scale=(0.22, 1.0)),
        T.RandomHorizontalFlip(),
        *_to_tensor(uint8),
    ])


def eval_transform(resolution: int, uint8: bool = False):
    """Resize the short side to resolution / 0.875, centre crop, ImageNet normalisation
    (``uint8``: left to the network)."""
    from torchvision import transforms as T

    return T.Compose([
        T.Resize(int(math.floor(resolution / 0.875))),
        T.CenterCrop(resolution),
        *_to_tensor(uint8),
    ])
