"""Rep-Net side network (DESIGN 3): a backbone in, side modules attached at its tap blocks out.

Side module j reads the input of tap block j (module 0 reads the image, 4x4 average
pooled), and its output is added to the output of tap block j. Module: AvgPool 2x2 ->
conv k x k (groups 2, 1 for module 0) -> BN -> ReLU -> conv 1x1 -> BN (gamma 0, so the
untrained network equals the backbone) -> bilinear resize to the tap block's output.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from edgetl.errors import ConfigError
import edgetl.models.archs as archs
from edgetl.models.backbone import EdgeNet, block_shapes, block_strides
from edgetl.options import MODES, LeanOptions
from edgetl.units import round_up

TAPS = archs.get(archs.DEFAULT_ARCH).taps  # the default backbone's; a network's own are its architecture's (taps_of)
IMAGE_POOL = 4


def taps_of(net: EdgeNet) -> tuple[int, ...]:
    """The blocks a Rep-Net side network adds to on ``net``: its architecture's taps."""
    return archs.get(net.spec.arch).taps


class Resize(nn.Module):
    """Bilinear resize to a size given at call time (the tap block's output size)."""

    def forward(self, x: torch.Tensor, size) -> torch.Tensor:
        if tuple(x.shape[-2:]) == tuple(size):
            return x
        return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)


