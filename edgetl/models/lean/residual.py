"""Lean residual block: lean body layers, an optional lean shortcut and a lean activation in, a
block computing act(body(x) + shortcut(x)) with the sum written into the body's output out."""

from __future__ import annotations

import torch
from torch import nn

from edgetl.errors import ConfigError


class LeanResidualBlock(nn.Module):
    """A torchvision BasicBlock / Bottleneck in lean form: ``act(body(x) + identity)``, identity
    ``x`` or ``downsample(x)``.

    The body's layers are registered under their own names (``conv1``, ``conv2``[, ``conv3``],
    the stock block's names), then ``downsample``, then ``act``: stock order, so the
    module-order pairings of lean convs with stock BNs (``edgetl.finetune.stock_state_dict``,
    ``edgetl.models.lean_full.full_state_dict``) hold. The body runs first, then the
    shortcut, as torchvision's blocks do (``x`` is held across the body either way). The sum
    is added into the body's output in place: nothing saved that output (a frozen conv keeps
    at most a mask, a lean full conv its input), and the activation after it, in place too,
    keeps a 1-bit mask (``LeanReLU``), so the add and the activation keep no map.
    """

    residual = True  # it adds its input back: paper accounting's R term (archs.resnet's has_skip)

    def __init__(self, body: nn.Sequential, shortcut: nn.Module | None, act: nn.Module):
        super().__init__()
        names = tuple(name for name, _ in body.named_children())
        if not names:
            raise ConfigError("a lean residual block needs at least one body layer")
        for name, layer in body.named_children():
            self.add_module(name, layer)
        self.body_names = names
        self.downsample = shortcut
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for name in self.body_names:
            y = self._modules[name](y)
        y += x if self.downsample is None else self.downsample(x)
        return self.act(y)
