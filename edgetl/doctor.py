"""Doctor: the machine in, platform facts (Jetson, L4T, library versions, GPU, memory, a budget) out.

Memory on a Jetson is shared by CPU and GPU, so ``torch.cuda.mem_get_info`` is wrong
there (DESIGN 2c): the available memory is ``MemAvailable`` of /proc/meminfo, and the
CUDA context (about 300 MB) comes out of the same pool.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from edgetl.units import MB

log = logging.getLogger(__name__)

# CUDA context size measured on Jetson Orin with torch (DESIGN 2c); it shares the memory pool.
CUDA_CONTEXT_BYTES = 300 * MB
# Keep this share of MemAvailable free for the OS, the data loader and page cache churn.
BUDGET_HEADROOM = 0.25
# Variables that cap the instructions a CPU's kernels use: oneDNN's (convolutions), MKL's (matrix
# products), ATen's own. Kernels for other instructions sum in another order, so training on an
# AVX-512 host and on an AVX2 one differs in the last bits; the demo on an AVX-512 EPYC gave
# the AVX2 report's every figure with the first two set to AVX2 (docs/pipeline.md).
LIBRARY_CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
KERNEL_CAPS = (*LIBRARY_CAPS, "ATEN_CPU_CAPABILITY")
# L4T release -> JetPack release (NVIDIA's Jetson Linux release notes).
JETPACK_BY_L4T = {
    "36.2.0": "6.0 DP", "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1",
    "35.4.1": "5.1.2", "35.5.0": "5.1.3", "35.6.0": "5.1.4",
}


@dataclass
class DoctorReport:
    """Platform facts; None where a fact does not apply or cannot be read."""

    machine: str
    python: str
    is_jetson: bool
    jetson_model: str | None
    l4t_release: str | None
    jetpack: str | None
    torch: str | None
    torch_cuda: str | None
    cuda_available: bool
    cudnn: str | None
    gpu_name: str | None
    gpu_is_integrated: bool | None
    gpu_capability: str | None
    tensorrt: str | None
    onnx: str | None
    onnxruntime: str | None
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    suggested_budget_bytes: int | None
    # the CPU heap policy of the process asking (``edgetl.heap``; the command fills it in: the
    # edgetl program holds freed memory, a library caller's process has the C library's default)
    heap: str | None = None
    # the vector instructions ATen's CPU kernels use here (torch.backends.cpu.get_cpu_capability),
    # and the caps set on the CPU kernels (``KERNEL_CAPS``: variable -> value, the ones set)
    cpu_capability: str | None = None
    kernel_caps: dict[str, str] = field(default_factory=dict)
    # the C++ compiler and the ninja that build the fused mask kernels here (``edgetl.models.lean.fused``)
    cxx: str | None = None
    ninja: str | None = None
    # what building them lacks here (``fused.missing``: a compiler, ninja or setuptools), None: nothing
    fused_missing: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes per key (the file's values are kiB)."""
    values = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return values
    for line in text.splitlines():
        match = re.match(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+kB)?$", line.strip())
        if match:
            values[match.group(1)] = int(match.group(2)) * (1024 if line.strip().endswith("kB") else 1)
    return values


def parse_l4t_release(text: str) -> str | None:
    """'# R36 (release), REVISION: 4.0, ...' -> '36.4.0'."""
    match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    if not match:
        return None
    return f"{match.group(1)}.{match.group(2)}"


def suggested_budget(mem_available_bytes: int | None, integrated_gpu: bool) -> int | None:
    """A memory budget that leaves headroom: 75 % of MemAvailable, less the CUDA context on shared memory."""
    if mem_available_bytes is None:
        return None
    budget = int(mem_available_bytes * (1 - BUDGET_HEADROOM))
    if integrated_gpu:
        budget -= CUDA_CONTEXT_BYTES
    return max(budget, 0) // MB * MB


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # a broken install raises more than ImportError (e.g. missing libnvinfer)
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "replace").rstrip("\x00\n ")
    except OSError:
        return None


def _jetson_files(root: Path) -> tuple[str | None, str | None]:
    """The device-tree model and L4T's release file under ``root`` (None where absent)."""
    return _read(root / "proc/device-tree/model"), _read(root / "etc/nv_tegra_release")


def _names_a_jetson(model: str | None, tegra: str | None) -> bool:
    return tegra is not None or (model is not None and "jetson" in model.lower())


def is_jetson(root: str | Path = "/") -> bool:
    """Whether the machine under ``root`` is a Jetson: L4T's release file, or a device-tree model
    naming one (a container that does not mount the release file still sees /proc)."""
    return _names_a_jetson(*_jetson_files(Path(root)))


