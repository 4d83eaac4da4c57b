"""ImageNet's per-channel pixel statistics (RGB, pixels scaled to [0, 1]): what the loaders
(``edgetl.data``), a network that normalises its own uint8 batch (``edgetl.models.lean.InputNorm``)
and the exported model's preprocessing metadata (``edgetl.export``) all use."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
