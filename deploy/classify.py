#!/usr/bin/env python3
"""Classify images with an exported edgetl model: an ONNX file or TensorRT engine + its sidecar JSON in, labels out.

Standalone: the ONNX path needs only onnxruntime, Pillow and numpy (no torch, no edgetl),
so it runs on a bare Jetson or any server. The engine path needs TensorRT 10 and uses
torch (as JetPack's PyTorch wheel provides it) only to hold CUDA buffers.

    python deploy/classify.py --model runs/x/export/model.onnx a.jpg b.png
    python deploy/classify.py --model runs/x/export/model.engine --top-k 3 --json imgs/*.jpg
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SIDECAR_FORMAT = "edgetl-export/1"


def load_sidecar(model_path: str | Path) -> dict:
    """The metadata written beside a model by ``edgetl export`` (``<model>.json``)."""
    path = Path(str(model_path) + ".json")
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing; it holds the labels and preprocessing (edgetl export writes it)")
    meta = json.loads(path.read_text())
    if meta.get("format") != SIDECAR_FORMAT:
        raise SystemExit(f"error: {path} is not an edgetl export sidecar ({SIDECAR_FORMAT})")
    return meta


def preprocess_image(image: Image.Image, prep: dict) -> np.ndarray:
    """One PIL image -> float32 CHW: RGB, shorter side to prep['resize'] (bilinear), centre crop, normalise."""
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


def preprocess(paths: list[str | Path], prep: dict) -> np.ndarray:
    """Image files -> a float32 NCHW batch."""
    batch = []
    for path in paths:
        with Image.open(path) as image:
            batch.append(preprocess_image(image, prep))
    return np.stack(batch)


class OnnxModel:
    """onnxruntime session; CUDA / TensorRT execution providers are used when onnxruntime offers them."""

    def __init__(self, path: str | Path, threads: int | None = None, providers: list[str] | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        available = ort.get_available_providers()
        providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self.input_name = self.session.get_inputs()[0].name
        self.providers = self.session.get_providers()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: batch.astype(np.float32, copy=False)})[0]


class EngineModel:
    """A serialized TensorRT 10 engine with a dynamic batch axis (one input, one output)."""

    def __init__(self, path: str | Path, max_batch: int):
        import tensorrt as trt
        import torch  # CUDA buffers and stream; shipped with JetPack's PyTorch

        self.torch = torch
        self.max_batch = max_batch
        logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise SystemExit(f"error: TensorRT cannot load {path} (built for another GPU or TensorRT version?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_name = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
        self.output_name = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)
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


def open_model(path: str | Path, meta: dict, threads: int | None = None):
    if meta.get("artifact") == "tensorrt-engine":
        return EngineModel(path, max_batch=meta["batch"]["max"])
    return OnnxModel(path, threads=threads)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def classify(model_path: str | Path, images: list[str | Path], top_k: int = 1, batch: int = 8,
             threads: int | None = None) -> list[dict]:
    """Top-k labels and probabilities for each image file."""
    meta = load_sidecar(model_path)
    model = open_model(model_path, meta, threads=threads)
    labels = meta["labels"]
    results = []
    for start in range(0, len(images), batch):
        paths = images[start:start + batch]
        probs = softmax(model(preprocess(paths, meta["preprocessing"])))
        for path, p in zip(paths, probs):
            order = np.argsort(-p)[:top_k]
            results.append({"image": str(path),
                            "top": [{"label": labels[i], "index": int(i), "prob": float(p[i])} for i in order]})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Classify images with an edgetl ONNX model or TensorRT engine.")
    parser.add_argument("--model", required=True, help="model.onnx or model.engine (its .json sidecar beside it)")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--json", action="store_true", help="print results as JSON lines")
    args = parser.parse_args(argv)
    for result in classify(args.model, args.images, top_k=args.top_k, batch=args.batch, threads=args.threads):
        if args.json:
            print(json.dumps(result))
        else:
            tops = ", ".join(f"{t['label']} {t['prob']:.3f}" for t in result["top"])
            print(f"{result['image']}: {tops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
