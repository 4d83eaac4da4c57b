"""Issue #29 item 7: every bad input to deploy/classify.py and deploy/benchmark.py ends in one
line on stderr naming the bad file or value, exit code 2, no traceback, the user's files untouched;
grayscale, RGBA and palette images classify as their RGB conversion does."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgetl.export import Preprocessing, example_images, export_onnx, merge_for_inference
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import build_network

from tests.bad_files import flip_png_data, image_bytes, truncate

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RES = 64
LABELS = ["cat", "dog", "eel"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A tiny exported model (random weights, 3 classes, 64 px): m.onnx + m.onnx.json, and ok.png."""
    folder = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.25, num_classes=len(LABELS)), mode="repnet")
    with torch.no_grad():  # probabilities that depend on the image (a fresh network's barely do)
        net.classifier[-1].weight.normal_(0.0, 0.03)
        for m in net.side.modules():  # zero-initialised gammas would silence the side network
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.normal_(1.0, 0.5)
                m.bias.normal_(0.0, 0.1)
        for m in net.modules():  # BN statistics of seeded random images, averaged over all of them
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None
        net.train()(example_images(Preprocessing(resolution=RES), count=16))
    net.eval()
    export_onnx(merge_for_inference(net), folder / "m.onnx", resolution=RES, dynamo=False, labels=LABELS)
    (folder / "ok.png").write_bytes(image_bytes("PNG", 48, seed=1))
    return folder


def run_script(script: str, args: list, cwd: Path, prelude: str | None = None) -> subprocess.CompletedProcess:
    """``python deploy/<script>.py ARGS``; with a ``prelude`` (code that fakes or blocks modules),
    the script runs as ``__main__`` after it in one ``python -c``."""
    args = [str(a) for a in args]
    path = DEPLOY / f"{script}.py"
    if prelude is None:
        cmd = [sys.executable, str(path), *args]
    else:
        code = (f"import sys, runpy\n{prelude}\nsys.argv = [{path.name!r}, *{args!r}]\n"
                f"runpy.run_path({str(path)!r}, run_name='__main__')")
        cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(out: subprocess.CompletedProcess, script: str, needles: list[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"{script}.py: error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == "", out.stdout
    return lines[0]


def png_of_size(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (Pillow cannot write a 0-pixel image)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def edit_sidecar(d: Path, change) -> None:
    meta = json.loads((d / "m.onnx.json").read_text())
    change(meta)
    (d / "m.onnx.json").write_text(json.dumps(meta))


def engine_files(d: Path, batch_max: int = 8) -> Path:
    """m.engine holding bytes that are no TensorRT engine, and an engine sidecar as the README says."""
    (d / "m.engine").write_bytes(b"not a serialized engine\x00" * 40)
    meta = json.loads((d / "m.onnx.json").read_text())
    meta.update(artifact="tensorrt-engine", batch={"min": 1, "opt": batch_max, "max": batch_max})
    (d / "m.engine.json").write_text(json.dumps(meta))
    return d / "m.engine"


BLOCK_TORCH = "sys.modules['torch'] = None"
NO_TENSORRT = "sys.modules['tensorrt'] = None; sys.modules['torch'] = None"
# TensorRT present and a GPU seen, but deserialize_cuda_engine answers None, as TensorRT does
# for bytes that are no engine (or one built for another GPU or TensorRT version).
FAKE_TENSORRT = """import types
class Logger:
    WARNING = 2
    def __init__(self, level): pass
class Runtime:
    def __init__(self, logger): pass
    def deserialize_cuda_engine(self, data): return None
sys.modules['tensorrt'] = types.SimpleNamespace(Logger=Logger, Runtime=Runtime, __version__='10.3.0')
sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))"""


# Each case: (script, prepare). prepare(d) changes the copies in d (m.onnx, m.onnx.json, ok.png)
# and returns (args, needles[, prelude]): the needles must all be in the one error line.
CASES = {}


def case(script: str = "classify"):
    def register(prepare):
        CASES[prepare.__name__] = (script, prepare)
        return prepare
    return register


# --- the model file -------------------------------------------------------------------------

@case()
def model_missing(d):
    return ["--model", d / "nope.onnx", d / "ok.png"], ["nope.onnx", "does not exist"]


@case()
def model_is_a_directory(d):
    (d / "run" / "export").mkdir(parents=True)
    (d / "m.onnx").rename(d / "run" / "export" / "model.onnx")
    return ["--model", d / "run", d / "ok.png"], [f"model file {d / 'run'} is a directory",
                                                  f"pass {d / 'run' / 'export' / 'model.onnx'}"]


@case()
def model_empty(d):
    (d / "m.onnx").write_bytes(b"")
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "empty (0 bytes)"]


@case()
def model_truncated(d):
    truncate(d / "m.onnx", keep=0.5)
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "not a valid ONNX model", "cut short"]


@case()
def model_header_corrupted(d):
    # One byte of the first node's first input name flipped: onnxruntime fails on the string
    # (UnicodeDecodeError) and, with its fallback on, prints an "EP Error" banner on stdout first.
    data = bytearray((d / "m.onnx").read_bytes())
    data[data.index(b"features.")] ^= 0xFF
    (d / "m.onnx").write_bytes(bytes(data))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "not a valid ONNX model"]


