"""The architecture registry: a backbone's name in, what edgetl needs to know of it out.

A backbone is data (issue #42): each architecture is one ``Architecture`` entry, registered by
name as timm's ``register_model`` registers a model, and everything that differs between
networks (how to build it, its numbered blocks' prunable hidden channels, the Rep-Net taps,
its torchvision weights, the paper's pruning) is read from the entry of ``BackboneSpec.arch``.
The entries live beside this module, one module a family (``mobilenet_v2``, ``resnet``);
docs/design/backbones.md is the design, and says where MobileNetV3 and EfficientNet plug in.
How a block becomes lean is registered by block type in ``edgetl.models.lean`` (a block
type serves every architecture built of it).

Block i is ``features[i]`` of the built network; its head (global pool, dropout, classifier)
is reported as block ``len(features)``.
"""

from edgetl.models.archs.registry import Architecture, Hidden, Spec, bn_like, conv_like, get, register, registered

# The entries edgetl ships, registered in this order (the first is the default backbone).
from edgetl.models.archs.mobilenet_v2 import MOBILENET_V2  # noqa: E402
from edgetl.models.archs.resnet import RESNET18, RESNET34, RESNET50  # noqa: E402

DEFAULT_ARCH = MOBILENET_V2.name  # the backbone a command builds when none is named

__all__ = ["DEFAULT_ARCH", "Architecture", "Hidden", "MOBILENET_V2", "RESNET18", "RESNET34", "RESNET50", "Spec",
           "bn_like", "conv_like", "get", "register", "registered"]
