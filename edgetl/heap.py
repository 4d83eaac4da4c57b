"""The edgetl program's CPU heap policy: memory a training step frees is kept for the next step.

glibc's malloc serves a block of at least its mmap threshold (128 KiB at first, raised as such
blocks are freed, up to 32 MiB) with a mapping of its own, and unmaps it when it is freed;
free memory at the top of the heap past the trim threshold goes back to the kernel too. A
training step frees its activations and gradients at its end and asks for the same sizes again
in the next, so every step pays the kernel to map and zero those pages again. On CPU that is a
large share of a step: a lean Rep-Net step at 224 px, batch 8 took about 69,000 page faults and
333 ms when run step after step, 0 and 209 ms with freed memory kept
(``scripts/heap_policy.py``, benchmarks/heap_policy.json). The process's peak stayed within 2 %
(the same blocks, reused): it keeps its high-water mark between steps instead of giving it back
and taking it again. What it risks is the heap fragmenting: a loop that allocated, filled and
freed one 48 MB tensor while small objects landed in the freed space grew by seven such blocks
before it settled (docs/bench.md); no training step measured did.

So the program (``edgetl.cli.entry``) calls ``hold_freed_memory``, as it sets OpenMP's wait
policy, and the library never does at import. It sets glibc's mmap and trim thresholds to
``HOLD_BYTES`` with ``mallopt`` (where a glibc refuses so high an mmap threshold, mmap is
turned off for malloc instead: the same effect). It leaves the C library's default:

* off glibc (macOS, musl): there is nothing of this kind to set;
* where the user tuned glibc's malloc (a ``MALLOC_*_`` variable, or ``glibc.malloc`` in
  ``GLIBC_TUNABLES``): theirs is kept;
* on a Jetson, whose CPU memory is its GPU's: edgetl trains on the GPU there, and what the
  CPU side frees (a checkpoint once it is on the GPU) should go back to the shared pool.

``heap_policy()`` says which held in this process; the bench records it beside the threads.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

from edgetl.doctor import is_jetson

HOLD_BYTES = 1 << 30  # the mmap and trim thresholds set: past any single block a step asks for

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# glibc's environment variables for the same settings (read once, at the process's start)
USER_TUNING = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")

DEFAULT = "the C library's default"
_policy = DEFAULT


def glibc_version() -> str | None:
    """'2.36' where this process runs on glibc, else None."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not name or not name.startswith("glibc "):
        return None
    return name.split()[1]


def hold_freed_memory(environ: Mapping[str, str] = os.environ, root: str = "/") -> str:
    """Apply the policy (the module docstring) to this process; what now holds, as
    ``heap_policy()`` reports it. ``environ`` and ``root`` are for tests."""
    global _policy
    version = glibc_version()
    tuned = [name for name in USER_TUNING if name in environ]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        tuned.append("GLIBC_TUNABLES")
    if version is None:
        _policy = f"{DEFAULT} (not glibc)"
    elif tuned:
        _policy = f"{DEFAULT} (the user's {', '.join(tuned)} kept)"
    elif is_jetson(root):
        _policy = f"{DEFAULT} (a Jetson: the CPU's memory is the GPU's)"
    else:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        gib = f"{HOLD_BYTES >> 30} GiB"
        if mallopt(M_MMAP_THRESHOLD, HOLD_BYTES):
            how = f"mmap and trim thresholds {gib}"
        elif mallopt(M_MMAP_MAX, 0):
            how = f"mmap off, trim threshold {gib}"
        else:  # the trim threshold alone would fix the mmap threshold at its first 128 KiB: worse
            _policy = f"{DEFAULT} (glibc {version} refused the mmap settings)"
            return _policy
        mallopt(M_TRIM_THRESHOLD, HOLD_BYTES)  # glibc takes any trim threshold
        _policy = f"freed memory held (glibc {version}: {how})"
    return _policy


def heap_policy() -> str:
    """What holds in this process: ``hold_freed_memory``'s answer, or the C library's default
    where it was not called (a Python user's own process)."""
    return _policy
