"""Backbone adapter: a BackboneSpec in, the network of its architecture (optionally pruned) out.

What an architecture is, is its entry in ``edgetl.models.archs``: block i is ``features[i]``
of the built network (MobileNetV2: 0 the stem, 1..17 the inverted residual blocks, 18 the
last 1x1 conv); the head (global pool, dropout, linear) is reported as block
``len(features)``. A pruned network is rebuilt from its spec: the hidden channel count of
each pruned block; residual widths never change.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edgetl.errors import ConfigError, DataError
from edgetl.io import load_state, load_torch_file
from edgetl.recipe import MAX_CLASSES, MAX_WIDTH
from edgetl.twin import meta_copy
import edgetl.models.archs as archs

# The FMEC 2023 paper's pruning ratios, written once in the MobileNetV2 entry: prune, bench,
# demo and the figure scripts read them here.
PAPER_RATIOS = archs.get(archs.DEFAULT_ARCH).paper_ratios


@dataclass
class BackboneSpec:
    """Everything needed to rebuild a backbone: architecture, width, classes, hidden channels.

    Attributes:
        arch: a registered architecture (``edgetl.models.archs``; a spec without one is
            MobileNetV2, as every backbone folder edgetl wrote so far says).
        width: torchvision's width multiplier (1.0 where the architecture has none).
        num_classes: outputs of the new linear classifier.
        hidden: block index -> hidden (expanded) channel count, for pruned blocks only.
        dropout: dropout before the classifier (None: the architecture's, MobileNetV2's 0.2,
            ResNet's 0.0; the spec holds the resolved value, which to_dict writes).
    """

    arch: str = archs.DEFAULT_ARCH
    width: float = 1.0
    num_classes: int = 1000
    hidden: dict[int, int] = field(default_factory=dict)
    dropout: float | None = None

    def __post_init__(self) -> None:
        arch = archs.get(self.arch)
        if self.dropout is None:
            self.dropout = arch.dropout
        if not 0 < self.width <= MAX_WIDTH:
            raise ConfigError(f"width {self.width:g} is not allowed; allowed: more than 0, at most {MAX_WIDTH:g}")
        if self.width != 1.0 and not arch.width_multiplier:
            raise ConfigError(f"{arch.title} has no width multiplier; allowed width: 1.0, got {self.width}")
        if not 1 <= int(self.num_classes) <= MAX_CLASSES:
            raise ConfigError(f"num_classes {self.num_classes} is not allowed; allowed: 1..{MAX_CLASSES:,}")
        self.hidden = {int(k): int(v) for k, v in self.hidden.items()}
        for block, channels in self.hidden.items():
            if block not in arch.prunable:
                raise ConfigError(f"block {block} has no hidden channels to set; allowed blocks: "
                                  f"{arch.prunable.start}..{arch.prunable.stop - 1}")
            if channels < 1:
                raise ConfigError(f"block {block}: hidden channels must be >= 1, got {channels}")

    def key(self) -> tuple:
        """What a network of this spec is built from, hashable (the spec is a mutable
        dataclass): a key for what is computed from the network's shapes alone."""
        return self.arch, self.width, self.num_classes, tuple(sorted(self.hidden.items())), self.dropout

    @classmethod
    def from_key(cls, key: tuple) -> "BackboneSpec":
        """The spec a ``key()`` was made from."""
        arch, width, num_classes, hidden, dropout = key
        return cls(arch=arch, width=width, num_classes=num_classes, hidden=dict(hidden), dropout=dropout)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["hidden"] = {str(k): v for k, v in sorted(self.hidden.items())}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "BackboneSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown backbone spec keys: {sorted(unknown)}; allowed: {sorted(known)}")
        data = dict(data)
        data["hidden"] = {int(k): int(v) for k, v in data.get("hidden", {}).items()}
        return cls(**data)


def prunable_blocks(arch: str = archs.DEFAULT_ARCH) -> range:
    """Blocks whose hidden channels can be pruned (MobileNetV2: 1, the stem's output, to 17)."""
    return archs.get(arch).prunable


