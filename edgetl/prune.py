"""Prune stage: a backbone and per-block ratios in, a backbone with fewer hidden channels out.

Deciding is apart from doing: ``default_blocks`` (the profile's sensitive blocks) and
``auto_ratios`` (the paper's rule: prune until a block's temporary memory is at most the
overall cumulative gradient memory) return data; ``prune`` edits a copy of the network
with torch-pruning's DependencyGraph (DESIGN 5) and returns a ``PruneResult``;
``save_pruned`` writes it as a backbone folder (``save_backbone`` format + pruning record).
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import logging
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgetl.data import IMAGENET_MEAN, IMAGENET_STD, class_folders
from edgetl.errors import ConfigError, DataError
import edgetl.models.archs as archs
from edgetl.models.backbone import (
    PAPER_RATIOS,
    BackboneSpec,
    EdgeNet,
    block_out_channels,
    build_backbone,
    hidden_channels,
    load_backbone,
)

log = logging.getLogger(__name__)

IMPORTANCES = ("activation-l2", "weight-l2")
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_IMAGES = "train-images-idx3-ubyte.gz"
RATIO_STEP = 0.001  # --auto picks ratios on this grid: fine enough to hit every kept count up to 1000

# Memory figures are for fine-tuning the pruned backbone with Rep-Net, as in the paper's
# Table I (224 px, batch 8, 102 classes: Flowers102).
MEMORY_MODE = "repnet"
MEMORY_BATCH_SIZE = 8
MEMORY_NUM_CLASSES = 102


# ----------------------------------------------------------------------------- deciding


def check_plan(blocks: list[int], ratios: list[float], round_to: int = 1, arch: str = archs.DEFAULT_ARCH) -> None:
    """Raise ConfigError naming the first bad block, ratio or count."""
    entry = archs.get(arch)
    allowed = entry.prunable
    for b in blocks:
        if not isinstance(b, int) or b not in allowed:
            through = [p for p in allowed if b in entry.affects(p) and p != b]
            why = (f"block {b} is pruned through block {through[0]}" if through else
                   f"block {b} has no hidden channels" if isinstance(b, int) and 0 <= b else None)
            raise ConfigError(f"block {b} cannot be pruned; allowed: {allowed.start}..{allowed.stop - 1} "
                              f"({entry.title}{'; ' + why if why else ''})")
    if len(set(blocks)) != len(blocks):
        raise ConfigError(f"blocks {blocks} name a block twice")
    if len(ratios) != len(blocks):
        raise ConfigError(
            f"{len(ratios)} ratios for {len(blocks)} blocks {blocks}; give one ratio per block"
        )
    for b, r in zip(blocks, ratios):
        if not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ConfigError(f"ratio {r} for block {b} is not allowed; allowed: 0 <= ratio < 1")
    if not isinstance(round_to, int) or round_to < 1:
        raise ConfigError(f"round_to {round_to} is not allowed; allowed: an integer >= 1")


def kept_channels(channels: int, ratio: float, round_to: int = 1) -> int:
    """Channels torch-pruning keeps: int(C * (1 - ratio)), rounded down to ``round_to``.

    Mirrors ``MetaPruner``: rounding only applies when something is pruned at all.
    """
    kept = int(channels * (1 - ratio))
    if kept >= channels:
        return channels
    return kept - kept % round_to


def _memory_spec(spec: BackboneSpec, num_classes: int) -> BackboneSpec:
    return dataclasses.replace(spec, hidden=dict(spec.hidden), num_classes=num_classes)


def memory_report(spec: BackboneSpec, *, resolution: int, batch_size: int = MEMORY_BATCH_SIZE,
                  num_classes: int = MEMORY_NUM_CLASSES):
    """Paper accounting (DESIGN 2a) of Rep-Net fine-tuning on the backbone ``spec``."""
    from edgetl.models.side import build_network
    from edgetl.profile import check_options, paper_report

    check_options(mode=MEMORY_MODE, accounting="paper", resolution=resolution, batch_size=batch_size)
    net = build_network(_memory_spec(spec, num_classes), MEMORY_MODE, device="meta")
    return paper_report(net, mode=MEMORY_MODE, resolution=resolution, batch_size=batch_size)


def affected_blocks(block: int, arch: str = archs.DEFAULT_ARCH) -> tuple[int, ...]:
    """Blocks whose temporary memory changes when ``block``'s hidden channels change."""
    return archs.get(arch).affects(block)


