"""Fused mask kernels (``LeanOptions.mask_kernels`` "fused"): a masked layer's activation mask
packed in the pass that clamps it, and unpacked into the gradient in the pass that multiplies it.

With torch's own ops a lean layer builds its ReLU6 mask in ten kernels forward (clamp, two
casts, two integer adds, an and, the fold and its copy: ``frozen._clamped_mask``,
``masks.pack_mask_``) and applies it in six backward (the unpack table's four, the gather,
the multiply: ``masks.unpack_as``); stock PyTorch's ReLU6 takes one each way. These two ops
(``csrc/masks.cpp``) take one each way and give the same values bit for bit:

    clamp_pack_(y, upper)   y clamped to [0, upper] in place, the packed mask of 0 < y < upper
                            (of y > 0 with upper None) returned
    mask_mul(g, packed, channels_last)
                            g times the unpacked mask, a new tensor laid out as the masked
                            output was

They also allocate less: no byte-per-element masks forward, no row indices or table backward,
so a fused step's peak is at most the aten step's (the accounting measures it through the
ops' meta kernels, as it measures every other op).

The kernels are compiled on first use with the C++ compiler torch's own extensions use
(``torch.utils.cpp_extension``; g++ on Linux), into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), a few seconds once per
source version. They have CPU and meta kernels (float32, bf16 and fp16 run AVX2 where the CPU
has it; other CPUs, a Jetson's Arm cores among them, a portable loop) and CUDA kernels
(``csrc/masks_cuda.cu``), built with the CPU ones into a second library where the CUDA toolkit's
nvcc is found: for a network on a GPU (``prepare``), refused in one line elsewhere. The CUDA
kernels compile here but have not yet run on a GPU; tests/test_fused_masks.py checks them
against torch's path where there is one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from edgetl.errors import CapabilityError

SOURCE = Path(__file__).with_name("csrc") / "masks.cpp"
_LOCK = threading.Lock()
_LOADED: set[str] = set()  # the op namespaces loaded


def compiler() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would build with here (``CXX``, else c++),
    None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def ninja() -> str | None:
    """The ninja ``torch.utils.cpp_extension`` builds with (looked up on PATH), None where there is none."""
    return shutil.which("ninja")


def missing() -> str | None:
    """What building the kernels needs and lacks here, in words; None where nothing is missing."""
    if compiler() is None:
        return "a C++ compiler (CXX, else c++)"
    if ninja() is None:
        return "ninja"
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools (torch's extension builder imports it)"
    return None


def buildable() -> bool:
    """Whether the kernels can be built here: a C++ compiler, ninja and setuptools."""
    return missing() is None


@contextlib.contextmanager
def _quiet_cpp_extension():
    """``torch.utils.cpp_extension``'s log held to errors: it warns at import where it finds no CUDA
    toolkit, irrelevant to the CPU kernels."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def cuda_home() -> str | None:
    """The CUDA toolkit ``torch.utils.cpp_extension`` would build the CUDA kernels with (its nvcc
    present), None where there is none."""
    with _quiet_cpp_extension():
        from torch.utils.cpp_extension import CUDA_HOME
    if not CUDA_HOME:
        return None
    home = Path(CUDA_HOME)  # a whole toolkit: nvcc, its runtime's header and library to link
    complete = ((home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime_api.h").exists()
                and any((home / lib / "libcudart.so").exists() for lib in ("lib64", "lib")))
    return CUDA_HOME if complete else None


_CUDA_SOURCE = SOURCE.with_name("masks_cuda.cu")
# op namespace -> (extension name, sources, C++ flags, nvcc flags): the CPU build every CPU run
# uses; the portable loop alone (what an Arm CPU runs), which the tests check on x86-64 as well;
# and the CPU build with the CUDA kernels, for a network on a GPU
BUILDS = {
    "edgetl": ("edgetl_masks", (SOURCE,), (), None),
    "edgetl_portable": ("edgetl_masks_portable", (SOURCE,), ("-DEDGETL_PORTABLE", "-DEDGETL_OPS=edgetl_portable"),
                        None),
    "edgetl_cuda": ("edgetl_masks_cuda", (SOURCE, _CUDA_SOURCE), ("-DEDGETL_OPS=edgetl_cuda",),
                    ("-O3", "-DEDGETL_OPS=edgetl_cuda")),
}


def load(namespace: str = "edgetl") -> None:
    """Compile (once per source version) and load the fused kernels into ``torch.ops.<namespace>``;
    a machine without a working compiler gets one CapabilityError line."""
    if namespace in _LOADED:
        return
    with _LOCK:
        if namespace in _LOADED:
            return
        if not hasattr(getattr(torch.ops, namespace), "clamp_pack_"):  # not loaded by another copy of this module
            _compile(*BUILDS[namespace])
        _LOADED.add(namespace)


def _compile(name: str, sources, flags, cuda_flags) -> None:
    try:
        with _quiet_cpp_extension():
            from torch.utils.cpp_extension import load as compile_and_load

            compile_and_load(name=name, sources=[str(s) for s in sources], extra_cflags=["-O3", *flags],
                             extra_cuda_cflags=list(cuda_flags or ()),
                             extra_include_paths=_wheel_headers(cuda_flags), is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or header is the user's machine
        lines = [line for line in str(exc).splitlines() if line.strip()]
        # the compiler's or the linker's own complaint where there is one, else the first line
        first = next((line for line in lines if ("error" in line.lower() or "cannot find" in line)
                      and "building extension" not in line.lower() and "collect2" not in line),
                     lines[0] if lines else type(exc).__name__)
        needs = ("a C++ compiler (g++), ninja, setuptools and the CUDA toolkit (nvcc)" if cuda_flags
                 else "a C++ compiler (g++), ninja and setuptools")
        raise CapabilityError(f"mask_kernels fused: compiling {', '.join(s.name for s in sources)} failed "
                              f"({first.strip()[:160]}); install {needs}, or use mask_kernels aten") from None


def _wheel_headers(cuda_flags) -> list[str]:
    """For a CUDA build: the headers of the CUDA libraries torch's wheels install
    (``site-packages/nvidia/*/include``: cuSPARSE, cuBLAS... that ATen's CUDA headers include),
    where a toolkit's own are incomplete."""
    if not cuda_flags:
        return []
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(str(p) for root in roots for p in Path(root).glob("*/include") if p.is_dir())


def check_device(device: torch.device | str) -> None:
    """Refuse, in one line, a device the fused kernels have no kernel for: they run on CPU, on
    CUDA where the CUDA toolkit can build them, and on meta (the accounting)."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise CapabilityError("mask_kernels fused on cuda: torch sees no CUDA device to build its kernels for")
    if kind == "cuda" and cuda_home() is None:
        raise CapabilityError("mask_kernels fused on cuda needs the CUDA toolkit (nvcc, cuda_runtime_api.h, "
                              "libcudart.so) to build its kernels, and none was found (set CUDA_HOME to one); "
                              "install it, or use mask_kernels aten")
    if kind not in ("cpu", "meta", "cuda"):
        raise CapabilityError(f"mask_kernels fused runs on CPU and CUDA; the network is on {kind} "
                              f"(allowed there: mask_kernels aten)")


def prepare(device: torch.device | str) -> None:
    """Check ``device`` (``check_device``) and load the builds a network there runs: the CPU one
    (its meta kernels serve the accounting on every device), and on CUDA the CUDA one."""
    check_device(device)
    load("edgetl")
    if torch.device(device).type == "cuda":
        load("edgetl_cuda")


def fusable(t: torch.Tensor) -> bool:
    """Whether the fused ops give torch's path's bytes for this activation: fp32, bf16 or fp16
    (what the lean runtime computes in), laid out contiguous or channels-last (its memory order is
    then the order ``masks.memory_flat`` packs in). A layer set to ``fused`` runs torch's ops on
    any other tensor (a permuted or sliced input to a ``LeanReLU``; float64, which the lean runtime
    does not compute in): the same results, as torch's ops give them."""
    return t.dtype in _DTYPES and (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(
        memory_format=torch.channels_last)))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ops(t: torch.Tensor):
    """The op namespace for ``t``'s device, built and loaded on first use (a network set to fused
    and moved or unpickled since: checked here, in one line)."""
    namespace = "edgetl_cuda" if t.is_cuda else "edgetl"
    if namespace not in _LOADED:
        prepare(t.device)
    return getattr(torch.ops, namespace)


def clamp_pack_(y: torch.Tensor, upper: float | None) -> torch.Tensor:
    """``y`` clamped to [0, upper] in place (``upper`` None: ReLU); returns the packed mask of
    the clamped values strictly inside (``frozen._act_mask``'s bytes)."""
    return _ops(y).clamp_pack_(y, upper)


def mask_mul(g: torch.Tensor, packed: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``unpack_as(packed, g.shape, table, channels_last).mul_(g)`` in one kernel: a new tensor
    laid out channels-last or plain as the masked output was."""
    return _ops(g).mask_mul(g, packed, channels_last)

