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
source version. They have CPU and meta kernels: a CUDA network refuses ``fused`` (the aten
path there; a CUDA graph folds its launches). float32 runs AVX2 where the CPU has it; bf16,
fp16 and other CPUs (a Jetson's Arm cores) run a portable loop.
"""

from __future__ import annotations

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


def buildable() -> bool:
    """Whether the kernels can be built here: a C++ compiler, and ninja, which
    ``torch.utils.cpp_extension`` builds with (looked up on PATH)."""
    return compiler() is not None and shutil.which("ninja") is not None


# op namespace -> (extension name, extra compiler flags): the build every run uses, and the
# portable loop alone (what an Arm CPU runs), which the tests check on x86-64 as well
BUILDS = {"edgetl": ("edgetl_masks", ()),
          "edgetl_portable": ("edgetl_masks_portable", ("-DEDGETL_PORTABLE", "-DEDGETL_OPS=edgetl_portable"))}


def load(namespace: str = "edgetl") -> None:
    """Compile (once per source version) and load the fused kernels into ``torch.ops.<namespace>``;
    a machine without a working compiler gets one CapabilityError line."""
    if namespace in _LOADED:
        return
    with _LOCK:
        if namespace in _LOADED:
            return
        name, flags = BUILDS[namespace]
        if not hasattr(getattr(torch.ops, namespace), "clamp_pack_"):  # not loaded by another copy of this module
            _compile(name, flags)
        _LOADED.add(namespace)


def _compile(name: str, flags) -> None:
    # the cpp_extension module logs a warning at import where no CUDA toolkit is found:
    # irrelevant to CPU kernels
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load as compile_and_load

        compile_and_load(name=name, sources=[str(SOURCE)], extra_cflags=["-O3", *flags],
                         is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or header is the user's machine
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise CapabilityError(f"mask_kernels fused: compiling {SOURCE.name} failed ({first.strip()[:160]}); "
                              "install a C++ compiler (g++) and ninja, or use mask_kernels aten") from None
    finally:
        quiet.setLevel(level)


def check_device(device: torch.device | str) -> None:
    """Refuse, in one line, a device the fused kernels have no kernel for (they run on CPU,
    and on meta for the accounting)."""
    kind = torch.device(device).type
    if kind not in ("cpu", "meta"):
        raise CapabilityError(f"mask_kernels fused runs on CPU; the network is on {kind} "
                              f"(allowed there: mask_kernels aten)")


def clamp_pack_(y: torch.Tensor, upper: float | None) -> torch.Tensor:
    """``y`` clamped to [0, upper] in place (``upper`` None: ReLU); returns the packed mask of
    the clamped values strictly inside (``frozen._act_mask``'s bytes)."""
    return torch.ops.edgetl.clamp_pack_(y, upper)


def mask_mul(g: torch.Tensor, packed: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``unpack_as(packed, g.shape, table, channels_last).mul_(g)`` in one kernel: a new tensor
    laid out channels-last or plain as the masked output was."""
    return torch.ops.edgetl.mask_mul(g, packed, channels_last)