@case()
def model_is_text(d):
    (d / "m.onnx").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\n")
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "not a valid ONNX model", "looks like text"]


@case()
def model_is_an_image(d):
    (d / "m.onnx").write_bytes((d / "ok.png").read_bytes())
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "looks like a PNG image"]


@case()
def model_is_a_checkpoint(d):
    torch.save({"model": {"w": torch.zeros(3)}}, d / "m.onnx")
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "a zip archive, maybe a PyTorch checkpoint"]


@case()
def model_weights_not_finite(d):
    """A valid file whose classifier weights hold NaN: found by the logits, not the loader."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(d / "m.onnx"))
    weight = next(t for t in reversed(model.graph.initializer) if numpy_helper.to_array(t).ndim == 2)
    array = numpy_helper.to_array(weight).copy()
    array[0, 0] = np.nan
    weight.CopyFrom(numpy_helper.from_array(array, weight.name))
    onnx.save(model, str(d / "m.onnx"))
    return ["--model", d / "m.onnx", d / "ok.png"], [f"model {d / 'm.onnx'} gives non-finite logits"]


@case()
def model_is_the_sidecar(d):
    return ["--model", d / "m.onnx.json", d / "ok.png"], [f"{d / 'm.onnx.json'} is the sidecar",
                                                          f"pass the model file {d / 'm.onnx'}"]


@case()
def model_replaced_after_export(d):
    """Issue #41: another valid model of the same shape (one weight changed) beside the sidecar of
    the first: it loads and runs, and is refused by the sidecar's SHA-256 before any output."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(d / "m.onnx"))
    weight = next(t for t in reversed(model.graph.initializer) if numpy_helper.to_array(t).ndim == 2)
    array = numpy_helper.to_array(weight).copy()
    array[0, 0] += 0.5
    weight.CopyFrom(numpy_helper.from_array(array, weight.name))
    onnx.save(model, str(d / "m.onnx"))
    return ["--model", d / "m.onnx", d / "ok.png"], [f"model {d / 'm.onnx'} is not the file its sidecar",
                                                     "SHA-256", "export again"]


# --- the sidecar ----------------------------------------------------------------------------

@case()
def sidecar_missing(d):
    (d / "m.onnx.json").unlink()
    return ["--model", d / "m.onnx", d / "ok.png"], [f"sidecar {d / 'm.onnx.json'} is missing"]


@case()
def sidecar_empty(d):
    (d / "m.onnx.json").write_bytes(b"")
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "empty (0 bytes)"]


@case()
def sidecar_truncated(d):
    truncate(d / "m.onnx.json", keep=0.5)
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "not valid JSON", "line "]


@case()
def sidecar_binary(d):
    (d / "m.onnx.json").write_bytes((d / "ok.png").read_bytes())
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "not UTF-8"]