def block_tmp_bytes(report, block: int, arch: str = archs.DEFAULT_ARCH) -> int:
    """Temporary memory of pruning unit ``block`` (MobileNetV2's block 1 includes the stem it
    shares channels with)."""
    return max(report.block(i).tmp_bytes for i in affected_blocks(block, arch))


def default_blocks(spec: BackboneSpec, *, resolution: int) -> list[int]:
    """The profile's sensitive blocks (Rep-Net, paper accounting) that can be pruned.

    A sensitive block without hidden channels of its own maps to the prunable blocks whose
    count changes it (MobileNetV2's stem: block 1, which shares the stem's output channels);
    one no prunable block changes (ResNet's stem) is left to the lean levers, and logged.
    """
    entry = archs.get(spec.arch)
    report = memory_report(spec, resolution=resolution)
    blocks = sorted({p for b in report.sensitive_blocks for p in entry.prunable if b in entry.affects(p)})
    left = [b for b in report.sensitive_blocks if not any(b in entry.affects(p) for p in entry.prunable)]
    log.info("sensitive blocks %s -> prunable blocks %s", report.sensitive_blocks, blocks)
    if left:
        log.warning("sensitive blocks %s of %s have no hidden channels to prune", left, entry.title)
    return blocks


@dataclass
class BlockChoice:
    """What ``auto_ratios`` chose for one block, and why."""

    block: int
    channels: int
    ratio: float
    kept: int
    tmp_before_bytes: int
    tmp_after_bytes: int
    reason: str