class EdgeNet(nn.Module):
    """An architecture's numbered feature blocks, an optional side network, and the head.

    Every operation that costs memory is a module, so tracing and accounting see it.
    The side module of tap block i runs right after block i, on block i's input (the
    image for the first tap), and its output is added to block i's output.
    """

    def __init__(self, features: nn.Sequential, classifier: nn.Sequential, spec: BackboneSpec):
        super().__init__()
        self.spec = spec
        self.features = features
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = classifier
        self.side: nn.Module | None = None
        # streamed segments by first block (edgetl.models.stream.apply_streams); they hold
        # their blocks unregistered, so the state_dict is the same with or without them
        self.streams: nn.ModuleDict | None = None
        # a uint8 batch's normalisation (edgetl.models.lean.InputNorm, LeanOptions.uint8_input)
        self.input_norm: nn.Module | None = None
        # The runtime configuration, declared here and set once where the network is built
        # (edgetl.models.side.make_lean): the lean runtime's options (None: stock modules),
        # which the step's schedule reads (stream, recompute), the dtype the batch is fed
        # in (the lean activation dtype, or uint8 pixels that input_norm normalises) and its
        # layout (channels-last where the lean runtime runs so: LeanOptions.channels_last).
        self.options = None  # edgetl.options.LeanOptions | None
        self.input_dtype: torch.dtype = torch.float32
        self.input_memory_format: torch.memory_format = torch.contiguous_format

    def to_channels_last(self) -> "EdgeNet":
        """Lay the weights and buffers out channels-last and take the batch so
        (``input_memory_format``: ``edgetl.train.loop.device_batch`` converts it); returns self."""
        self.to(memory_format=torch.channels_last)
        self.input_memory_format = torch.channels_last
        return self

    def attach_side(self, side: nn.Module | None) -> None:
        self.side = side

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        side = self.side
        taps = side.taps if side is not None else ()
        streams = self.streams if self.streams is not None else {}
        x = image
        norm = self.input_norm
        if norm is not None and "0" not in streams:
            # a uint8 batch (edgetl.models.lean.InputNorm) normalised here, unless the first
            # streamed segment and the side's image pool take it micro-batch by micro-batch
            x = norm(image)
        first = x if taps else None  # the side's first module reads the (normalised) image
        i = 0
        pooled = False  # the last streamed segment may end with the global pool (its tail)
        while i < len(self.features):
            segment = streams[str(i)] if str(i) in streams else None
            block = segment if segment is not None else self.features[i]
            last = segment.stop - 1 if segment is not None else i  # a segment may end at a tap
            if last in taps:
                j = taps.index(last)
                side_in = first if j == 0 else x
                first = None
                x = block(x)
                x = x + side.blocks[j](side_in, x.shape[-2:])
            else:
                x = block(x)
            pooled = segment is not None and segment.tail is not None
            i = segment.stop if segment is not None else i + 1
        if not pooled:
            x = self.pool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def hidden_channels(net: EdgeNet | nn.Module, block: int) -> int:
    """Hidden (expanded) channel count of a block of a built network."""
    arch = archs.get(net.spec.arch if isinstance(net, EdgeNet) else archs.DEFAULT_ARCH)
    return arch.hidden_convs(net.features, block)[0].out_channels


def build_backbone(spec: BackboneSpec, device: torch.device | str | None = None) -> EdgeNet:
    """Build the (optionally pruned) backbone with random weights.

    Args:
        spec: architecture, width, classes and hidden channel counts.
        device: where to allocate; "meta" builds shapes only (used by the profiler and the
            planner, hundreds of times a plan): a copy of one network built per spec
            (``_meta_template``), with tensors of its own, its spec the one given.
    """
    if device is not None and torch.device(device).type == "meta":
        net = meta_copy(_meta_template(spec.key(), torch.get_default_dtype()))
        net.spec = spec
        return net
    return _build(spec, device)


def _build(spec: BackboneSpec, device: torch.device | str | None) -> EdgeNet:
    arch = archs.get(spec.arch)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        features, classifier = arch.build(spec)
        for block, channels in sorted(spec.hidden.items()):
            arch.set_hidden(features, block, channels)
    return EdgeNet(features, classifier, spec)


