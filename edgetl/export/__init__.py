"""Export: a fine-tuning run folder in, an ONNX file (and optionally a TensorRT engine) plus sidecar JSON out.

The exported network is the inference form of the run's EdgeNet: eval mode, every
BatchNorm folded into the conv before it (backbone and Rep-Net side network), so the
graph holds convs, ReLU6/ReLU, pools, adds, resizes and the classifier only. Metadata
(labels, preprocessing, source run, recipe hash, builder settings) lives in a sidecar
JSON beside each artifact (``model.onnx.json``, ``model.engine.json``); the engine file
holds the serialized engine bytes and nothing else, so ``trtexec --loadEngine`` reads it.

Every output is checked before any work (``sidecar.check_outputs``: never a file the
export reads, nor one edgetl did not make or made for another purpose), and an artifact and
its sidecar are written under temporary names and renamed into place together, so a failed
or killed export leaves no half of one (``sidecar.StagedFiles``).

Rooms: this package's ``__init__`` (the run folder's model, inference form, ONNX export and
its parity check, ``export_run``), ``exporter`` (torch's exporters: the opsets each can be
asked for, the call), ``engine`` (the TensorRT build), ``sidecar`` (the artifact files: metadata format both artifacts share, where
an export may write, writing a pair).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edgetl.data import IMAGENET_MEAN, IMAGENET_STD
from edgetl.errors import CapabilityError, ConfigError, DataError, EdgetlError
from edgetl.export.exporter import (
    INPUT_NAME, OUTPUT_NAME, _export_graph, _first_line, _onnx_modules, check_opset, drop_stack_traces, opset_range,
    runtime_max_opset, written_opset,
)
from edgetl.export.engine import DEFAULT_WORKSPACE_BYTES, _import_tensorrt, _stage_engine, build_engine
from edgetl.export.sidecar import SIDECAR_FORMAT, check_outputs, file_sha256, sidecar_path
from edgetl.io import StagedFiles, atomic_text_json, load_state, load_torch_file, read_json
from edgetl.models.backbone import BackboneSpec, EdgeNet

log = logging.getLogger(__name__)

RUN_MODEL_FILE = "model.json"
# model.pt: the best weights in the stock layout, written by edgetl finetune at the end
# (best.pt / last.pt hold the lean training layout when the run used the lean runtime).
CHECKPOINT_FILES = ("model.pt", "best.pt", "last.pt")
FORMATS = ("onnx", "engine")
DEFAULT_MAX_BATCH = 8
# Test-time resize of the reference recipe: shorter side to resolution / 0.875, centre crop.
CROP_RATIO = 0.875
PARITY_BATCHES = (1, 8)


@dataclass
class Preprocessing:
    """How a deployed model wants its input: what a runner must do to an image file.

    Attributes:
        resolution: square input size in pixels (the crop).
        resize: shorter side is resized to this (bilinear) before the centre crop.
        mean: per-channel mean subtracted after scaling pixels to [0, 1] (RGB order).
        std: per-channel standard deviation divided by after the mean.
        channels: colour order of the input ("RGB"; grayscale images are converted).
        layout: tensor layout of the input ("NCHW", float32).
    """

    resolution: int = 224
    resize: int | None = None
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    channels: str = "RGB"
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        self.resolution = int(self.resolution)
        if self.resolution < 8:
            raise ConfigError(f"resolution must be >= 8 pixels, got {self.resolution}")
        if self.resize is None:
            self.resize = int(round(self.resolution / CROP_RATIO))
        self.resize = int(self.resize)
        if self.resize < self.resolution:
            raise ConfigError(f"resize ({self.resize}) must be >= resolution ({self.resolution})")
        self.mean = tuple(float(v) for v in self.mean)
        self.std = tuple(float(v) for v in self.std)
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ConfigError("mean and std need 3 values each, std > 0")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["mean"], data["std"] = list(self.mean), list(self.std)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Preprocessing":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown preprocessing keys: {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**data)


@dataclass
class RunModel:
    """A fine-tuned network read back from a run folder, with what export needs to describe it."""

    net: EdgeNet
    spec: BackboneSpec
    mode: str
    labels: list[str]
    recipe: dict
    preprocessing: Preprocessing
    run_dir: Path
    checkpoint: Path

    @property
    def recipe_hash(self) -> str:
        return recipe_hash(self.recipe)


@dataclass
class ExportResult:
    """What an export produced, with the parity figures measured against PyTorch."""

    onnx_path: Path
    onnx_sidecar: Path
    onnx_bytes: int
    opset: int
    exporter: str
    export_seconds: float
    parity_max_abs_diff: dict[int, float] = field(default_factory=dict)
    parity_images: str = ""
    engine_path: Path | None = None
    engine_sidecar: Path | None = None
    engine_bytes: int | None = None
    engine_seconds: float | None = None

    @property
    def max_abs_diff(self) -> float:
        return max(self.parity_max_abs_diff.values(), default=float("nan"))


def recipe_hash(recipe: dict) -> str:
    """sha256 of the recipe as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_run_model(run_dir: str | Path, device: torch.device | str = "cpu") -> RunModel:
    """Rebuild the fine-tuned network of a run folder and load its final (else best, else last) weights.

    Run-folder contract (what ``edgetl finetune`` writes):

    - ``model.json``: a JSON object with
        - ``"backbone"``: a ``BackboneSpec.to_dict()`` (arch, width, num_classes, hidden, dropout);
        - ``"mode"``: the fine-tuning mode (``edgetl.models.side.TRAIN_MODES``); repnet modes
          rebuild the Rep-Net side network;
        - ``"labels"``: list of class names, ``len == backbone.num_classes``;
        - ``"recipe"``: the resolved recipe (any JSON object; hashed into the export sidecar);
        - optional ``"preprocessing"``: ``Preprocessing`` fields (resolution, resize, mean,
          std); missing fields take the defaults (224 px, ImageNet mean/std, resize 256).
    - ``model.pt``, else ``best.pt``, else ``last.pt``: a checkpoint dict saved with ``torch.save`` whose
      ``"model"`` entry is the EdgeNet ``state_dict`` including ``side.*`` keys. Other entries
      (optimizer, scheduler, epoch, ...) are ignored. It is loaded with ``weights_only=True``,
      so it must hold only tensors and plain containers.

    Args:
        run_dir: the run folder.
        device: where to build the network.

    Raises:
        DataError: the folder, ``model.json`` or a checkpoint is missing, damaged or inconsistent.
        ConfigError: ``model.json`` names an unknown arch, mode or preprocessing key.
    """
    from edgetl.models.side import build_network

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run folder {run_dir} does not exist")
    info_path = run_dir / RUN_MODEL_FILE
    if not info_path.is_file():
        raise DataError(f"{run_dir} is not an edgetl run folder: {RUN_MODEL_FILE} is missing")
    info = read_json(info_path)
    missing = [k for k in ("backbone", "mode", "labels", "recipe") if not isinstance(info, dict) or k not in info]
    if missing:
        raise DataError(f"{info_path} lacks {', '.join(missing)}")
    spec = BackboneSpec.from_dict(info["backbone"])
    labels = [str(label) for label in info["labels"]]
    if len(labels) != spec.num_classes:
        raise DataError(f"{info_path}: {len(labels)} labels for {spec.num_classes} classes")
    preprocessing = Preprocessing.from_dict(info.get("preprocessing") or {})

    checkpoint = next((run_dir / name for name in CHECKPOINT_FILES if (run_dir / name).is_file()), None)
    if checkpoint is None:
        raise DataError(f"{run_dir} has no checkpoint: expected {' or '.join(CHECKPOINT_FILES)}")
    ckpt = load_torch_file(checkpoint, "a plain checkpoint", map_location=device)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise DataError(f"{checkpoint} has no 'model' state_dict entry")

    net = build_network(spec, mode=info["mode"], device=device)
    load_state(net, ckpt["model"], checkpoint, f"the network {RUN_MODEL_FILE} describes")
    net.eval()
    return RunModel(net, spec, info["mode"], labels, info["recipe"], preprocessing, run_dir, checkpoint)