@dataclass
class AutoPlan:
    target_bytes: int
    target_source: str
    choices: list[BlockChoice]

    @property
    def blocks(self) -> list[int]:
        return [c.block for c in self.choices]

    @property
    def ratios(self) -> list[float]:
        return [c.ratio for c in self.choices]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def auto_ratios(spec: BackboneSpec, blocks: list[int], *, resolution: int,
                target_bytes: int | None = None, round_to: int = 1) -> AutoPlan:
    """Per block, the smallest ratio (0.001 grid) whose pruned temporary memory is <= target.

    The default target is the overall cumulative gradient memory of the unpruned network
    (paper Step 2). A block's temporary memory depends only on its own hidden channels, so
    all blocks are bisected together, one profile per step. A block already under the
    target is left alone; one that cannot reach it even with one channel is left alone
    with a warning.
    """
    check_plan(blocks, [0.0] * len(blocks), round_to, spec.arch)
    base = memory_report(spec, resolution=resolution)
    if target_bytes is None:
        target_bytes, source = base.stored_bytes, "overall cumulative gradient memory (unpruned)"
    else:
        if target_bytes < 1:
            raise ConfigError(f"target bytes {target_bytes} is not allowed; allowed: >= 1")
        source = "given"
    meta = build_backbone(spec, device="meta")
    channels = {b: hidden_channels(meta, b) for b in blocks}

    def tmp(kept: dict[int, int]) -> dict[int, int]:
        trial = dataclasses.replace(spec, hidden={**spec.hidden, **kept})
        report = memory_report(trial, resolution=resolution)
        return {b: block_tmp_bytes(report, b, spec.arch) for b in kept}

    before = {b: block_tmp_bytes(base, b, spec.arch) for b in blocks}
    todo = [b for b in blocks if before[b] > target_bytes]
    floor = tmp({b: 1 for b in todo}) if todo else {}
    todo = [b for b in todo if floor[b] <= target_bytes]
    lo = {b: 1 for b in todo}  # tmp(lo) <= target < tmp(hi); tmp grows with the kept count
    hi = {b: channels[b] for b in todo}
    while any(hi[b] - lo[b] > 1 for b in todo):
        mid = {b: (lo[b] + hi[b]) // 2 for b in todo}
        for b, t in tmp(mid).items():
            if t <= target_bytes:
                lo[b] = mid[b]
            else:
                hi[b] = mid[b]
    grid = [round(i * RATIO_STEP, 3) for i in range(1, round(1 / RATIO_STEP))]
    ratio, kept = {}, {}
    for b in todo:
        fits = [r for r in grid if 1 <= kept_channels(channels[b], r, round_to) <= lo[b]]
        ratio[b] = fits[0] if fits else 1 - (lo[b] + 0.5) / channels[b]  # grid too coarse: exact
        kept[b] = kept_channels(channels[b], ratio[b], round_to)
    after = tmp(kept) if todo else {}
    more = tmp({b: kept[b] + 1 for b in todo if kept[b] < channels[b]}) if todo else {}

    mb, choices = 1e6, []
    for b in blocks:
        c = channels[b]
        if before[b] <= target_bytes:
            choices.append(BlockChoice(b, c, 0.0, c, before[b], before[b],
                                       f"already {before[b] / mb:.3f} MB <= target {target_bytes / mb:.3f} MB"))
        elif b not in kept:
            log.warning("block %d cannot reach the target: one channel still needs %d bytes", b, floor[b])
            choices.append(BlockChoice(b, c, 0.0, c, before[b], before[b],
                                       f"unreachable: even 1 channel needs {floor[b] / mb:.3f} MB > "
                                       f"target {target_bytes / mb:.3f} MB; not pruned"))
        else:
            reason = f"keeps {kept[b]} of {c}: {after[b] / mb:.3f} MB <= target {target_bytes / mb:.3f} MB"
            if b in more:
                reason += f"; {kept[b] + 1} channels would need {more[b] / mb:.3f} MB"
            choices.append(BlockChoice(b, c, ratio[b], kept[b], before[b], after[b], reason))
    return AutoPlan(int(target_bytes), source, choices)


# ------------------------------------------------------------------------------ input


def load_input(*, checkpoint: str | Path | None = None, weights: str | Path | None = None,
               width: float | None = None, seed: int = 0) -> tuple[EdgeNet, dict]:
    """The network to prune, and a description of where it came from.

    Args:
        checkpoint: a backbone folder (from ``save_backbone``), an architecture or a
            torchvision weights name ("mobilenet_v2:IMAGENET1K_V1", "resnet18:random", ...;
            see ``edgetl.models.backbone.open_backbone``).
        weights: a torchvision state_dict file of a registered architecture
            (``weights_only=True``, recognised by its keys).
        width: width multiplier of the default backbone (not with a folder).
        seed: random init seed of the default backbone.

    Without ``checkpoint`` and ``weights`` the input is MobileNetV2 with random weights.
    """
    from edgetl.models.backbone import RANDOM_WEIGHTS, is_weights_name, open_backbone

    if checkpoint is not None and weights is not None:
        raise ConfigError("--weights is a torchvision state_dict file (any registered architecture, recognised by "
                          "its keys); --checkpoint names its own weights: give one of the two")
    if checkpoint is not None and width is not None and not is_weights_name(checkpoint):
        raise ConfigError("--weights and --width describe the default backbone; not with --checkpoint")
    ref = checkpoint if checkpoint is not None else weights if weights is not None else f"{archs.DEFAULT_ARCH}:{RANDOM_WEIGHTS}"
    if weights is not None and not Path(weights).is_file():
        raise DataError(f"weights file {weights} does not exist")
    net, found = open_backbone(ref, width=width, seed=seed)
    return net.eval(), found


# --------------------------------------------------------------------- calibration data
# A minimal, self-contained loader; to be replaced by edgetl.data once that lands.


def _read_idx_images(path: Path, count: int) -> torch.Tensor:
    """The first ``count`` images of an IDX3 (gzip) file, as uint8 (N, rows, cols)."""
    try:
        with gzip.open(path, "rb") as f:
            header = f.read(16)
            if len(header) != 16:
                raise DataError(f"{path} is truncated")
            magic, n, rows, cols = struct.unpack(">IIII", header)
            if magic != 2051:
                raise DataError(f"{path} is not an IDX image file (magic {magic})")
            count = min(count, n)
            data = f.read(count * rows * cols)
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if len(data) != count * rows * cols:
        raise DataError(f"{path} is truncated")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(count, rows, cols)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def calibration_batches(source: str | Path, *, resolution: int, batches: int = 8,
                        batch_size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """Calibration images, ImageNet-normalised, (batch, 3, resolution, resolution) each.

    Args:
        source: "fashion-mnist" (the IDX files under /usr/share/datasets/fashion-mnist; gray
            28x28 replicated to 3 channels and resized) or an ImageFolder root (class
            folders, or a ``train/`` folder of class folders); a fixed random subset.
        resolution: image side in pixels.
        batches: how many batches.
        batch_size: images per batch.
        seed: which subset of an ImageFolder.
    """
    if batches < 1 or batch_size < 1:
        raise ConfigError(f"calibration needs >= 1 batch of >= 1 image; got {batches} x {batch_size}")
    need = batches * batch_size
    if str(source) == "fashion-mnist":
        path = FASHION_MNIST_DIR / FASHION_MNIST_IMAGES
        if not path.is_file():
            raise DataError(f"Fashion-MNIST not found at {path}; as root: apt-get install dataset-fashion-mnist")
        gray = _read_idx_images(path, need).float().div_(255).unsqueeze(1)
        images = F.interpolate(gray, size=(resolution, resolution), mode="bilinear",
                               align_corners=False).expand(-1, 3, -1, -1)
        images = _normalise(images)
    else:
        images = _image_folder(Path(source), need, resolution, seed)
    return [images[i:i + batch_size].contiguous() for i in range(0, len(images), batch_size)][:batches]


def _image_folder(root: Path, need: int, resolution: int, seed: int) -> torch.Tensor:
    """``need`` images of ``root/<class>/*`` (or ``root/train/<class>/*``), read as a split is
    read for training (``edgetl.data.class_folders``): an entry that cannot be read is named in
    one line, and a FIFO among the images is never waited on."""
    from torchvision import transforms

    if not root.is_dir():
        raise DataError(f"calibration data {root} is neither 'fashion-mnist' nor a folder")
    if (root / "train").is_dir():
        root = root / "train"
    transform = transforms.Compose([
        transforms.Resize(int(math.floor(resolution / 0.875))),
        transforms.CenterCrop(resolution),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    data = class_folders(root)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:need]
    return torch.stack([transform(data[int(i)][0]) for i in order])


# ------------------------------------------------------------------------------- doing


def key_conv(net: EdgeNet, block: int) -> nn.Conv2d:
    """The (first) conv whose output channels are ``block``'s hidden channels (DESIGN 5)."""
    return key_convs(net, block)[0]


def key_convs(net: EdgeNet, block: int) -> list[nn.Conv2d]:
    """Every conv whose output channels are ``block``'s hidden channels: its entry's hidden
    layers (MobileNetV2: the expand conv, or the stem's for block 1; a ResNet Bottleneck:
    conv1 and conv2, pruned to one count)."""
    return archs.get(net.spec.arch).hidden_convs(net.features, block)


_ACTS = {None: lambda t: t, "relu": torch.relu, "relu6": lambda t: t.clamp(0, 6)}


@torch.no_grad()
def activation_l2(net: EdgeNet, blocks: list[int], batches: Iterable) -> dict[int, torch.Tensor]:
    """Per block, the L2 norm of each hidden activation channel over all calibration images.

    Runs only the feature blocks up to the last one asked for, in eval mode.
    """
    return {b: scores[0] for b, scores in activation_l2_layers(net, blocks, batches).items()}


@torch.no_grad()
def activation_l2_layers(net: EdgeNet, blocks: list[int], batches: Iterable) -> dict[int, list[torch.Tensor]]:
    """Per block, per hidden layer of its entry (``activation_l2``'s norm of each)."""
    device = next(net.parameters()).device
    entry = archs.get(net.spec.arch)
    layers = {b: entry.hidden(b) for b in blocks}
    sums = {(b, i): None for b in blocks for i in range(len(layers[b]))}
    handles = []

    def hook(key, act):
        def record(module, args, out):
            sq = _ACTS[act](out.detach().double()).pow(2).sum(dim=(0, 2, 3))
            sums[key] = sq if sums[key] is None else sums[key] + sq
        return record

    for b in blocks:
        for i, hidden in enumerate(layers[b]):
            module = net.features.get_submodule(hidden.activation)
            handles.append(module.register_forward_hook(hook((b, i), hidden.act)))
    upto = net.features[: max(blocks) + 1]
    was_training = net.training
    net.eval()
    count = 0
    try:
        for batch in batches:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != 3:
                raise DataError("calibration batches must be image tensors (N, 3, H, W)")
            upto(x.to(device=device, dtype=next(net.parameters()).dtype))
            count += x.shape[0]
    finally:
        for h in handles:
            h.remove()
        net.train(was_training)
    if count == 0:
        raise DataError("calibration data gave no images")
    log.info("activation L2 over %d calibration images", count)
    return {b: [sums[b, i].sqrt().float() for i in range(len(layers[b]))] for b in blocks}


def _activation_importance_class():
    import torch_pruning as tp

    prune_out = tp.pruner.function.prune_conv_out_channels

    class ActivationL2Importance(tp.importance.Importance):
        """Channel score = L2 norm of its activation, scattered into the group's root order.

        ``scores`` maps a key conv (whose output channels are the pruned ones) to one score
        per output channel. Groups without a key conv score nothing (they are not pruned).
        """

        def __init__(self, scores: dict[nn.Module, torch.Tensor]):
            self.scores = scores

        @torch.no_grad()
        def __call__(self, group):
            for i, (dep, idxs) in enumerate(group):
                module = dep.target.module
                if module in self.scores and dep.handler == prune_out:
                    out = torch.zeros(len(group[0].idxs))
                    out.scatter_(0, torch.as_tensor(group[i].root_idxs, dtype=torch.long),
                                 self.scores[module][torch.as_tensor(idxs, dtype=torch.long)].cpu())
                    return out
            return None

    return ActivationL2Importance


@dataclass
class PruneResult:
    """A pruned backbone and the record of how it was made (written into backbone.json)."""

    net: EdgeNet
    blocks: list[int]
    ratios: list[float]
    channels_before: dict[int, int]
    kept: dict[int, int]
    importance: str
    calibration: str | None
    round_to: int
    history: list
    before: dict
    after: dict
    base: dict = field(default_factory=dict)
    auto: dict | None = None

    @property
    def spec(self) -> BackboneSpec:
        return self.net.spec

    def info(self) -> dict:
        """The JSON-safe pruning record stored beside the spec in backbone.json."""
        return {
            "base": self.base,
            "pruning": {
                "blocks": self.blocks,
                "ratios": self.ratios,
                "channels_before": {str(b): c for b, c in self.channels_before.items()},
                "kept": {str(b): c for b, c in self.kept.items()},
                "importance": self.importance,
                "calibration": self.calibration,
                "round_to": self.round_to,
                "auto": self.auto,
                "history": self.history,
            },
            "before": self.before,
            "after": self.after,
        }


def summarize(net: EdgeNet, blocks: list[int], *, resolution: int) -> dict:
    """Params, MACs (backbone, one image) and paper-accounting memory (Rep-Net fine-tuning)."""
    import torch_pruning as tp

    device = next(net.parameters()).device
    macs, params = tp.utils.count_ops_and_params(
        net, torch.zeros(1, 3, resolution, resolution, device=device))
    report = memory_report(net.spec, resolution=resolution)
    tmp_blocks = sorted({i for b in blocks for i in affected_blocks(b, net.spec.arch)})
    return {
        "hidden": {str(b): hidden_channels(net, b) for b in blocks},
        "params": int(params),
        "macs": int(macs),
        "memory": {
            "accounting": "paper",
            "mode": MEMORY_MODE,
            "resolution": resolution,
            "batch_size": report.batch_size,
            "num_classes": report.num_classes,
            "peak_activation_bytes_per_image": report.peak_activation_bytes,
            "stored_bytes_per_image": report.stored_bytes,
            "total_bytes": report.total_bytes,
            "tmp_bytes": {str(i): report.block(i).tmp_bytes for i in tmp_blocks},
            "sensitive_blocks": report.sensitive_blocks,
        },
    }


def prune(*, net: EdgeNet, blocks: list[int], ratios: list[float],
          importance: str = "activation-l2", calib_batches: Iterable | None = None,
          calibration: str | None = None, round_to: int = 1, resolution: int = 224,
          base: dict | None = None, auto: AutoPlan | None = None) -> PruneResult:
    """Prune the hidden channels of ``blocks`` by ``ratios``; ``net`` itself is untouched.

    Args:
        net: the backbone (no side network).
        blocks: prunable blocks 1..17 (1 also prunes the stem's output).
        ratios: fraction of each block's hidden channels to remove; kept = int(C * (1 - r)).
        importance: "activation-l2" (needs ``calib_batches``) or "weight-l2".
        calib_batches: iterable of image batches (or (image, label) pairs).
        calibration: a description of the calibration data, for the record.
        round_to: round kept counts down to a multiple of this.
        resolution: input size for tracing, MACs and the memory figures.
        base: description of the input network, for the record.
        auto: the plan that chose the ratios, for the record.
    """
    import torch_pruning as tp

    check_plan(blocks, ratios, round_to, net.spec.arch)
    if importance not in IMPORTANCES:
        raise ConfigError(f"unknown importance {importance!r}; allowed: {', '.join(IMPORTANCES)}")
    if importance == "activation-l2" and calib_batches is None:
        raise ConfigError("importance activation-l2 needs calibration data")
    if net.side is not None:
        raise ConfigError("prune a backbone without a side network")
    channels = {b: hidden_channels(net, b) for b in blocks}
    kept = {b: kept_channels(channels[b], r, round_to) for b, r in zip(blocks, ratios)}
    for b, k in kept.items():
        if k < 1:
            raise ConfigError(f"ratio {ratios[blocks.index(b)]} keeps no channel of block {b} "
                              f"({channels[b]} channels, round_to {round_to})")

    model = copy.deepcopy(net).eval()
    # residual widths: every block's output but those that are another block's hidden
    # channels (MobileNetV2's stem output is block 1's)
    shared = {i for b in blocks for i in affected_blocks(b, net.spec.arch) if i != b}

    def residual_widths() -> list[int]:
        return [c for i, c in enumerate(block_out_channels(model, as_built=True)) if i not in shared]

    widths = residual_widths()
    before = summarize(model, blocks, resolution=resolution)
    if importance == "activation-l2":
        scores = activation_l2_layers(model, blocks, calib_batches)
        scorer = _activation_importance_class()(
            {conv: s for b in blocks for conv, s in zip(key_convs(model, b), scores[b])})
    else:
        scorer = tp.importance.MagnitudeImportance(p=2)
    device = next(model.parameters()).device
    ratio_dict = {conv: r for b, r in zip(blocks, ratios) if kept[b] < channels[b] for conv in key_convs(model, b)}
    history: list = []
    if ratio_dict:
        pruner = tp.pruner.MetaPruner(
            model,
            torch.zeros(1, 3, resolution, resolution, device=device),
            importance=scorer,
            pruning_ratio=0.0,
            pruning_ratio_dict=ratio_dict,
            round_to=round_to if round_to > 1 else None,
        )
        pruner.step()
        history = [[str(name), bool(out), [int(i) for i in idxs]]
                   for name, out, idxs in pruner.pruning_history()]
    got = {b: hidden_channels(model, b) for b in blocks}
    if any(conv.out_channels != got[b] for b in blocks for conv in key_convs(model, b)):
        raise RuntimeError("torch-pruning left the hidden layers of one block at different widths (a bug in edgetl.prune)")
    if got != kept or residual_widths() != widths:
        raise RuntimeError(f"torch-pruning kept {got}, expected {kept} (a bug in edgetl.prune)")

    # Rebuild from the spec, as every later stage will: the result is a plain EdgeNet.
    spec = dataclasses.replace(model.spec, hidden={**model.spec.hidden, **kept})
    pruned = build_backbone(spec, device=device)
    pruned.load_state_dict(model.state_dict())
    pruned.eval()
    after = summarize(pruned, blocks, resolution=resolution)
    log.info("pruned blocks %s to %s hidden channels", blocks, [kept[b] for b in blocks])
    return PruneResult(
        net=pruned, blocks=list(blocks), ratios=[float(r) for r in ratios],
        channels_before=channels, kept=kept, importance=importance, calibration=calibration,
        round_to=round_to, history=history, before=before, after=after, base=dict(base or {}),
        auto=auto.to_dict() if auto is not None else None,
    )


def save_pruned(result: PruneResult, out: str | Path, overwrite: bool = False) -> Path:
    """Write ``result`` as a backbone folder, atomically (no partial folder on error)."""
    from edgetl.io import atomic_directory
    from edgetl.models.backbone import save_backbone

    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"output folder {out} already exists; choose another or remove it")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_backbone(tmp, result.net, info=result.info())
    log.info("saved pruned backbone to %s", out)
    return out