@case()
def sidecar_not_an_object(d):
    (d / "m.onnx.json").write_text("[1, 2]")
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "edgetl-export/1", "JSON object"]


@case()
def sidecar_foreign_format(d):
    edit_sidecar(d, lambda m: m.update(format="something-else/3"))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "edgetl-export/1", "something-else/3"]


@case()
def sidecar_unknown_artifact(d):
    edit_sidecar(d, lambda m: m.update(artifact="tflite"))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "'tflite'", "onnx, tensorrt-engine"]


@case()
def sidecar_without_labels(d):
    edit_sidecar(d, lambda m: m.pop("labels"))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "labels must be a non-empty list"]


@case()
def sidecar_too_few_labels(d):
    edit_sidecar(d, lambda m: m.update(labels=["cat", "dog"]))
    return ["--model", d / "m.onnx", d / "ok.png"], [f"model {d / 'm.onnx'} outputs shape ['batch', 3]",
                                                     f"sidecar {d / 'm.onnx.json'} has 2 labels"]


@case()
def sidecar_too_many_labels(d):
    edit_sidecar(d, lambda m: m.update(labels=["cat", "dog", "eel", "fox"]))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx"), "has 4 labels", "do not belong together"]


@case()
def sidecar_preprocessing_keys_missing(d):
    edit_sidecar(d, lambda m: [m["preprocessing"].pop(k) for k in ("resize", "std")])
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "preprocessing lacks resize, std"]


@case()
def sidecar_zero_std(d):
    edit_sidecar(d, lambda m: m["preprocessing"].update(std=[0.2, 0.0, 0.2]))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "preprocessing.std", "[0.2, 0.0, 0.2]"]


@case()
def sidecar_resize_below_resolution(d):
    edit_sidecar(d, lambda m: m["preprocessing"].update(resize=RES - 1))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "preprocessing.resize", f"{RES - 1}"]


@case()
def sidecar_resolution_not_the_models(d):
    def change(meta):
        meta["preprocessing"].update(resolution=96, resize=110)
        meta["input"]["shape"] = ["batch", 3, 96, 96]
    edit_sidecar(d, change)
    return ["--model", d / "m.onnx", d / "ok.png"], [f"takes input shape ['batch', 3, {RES}, {RES}]",
                                                     str(d / "m.onnx.json"), "[batch, 3, 96, 96]"]


@case()
def sidecar_input_shape_disagrees(d):
    edit_sidecar(d, lambda m: m["input"].update(shape=["batch", 3, 32, 32]))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "input.shape", "[\"batch\", 3, 32, 32]"]


@case()
def sidecar_sha256_malformed(d):
    edit_sidecar(d, lambda m: m.update(sha256="abc"))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "sha256 must be the 64 hex digits"]


@case()
def sidecar_of_an_engine_beside_an_onnx(d):
    edit_sidecar(d, lambda m: m.update(artifact="tensorrt-engine", batch={"min": 1, "opt": 8, "max": 8}))
    return ["--model", d / "m.onnx", d / "ok.png"], [str(d / "m.onnx.json"), "describes a tensorrt-engine artifact",
                                                     "named as an ONNX model", "do not belong together"]


# --- a TensorRT engine ----------------------------------------------------------------------

@case()
def engine_without_tensorrt(d):
    engine = engine_files(d)
    return ["--model", engine, d / "ok.png"], [f"engine {engine}", "'tensorrt'", "not installed"], NO_TENSORRT


@case()
def engine_not_an_engine(d):
    engine = engine_files(d)
    return ["--model", engine, d / "ok.png"], [f"cannot load engine {engine}", "not a TensorRT engine"], FAKE_TENSORRT


@case()
def engine_sidecar_without_batch(d):
    engine = engine_files(d)
    sidecar = d / "m.engine.json"
    sidecar.write_text(json.dumps({k: v for k, v in json.loads(sidecar.read_text()).items() if k != "batch"}))
    return ["--model", engine, d / "ok.png"], [str(sidecar), "batch must be"], NO_TENSORRT


# --- the images -----------------------------------------------------------------------------