def kernel_caps(environ=os.environ) -> dict[str, str]:
    """The caps on the CPU kernels' instructions set in ``environ`` (``KERNEL_CAPS``)."""
    return {name: environ[name] for name in KERNEL_CAPS if environ.get(name)}


def libraries_capped(caps: dict[str, str]) -> bool:
    """Whether ``caps`` (``kernel_caps``) cap oneDNN's or MKL's kernels (``LIBRARY_CAPS``): ATen's
    own cap alone leaves theirs as they are."""
    return bool(set(caps) & set(LIBRARY_CAPS))


def doctor(root: str | Path = "/", probe_gpu: bool = True) -> DoctorReport:
    """Collect platform facts.

    Args:
        root: filesystem root to read /etc and /proc from (tests point it at a fake tree).
        probe_gpu: initialise CUDA through torch to read the GPU's properties.
    """
    root = Path(root)
    notes: list[str] = []
    model, tegra = _jetson_files(root)
    l4t = parse_l4t_release(tegra) if tegra else None
    jetson = _names_a_jetson(model, tegra)

    torch_version = torch_cuda = cudnn = gpu_name = capability = cpu_capability = cxx = ninja = fused_missing = None
    caps = kernel_caps()
    cuda_available, integrated = False, None
    try:
        import torch
    except ImportError:
        notes.append("torch is not installed: fine-tuning needs it")
    else:
        from edgetl.models.lean.fused import compiler, missing, ninja as find_ninja

        torch_version, torch_cuda = torch.__version__, torch.version.cuda
        cpu_capability = torch.backends.cpu.get_cpu_capability()
        cxx, ninja, fused_missing = compiler(), find_ninja(), missing()
        if cpu_capability.startswith("AVX512") and not libraries_capped(caps):
            notes.append("the CPU kernels use AVX-512 here: training rounds otherwise than on an AVX2-only "
                         "host; ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 reproduces such a host's "
                         "figures (docs/pipeline.md)")
        if torch.backends.cudnn.is_available():
            cudnn_int = torch.backends.cudnn.version()
            # cuDNN 9 encodes 9.3.0 as 90300, cuDNN 8 encodes 8.9.7 as 8907.
            if cudnn_int and cudnn_int >= 90000:
                cudnn = f"{cudnn_int // 10000}.{cudnn_int // 100 % 100}.{cudnn_int % 100}"
            elif cudnn_int:
                cudnn = f"{cudnn_int // 1000}.{cudnn_int // 100 % 10}.{cudnn_int % 100}"
        if probe_gpu:
            cuda_available = torch.cuda.is_available()
            if cuda_available:
                props = torch.cuda.get_device_properties(0)
                gpu_name, integrated = props.name, bool(props.is_integrated)
                capability = f"{props.major}.{props.minor}"
        if jetson and torch_cuda is None:
            notes.append("this torch build has no CUDA: install NVIDIA's JetPack wheel (see docker/README.md)")
        elif jetson and not cuda_available and probe_gpu:
            notes.append("CUDA is not available: in a container, run with --runtime nvidia")
    if integrated is None and jetson:
        integrated = True  # every Jetson GPU shares memory with the CPU

    mem = read_meminfo(root / "proc/meminfo")
    total, available = mem.get("MemTotal"), mem.get("MemAvailable")
    if available is None:
        notes.append("cannot read MemAvailable from /proc/meminfo")
    budget = suggested_budget(available, bool(integrated))
    if integrated and available is not None:
        notes.append("GPU memory is shared with the CPU: torch.cuda.mem_get_info does not show what is free")

    return DoctorReport(
        machine=platform.machine(),
        python=platform.python_version(),
        is_jetson=jetson,
        jetson_model=model,
        l4t_release=l4t,
        jetpack=JETPACK_BY_L4T.get(l4t) if l4t else None,
        torch=torch_version,
        torch_cuda=torch_cuda,
        cuda_available=cuda_available,
        cudnn=cudnn,
        gpu_name=gpu_name,
        gpu_is_integrated=integrated,
        gpu_capability=capability,
        tensorrt=_version("tensorrt"),
        onnx=_version("onnx"),
        onnxruntime=_version("onnxruntime"),
        mem_total_bytes=total,
        mem_available_bytes=available,
        suggested_budget_bytes=budget,
        cpu_capability=cpu_capability,
        kernel_caps=caps,
        cxx=cxx,
        ninja=ninja,
        fused_missing=fused_missing,
        notes=notes,
    )
