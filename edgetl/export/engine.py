"""A TensorRT engine from an exported ONNX file (dynamic batch axis), with its sidecar JSON.

Needs the ``tensorrt`` package and an NVIDIA GPU (a Jetson ships both with JetPack);
without them ``build_engine`` raises a CapabilityError that says where to build instead.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from edgetl.errors import CapabilityError, ConfigError, EdgetlError
from edgetl.export.sidecar import SIDECAR_FORMAT, file_sha256, sidecar_path
from edgetl.io import atomic_text_json, atomic_write_bytes

DEFAULT_WORKSPACE_BYTES = 1 << 30


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise CapabilityError(
            "building a TensorRT engine needs the 'tensorrt' Python package and an NVIDIA GPU; "
            "it is not installed here. On a Jetson, JetPack ships it (apt: python3-libnvinfer); "
            "or export ONNX here (--format onnx) and build on the device with trtexec (see deploy/README.md)"
        ) from None
    return trt


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    *,
    fp16: bool = False,
    max_batch: int = 8,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> dict:
    """Build a serialized TensorRT 10 engine from an ONNX file with a dynamic batch axis.

    The engine file holds only the serialized engine; its metadata (TensorRT version,
    precision, batch range, input shape, GPU, the engine's and the ONNX file's SHA-256, and
    the ONNX sidecar's labels and preprocessing) goes to ``engine_path + ".json"``. Both are
    written under temporary names and renamed into place together. An engine only runs on
    the GPU model and TensorRT version it was built with: build it on the target device.

    Args:
        onnx_path: an ONNX file from ``export_onnx``, with its sidecar beside it (an ONNX file
            without one is refused: its labels and preprocessing would be unknown).
        engine_path: output engine file: new, or an earlier edgetl engine
            (``sidecar.check_outputs``).
        fp16: allow FP16 kernels.
        max_batch: largest batch the optimization profile accepts (also its optimum).
        workspace_bytes: builder workspace memory pool limit.

    Returns:
        The metadata written to the sidecar.

    Raises:
        CapabilityError: no tensorrt package, no usable GPU, or fp16 without fast fp16.
        DataError: the ONNX file or its sidecar is missing, damaged or of another export.
        ConfigError: a bad setting or an output path it may not write.
        EdgetlError: the ONNX parser or the builder fails.
    """
    from edgetl.export.sidecar import check_outputs, read_sidecar
    from edgetl.io import StagedFiles

    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    _check_max_batch(max_batch)
    onnx_meta = read_sidecar(onnx_path, "onnx")
    check_outputs([engine_path], reads={onnx_path: "the ONNX file", sidecar_path(onnx_path): "the ONNX sidecar"})
    with StagedFiles() as stage:
        meta = _stage_engine(onnx_path, onnx_path, onnx_meta, engine_path, stage, fp16=fp16, max_batch=max_batch,
                             workspace_bytes=workspace_bytes)
        stage.commit()
    return meta


def _check_max_batch(max_batch) -> None:
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")


def _stage_engine(onnx_file: Path, onnx_path: Path, onnx_meta: dict, engine_path: Path, stage, *, fp16: bool,
                  max_batch: int, workspace_bytes: int) -> dict:
    """``build_engine``'s work from ``onnx_file`` (the ONNX model, perhaps still under its
    temporary name; ``onnx_path`` is its final path), its files staged in ``stage``
    (sidecar first, then the engine); returns the sidecar's content."""
    _check_max_batch(max_batch)
    trt = _import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:  # pybind raises TypeError/RuntimeError depending on version
        builder, error = None, str(exc)
    else:
        error = ""
    if builder is None:
        raise CapabilityError(
            "TensorRT cannot create a builder: no usable NVIDIA GPU here (CUDA initialization failure"
            + (f": {error}" if error else "")
            + "); build the engine on the Jetson or a CUDA machine"
        )
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EdgetlError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if fp16:
        if not builder.platform_has_fast_fp16:
            raise CapabilityError("fp16 requested but this GPU has no fast FP16; build without --fp16")
        config.set_flag(trt.BuilderFlag.FP16)
    tensor = network.get_input(0)
    shape = tuple(tensor.shape)
    rest = shape[1:]
    if any(d < 0 for d in rest):
        raise EdgetlError(f"only the batch axis may be dynamic; {onnx_path} input shape is {shape}")
    profile = builder.create_optimization_profile()
    profile.set_shape(tensor.name, (1, *rest), (max_batch, *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if serialized is None:
        raise EdgetlError("TensorRT failed to build the engine (see the TensorRT log above)")
    data = bytes(serialized)

    gpu = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    meta = {
        "format": SIDECAR_FORMAT,
        "artifact": "tensorrt-engine",
        "file": engine_path.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "tensorrt": trt.__version__,
        "precision": "fp16" if fp16 else "fp32",
        "batch": {"min": 1, "opt": max_batch, "max": max_batch},
        "workspace_bytes": int(workspace_bytes),
        "input": {"name": tensor.name, "shape": [-1, *rest], "dtype": "float32"},
        "output": onnx_meta.get("output", {"name": network.get_output(0).name}),
        "labels": onnx_meta.get("labels"),
        "preprocessing": onnx_meta.get("preprocessing"),
        "source": {**onnx_meta.get("source", {}), "onnx": onnx_path.name, "onnx_sha256": file_sha256(onnx_file)},
        "gpu": gpu,
        "build_seconds": seconds,
        "engine_bytes": len(data),
    }
    tmp_sidecar = stage.tmp(sidecar_path(engine_path))
    tmp = stage.tmp(engine_path)
    atomic_write_bytes(tmp, data)
    atomic_text_json(tmp_sidecar, meta)
    return meta