@case()
def image_missing(d):
    return ["--model", d / "m.onnx", d / "ok.png", d / "gone.jpg"], [f"image {d / 'gone.jpg'} does not exist"]


@case()
def image_is_a_directory(d):
    (d / "frames").mkdir()
    return ["--model", d / "m.onnx", d / "frames"], [f"image {d / 'frames'} is a directory"]


@case()
def image_empty(d):
    (d / "empty.jpg").write_bytes(b"")
    return ["--model", d / "m.onnx", d / "empty.jpg"], [f"image {d / 'empty.jpg'} is empty (0 bytes)"]


@case()
def image_is_text(d):
    (d / "notes.jpg").write_text("not a picture\n")
    return ["--model", d / "m.onnx", d / "notes.jpg"], [f"image {d / 'notes.jpg'} is not an image", "text"]


@case()
def image_truncated_jpeg(d):
    (d / "cut.jpg").write_bytes(image_bytes("JPEG", 64))
    truncate(d / "cut.jpg", keep=0.5)
    return ["--model", d / "m.onnx", d / "cut.jpg"], [f"image {d / 'cut.jpg'} is damaged or truncated"]


@case()
def image_truncated_png(d):
    (d / "cut.png").write_bytes(image_bytes("PNG", 64))
    truncate(d / "cut.png", keep=0.6)
    return ["--model", d / "m.onnx", d / "cut.png"], [f"image {d / 'cut.png'} is damaged or truncated"]


@case()
def image_jpeg_header_only(d):
    (d / "head.jpg").write_bytes(image_bytes("JPEG", 64)[:20])
    return ["--model", d / "m.onnx", d / "head.jpg"], [f"image {d / 'head.jpg'} looks like a JPEG image",
                                                       "header is damaged"]


@case()
def image_png_data_flipped(d):
    (d / "flip.png").write_bytes(image_bytes("PNG", 64))
    flip_png_data(d / "flip.png")
    return ["--model", d / "m.onnx", d / "flip.png"], [f"image {d / 'flip.png'} is damaged or truncated"]


@case()
def image_zero_width(d):
    (d / "w0.png").write_bytes(png_of_size(0, 5))
    return ["--model", d / "m.onnx", d / "w0.png"], [f"image {d / 'w0.png'} is a PNG of 0x5 pixels"]


@case()
def image_zero_height(d):
    (d / "h0.png").write_bytes(png_of_size(7, 0))
    return ["--model", d / "m.onnx", d / "h0.png"], [f"image {d / 'h0.png'} is a PNG of 7x0 pixels"]


@case()
def image_16_bit(d):
    Image.fromarray(np.arange(48 * 48, dtype=np.uint16).reshape(48, 48) * 20).save(d / "deep.png")
    return ["--model", d / "m.onnx", d / "deep.png"], [f"image {d / 'deep.png'}", "more than 8 bits", "I;16"]


@case()
def image_bad_among_good(d):
    """Nothing is printed for the good images before the bad one: all or nothing."""
    (d / "cut.jpg").write_bytes(image_bytes("JPEG", 64))
    truncate(d / "cut.jpg", keep=0.5)
    args = ["--model", d / "m.onnx", "--batch", "2", d / "ok.png", d / "ok.png", d / "cut.jpg", d / "ok.png"]
    return args, [f"image {d / 'cut.jpg'} is damaged or truncated"]


# --- the flags ------------------------------------------------------------------------------

@case()
def top_k_zero(d):
    return ["--model", d / "m.onnx", "--top-k", "0", d / "ok.png"], ["--top-k", "must be >= 1, got 0"]


@case()
def top_k_negative(d):
    return ["--model", d / "m.onnx", "--top-k", "-2", d / "ok.png"], ["--top-k", "must be >= 1, got -2"]


@case()
def top_k_above_classes(d):
    return ["--model", d / "m.onnx", "--top-k", "4", d / "ok.png"], ["top-k 4", "3 classes", str(d / "m.onnx")]