@functools.lru_cache(maxsize=32)
def _meta_template(key: tuple, default_dtype: torch.dtype) -> EdgeNet:
    """The meta network of a spec, by ``BackboneSpec.key()`` and torch's default dtype (what a
    build reads besides the spec; on meta it draws no random numbers): built once, only ever
    copied. torch's modules initialise their weights as they are built, and on meta each
    initialising op runs torch's Python meta kernels: MobileNetV2 1.0 took 112 ms to build on
    meta, 48 on CPU, and a copy (``edgetl.twin.meta_copy``) takes about a tenth of that."""
    return _build(BackboneSpec.from_key(key), "meta")


STRIDE_PROBE = 1024  # side of the meta image block_shapes follows: 2**10, so strides up to 1024 come out exact


def block_shapes(net: EdgeNet, *, as_built: bool = False) -> list[tuple[int, int]]:
    """(channels, cumulative stride) at the output of each feature block, found by a forward of
    a meta copy (any architecture: a max-pool or a strided shortcut counts as it runs).

    The copy is built from the spec, so a lean network (whose layers are not nn.Conv2d) gets
    its stock network's shapes; ``as_built`` copies the network's own stock layers instead
    (a network torch-pruning edited in place, whose spec does not know it yet)."""
    if as_built:
        return _forward_shapes(copy.deepcopy(net.features).to("meta"))
    return list(_spec_shapes(net.spec.key()))


@functools.lru_cache(maxsize=64)
def _spec_shapes(key: tuple) -> tuple[tuple[int, int], ...]:
    """``block_shapes`` of a spec's stock backbone, by ``BackboneSpec.key()``: a meta forward
    at 1024 px takes ~0.5 s on CPU and every build of a network with a side needs it."""
    return tuple(_forward_shapes(build_backbone(BackboneSpec.from_key(key), device="meta").features))