def _fold(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    return fuse_conv_bn_eval(conv.eval(), bn.eval())


def _fold_sequential(seq: nn.Sequential) -> None:
    names = list(seq._modules)
    for a, b in zip(names, names[1:]):
        conv, bn = seq._modules[a], seq._modules[b]
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            seq._modules[a] = _fold(conv, bn)
            seq._modules[b] = nn.Identity()


def _fold_numbered(module: nn.Module) -> None:
    """Fold each ``bn{N}`` child into the ``conv{N}`` beside it (a SideModule's conv1/bn1 and
    conv2/bn2, a ResNet BasicBlock's two pairs, a Bottleneck's three)."""
    children = module._modules
    for name in list(children):
        number = name[2:] if name.startswith("bn") else ""
        conv, bn = children.get(f"conv{number}"), children[name]
        if number.isdigit() and isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            children[f"conv{number}"], children[name] = _fold(conv, bn), nn.Identity()


class GlobalAvgPool(nn.Module):
    """``AdaptiveAvgPool2d(1)`` and the flatten after it as one mean over height and width.

    The exported graph then has no reshape to a batch-dependent shape: the dynamo exporter of
    torch 2.5 with onnxscript 0.2.x cannot lower ``torch.flatten(x, 1)`` under a dynamic batch
    axis (``EdgeNet.forward``'s flatten of a 2-D tensor returns it as it is).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


def merge_for_inference(net: EdgeNet) -> EdgeNet:
    """A copy of ``net`` in eval mode with every BatchNorm folded into the conv before it.

    Covers Conv-BN pairs inside ``nn.Sequential`` containers (MobileNetV2's layers, ResNet's
    stem and downsample shortcuts, as torchvision builds them) and every ``conv{N}``/``bn{N}``
    pair of one module (the side network's SideModules, ResNet's BasicBlock and Bottleneck),
    and pools with ``GlobalAvgPool``. The result computes what ``net.eval()`` computes, up to
    float rounding; ``net`` is not changed. Its activations (``inplace`` modules: ReLU6, ReLU)
    write new tensors: the same values, and the same ONNX graph, but the dynamo exporter
    decomposes each in-place activation again under the dynamic batch's symbolic shapes, a
    fifth of a second or more apiece (docs/jetson.md, Export).

    Raises:
        ConfigError: a BatchNorm is left that does not follow a conv (it would run unfolded).
    """
    merged = copy.deepcopy(net).eval()
    for module in list(merged.modules()):
        if isinstance(module, nn.Sequential):
            _fold_sequential(module)
        _fold_numbered(module)
    pool = getattr(merged, "pool", None)
    if isinstance(pool, nn.AdaptiveAvgPool2d) and pool.output_size in (1, (1, 1)):
        merged.pool = GlobalAvgPool()
    left = [name for name, m in merged.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if left:
        raise ConfigError(f"cannot fold BatchNorm layers that follow no conv: {left[:5]}")
    for module in merged.modules():
        if isinstance(getattr(module, "inplace", None), bool):
            module.inplace = False  # see the docstring: the same values, a quicker export
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged


def example_images(preprocessing: Preprocessing, count: int = max(PARITY_BATCHES), seed: int = 0) -> torch.Tensor:
    """Seeded random images (uniform pixels), normalised as the preprocessing says.

    Used for the parity check when no real images are given.
    """
    gen = torch.Generator().manual_seed(seed)
    res = preprocessing.resolution
    pixels = torch.rand(count, 3, res, res, generator=gen)
    mean = torch.tensor(preprocessing.mean).view(1, 3, 1, 1)
    std = torch.tensor(preprocessing.std).view(1, 3, 1, 1)
    return (pixels - mean) / std


def onnx_parity(
    onnx_path: str | Path, net: nn.Module, images: torch.Tensor, batches: tuple[int, ...] = PARITY_BATCHES
) -> dict[int, float]:
    """Max abs difference of onnxruntime (CPU) logits vs PyTorch's, per batch size.

    Args:
        onnx_path: the exported model.
        net: the PyTorch network (eval mode) it came from.
        images: preprocessed images, at least ``max(batches)`` of them.

    Raises:
        CapabilityError: onnxruntime cannot load or run the model.
    """
    _, ort = _onnx_modules()
    if images.shape[0] < max(batches):
        raise ConfigError(f"parity check needs {max(batches)} images, got {images.shape[0]}")
    options = ort.SessionOptions()
    # Small model, shared machines: one thread is enough and keeps the result deterministic.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's errors derive from Exception only
        raise CapabilityError(f"onnxruntime {ort.__version__} cannot load the exported model for the parity "
                              f"check: {_first_line(exc)}") from None
    input_name = session.get_inputs()[0].name
    images = images.detach().to("cpu", torch.float32)
    diffs = {}
    with torch.no_grad():
        for batch in batches:
            x = images[:batch].contiguous()
            expected = net(x.to(next(net.parameters()).device)).float().cpu().numpy()
            got = session.run(None, {input_name: x.numpy()})[0]
            if got.shape != expected.shape:
                raise EdgetlError(f"ONNX output shape {got.shape} != PyTorch {expected.shape} at batch {batch}")
            diffs[batch] = float(abs(got - expected).max())
    return diffs


def export_onnx(
    net: nn.Module,
    path: str | Path,
    *,
    resolution: int,
    opset: int | None = None,
    dynamic_batch: bool = True,
    dynamo: bool = True,
    images: torch.Tensor | None = None,
    preprocessing: Preprocessing | None = None,
    labels: list[str] | None = None,
    source: dict | None = None,
) -> ExportResult:
    """Export an (already merged, eval-mode) network to ONNX, check it, and measure parity.

    Writes ``path`` and the sidecar ``path + ".json"`` (labels, preprocessing, input and
    output names and shapes, opset, parity figures, the file's SHA-256, and ``source``: run
    folder, checkpoint, recipe hash). Both are written under temporary names and renamed into
    place once ``onnx.checker`` accepts the model and the parity check ran, so a failed export
    leaves neither (and an earlier export at ``path`` as it was).

    Args:
        net: the network to export (use ``merge_for_inference`` first).
        path: output ``.onnx`` file: new, or an earlier edgetl export (``sidecar.check_outputs``).
        resolution: square input size in pixels.
        opset: ONNX opset (``opset_range``); None takes the exporter's default.
        dynamic_batch: give the input and output a symbolic batch axis.
        dynamo: torch's default exporter (needs onnxscript); False is the legacy one.
        images: preprocessed images (N >= 8, 3, resolution, resolution) for the parity
            check; None uses seeded random images (``example_images``).
        preprocessing: what a runner must do to an image; defaults from ``resolution``.
        labels: class names, one per output.
        source: provenance to record (run folder, checkpoint, recipe hash, ...).

    Raises:
        ConfigError: a bad argument, an opset out of range, or a path it may not write.
        CapabilityError: onnx / onnxruntime / onnxscript missing, or the exporter cannot write
            the network at the opset asked (never another opset instead).
        ResourceError: the output folder cannot be written.
        EdgetlError: the exported graph fails the checker or gives a wrong shape.
    """
    path = Path(path)
    check_opset(opset, dynamo)
    check_outputs([path], reads={})
    with StagedFiles() as stage:
        result, _ = _stage_onnx(net, path, stage, resolution=resolution, opset=opset, dynamic_batch=dynamic_batch,
                                dynamo=dynamo, images=images, preprocessing=preprocessing, labels=labels,
                                source=source)
        stage.commit()
    return result


def _stage_onnx(net: nn.Module, path: Path, stage: StagedFiles, *, resolution: int, opset: int | None,
                dynamic_batch: bool, dynamo: bool, images: torch.Tensor | None,
                preprocessing: Preprocessing | None, labels: list[str] | None,
                source: dict | None) -> tuple[ExportResult, dict]:
    """``export_onnx``'s work, its files staged in ``stage`` (sidecar first, then the model):
    the result (final paths) and the sidecar's content."""
    onnx, _ = _onnx_modules()
    preprocessing = preprocessing or Preprocessing(resolution=resolution)
    if preprocessing.resolution != resolution:
        raise ConfigError(f"resolution {resolution} != preprocessing.resolution {preprocessing.resolution}")
    if images is None:
        images, image_source = example_images(preprocessing), "seeded random pixels"
    else:
        image_source = "given images"
    if tuple(images.shape[1:]) != (3, resolution, resolution):
        raise ConfigError(f"parity images must be (N, 3, {resolution}, {resolution}), got {tuple(images.shape)}")
    bad = [name for name, t in [*net.named_parameters(), *net.named_buffers()]
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise DataError(f"refusing to export non-finite weights ({len(bad)} tensors hold NaN or inf, "
                        f"first {bad[0]}): the training diverged; export a checkpoint from before it")
    net = net.eval()
    device = next(net.parameters()).device
    x = images[:2].to(device, torch.float32)  # batch 2: a batch of 1 would be specialised away
    num_outputs = int(net(x[:1]).shape[-1])
    if labels is not None and len(labels) != num_outputs:
        raise ConfigError(f"{len(labels)} labels for {num_outputs} outputs")

    sidecar = sidecar_path(path)
    tmp_sidecar = stage.tmp(sidecar)  # renamed before the model: a new model never stands without it
    tmp = stage.tmp(path)
    start = time.perf_counter()
    _export_graph(net, x, tmp, opset=opset, dynamic_batch=dynamic_batch, dynamo=dynamo)
    model = onnx.load(str(tmp))
    if drop_stack_traces(model):  # the exporting machine's paths stay on it
        onnx.save(model, str(tmp))
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise EdgetlError(f"exported ONNX graph fails onnx.checker: {str(exc).splitlines()[0]}") from None
    seconds = time.perf_counter() - start
    used_opset = written_opset(model)
    if opset is not None and used_opset != opset:
        low, high, _ = opset_range(dynamo)
        raise CapabilityError(f"torch's {'dynamo' if dynamo else 'legacy'} exporter wrote opset {used_opset} when "
                              f"opset {opset} was asked; refusing another opset than asked (allowed here: "
                              f"{low} <= opset <= {high})")
    batches = PARITY_BATCHES if dynamic_batch else (x.shape[0],)
    parity = onnx_parity(tmp, net, images, batches)
    log.info("exported %s (opset %d) in %.1f s; parity %s", path, used_opset, seconds, parity)

    batch_dim = "batch" if dynamic_batch else int(x.shape[0])
    meta = {
        "format": SIDECAR_FORMAT,
        "artifact": "onnx",
        "file": path.name,
        "sha256": file_sha256(tmp),
        "input": {"name": INPUT_NAME, "shape": [batch_dim, 3, resolution, resolution], "dtype": "float32"},
        "output": {"name": OUTPUT_NAME, "shape": [batch_dim, num_outputs], "dtype": "float32", "kind": "logits"},
        "labels": list(labels) if labels is not None else [str(i) for i in range(num_outputs)],
        "preprocessing": preprocessing.to_dict(),
        "opset": used_opset,
        "exporter": "dynamo" if dynamo else "legacy",
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "parity": {"max_abs_diff": {str(b): d for b, d in parity.items()}, "images": image_source,
                   "reference": "PyTorch eval mode vs onnxruntime CPUExecutionProvider"},
        "source": source or {},
    }
    atomic_text_json(tmp_sidecar, meta)
    result = ExportResult(
        onnx_path=path, onnx_sidecar=sidecar, onnx_bytes=tmp.stat().st_size, opset=used_opset,
        exporter="dynamo" if dynamo else "legacy", export_seconds=seconds,
        parity_max_abs_diff=parity, parity_images=image_source,
    )
    return result, meta


def export_run(
    run_dir: str | Path,
    *,
    format: str = "onnx",
    output: str | Path | None = None,
    fp16: bool = False,
    max_batch: int | None = None,
    opset: int | None = None,
    dynamo: bool = True,
    images: torch.Tensor | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> ExportResult:
    """Export a run folder's model: ONNX always, then a TensorRT engine for ``format="engine"``.

    Every argument and output path is checked before any work; the files (ONNX and its
    sidecar, and the engine and its sidecar) are renamed into place only once all of them
    are complete, so a refused, failed or interrupted export leaves nothing it made (no file,
    no folder) and an earlier export at the same paths as it was.

    Args:
        run_dir: a fine-tuning run folder (see ``load_run_model`` for its contract).
        format: "onnx" or "engine".
        output: the ONNX path (``format="onnx"``) or the engine path (``"engine"``; the
            ONNX file goes beside it). Default: ``RUN/export/model.onnx`` / ``model.engine``.
            Never a file the export reads (the run's model.json and checkpoints) nor an
            existing file other than an earlier export (``sidecar.check_outputs``).
        fp16, max_batch, workspace_bytes: engine build settings (``build_engine``; max_batch
            defaults to 8 and applies to engines only).
        opset, dynamo: ONNX exporter settings (``export_onnx``).
        images: preprocessed images for the parity check (None: seeded random).

    Raises:
        ConfigError: a bad argument or output path. ResourceError: an unwritable output folder.
        CapabilityError, DataError, EdgetlError: as ``load_run_model``, ``export_onnx`` and
            ``build_engine`` say.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; allowed: {', '.join(FORMATS)}")
    if fp16 and format != "engine":
        raise ConfigError("fp16 applies to TensorRT engines only; use format='engine'")
    if max_batch is not None and format != "engine":
        raise ConfigError(f"a largest batch ({max_batch}) applies to TensorRT engines only (format='engine'); "
                          "the ONNX model takes any batch size")
    max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    check_opset(opset, dynamo)
    run = load_run_model(run_dir)
    out = Path(output) if output is not None else Path(run_dir) / "export" / f"model.{format}"
    onnx_path = out if format == "onnx" else out.with_suffix(".onnx")
    if format == "engine" and onnx_path == out:
        raise ConfigError(f"engine path {out} must not end in .onnx")
    reads = {run.run_dir / RUN_MODEL_FILE: f"the run's {RUN_MODEL_FILE}"}
    reads.update({run.run_dir / name: f"the run's checkpoint {name}" for name in CHECKPOINT_FILES
                  if (run.run_dir / name).exists()})
    check_outputs([onnx_path, out] if format == "engine" else [onnx_path], reads)
    if format == "engine":
        _import_tensorrt()  # fail before the (slow) ONNX export, not after
    net = merge_for_inference(run.net)
    with StagedFiles() as stage:
        result, onnx_meta = _stage_onnx(
            net, onnx_path, stage, resolution=run.preprocessing.resolution, opset=opset, dynamic_batch=True,
            dynamo=dynamo, images=images, preprocessing=run.preprocessing, labels=run.labels,
            source={"run": str(run.run_dir.resolve()), "checkpoint": run.checkpoint.name, "mode": run.mode,
                    "backbone": run.spec.to_dict(), "recipe_hash": run.recipe_hash},
        )
        if format == "engine":
            start = time.perf_counter()
            meta = _stage_engine(stage.tmps[onnx_path], onnx_path, onnx_meta, out, stage, fp16=fp16,
                                 max_batch=max_batch, workspace_bytes=workspace_bytes)
            result.engine_path, result.engine_sidecar = out, sidecar_path(out)
            result.engine_bytes, result.engine_seconds = meta["engine_bytes"], time.perf_counter() - start
        stage.commit()
    return result