@case()
def top_k_not_a_number(d):
    return ["--model", d / "m.onnx", "--top-k", "all", d / "ok.png"], ["--top-k", "'all'"]


@case()
def batch_zero(d):
    return ["--model", d / "m.onnx", "--batch", "0", d / "ok.png"], ["--batch", "must be >= 1, got 0"]


@case()
def threads_zero(d):
    return ["--model", d / "m.onnx", "--threads", "0", d / "ok.png"], ["--threads", "must be >= 1, got 0"]


@case()
def threads_above_cpus(d):
    cpus = len(os.sched_getaffinity(0))
    return ["--model", d / "m.onnx", "--threads", str(cpus + 1), d / "ok.png"], [
        f"threads {cpus + 1} is more than the {cpus} CPUs", f"allowed: 1 to {cpus}"]


@case()
def threads_past_int64(d):
    return ["--model", d / "m.onnx", "--threads", "9" * 20, d / "ok.png"], ["--threads", "is too large"]


@case()
def no_images(d):
    return ["--model", d / "m.onnx"], ["images"]


# --- benchmark.py ---------------------------------------------------------------------------

@case("benchmark")
def bench_iters_zero(d):
    return ["--model", d / "m.onnx", "--iters", "0"], ["--iters", "must be >= 1, got 0"]


@case("benchmark")
def bench_warmup_negative(d):
    return ["--model", d / "m.onnx", "--warmup", "-1"], ["--warmup", "must be >= 0, got -1"]


@case("benchmark")
def bench_batch_zero(d):
    return ["--model", d / "m.onnx", "--batch", "1", "0"], ["--batch", "must be >= 1, got 0"]


@case("benchmark")
def bench_batch_negative(d):
    return ["--model", d / "m.onnx", "--batch", "-8"], ["--batch", "must be >= 1, got -8"]


@case("benchmark")
def bench_threads_zero(d):
    return ["--model", d / "m.onnx", "--threads", "0"], ["--threads", "must be >= 1, got 0"]


@case("benchmark")
def bench_threads_above_cpus(d):
    """A hundred million threads hung onnxruntime's session creation (issue #41)."""
    return ["--model", d / "m.onnx", "--threads", "100000000"], ["threads 100000000 is more than the", "CPUs"]


@case("benchmark")
def bench_batch_beyond_memory(d):
    return ["--model", d / "m.onnx", "--batch", "100000000000"], [
        "batch 100000000000 needs", "GiB for its input alone", "memory available"], BLOCK_TORCH


@case("benchmark")
def bench_model_replaced_after_export(d):
    model_replaced_after_export(d)
    return ["--model", d / "m.onnx", "--iters", "1"], [f"model {d / 'm.onnx'} is not the file its sidecar"]


@case("benchmark")
def bench_model_truncated(d):
    truncate(d / "m.onnx", keep=0.3)
    return ["--model", d / "m.onnx", "--iters", "2"], [str(d / "m.onnx"), "not a valid ONNX model"], BLOCK_TORCH


@case("benchmark")
def bench_sidecar_labels_disagree(d):
    edit_sidecar(d, lambda m: m.update(labels=["cat", "dog"]))
    return ["--model", d / "m.onnx", "--iters", "2"], [str(d / "m.onnx"), "has 2 labels"], BLOCK_TORCH


@case("benchmark")
def bench_engine_batch_above_max(d):
    engine = engine_files(d, batch_max=8)
    return ["--model", engine, "--batch", "1", "16"], ["batch 16", str(engine), "largest, 8"], NO_TENSORRT


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2(name, src, tmp_path):
    script, prepare = CASES[name]
    d = tmp_path / "user"
    d.mkdir()
    for f in ("m.onnx", "m.onnx.json", "ok.png"):
        (d / f).write_bytes((src / f).read_bytes())
    args, needles, *prelude = prepare(d)
    before = snapshot(d)
    out = run_script(script, args, cwd=tmp_path, prelude=prelude[0] if prelude else None)
    line = assert_one_line_error(out, script, needles)
    assert snapshot(d) == before, "the user's files must be left as they were"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user"], "nothing written beside them"
    print(line)