def _forward_shapes(features: nn.Module) -> list[tuple[int, int]]:
    x = torch.empty(1, 3, STRIDE_PROBE, STRIDE_PROBE, device="meta")
    shapes = []
    with torch.no_grad():
        for block in features:
            x = block(x)
            shapes.append((int(x.shape[1]), STRIDE_PROBE // int(x.shape[-1])))
    return shapes


def block_strides(net: EdgeNet) -> list[int]:
    """Cumulative spatial stride at the output of each feature block."""
    return [stride for _, stride in block_shapes(net)]


def block_out_channels(net: EdgeNet, *, as_built: bool = False) -> list[int]:
    """Output channels of each feature block."""
    return [channels for channels, _ in block_shapes(net, as_built=as_built)]


BACKBONE_FORMAT = "edgetl-backbone/1"
SPEC_FILE = "backbone.json"
WEIGHTS_FILE = "backbone.pt"


def backbone_state_dict(net: EdgeNet) -> dict[str, torch.Tensor]:
    """The backbone's weights (features + classifier), without any side network."""
    return {k: v for k, v in net.state_dict().items() if not k.startswith("side.")}


def save_backbone(folder: str | Path, net: EdgeNet, info: dict | None = None) -> None:
    """Write a backbone folder: ``backbone.json`` (format, spec, info) and a plain state_dict.

    The folder must exist (callers build it with ``edgetl.io.atomic_directory``).
    """
    from edgetl.io import atomic_text_json, atomic_torch_save

    folder = Path(folder)
    atomic_torch_save(backbone_state_dict(net), folder / WEIGHTS_FILE)
    atomic_text_json(folder / SPEC_FILE, {"format": BACKBONE_FORMAT, "spec": net.spec.to_dict(), **(info or {})})


def read_backbone_info(folder: str | Path) -> dict:
    """Read and check a backbone folder's ``backbone.json``; the spec is under "spec"."""
    from edgetl.io import read_json

    folder = Path(folder)
    path = folder / SPEC_FILE
    if not folder.is_dir():
        raise DataError(f"backbone folder {folder} does not exist")
    if not path.is_file():
        raise DataError(f"{folder} is not an edgetl backbone folder: {SPEC_FILE} is missing")
    info = read_json(path)
    if not isinstance(info, dict) or info.get("format") != BACKBONE_FORMAT:
        raise DataError(f"{path} is not an edgetl backbone description (format {BACKBONE_FORMAT})")
    return info


def read_backbone_spec(folder: str | Path) -> BackboneSpec:
    return BackboneSpec.from_dict(read_backbone_info(folder)["spec"])


def load_backbone(folder: str | Path, device: torch.device | str | None = None) -> EdgeNet:
    """Rebuild a saved (optionally pruned) backbone from its spec and load its weights.

    Weights load with ``weights_only=True``: a backbone folder never executes code.
    """
    spec = read_backbone_spec(folder)
    net = build_backbone(spec, device=device)
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise DataError(f"{folder} has no weights file {WEIGHTS_FILE}")
    state = load_torch_file(path, "a state_dict", map_location=device or "cpu")
    load_state(net, state, path, f"the network {SPEC_FILE} describes")
    return net


# --- backbone references: a folder, a torchvision weights name, or a state_dict file ------
# Issue 18: a user starts from ImageNet weights by name, through torchvision's own weights
# API and cache (TORCH_HOME); downloaded once where the machine is online, read from the
# cache after that. EDGETL_OFFLINE=1 forbids the download (the tests set it), so an empty
# cache is then the one-line error at once. A weights name is "ARCH:TAG" for any registered
# architecture with torchvision weights ("resnet18:IMAGENET1K_V1", "mobilenet_v2:DEFAULT",
# "resnet50:random"); a bare "ARCH" is its entry's default weights.

RANDOM_WEIGHTS = "random"
# the default backbone's: torchvision's original ImageNet weights of MobileNetV2, 71.9 % top-1
DEFAULT_WEIGHTS = f"{archs.DEFAULT_ARCH}:{archs.get(archs.DEFAULT_ARCH).default_weights}"
OFFLINE_ENV = "EDGETL_OFFLINE"


def default_weights(arch: str) -> str:
    """The weights name a bare architecture name stands for ("resnet18" -> "resnet18:IMAGENET1K_V1")."""
    entry = archs.get(arch)
    return f"{entry.name}:{entry.default_weights if entry.weights is not None else RANDOM_WEIGHTS}"


def weights_names(arch: str | None = None) -> list[str]:
    """Every weights name a backbone argument accepts (torchvision's, DEFAULT and random), for
    one architecture or all registered ones."""
    names = []
    for entry in (archs.get(a) for a in ([arch] if arch is not None else archs.registered())):
        tags = [w.name for w in entry.weights_enum()] + ["DEFAULT"] if entry.weights is not None else []
        names += [f"{entry.name}:{t}" for t in tags + [RANDOM_WEIGHTS]]
    return names


def _split_name(ref: str | Path) -> tuple[archs.Architecture, str] | None:
    """(entry, tag) of "ARCH:TAG" or a bare "ARCH" (its default tag); None for anything else."""
    name, sep, tag = str(ref).partition(":")
    if name not in archs.registered():
        return None
    entry = archs.get(name)
    return entry, tag if sep else default_weights(name).split(":", 1)[1]


def is_weights_name(ref: str | Path | None) -> bool:
    """Whether ``ref`` names torchvision weights ("resnet18:TAG", "resnet18") rather than a path."""
    return ref is not None and _split_name(ref) is not None and not Path(ref).exists()


def _weights(ref: str):
    """(entry, torchvision weights member or None for random) of a weights name (DEFAULT resolved)."""
    entry, tag = _split_name(ref)
    if tag == RANDOM_WEIGHTS:
        return entry, None
    try:
        return entry, entry.weights_enum()[tag]
    except KeyError:
        raise ConfigError(f"unknown weights {ref!r}; allowed: {', '.join(weights_names(entry.name))}") from None


def weights_file(ref: str) -> Path:
    """Where torchvision's cache keeps the file of a weights name (TORCH_HOME/hub/checkpoints/...)."""
    _, weights = _weights(ref)
    if weights is None:
        raise ConfigError(f"{ref} has no file: random weights are made, not read")
    return Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[1]


def _read_state_dict(path: Path, what: str) -> dict:
    state = load_torch_file(path, "a state_dict")
    if not isinstance(state, dict):
        raise DataError(f"{path} does not hold a state_dict ({what})")
    return state


def _imagenet_state_dict(ref: str) -> tuple[dict, Path]:
    """The state_dict of a torchvision weights name (torchvision's keys), from the cache or
    (online) downloaded into it."""
    import os
    import urllib.error

    _, weights = _weights(ref)
    path = weights_file(ref)
    if path.is_file():
        return _read_state_dict(path, ref), path
    where = (f"put {path.name} (from {weights.url}) at {path} (the torch cache; TORCH_HOME moves it), "
             f"or pass a local file with --weights FILE")
    if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
        raise DataError(f"{ref} is not in the torch cache and {OFFLINE_ENV} forbids downloading it: {where}")
    try:
        weights.get_state_dict(progress=True, check_hash=True)
    except (OSError, urllib.error.URLError, RuntimeError) as exc:
        reason = str(getattr(exc, "reason", exc)).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{ref} is not in the torch cache and could not be downloaded ({reason}): {where}") from None
    return _read_state_dict(path, ref), path


def weights_info(ref: str) -> dict:
    """What a run records of named weights: name, file, ImageNet accuracy, transforms, class names."""
    entry, w = _weights(ref)
    if w is None:
        return {"weights": f"{entry.name}:{RANDOM_WEIGHTS}"}
    t = w.transforms()
    return {
        "weights": f"{entry.name}:{w.name}",
        "url": w.url,
        "imagenet_acc1": w.meta["_metrics"]["ImageNet-1K"]["acc@1"],
        "preprocessing": {"crop_size": int(t.crop_size[0]), "resize_size": int(t.resize_size[0]),
                          "mean": list(t.mean), "std": list(t.std), "interpolation": t.interpolation.value},
        "categories": list(w.meta["categories"]),
    }


def _imagenet_width(ref: str | Path, width: float | None) -> float:
    """ImageNet weights exist at width 1.0 only: that width, or a one-line ConfigError."""
    if width not in (None, 1.0):
        entry, _ = _split_name(ref)
        if not entry.width_multiplier:
            raise ConfigError(f"{entry.title} has no width multiplier, and the width given is {width:g} (--width or "
                              "model.width: a recipe made for MobileNetV2 sets one); give width 1.0 "
                              "(--set model.width=1.0)")
        raise ConfigError(f"{ref} exists for width 1.0 only, not {width}; use {entry.name}:random "
                          "for another width, or a backbone folder")
    return 1.0


def _state_arch(state: dict, path: Path) -> archs.Architecture:
    """The registered architecture whose torchvision state_dict keys ``state`` has (a file of
    torchvision's ``resnet50().state_dict()`` is ResNet-50): the first whose keys match exactly."""
    keys = set(state)
    for name in archs.registered():
        entry = archs.get(name)
        with contextlib.suppress(ConfigError, DataError):
            net = build_backbone(BackboneSpec(arch=name), device="meta")
            if set(entry.from_torchvision(dict.fromkeys(keys))) == set(net.state_dict()):
                return entry
    raise DataError(f"{path} is not the state_dict of a torchvision {' / '.join(archs.get(a).title for a in archs.registered())}")


def _file_spec(path: Path, width: float | None) -> tuple[BackboneSpec, dict]:
    """A torchvision state_dict file: the spec it fits (its architecture, its class count) and the state."""
    state = _read_state_dict(path, "a torchvision state_dict")
    entry = _state_arch(state, path)
    mapped = entry.from_torchvision(state)
    head = mapped.get("classifier.1.weight")
    classes = int(head.shape[0]) if isinstance(head, torch.Tensor) and head.dim() == 2 else 1000
    return BackboneSpec(arch=entry.name, width=1.0 if width is None else width, num_classes=classes), mapped


def open_backbone(
    ref: str | Path, *, width: float | None = None, seed: int = 0, device: torch.device | str | None = None,
) -> tuple[EdgeNet, dict]:
    """The network a backbone argument names, and a description of where it came from.

    Args:
        ref: a backbone folder (edgetl prune / retrain output); a torchvision weights name
            ("resnet18:IMAGENET1K_V1", "mobilenet_v2:DEFAULT", "resnet50:random", or a bare
            architecture name for its default weights); or a torchvision state_dict file
            (.pth) of a registered architecture (recognised by its keys).
        width: width multiplier for "mobilenet_v2:random" or a state_dict file (default 1.0);
            ImageNet weights exist for width 1.0 only; a folder has its own.
        seed: random init seed for "ARCH:random".
        device: where to build the network.

    The description has "source" (a sentence), "arch", "width", and for named weights
    the ``weights_info`` fields (name, ImageNet accuracy, preprocessing, class names).
    """
    path = Path(ref)
    if path.is_dir():
        if width is not None:
            raise ConfigError(f"--width describes a stock network; backbone folder {path} has its own width")
        net = load_backbone(path, device=device)
        return net, {"source": str(path), "arch": net.spec.arch, "width": net.spec.width}
    if is_weights_name(ref):
        entry, weights = _weights(str(ref))
        info = weights_info(str(ref))
        if weights is None:
            width = 1.0 if width is None else width
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                net = build_backbone(BackboneSpec(arch=entry.name, width=width), device=device)
            source = f"torchvision {entry.name} width {width}, random init (seed {seed})"
        else:
            width = _imagenet_width(ref, width)
            state, file = _imagenet_state_dict(str(ref))
            net = build_backbone(BackboneSpec(arch=entry.name, width=width), device=device)
            load_state(net, entry.from_torchvision(state), file, f"{entry.name} width {width}")
            source = f"torchvision {info['weights']} ({file})"
        return net.eval(), {"source": source, "arch": entry.name, "width": width, **info}
    if path.is_file():
        spec, state = _file_spec(path, width)
        net = build_backbone(spec, device=device)
        load_state(net, state, path, f"{spec.arch} width {spec.width}")
        return net.eval(), {"source": f"torchvision {spec.arch} width {spec.width}, weights {path}",
                            "arch": spec.arch, "width": spec.width, "weights_file": str(path)}
    raise _missing(ref)


def _missing(ref: str | Path) -> DataError:
    return DataError(f"backbone folder {ref} does not exist; give a backbone folder, a state_dict file, an "
                     f"architecture ({', '.join(archs.registered())}) or a weights name "
                     f"({', '.join(weights_names(archs.DEFAULT_ARCH))}, ...)")


def backbone_spec(ref: str | Path | None, *, width: float | None = None) -> BackboneSpec:
    """The architecture a backbone argument names, without loading weights (None: the default
    MobileNetV2 at ``width``; a state_dict file is read for its keys)."""
    if ref is not None and Path(ref).is_dir():
        return read_backbone_spec(ref)
    if ref is not None and is_weights_name(ref):
        entry, weights = _weights(str(ref))
        return BackboneSpec(arch=entry.name, width=_imagenet_width(ref, width) if weights is not None
                            else 1.0 if width is None else width)
    if ref is not None and Path(ref).is_file():
        return _file_spec(Path(ref), width)[0]
    if ref is not None:
        raise _missing(ref)
    return BackboneSpec(width=1.0 if width is None else width)


def input_spec(ref: BackboneSpec | str | Path | None, *, width: float | None = None,
               num_classes: int) -> BackboneSpec:
    """The spec of the backbone a command starts from (a spec, a folder, a weights name or
    file; None: the default MobileNetV2), with the data's ``num_classes``.

    ``width`` describes the default MobileNetV2 (or mobilenet_v2:random, a weights file):
    beside a backbone folder, which has its own, it is refused (as retrain and prune refuse
    it), and so is a width the spec or weights name lacks; nothing is loaded.
    """
    folder = ref is not None and not isinstance(ref, BackboneSpec) and Path(ref).is_dir()
    spec = ref if isinstance(ref, BackboneSpec) else backbone_spec(ref, width=None if folder else width)
    if folder and width is not None:
        raise ConfigError(f"width {width:g} is for the default backbone; the backbone folder {ref} has "
                          f"its own width ({spec.width:g}): leave the width out")
    if width is not None and spec.width != width:
        raise ConfigError(f"width {width:g} disagrees with the backbone's width {spec.width:g}; leave the width out")
    return dataclasses.replace(spec, num_classes=num_classes, hidden=dict(spec.hidden))


def describe_backbone(ref: str | Path) -> dict:
    """What a run records of its starting backbone: the named weights' info, or the folder's origin."""
    path = Path(ref)
    if path.is_dir():
        info = read_backbone_info(path)
        return {"folder": str(path), **{k: info[k] for k in ("base",) if k in info}}
    if is_weights_name(ref):
        return weights_info(str(ref))
    return {"weights_file": str(path)}
