"""``edgetl export``: a run folder in, an ONNX file or TensorRT engine (plus sidecar JSON) out."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgetl.cli import COMMANDS
from edgetl.cli._common import HelpFormatter, given_path, positive_int
from edgetl.export import DEFAULT_MAX_BATCH, FORMATS, export_run


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help=COMMANDS["export"],
        description=(
            "Fold BatchNorm into the convs, export the run's model to ONNX with a dynamic batch "
            "axis, check it with onnx.checker and compare onnxruntime to PyTorch at batch 1 and 8. "
            "--format engine then builds a TensorRT engine (needs TensorRT and an NVIDIA GPU: run "
            "it on the Jetson). Labels and preprocessing go to a sidecar JSON beside each file. "
            "Every flag and output path is checked before any work; the files appear whole or not at all."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--run", dest="run_dir", required=True, metavar="DIR", help="a fine-tuning run folder (model.json + best.pt/last.pt)")
    p.add_argument("--format", default="onnx", help=f"one of: {', '.join(FORMATS)}")
    p.add_argument("--fp16", action="store_true", help="allow FP16 kernels in the TensorRT engine")
    p.add_argument("--batch", type=positive_int, default=None,
                   help=f"largest batch of the engine's optimization profile (--format engine only; "
                        f"default {DEFAULT_MAX_BATCH})")
    p.add_argument("--opset", type=positive_int, default=None,
                   help="ONNX opset (default: the exporter's); one outside what the installed exporter and "
                        "onnxruntime support is refused, never replaced by another")
    p.add_argument("--legacy-exporter", action="store_true",
                   help="use torch's legacy TorchScript exporter (opset <= 20) instead of the dynamo one")
    p.add_argument("-o", "--output", type=given_path, metavar="PATH",
                   help="output file (default: RUN/export/model.onnx or model.engine); new, or an earlier "
                        "export, never a file of the run or one edgetl did not make")
    p.set_defaults(run=run)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.2f} MB"


def run(args) -> int:
    result = export_run(
        args.run_dir,
        format=args.format,
        output=args.output,
        fp16=args.fp16,
        max_batch=args.batch,
        opset=args.opset,
        dynamo=not args.legacy_exporter,
    )
    print(f"ONNX     {result.onnx_path}  ({_size(result.onnx_bytes)}, opset {result.opset}, "
          f"{result.exporter} exporter, {result.export_seconds:.1f} s)")
    parity = ", ".join(f"batch {b}: {d:.2e}" for b, d in result.parity_max_abs_diff.items())
    print(f"parity   onnxruntime vs PyTorch max abs diff {parity} ({result.parity_images})")
    print(f"sidecar  {result.onnx_sidecar}")
    if result.engine_path is not None:
        batch = args.batch or DEFAULT_MAX_BATCH
        print(f"engine   {result.engine_path}  ({_size(result.engine_bytes)}, "
              f"{'fp16' if args.fp16 else 'fp32'}, batch 1..{batch}, {result.engine_seconds:.1f} s)")
        print(f"sidecar  {result.engine_sidecar}")
    target = result.engine_path or result.onnx_path
    deploy = Path(__file__).resolve().parents[2] / "deploy" / "classify.py"
    print(f"next: python {deploy if deploy.is_file() else 'deploy/classify.py'} --model {target} IMAGE...")
    return 0