def test_unusual_image_modes_classify_as_their_rgb_conversion(src, tmp_path):
    """Grayscale, grayscale + alpha, RGBA, palette, 1-bit and CMYK JPEG work, converted to RGB.

    Each gets a twin: the same file opened and converted to RGB by Pillow, saved as PNG
    (lossless); the script must give both the same probabilities, in a process without torch.
    """
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 56, 3)).astype(np.uint8))
    alpha = Image.fromarray(rng.integers(0, 256, (40, 56)).astype(np.uint8))
    rgba = rgb.copy()
    rgba.putalpha(alpha)
    files = {"gray.png": rgb.convert("L"), "gray_alpha.png": rgba.convert("LA"), "rgba.png": rgba,
             "palette.png": rgb.convert("P", palette=Image.ADAPTIVE, colors=16), "bilevel.png": rgb.convert("1"),
             "cmyk.jpg": rgb.convert("CMYK")}
    paths, twins = [], []
    for name, image in files.items():
        paths.append(tmp_path / name)
        image.save(paths[-1])
        with Image.open(paths[-1]) as reread:
            assert reread.mode == image.mode, name  # the file really holds the unusual mode
            twins.append(tmp_path / f"{name}.rgb.png")
            reread.convert("RGB").save(twins[-1])
    out = run_script("classify", ["--model", src / "m.onnx", "--top-k", "3", "--batch", "1", "--json", *paths, *twins],
                     cwd=tmp_path, prelude=BLOCK_TORCH)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["image"] for r in results] == [str(p) for p in paths + twins]
    probs = {r["image"]: sorted((t["index"], t["prob"]) for t in r["top"]) for r in results}
    spread = []
    for path, twin in zip(paths, twins):
        got, want = np.array(probs[str(path)]), np.array(probs[str(twin)])
        assert np.array_equal(got[:, 0], [0, 1, 2]) and abs(got[:, 1].sum() - 1.0) <= 1e-5
        assert np.abs(got - want).max() <= 1e-6, path.name
        spread.append(got[:, 1].max() - got[:, 1].min())
    assert min(spread) > 0.05, "probabilities must differ between classes for the comparison to mean much"
    # And the conversion matters: grayscale and RGBA give other answers than the RGB original.
    rgb.save(tmp_path / "rgb.png")
    base = run_script("classify", ["--model", src / "m.onnx", "--top-k", "3", "--json", tmp_path / "rgb.png"],
                      cwd=tmp_path)
    rgb_probs = np.array(sorted((t["index"], t["prob"]) for t in json.loads(base.stdout)["top"]))
    assert np.abs(np.array(probs[str(tmp_path / "gray.png")]) - rgb_probs).max() > 1e-4


def test_benchmark_with_no_warmup(src):
    out = run_script("benchmark", ["--model", src / "m.onnx", "--batch", "1", "3", "--iters", "2",
                                   "--warmup", "0", "--threads", "1", "--json"], cwd=src, prelude=BLOCK_TORCH)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    rows = json.loads(out.stdout)
    assert [r["batch"] for r in rows] == [1, 3] and all(r["iters"] == 2 for r in rows)
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in rows)


def _load_deploy(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}_errors", DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(DEPLOY))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DEPLOY))
    return module


def test_python_callers_get_deploy_error_not_exit(src, tmp_path):
    """``classify()`` and ``benchmark()`` raise DeployError (the scripts turn it into the line)."""
    classify = _load_deploy("classify")
    benchmark = _load_deploy("benchmark")
    with pytest.raises(classify.DeployError, match="top-k must be an integer >= 1, got 0"):
        classify.classify(src / "m.onnx", [src / "ok.png"], top_k=0)
    with pytest.raises(classify.DeployError, match="does not exist"):
        classify.classify(tmp_path / "m.onnx", [src / "ok.png"])
    with pytest.raises(Exception, match="iters must be an integer >= 1, got 0") as exc:
        benchmark.benchmark(src / "m.onnx", [1], iters=0)
    assert type(exc.value).__name__ == "DeployError"
