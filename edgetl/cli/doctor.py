"""``edgetl doctor``: platform facts and a suggested memory budget, as text or JSON."""

from __future__ import annotations

import dataclasses
import json

from edgetl.cli import COMMANDS
from edgetl.doctor import MB, doctor, libraries_capped
from edgetl.heap import heap_policy


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help=COMMANDS["doctor"],
        description=(
            "Report what this machine offers for fine-tuning: Jetson model and L4T release, "
            "library versions, GPU (integrated or not), available memory (/proc/meminfo "
            "MemAvailable) and a suggested --budget. MB = 10^6 bytes."
        ),
    )
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.add_argument("--no-gpu", action="store_true", help="do not initialise CUDA to read GPU properties")
    p.set_defaults(run=run)


def _mb(n_bytes: int | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / MB:.0f} MB"


def _kernels(report) -> str | None:
    """The instructions ATen's CPU kernels use, and the caps set on oneDNN's, MKL's or ATen's."""
    if report.cpu_capability is None:
        return None
    caps = [f"{k}={v}" for k, v in report.kernel_caps.items()]
    if not libraries_capped(report.kernel_caps):
        caps.append("oneDNN and MKL uncapped")
    return f"{report.cpu_capability} (ATen); {', '.join(caps)}"


def _compiler(report) -> str:
    """The compiler and ninja that build --mask-kernels fused, or what is missing for it (either
    of them, or what else ``fused.missing`` names: setuptools)."""
    if report.cxx and report.ninja and report.fused_missing is None:
        return f"{report.cxx}, ninja {report.ninja} (build --mask-kernels fused)"
    tools = " and ".join(name for name, path in (("C++ compiler", report.cxx), ("ninja", report.ninja)) if not path)
    return f"{report.cxx or 'none'}; no {tools or report.fused_missing}: --mask-kernels fused is refused"


def run(args) -> int:
    report = dataclasses.replace(doctor(probe_gpu=not args.no_gpu), heap=heap_policy())
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    na = "-"
    rows = [
        ("machine", f"{report.machine}, Python {report.python}"),
        ("Jetson", f"yes: {report.jetson_model or 'unknown model'}" if report.is_jetson else "no"),
        ("L4T release", report.l4t_release and f"{report.l4t_release} (JetPack {report.jetpack or '?'})"),
        ("torch", report.torch and f"{report.torch} (CUDA {report.torch_cuda or 'none'})"),
        ("CUDA available", "yes" if report.cuda_available else "no"),
        ("cuDNN", report.cudnn),
        ("GPU", report.gpu_name and f"{report.gpu_name}, sm_{(report.gpu_capability or '').replace('.', '')}"),
        ("GPU integrated", None if report.gpu_is_integrated is None else ("yes" if report.gpu_is_integrated else "no")),
        ("TensorRT", report.tensorrt),
        ("onnx", report.onnx),
        ("onnxruntime", report.onnxruntime),
        ("memory total", _mb(report.mem_total_bytes)),
        ("memory available", _mb(report.mem_available_bytes)),
        ("suggested --budget", _mb(report.suggested_budget_bytes)),
        ("CPU heap", report.heap),
        ("CPU kernels", _kernels(report)),
        ("C++ compiler", _compiler(report)),
    ]
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        print(f"{name:<{width}}{value or na}")
    for note in report.notes:
        print(f"note: {note}")
    return 0