class SideModule(nn.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        groups: int,
        image_pool: int = 1,
    ):
        super().__init__()
        mid = round_up(in_channels, 8)
        self.in_channels, self.mid_channels, self.out_channels = in_channels, mid, out_channels
        self.pre_pool = nn.AvgPool2d(image_pool) if image_pool > 1 else None
        self.pool = nn.AvgPool2d(2)
        self.conv1 = nn.Conv2d(
            in_channels, mid, kernel_size, padding=kernel_size // 2, groups=groups, bias=False
        )
        self.bn1 = nn.BatchNorm2d(mid)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(mid, out_channels, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        nn.init.zeros_(self.bn2.weight)
        self.resize = Resize()

    def forward(self, x: torch.Tensor, size) -> torch.Tensor:
        if self.pre_pool is not None:
            x = self.pre_pool(x)
        x = self.pool(x)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return self.resize(x, size)


class SideNetwork(nn.Module):
    """The side modules, one per tap block; ``taps`` says where each attaches."""

    def __init__(self, blocks: list[SideModule], taps: tuple[int, ...]):
        super().__init__()
        self.taps = tuple(taps)
        self.blocks = nn.ModuleList(blocks)


def build_side_network(net: EdgeNet, taps: tuple[int, ...] | None = None) -> SideNetwork:
    """Build a Rep-Net side network sized for ``net`` (any width, pruned or not).

    The conv kernels are the architecture's (``side_kernels``: MobileNetV2 1.0 then has
    about 380 k side parameters, DESIGN 3); for other taps, 5, or 3 where the tap block's
    input is at stride 32 (7x7 at 224 px).
    """
    arch = archs.get(net.spec.arch)
    taps = taps_of(net) if taps is None else tuple(taps)
    kernels = arch.side_kernels if arch.side_kernels is not None and taps == arch.taps else None
    shapes = block_shapes(net)
    outs = [channels for channels, _ in shapes]
    strides = [stride for _, stride in shapes]
    device = next(net.parameters()).device
    blocks = []
    for j, tap in enumerate(taps):
        if not (0 if j == 0 else 1) <= tap < len(outs):
            raise ConfigError(f"tap block {tap} out of range {0 if j == 0 else 1}..{len(outs) - 1}")
        if j == 0:
            in_ch, groups, in_stride = 3, 1, IMAGE_POOL
        else:
            in_ch, groups, in_stride = outs[tap - 1], 2, strides[tap - 1]
        kernel = kernels[j] if kernels is not None else 3 if in_stride >= 32 else 5
        with torch.device(device):
            blocks.append(
                SideModule(in_ch, outs[tap], kernel, groups, image_pool=IMAGE_POOL if j == 0 else 1)
            )
    return SideNetwork(blocks, taps)


def _side_map_sides(strides: list[int], resolution: int, taps: tuple[int, ...]) -> list[int]:
    """The side of each side module's conv1 input map (after its 2x2 pool) at ``resolution``.

    A MobileNetV2 stride-2 conv (3x3, padding 1) maps n pixels to ceil(n / 2), so the
    input of a tap block at stride s is ceil(r / s); module 0 pools the image by 4 then 2.
    """
    sides = []
    for j, tap in enumerate(taps):
        n = resolution // IMAGE_POOL if j == 0 else -(-resolution // strides[tap - 1])
        sides.append(n // 2)
    return sides


def min_resolution(net: EdgeNet, batch_size: int = 2, taps: tuple[int, ...] | None = None) -> int:
    """Smallest input side (pixels) at which the side network can train a batch of ``batch_size``.

    Every side module pools its input 2x2, so each needs an input of at least 2x2; its BN
    layers in training need more than one value per channel, which a batch of one gets only
    from a map of at least 2x2 after the pool. MobileNetV2: 33 px (the last module's input is
    at stride 32), 97 px at batch 1.
    """
    taps = taps_of(net) if taps is None else taps
    # from the spec: a lean network's layers are not nn.Conv2d, but its strides are the stock ones
    strides = block_strides(net)
    need = 1 if batch_size >= 2 else 2
    resolution = 1
    while min(_side_map_sides(strides, resolution, taps)) < need:
        resolution += 1
    return resolution


def check_resolution(net: EdgeNet, resolution: int, batch_size: int, where: str = "data.resolution") -> None:
    """Raise a one-line ConfigError if the side network cannot train at ``resolution``."""
    low = min_resolution(net, batch_size, getattr(net.side, "taps", None))
    if resolution < low:
        at = " at batch size 1 (the smallest side map gives BatchNorm one value per channel)" if batch_size < 2 else ""
        raise ConfigError(
            f"{where}: {resolution} px is too small for the Rep-Net side network{at}; allowed: >= {low} px"
        )


TRAIN_MODES = MODES  # what trains (edgetl.options)


def set_trainable(net: EdgeNet, mode: str) -> None:
    """Mark which parameters train, by fine-tuning mode.

    full: everything; last: the classifier; bias: backbone BN betas (MobileNetV2 convs have
    no bias) + classifier (TinyTL-B); bn+last: backbone BN gammas and betas + classifier;
    repnet: side network + classifier; repnet+bias: repnet + backbone BN betas.
    """
    if mode not in TRAIN_MODES:
        raise ConfigError(f"unknown mode {mode!r}; allowed: {', '.join(TRAIN_MODES)}")
    if mode.startswith("repnet") and net.side is None:
        raise ConfigError(f"mode {mode!r} needs a side network; attach one first")
    for p in net.parameters():
        p.requires_grad_(mode == "full")
    if mode == "full":
        return
    for p in net.classifier.parameters():
        p.requires_grad_(True)
    if mode.startswith("repnet"):
        for p in net.side.parameters():
            p.requires_grad_(True)
    for m in net.features.modules():
        if isinstance(m, nn.BatchNorm2d):
            if mode in ("bias", "bn+last", "repnet+bias"):
                m.bias.requires_grad_(True)
            if mode == "bn+last":
                m.weight.requires_grad_(True)


def build_network(
    spec,
    mode: str = "repnet",
    device: torch.device | str | None = None,
    lean: LeanOptions | None = None,
) -> EdgeNet:
    """Backbone from ``spec`` + side network when the mode needs one, trainability set.

    With ``lean`` the frozen backbone and the side network are converted to the lean
    runtime layers (edgetl.models.lean); without it they are stock torch modules.
    """
    from edgetl.metaop import MetaMemo
    from edgetl.models.backbone import build_backbone

    # on meta (a network the accounting measures), torch's meta kernels run once per layout
    with MetaMemo() if device is not None and torch.device(device).type == "meta" else nullcontext():
        net = build_backbone(spec, device=device)
        if mode.startswith("repnet"):
            net.attach_side(build_side_network(net))
        set_trainable(net, mode)
        if lean is not None:
            make_lean(net, lean)
    return net


def trains_backbone_convs(net: EdgeNet) -> bool:
    """Whether any conv weight of the backbone trains (mode full)."""
    return any(m.weight.requires_grad for m in net.features.modules() if isinstance(m, nn.Conv2d))


def make_lean(net: EdgeNet, lean: LeanOptions) -> EdgeNet:
    """Convert a built network (weights loaded, trainability set) to the lean runtime, in place.

    A network whose backbone convs train (mode full) becomes lean full fine-tuning
    (``edgetl.models.lean_full``: BN folded, each conv's input kept by ``lean.storage``);
    every other mode keeps a frozen lean backbone (``edgetl.models.lean_side``).
    """
    from edgetl.models.lean_side import leanify_network

    trains_convs = trains_backbone_convs(net)
    lean.check_backbone(trains_convs=trains_convs)
    if trains_convs:
        from edgetl.models.lean_full import leanify_full

        leanify_full(net, storage=lean.storage, keep=lean.keep)
        _mask_kernels(net, lean)
        net.options = lean
        return net
    leanify_network(
        net, pool=lean.pool, bn=lean.bn, weight_dtype=lean.frozen_weights, act_dtype=lean.precision
    )
    if lean.uint8_input:
        from edgetl.models.lean import ACT_DTYPES, InputNorm

        norm = InputNorm(out_dtype=ACT_DTYPES[lean.precision]).to(next(net.parameters()).device)
        pool = getattr(net.side.blocks[0], "pre_pool", None) if net.side is not None else None
        if net.side is not None and not hasattr(pool, "set_input"):
            raise ConfigError("uint8 input needs the side network's image pool (a lean Rep-Net side network)")
        net.input_norm = norm
        net.input_dtype = torch.uint8
        if pool is not None:
            pool.set_input(norm, None)
    if lean.channels_last:
        net.to_channels_last()
    _mask_kernels(net, lean)
    net.options = lean  # its stream and recompute: read by edgetl.memory.schedule.fit_schedule
    return net


def _mask_kernels(net: EdgeNet, lean: LeanOptions) -> None:
    """The masked layers' kernels (``LeanOptions.mask_kernels``): torch's ops unless asked."""
    if lean.mask_kernels != "aten":
        from edgetl.models.lean import set_mask_kernels

        set_mask_kernels(net, lean.mask_kernels)
