#!/usr/bin/env python3
"""Classify images with an exported edgetl model: an ONNX file or TensorRT engine + its sidecar JSON in, labels out.

Standalone: the ONNX path needs only onnxruntime, Pillow and numpy (no torch, no edgetl),
so it runs on a bare Jetson or any server. The engine path needs TensorRT 10 and uses
torch (as JetPack's PyTorch wheel provides it) only to hold CUDA buffers.

    python deploy/classify.py --model runs/x/export/model.onnx a.jpg b.png
    python deploy/classify.py --model runs/x/export/model.engine --top-k 3 --json imgs/*.jpg

Bad input (a missing, damaged or foreign model, sidecar or image; a flag out of range)
ends in one line on stderr, ``classify.py: error: ...``, and exit code 2, as ``edgetl`` does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import stat
import sys
from pathlib import Path

import numpy as np

SIDECAR_FORMAT = "edgetl-export/1"
ARTIFACTS = ("onnx", "tensorrt-engine")
PREPROCESSING_KEYS = ("resolution", "resize", "mean", "std", "channels", "layout")
EXIT_USAGE = 2
# Pillow modes with more than 8 bits a channel: convert("RGB") clips them (a 16-bit
# grayscale frame turns white), so they are refused rather than classified wrongly.
HIGH_DEPTH_MODES = ("I", "F")


class DeployError(Exception):
    """Bad input (a model, sidecar or image file; a value) or a missing capability.

    ``main`` prints it as one line on stderr and exits with code 2.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``classify.py: error: ...``) with exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def count_arg(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        if len(text.strip().lstrip("+-").lstrip("0")) > 18:  # past int64: no runtime takes it
            raise argparse.ArgumentTypeError(f"{_short(text)} is too large; allowed: an integer >= {minimum} "
                                             "of at most 18 digits")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def check_count(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DeployError(f"{name} must be an integer >= {minimum}, got {value!r}")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads) -> None:
    """``threads`` is None (the runtime's choice) or 1 .. the usable CPUs: onnxruntime starts
    every thread asked for, and millions of them hang the process instead of failing."""
    if threads is None:
        return
    check_count("threads", threads)
    cpus = usable_cpus()
    if threads > cpus:
        raise DeployError(f"threads {threads} is more than the {cpus} CPUs this process can use; "
                          f"allowed: 1 to {cpus}")


def first_line(text: str, limit: int = 160) -> str:
    """The first non-empty line of a library's message, cut to ``limit`` characters."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def looks_like(path: str | Path) -> str | None:
    """What a file's first bytes say it is ("a PNG image", "text", ...), for error messages."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "a WEBP image"
    for magic, kind in ((b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"),
                        (b"GIF8", "a GIF image"), (b"BM", "a BMP image"), (b"II*\x00", "a TIFF image"),
                        (b"MM\x00*", "a TIFF image"), (b"PK\x03\x04", "a zip archive, maybe a PyTorch checkpoint"),
                        (b"\x7fELF", "an executable")):
        if head.startswith(magic):
            return kind
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text.lstrip().startswith(("{", "[")):
        return "JSON text"
    if all(c.isprintable() or c in "\t\r\n" for c in text):
        return "text"
    return None


def check_file(path: str | Path, what: str, directory_hint=None) -> Path:
    """``path`` is an existing, non-empty regular file; otherwise a DeployError naming it.

    ``directory_hint(path)``, when given, says what to pass instead of a directory.
    """
    path = Path(path)
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise DeployError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise DeployError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        hint = f"; {directory_hint(path)}" if directory_hint else ""
        raise DeployError(f"{what} {path} is a directory, not a file{hint}")
    if not stat.S_ISREG(st.st_mode):
        raise DeployError(f"{what} {path} is not a regular file")
    if st.st_size == 0:
        raise DeployError(f"{what} {path} is empty (0 bytes): an interrupted copy or write?")
    return path


def _model_in(folder: Path) -> str:
    """What to pass instead of a folder: the model files inside it or its export/ folder."""
    candidates = [folder / sub / name for sub in ("", "export") for name in ("model.onnx", "model.engine")]
    found = [str(c) for c in candidates if c.is_file()]
    return f"pass {' or '.join(found)}" if found else "pass a .onnx or .engine file (edgetl export writes one)"


def check_model_file(path: str | Path) -> Path:
    """The model file exists, is a file, is not empty and is not the sidecar itself."""
    path = Path(path)
    if path.suffix == ".json" and Path(str(path)[:-5]).is_file():
        raise DeployError(f"model {path} is the sidecar JSON; pass the model file {str(path)[:-5]}")
    return check_file(path, "model file", directory_hint=_model_in)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_sidecar(meta, path: str | Path) -> dict:
    """The sidecar has every key a runner uses, with values it can use; returns it."""
    where = f"sidecar {path}"
    if not isinstance(meta, dict):
        raise DeployError(f"{where} is not an edgetl export sidecar ({SIDECAR_FORMAT}): not a JSON object")
    if meta.get("format") != SIDECAR_FORMAT:
        raise DeployError(f"{where} is not an edgetl export sidecar ({SIDECAR_FORMAT}); "
                          f"its format is {_short(meta.get('format'))}")
    if meta.get("artifact") not in ARTIFACTS:
        raise DeployError(f"{where}: artifact {_short(meta.get('artifact'))} is not one of {', '.join(ARTIFACTS)}")
    labels = meta.get("labels")
    if not (isinstance(labels, list) and labels and all(isinstance(label, str) for label in labels)):
        raise DeployError(f"{where}: labels must be a non-empty list of class names, got {_short(labels)}")
    prep = meta.get("preprocessing")
    if not isinstance(prep, dict):
        raise DeployError(f"{where}: preprocessing must be an object with {', '.join(PREPROCESSING_KEYS)}, "
                          f"got {_short(prep)}")
    missing = [key for key in PREPROCESSING_KEYS if key not in prep]
    if missing:
        raise DeployError(f"{where}: preprocessing lacks {', '.join(missing)} "
                          f"(needs {', '.join(PREPROCESSING_KEYS)})")
    resolution, resize = prep["resolution"], prep["resize"]
    if not (_is_int(resolution) and resolution >= 1):
        raise DeployError(f"{where}: preprocessing.resolution must be an integer >= 1, got {_short(resolution)}")
    if not (_is_int(resize) and resize >= resolution):
        raise DeployError(f"{where}: preprocessing.resize must be an integer >= resolution {resolution} "
                          f"(the centre crop is taken from the resized image), got {_short(resize)}")
    for key, positive in (("mean", False), ("std", True)):
        value = prep[key]
        if not (isinstance(value, list) and len(value) == 3 and all(_is_number(v) for v in value)
                and (not positive or all(v > 0 for v in value))):
            kind = "positive numbers" if positive else "numbers"
            raise DeployError(f"{where}: preprocessing.{key} must be 3 {kind} (R, G, B), got {_short(value)}")
    if prep["channels"] != "RGB" or prep["layout"] != "NCHW":
        raise DeployError(f"{where}: preprocessing channels {_short(prep['channels'])} / layout "
                          f"{_short(prep['layout'])}; this runner feeds RGB / NCHW")
    shape = meta.get("input", {}).get("shape") if isinstance(meta.get("input"), dict) else None
    if not (isinstance(shape, list) and len(shape) == 4 and list(shape[1:]) == [3, resolution, resolution]):
        raise DeployError(f"{where}: input.shape must be [batch, 3, {resolution}, {resolution}] "
                          f"(preprocessing.resolution {resolution}), got {_short(shape)}")
    if meta["artifact"] == "tensorrt-engine":
        batch = meta.get("batch")
        if not (isinstance(batch, dict) and _is_int(batch.get("max")) and batch["max"] >= 1):
            raise DeployError(f"{where}: batch must be {{\"min\": 1, \"opt\": N, \"max\": N}} with N >= 1 "
                              f"for a TensorRT engine, got {_short(batch)}")
    return meta


def load_sidecar(model_path: str | Path) -> dict:
    """The metadata written beside a model by ``edgetl export`` (``<model>.json``), checked.

    The model file itself is checked first (exists, a file, not empty).

    Raises:
        DeployError: the model file or the sidecar is missing, damaged or incomplete.
    """
    model_path = check_model_file(model_path)
    path = Path(str(model_path) + ".json")
    if not path.exists():
        hint = (" (for an engine built by trtexec, copy model.onnx.json as deploy/README.md says)"
                if model_path.suffix == ".engine" else "")
        raise DeployError(f"sidecar {path} is missing; it holds the labels and preprocessing "
                          f"(edgetl export writes it beside the model){hint}")
    check_file(path, "sidecar")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DeployError(f"sidecar {path} is not UTF-8 text: damaged, or another kind of file") from None
    except OSError as exc:
        raise DeployError(f"sidecar {path} cannot be read: {exc.strerror or exc}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise DeployError(f"sidecar {path} is not valid JSON ({exc.msg}: {where}); damaged or cut short? "
                          "export the model again") from None
    return check_artifact(model_path, check_sidecar(meta, path))


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


def check_artifact(model_path: Path, meta: dict) -> dict:
    """The artifact kind the sidecar names agrees with the model file's name, and its ``sha256``
    (when it records one) is 64 hex digits; ``check_sha256`` compares it with the file."""
    sidecar = f"{model_path}.json"
    kind, suffix = meta["artifact"], model_path.suffix.lower()
    if (kind == "onnx" and suffix in ENGINE_SUFFIXES) or (kind == "tensorrt-engine" and suffix == ".onnx"):
        raise DeployError(f"sidecar {sidecar} describes a {kind} artifact but model {model_path} is named as "
                          f"{'an ONNX model' if suffix == '.onnx' else 'a TensorRT engine'}: the model and sidecar "
                          "do not belong together")
    want = meta.get("sha256")
    if want is not None and not (isinstance(want, str) and len(want) == 64
                                 and all(c in "0123456789abcdefABCDEF" for c in want)):
        raise DeployError(f"sidecar {sidecar}: sha256 must be the 64 hex digits of the model file's SHA-256, "
                          f"got {_short(want)}")
    return meta


def check_sha256(model_path: str | Path, meta: dict) -> None:
    """The model file is the one its sidecar describes: its SHA-256 is the sidecar's ``sha256``
    (edgetl export records it; a sidecar without one, from an older edgetl or made by hand, is
    taken as it is). Checked after the model loaded and ran, so a damaged file is named by
    what is wrong with it; before anything is printed."""
    want, sidecar = meta.get("sha256"), f"{model_path}.json"
    if want is None:
        return
    kind = meta["artifact"]
    try:
        got = file_sha256(model_path)
    except OSError as exc:
        raise DeployError(f"model file {model_path} cannot be read: {exc.strerror or exc}") from None
    if got != want.lower():
        hint = (f"; for an engine built by trtexec, delete \"sha256\" from the sidecar copied from the ONNX one"
                if kind == "tensorrt-engine" else "")
        raise DeployError(f"model {model_path} is not the file its sidecar {sidecar} describes (SHA-256 "
                          f"{got[:12]}..., the sidecar says {want[:12]}...): replaced after export, or the sidecar "
                          f"of another export; export again{hint}")


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DeployError("reading images needs Pillow (pip install pillow)") from None
    return Image


def preprocess_image(image, prep: dict) -> np.ndarray:
    """One PIL image -> float32 CHW: RGB, shorter side to prep['resize'] (bilinear), centre crop, normalise."""
    Image = _pil()
    image = image.convert("RGB")
    w, h = image.size
    short = prep["resize"]
    if w <= h:
        size = (short, int(short * h / w))
    else:
        size = (int(short * w / h), short)
    image = image.resize(size, Image.BILINEAR)
    crop = prep["resolution"]
    # Same rounding as torchvision's CenterCrop.
    left = int(round((size[0] - crop) / 2.0))
    top = int(round((size[1] - crop) / 2.0))
    image = image.crop((left, top, left + crop, top + crop))
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(prep["mean"], np.float32)) / np.asarray(prep["std"], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _png_size(path: Path) -> tuple[int, int] | None:
    """Width and height from a PNG's IHDR chunk (Pillow refuses to open a PNG whose size is 0)."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) == 24 and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    return None


def read_image(path: str | Path):
    """An image file, decoded whole, as an RGB PIL image (from any of Pillow's 8-bit modes).

    Raises:
        DeployError: the file is missing, empty, not an image, damaged or truncated, has no
            pixels, or has more than 8 bits a channel.
    """
    Image = _pil()
    path = check_file(path, "image")
    try:
        with Image.open(path) as image:
            image.load()  # decode now: a truncated file fails here, not in resize
            if image.width < 1 or image.height < 1:
                raise DeployError(f"image {path} has {image.width}x{image.height} pixels; it needs at least 1x1")
            if image.mode.startswith(HIGH_DEPTH_MODES):
                raise DeployError(f"image {path} has more than 8 bits a channel (Pillow mode {image.mode}); "
                                  "convert it to 8-bit RGB or grayscale (the model was trained on 8-bit images)")
            return image.convert("RGB")  # as edgetl's training loader converts
    except DeployError:
        raise
    except Image.UnidentifiedImageError:
        kind = looks_like(path)
        size = _png_size(path) if kind == "a PNG image" else None
        if size is not None and 0 in size:
            raise DeployError(f"image {path} is a PNG of {size[0]}x{size[1]} pixels; it needs at least 1x1") from None
        if kind and kind.endswith("image"):
            raise DeployError(f"image {path} looks like {kind} but Pillow cannot read it: "
                              "its header is damaged") from None
        what = f"it looks like {kind}" if kind else "Pillow does not recognise its format"
        raise DeployError(f"image {path} is not an image file ({what})") from None
    except Image.DecompressionBombError as exc:
        raise DeployError(f"image {path} is too large to decode safely ({first_line(exc)})") from None
    except PermissionError as exc:
        raise DeployError(f"image {path} cannot be read: {exc.strerror or exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # Pillow's words for a file cut short or with broken data: "image file is truncated",
        # "broken data stream when reading image file", "Truncated File Read", ...
        raise DeployError(f"image {path} is damaged or truncated (Pillow: {first_line(exc)})") from None


def preprocess(paths: list[str | Path], prep: dict) -> np.ndarray:
    """Image files -> a float32 NCHW batch."""
    return np.stack([preprocess_image(read_image(path), prep) for path in paths])


class OnnxModel:
    """onnxruntime session; CUDA / TensorRT execution providers are used when onnxruntime offers them."""

    def __init__(self, path: str | Path, threads: int | None = None, providers: list[str] | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise DeployError(f"running ONNX model {path} needs onnxruntime, which is not installed here "
                              "(pip install onnxruntime; onnxruntime-gpu for CUDA)") from None

        self.path = path
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        available = ort.get_available_providers()
        providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        try:
            # No fallback: onnxruntime's own prints a banner on stdout and retries on the CPU (a silent downgrade).
            self.session = ort.InferenceSession(str(path), options, providers=providers, enable_fallback=0)
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            name = type(exc).__name__
            if name in ("InvalidProtobuf", "UnicodeDecodeError", "DecodeError"):
                kind = looks_like(path)
                what = f"it looks like {kind}" if kind else "damaged, cut short, or another kind of file"
                raise DeployError(f"model file {path} is not a valid ONNX model ({what}); export it again") from None
            message = first_line(str(exc).replace(f"Load model from {path} failed:", ""))
            raise DeployError(f"onnxruntime {ort.__version__} cannot load model {path} ({name}: {message})") from None
        self.session.disable_fallback()
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        self.input_names = [i.name for i in inputs]
        self.input_name = self.input_names[0] if inputs else None
        self.input_type = inputs[0].type if inputs else None
        self.input_shape = [d if isinstance(d, int) and d > 0 else None for d in inputs[0].shape] if inputs else []
        self.output_shape = [d if isinstance(d, int) and d > 0 else None for d in outputs[0].shape] if outputs else []
        self.providers = self.session.get_providers()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        try:
            return self.session.run(None, {self.input_name: batch.astype(np.float32, copy=False)})[0]
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise DeployError(f"onnxruntime cannot run model {self.path} on a batch of shape "
                              f"{list(batch.shape)} ({type(exc).__name__}: {first_line(exc)})") from None


class EngineModel:
    """A serialized TensorRT 10 engine with a dynamic batch axis (one input, one output)."""

    def __init__(self, path: str | Path, max_batch: int):
        try:
            import tensorrt as trt
        except ImportError:
            raise DeployError(
                f"running TensorRT engine {path} needs the 'tensorrt' Python package (TensorRT 10) and an "
                "NVIDIA GPU; it is not installed here. On a Jetson, JetPack ships it (apt: python3-libnvinfer); "
                f"elsewhere run the ONNX model ({Path(path).with_suffix('.onnx')})") from None
        try:
            import torch  # CUDA buffers and stream; shipped with JetPack's PyTorch
        except ImportError:
            raise DeployError(f"running TensorRT engine {path} needs torch for its CUDA buffers "
                              "(JetPack's PyTorch wheel); it is not installed here") from None
        if not torch.cuda.is_available():
            raise DeployError(f"running TensorRT engine {path} needs an NVIDIA GPU; torch sees none here")

        self.torch = torch
        self.path = path
        self.max_batch = max_batch
        logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise DeployError(f"TensorRT {trt.__version__} cannot load engine {path}: not a TensorRT engine, "
                              "damaged, or built for another GPU or TensorRT version (build it on this device)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if len(self.input_names) != 1 or not outputs:
            raise DeployError(f"engine {path} has {len(self.input_names)} inputs and {len(outputs)} outputs; "
                              "this runner feeds one image tensor and reads one output")
        self.input_name, self.output_name = self.input_names[0], outputs[0]
        self.input_type = ("tensor(float)" if self.engine.get_tensor_dtype(self.input_name) == trt.DataType.FLOAT
                           else str(self.engine.get_tensor_dtype(self.input_name)))
        self.input_shape = [d if d > 0 else None for d in self.engine.get_tensor_shape(self.input_name)]
        self.output_shape = [d if d > 0 else None for d in self.engine.get_tensor_shape(self.output_name)]
        self.providers = ["TensorRT " + trt.__version__]

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        torch = self.torch
        if batch.shape[0] > self.max_batch:
            return np.concatenate([self(batch[i:i + self.max_batch]) for i in range(0, len(batch), self.max_batch)])
        x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).cuda()
        self.context.set_input_shape(self.input_name, tuple(x.shape))
        out = torch.empty(tuple(self.context.get_tensor_shape(self.output_name)), dtype=torch.float32, device="cuda")
        self.context.set_tensor_address(self.input_name, x.data_ptr())
        self.context.set_tensor_address(self.output_name, out.data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return out.cpu().numpy()


def check_model_io(model, meta: dict, path: str | Path) -> None:
    """The model's input and output agree with its sidecar: one float32 [batch, 3, R, R] input
    with a dynamic batch axis, and one logit per label."""
    sidecar = f"{path}.json"
    if len(model.input_names) != 1:
        raise DeployError(f"model {path} has {len(model.input_names)} inputs ({', '.join(model.input_names)}); "
                          "this runner feeds one image tensor")
    if model.input_type != "tensor(float)":
        raise DeployError(f"model {path} takes {model.input_type} input; this runner feeds float32 (tensor(float))")
    resolution = meta["preprocessing"]["resolution"]
    shape = model.input_shape
    if len(shape) != 4 or any(d is not None and d != want for d, want in zip(shape[1:], (3, resolution, resolution))):
        shown = ["batch" if d is None else d for d in shape]
        raise DeployError(f"model {path} takes input shape {shown} but its sidecar {sidecar} says "
                          f"[batch, 3, {resolution}, {resolution}]: the model and sidecar do not belong together")
    if shape[0] is not None:
        raise DeployError(f"model {path} has a fixed batch of {shape[0]}; this runner needs a dynamic batch axis "
                          "(edgetl export makes one)")
    classes = model.output_shape[-1] if model.output_shape else None
    if len(model.output_shape) not in (0, 2) or (classes is not None and classes != len(meta["labels"])):
        shown = ["batch" if d is None else d for d in model.output_shape]
        raise DeployError(f"model {path} outputs shape {shown} but its sidecar {sidecar} has "
                          f"{len(meta['labels'])} labels: the model and sidecar do not belong together")


def open_model(path: str | Path, meta: dict, threads: int | None = None):
    """The runtime for ``path`` (onnxruntime or TensorRT, as the sidecar says), checked against the sidecar."""
    if meta.get("artifact") == "tensorrt-engine":
        model = EngineModel(path, max_batch=meta["batch"]["max"])
    else:
        model = OnnxModel(path, threads=threads)
    check_model_io(model, meta, path)
    return model


def check_logits(logits: np.ndarray, batch: int, meta: dict, path: str | Path) -> np.ndarray:
    """A model's logits for ``batch`` images, checked: one finite logit per label per image."""
    logits = np.asarray(logits)
    labels = len(meta["labels"])
    if logits.shape != (batch, labels):
        raise DeployError(f"model {path} gave logits of shape {list(logits.shape)} for a batch of {batch}; "
                          f"its sidecar {path}.json has {labels} labels: the model and sidecar do not belong together")
    if not np.isfinite(logits).all():
        raise DeployError(f"model {path} gives non-finite logits (NaN or inf): its weights are damaged; "
                          "export it again")
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def classify(model_path: str | Path, images: list[str | Path], top_k: int = 1, batch: int = 8,
             threads: int | None = None) -> list[dict]:
    """Top-k labels and probabilities for each image file.

    Raises:
        DeployError: a bad model, sidecar or image file, or ``top_k`` / ``batch`` / ``threads``
            out of range (``top_k`` at most the number of classes; never clamped).
    """
    check_count("top-k", top_k)
    check_count("batch", batch)
    check_threads(threads)
    meta = load_sidecar(model_path)
    labels = meta["labels"]
    if top_k > len(labels):
        raise DeployError(f"top-k {top_k} is more than the {len(labels)} classes of model {model_path}")
    for path in images:  # before the (slow) model load
        check_file(path, "image")
    model = open_model(model_path, meta, threads=threads)
    results = []
    for start in range(0, len(images), batch):
        paths = images[start:start + batch]
        logits = model(preprocess(paths, meta["preprocessing"]))
        probs = softmax(check_logits(logits, len(paths), meta, model_path))
        for path, p in zip(paths, probs):
            order = np.argsort(-p)[:top_k]
            results.append({"image": str(path),
                            "top": [{"label": labels[i], "index": int(i), "prob": float(p[i])} for i in order]})
    check_sha256(model_path, meta)
    return results


def run_main(prog: str, body) -> int:
    """Run ``body()``; a DeployError becomes one line on stderr and exit code 2."""
    try:
        return body()
    except DeployError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (`| head`) left: no traceback; stdout goes nowhere from here on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="classify.py",
                           description="Classify images with an edgetl ONNX model or TensorRT engine.")
    parser.add_argument("--model", required=True, help="model.onnx or model.engine (its .json sidecar beside it)")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--top-k", type=count_arg(1), default=1, help="labels per image (1 .. number of classes)")
    parser.add_argument("--batch", type=count_arg(1), default=8)
    parser.add_argument("--threads", type=count_arg(1), default=None,
                        help="onnxruntime intra-op threads (default: onnxruntime's choice)")
    parser.add_argument("--json", action="store_true", help="print results as JSON lines")
    args = parser.parse_args(argv)

    def body() -> int:
        for result in classify(args.model, args.images, top_k=args.top_k, batch=args.batch, threads=args.threads):
            if args.json:
                print(json.dumps(result))
            else:
                tops = ", ".join(f"{t['label']} {t['prob']:.3f}" for t in result["top"])
                print(f"{result['image']}: {tops}")
        sys.stdout.flush()  # a closed pipe shows here, inside run_main
        return 0

    return run_main("classify.py", body)


if __name__ == "__main__":
    sys.exit(main())
