"""CUDA memory terms (DESIGN 2d): tensor sizes or an alloc/free trace in, what PyTorch's caching allocator reports out.

Pure functions and a small model of ``c10/cuda/CUDACachingAllocator.cpp`` (its constants
and its default policy: best fit, split, merge on free, segments never given back):

* every block is rounded up to 512 B (``kMinBlockSize``); ``max_memory_allocated`` counts
  the rounded block, and a large-pool block that is not split (the rest would be 1 MiB or
  less) counts whole;
* blocks up to 1 MiB come from the small pool, carved out of 2 MiB segments; larger ones
  from the large pool: a request under 10 MiB opens a 20 MiB segment, a larger one a
  segment rounded up to 2 MiB; freed blocks stay cached, so ``max_memory_reserved`` (what
  the device loses) is the high-water mark of segments, fragmentation included;
* with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` each pool is one segment that
  grows by pages (2 MiB small, 20 MiB large), any block may be split, and reserved memory
  is the mapped pages.

How edgetl answers for ``device=cuda`` (issue #15):

* allocation rounding and the allocator's packing are *replayed*: a training step's
  storage trace (``edgetl.memory.meter.measure_training_memory(record_trace=True)``, one
  real step on the CPU or on the device) is fed to :class:`CachingAllocatorModel`, which
  gives the allocated and reserved peaks the device would report. ``reserved / allocated``
  of that replay is the *measured allocator slack* a CUDA plan uses in place of an assumed
  percentage (``allocator_slack``).
* cuBLAS keeps one workspace per handle and stream through the same allocator, from the
  first matrix product on, for the life of the process: 32 MiB on sm90 (H100/H200),
  8 MiB + 128 KiB elsewhere (the Jetson Orin's sm87), or what ``CUBLAS_WORKSPACE_CONFIG``
  says (``cublas_workspace_bytes``). PyTorch gives each thread its own handle, and on CUDA
  autograd runs backward on its own device thread: a training step holds *two* workspaces,
  the calling thread's (forward, optimizer) and the engine's (backward). An ``addmm`` with a
  bias (a ``Linear`` on a batch of more than one) goes through cuBLASLt, which keeps a
  workspace of its own per handle and stream: 1 MiB, or ``TORCH_CUBLASLT_WORKSPACE_SIZE``
  KiB (``cublaslt_workspace_bytes``). Measured on an H100 with torch 2.11
  (``benchmarks/cuda_h100_*``): the calling thread's first matrix product +32 MiB, its first
  biased addmm +1 MiB more, the first backward matrix product +32 MiB, a matrix product on
  another thread or stream +32 MiB each. The replay inserts each workspace at its thread's
  first such op (the storage trace marks the ops autograd's engine ran, and biased gemms);
  ``step_workspace_bytes`` is the sum for a step without a trace.
* cuDNN convolution workspaces (the lean runtime's ``conv2d_input``/``conv2d_weight`` go
  through cuDNN too) depend on the algorithm cuDNN's heuristics pick per shape, GPU and
  cuDNN version: edgetl does not guess them. They are *measured* on the device: the CUDA
  meter reports the allocated peak beside the replay of the same step's trace, and the
  difference (``CudaMemory.unexplained_bytes``) is what the libraries took inside kernels;
  a caller may pass measured per-step figures back as ``conv_workspace_bytes``.
* ``expandable_segments:True``: edgetl neither sets it (a library never changes the
  environment, STYLE; and it must be set before CUDA starts) nor, yet, recommends it: the
  model's replay of one 224 px step at batch 8 for a Jetson (sm87) gives mixed results
  (paper configuration: reserved 88.1 -> 86.0 MB; lean fp32: 121.6 -> 130.0 MB), it is
  untried on a Jetson (it needs CUDA's virtual memory management), and the GPU check
  (scripts/gpu_check.py) measures both ways. The replay assumes memory to spare: a device
  that runs short frees cached segments and retries before failing, so reserved-on-a-roomy
  device is an upper figure of what a step needs, allocated a lower one.

The CUDA context (about 300 MB on a Jetson) is outside all of this (``edgetl doctor``).
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Iterable

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool block (1 MiB)
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment (2 MiB)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: below this a large request opens a LARGE_BUFFER
LARGE_BUFFER = 20 << 20  # kLargeBuffer: 20 MiB segment for requests of 1-10 MiB
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are rounded up to 2 MiB
# expandable segments map physical memory in pages of these sizes per pool
SMALL_PAGE = SMALL_BUFFER
LARGE_PAGE = LARGE_BUFFER
# cuBLAS workspace defaults (aten/src/ATen/cuda/CublasHandlePool.cpp)
CUBLAS_WORKSPACE_SM90 = 4096 * 1024 * 8
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WORKSPACE_DEFAULT = 1024 * 1024  # TORCH_CUBLASLT_WORKSPACE_SIZE's default (1024 KiB)
JETSON_ORIN = (8, 7)  # compute capability of the Orin Nano / NX / AGX (sm87)
MATMUL_OPS = frozenset({"addmm", "mm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation",
                        "addmv", "mv", "dot"})


def round_block(nbytes: int) -> int:
    """The block the allocator hands out for a request of ``nbytes`` (0 B allocates nothing)."""
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes}")
    if nbytes == 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def is_small(block_bytes: int) -> bool:
    """Whether a (rounded) block comes from the small pool."""
    return block_bytes <= SMALL_SIZE


def segment_bytes(block_bytes: int) -> int:
    """Size of the segment (one cudaMalloc) opened when no cached block fits ``block_bytes``."""
    if block_bytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if block_bytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block_bytes // ROUND_LARGE) * ROUND_LARGE


def should_split(free_bytes: int, block_bytes: int, *, expandable: bool = False) -> bool:
    """Whether a free block of ``free_bytes`` is split to serve ``block_bytes``.

    Small pool (and any pool with expandable segments): when at least 512 B remain. Large
    pool: only when more than 1 MiB remains, else the whole block is handed out (and counted
    as allocated).
    """
    remaining = free_bytes - block_bytes
    if is_small(block_bytes) or expandable:
        return remaining >= MIN_BLOCK
    return remaining > SMALL_SIZE


def rounding_bytes(sizes: Iterable[int]) -> int:
    """Bytes the 512-B rounding adds to tensors of these sizes, if all were live at once."""
    return sum(round_block(s) - s for s in sizes)


def cublas_workspace_bytes(capability: tuple[int, int], env: dict[str, str] | None = None) -> int:
    """The cuBLAS workspace one handle and stream keep for the life of the process.

    Args:
        capability: the GPU's compute capability, e.g. (8, 7) for Jetson Orin, (9, 0) for H100.
        env: environment to read ``CUBLAS_WORKSPACE_CONFIG`` from (default ``os.environ``);
            ``:SIZE_KiB:COUNT`` pairs, summed.
    """
    env = os.environ if env is None else env
    default = CUBLAS_WORKSPACE_SM90 if tuple(capability) == (9, 0) else CUBLAS_WORKSPACE_DEFAULT
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(env: dict[str, str] | None = None) -> int:
    """The cuBLASLt workspace one handle and stream keep once a biased ``addmm`` ran.

    Args:
        env: environment to read ``TORCH_CUBLASLT_WORKSPACE_SIZE`` (KiB) from (default
            ``os.environ``).
    """
    env = os.environ if env is None else env
    size = (env.get("TORCH_CUBLASLT_WORKSPACE_SIZE") or "").strip()
    return int(size) * 1024 if size.isdigit() else CUBLASLT_WORKSPACE_DEFAULT


def step_workspace_bytes(capability: tuple[int, int], env: dict[str, str] | None = None) -> int:
    """The library workspaces an edgetl training step on CUDA holds, without a trace to say.

    Every edgetl network trains a ``Linear`` classifier: its forward is a biased ``addmm``
    on the calling thread (a cuBLAS and a cuBLASLt workspace) and its weight gradient a
    matrix product on autograd's device thread (a second cuBLAS workspace). At batch 1 the
    addmm takes plain cuBLAS (no cuBLASLt workspace); a trace's replay knows that.
    """
    return 2 * cublas_workspace_bytes(capability, env) + cublaslt_workspace_bytes(env)


def expandable_segments_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) turns expandable segments on."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


# ----------------------------------------------------------------------------- the allocator model


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self) -> tuple[int, int, int]:  # best fit: smallest size, then lowest address
        return (self.size, self.segment, self.offset)


@dataclass
class AllocatorPeaks:
    """What the allocator's statistics would say after a replay (bytes)."""

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    requested_peak_bytes: int  # sum of the sizes asked for (no rounding), at its own peak
    segments: int
    expandable: bool

    @property
    def slack(self) -> float:
        """reserved / allocated: the allocator slack a plan applies on CUDA."""
        return self.reserved_peak_bytes / self.allocated_peak_bytes if self.allocated_peak_bytes else 1.0


class CachingAllocatorModel:
    """One device, one stream: PyTorch's caching allocator with its default settings.

    ``malloc(key, nbytes)`` and ``free(key)``; ``allocated``/``reserved`` and their peaks
    follow the allocator's ``allocated_bytes``/``reserved_bytes`` statistics. Segment
    addresses are unknown: ties in best fit go to the older segment, then the lower offset.
    Not modelled: ``max_split_size_mb``, ``roundup_power2_divisions``, garbage collection
    thresholds, several streams, giving segments back (``empty_cache``, or on OOM).
    """

    def __init__(self, *, expandable: bool = False) -> None:
        self.expandable = expandable
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # per pool, sorted keys
        self._by_key: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[object, tuple[_Block | None, int]] = {}  # key -> (block, requested bytes)
        self._segments: list[int] = []  # bytes per segment (expandable: mapped bytes)
        self._pool_segment: dict[bool, int] = {}  # expandable: pool -> its one segment
        self._tail: dict[int, _Block] = {}  # expandable: segment -> its last block
        self.allocated = self.reserved = self.requested = 0
        self.allocated_peak = self.reserved_peak = self.requested_peak = 0

    def _insert(self, b: _Block) -> None:
        k = b.key()
        bisect.insort(self._free[b.small], k)
        self._by_key[k] = b

    def _remove(self, b: _Block) -> None:
        k = b.key()
        lst = self._free[b.small]
        del lst[bisect.bisect_left(lst, k)]
        del self._by_key[k]

    def _new_segment(self, size: int, small: bool) -> _Block:
        self._segments.append(size)
        self.reserved += size
        return _Block(len(self._segments) - 1, 0, size, small)

    def _expand(self, small: bool, size: int) -> _Block:
        """Expandable segments: map pages at the pool segment's end until a free block of ``size`` ends it."""
        page = SMALL_PAGE if small else LARGE_PAGE
        seg = self._pool_segment.get(small)
        if seg is None:
            self._segments.append(0)
            seg = self._pool_segment[small] = len(self._segments) - 1
        tail = self._tail.get(seg)
        have = tail.size if tail is not None and tail.free else 0
        grow = -(-(size - have) // page) * page
        self._segments[seg] += grow
        self.reserved += grow
        if tail is not None and tail.free:
            self._remove(tail)
            tail.size += grow
            return tail
        b = _Block(seg, 0 if tail is None else tail.offset + tail.size, grow, small, prev=tail)
        if tail is not None:
            tail.next = b
        self._tail[seg] = b
        return b

    def malloc(self, key: object, nbytes: int) -> None:
        if key in self._live:
            raise ValueError(f"{key!r} allocated twice")
        size = round_block(nbytes)
        if size == 0:
            self._live[key] = (None, 0)
            return
        small = is_small(size)
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1, -1))
        if i < len(lst):
            block = self._by_key[lst[i]]
            self._remove(block)
        elif self.expandable:
            block = self._expand(small, size)
        else:
            block = self._new_segment(segment_bytes(size), small)
        if should_split(block.size, size, expandable=self.expandable):
            rest = _Block(block.segment, block.offset + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            if self._tail.get(block.segment) is block:
                self._tail[block.segment] = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.free = False
        self._live[key] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.requested_peak = max(self.requested_peak, self.requested)

    def free(self, key: object) -> None:
        block, nbytes = self._live.pop(key)
        if block is None:
            return
        self.allocated -= block.size
        self.requested -= nbytes
        block.free = True
        prev, nxt = block.prev, block.next
        if nxt is not None and nxt.free:  # merge with free neighbours of the same segment
            self._remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            if self._tail.get(block.segment) is nxt:
                self._tail[block.segment] = block
        if prev is not None and prev.free:
            self._remove(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            if self._tail.get(block.segment) is block:
                self._tail[block.segment] = prev
            block = prev
        self._insert(block)

    def empty_cache(self) -> None:
        """As ``torch.cuda.empty_cache``: every segment with no live block is given back (a
        segment holding any live block stays whole). Not modelled with expandable segments,
        which unmap free pages inside a segment."""
        if self.expandable:
            raise ValueError("empty_cache is not modelled with expandable segments")
        for small in (True, False):
            for k in [k for k in self._free[small] if k[1] >= 0]:
                b = self._by_key[k]
                if b.prev is None and b.next is None:  # the whole segment, free
                    self._remove(b)
                    self.reserved -= self._segments[b.segment]
                    self._segments[b.segment] = 0

    @property
    def live_blocks(self) -> int:
        return sum(1 for b, _ in self._live.values() if b is not None)

    def reset_peaks(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats``: peaks restart at the current values."""
        self.allocated_peak, self.reserved_peak, self.requested_peak = self.allocated, self.reserved, self.requested

    def peaks(self) -> AllocatorPeaks:
        return AllocatorPeaks(self.allocated_peak, self.reserved_peak, self.requested_peak,
                              sum(1 for n in self._segments if n), self.expandable)


@dataclass
class TraceReplay:
    """A storage trace replayed through the allocator model, with the library workspaces added."""

    peaks: AllocatorPeaks
    tensor_peak_bytes: int  # the trace's own peak of live storage bytes (no rounding)
    cublas_workspace_bytes: int  # cuBLAS workspaces inserted, all threads (0 if no matrix product ran)
    conv_workspace_bytes: int  # per convolution, as given (measured on a device), else 0
    cublaslt_workspace_bytes: int = 0  # cuBLASLt workspaces inserted, all threads
    notes: list[str] = field(default_factory=list)

    @property
    def workspace_bytes(self) -> int:
        """Every library workspace the replay holds at its end (cuBLAS and cuBLASLt)."""
        return self.cublas_workspace_bytes + self.cublaslt_workspace_bytes


def replay_trace(events: Iterable[tuple], *, expandable: bool = False, cublas_workspace: int = 0,
                 cublaslt_workspace: int = 0, conv_workspace_bytes: int = 0) -> TraceReplay:
    """Feed a storage trace to :class:`CachingAllocatorModel`.

    Args:
        events: ``("alloc", key, nbytes)``, ``("free", key)``, ``("op", name[, in_backward,
            bias_gemm])`` (an aten op ran: a thread's first matrix product allocates its cuBLAS
            workspace, its first bias gemm its cuBLASLt workspace, where the ops autograd's
            engine ran are one thread and the rest another; every convolution holds
            ``conv_workspace_bytes`` just after its outputs exist), ``("reset",)`` (peaks
            restart, as after ``reset_peak_memory_stats``), ``("step", i)`` (a training step
            starts) and ``("input", key...)`` (the batch's blocks), in order.
        expandable: model ``expandable_segments:True``.
        cublas_workspace: bytes of one cuBLAS workspace (``cublas_workspace_bytes``).
        cublaslt_workspace: bytes of one cuBLASLt workspace (``cublaslt_workspace_bytes``).
        conv_workspace_bytes: one convolution's workspace (a measured figure; 0 = unmodelled).
    """
    run = _Replay(CachingAllocatorModel(expandable=expandable), cublas_workspace, cublaslt_workspace,
                  conv_workspace_bytes)
    for ev in events:
        run.feed(ev)
    return run.result()


class _Replay:
    """A storage trace fed event by event to allocator models: each allocation to the model
    ``into`` names at that moment, each free to the model that holds the block."""

    def __init__(self, model: CachingAllocatorModel, cublas_workspace: int, cublaslt_workspace: int,
                 conv_workspace_bytes: int) -> None:
        self.model = self.into = model
        self.cublas, self.cublaslt, self.conv = cublas_workspace, cublaslt_workspace, conv_workspace_bytes
        self.owner: dict[object, CachingAllocatorModel] = {}
        self.sizes: dict[object, int] = {}
        self.live = self.peak = 0
        self.inserted = {"cublas": 0, "cublaslt": 0}
        self.n_conv = 0

    def malloc(self, key: object, nbytes: int) -> None:
        self.into.malloc(key, nbytes)
        self.owner[key] = self.into

    def feed(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "alloc":
            _, key, nbytes = ev
            self.malloc(key, nbytes)
            self.sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        elif kind == "free":
            self.owner.pop(ev[1]).free(ev[1])
            self.live -= self.sizes.pop(ev[1])
        elif kind == "op":
            name = ev[1]
            thread = "backward" if len(ev) > 2 and ev[2] else "caller"
            wants = []
            if name in MATMUL_OPS and self.cublas:
                wants.append(("cublas", self.cublas))
            if len(ev) > 3 and ev[3] and self.cublaslt:
                wants.append(("cublaslt", self.cublaslt))
            for lib, nbytes in wants:
                key = (lib, "workspace", thread)
                if key not in self.owner:  # one per thread (and stream), for the life of the process
                    self.malloc(key, nbytes)
                    self.inserted[lib] += nbytes
            if self.conv and name.startswith("convolution"):
                self.n_conv += 1
                self.into.malloc(("conv", "workspace", self.n_conv), self.conv)
                self.into.free(("conv", "workspace", self.n_conv))
        elif kind == "reset":
            self.model.reset_peaks()
            self.peak = self.live
        elif kind not in ("step", "input"):
            raise ValueError(f"unknown trace event {ev!r}")

    def result(self) -> TraceReplay:
        notes = []
        if self.cublas and not self.inserted["cublas"]:
            notes.append("no matrix product in the trace: no cuBLAS workspace")
        return TraceReplay(self.model.peaks(), self.peak, self.inserted["cublas"], self.conv,
                           self.inserted["cublaslt"], notes)


@dataclass
class CapturedReplay:
    """A training step captured as a CUDA graph (``edgetl.train.graph.CapturedStep``), as the
    allocator would report it (bytes).

    Attributes:
        warmup: the eager steps before the capture (``replay_trace`` of them).
        kept_bytes: reserved once the warm-up's free segments are given back (``empty_cache``):
            the default pool's segments that hold a live block (weights, optimizer state, the
            static buffers, the library workspaces).
        pool_reserved_bytes: the graph's private pool: the segments its capture opened, held as
            long as the graph lives (a replay allocates nothing).
        kept_allocated_bytes: the default pool's live blocks while the graph replays (weights,
            optimizer state, the static buffers, the library workspaces).
        allocated_bytes, reserved_bytes: ``memory_allocated``/``memory_reserved`` while the graph
            replays: the default pool's live blocks and what the capture left live (its outputs).
        allocated_peak_bytes, reserved_peak_bytes: ``max_memory_allocated``/``max_memory_reserved``
            over the run: the warm-up's, or the capture's (every pool at once).
    """

    warmup: TraceReplay
    kept_bytes: int
    pool_reserved_bytes: int
    kept_allocated_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int

    @property
    def extra_bytes(self) -> int:
        """What a captured run reserves beyond an eager one (never below 0): ``reserved_bytes``
        against the warm-up's reserved peak. The free space in the kept segments cannot serve the
        pool, and the pool's own segments round up; both are device memory the graph holds and
        an eager run of the same step would not."""
        return max(0, self.reserved_bytes - self.warmup.peaks.reserved_peak_bytes)


def replay_captured(events: Iterable[tuple], *, cublas_workspace: int = 0,
                    cublaslt_workspace: int = 0) -> CapturedReplay:
    """A storage trace of eager training steps (``("step", i)`` marks each step's start), replayed
    as ``CapturedStep`` runs them: every step but the last eagerly (the warm-up), then the
    cached segments they left given back, the static input buffers made (the trace's
    ``("input", ...)`` blocks, moved there), then the last step captured into a private pool.

    The private pool is a second :class:`CachingAllocatorModel`: PyTorch's private pools carve
    their own small and large segments by the same rules, and a capture's allocations come
    only from its pool while its frees of older blocks go back to theirs (``c10/cuda/
    CUDACachingAllocator.cpp``, ``PrivatePool``). The capture runs on the warm-up's stream, so
    it reuses the warm-up's cuBLAS workspaces (they are kept per handle and stream). The
    statistics add up every pool. Not modelled: expandable segments (the default pool's
    ``empty_cache`` then unmaps pages inside segments), cuDNN workspaces.
    """
    events = list(events)
    starts = [i for i, ev in enumerate(events) if ev[0] == "step"]
    if len(starts) < 2:
        raise ValueError(f"the trace marks {len(starts)} step(s); a captured step needs a warm-up step before it")
    default = CachingAllocatorModel()
    run = _Replay(default, cublas_workspace, cublaslt_workspace, 0)
    for ev in events[:starts[-1]]:
        run.feed(ev)
    warmup = run.result()
    inputs = [key for ev in events if ev[0] == "input" for key in ev[1:] if key in run.owner]
    for key in inputs:  # the warm-up's batches go; the static buffers come after the segments are given back
        default.free(key)
    default.empty_cache()
    for key in inputs:
        default.malloc(key, run.sizes[key])
    kept = default.reserved
    run.into = pool = CachingAllocatorModel()
    allocated_peak, reserved_peak = default.allocated_peak, default.reserved_peak
    for ev in events[starts[-1]:]:
        run.feed(ev)
        allocated_peak = max(allocated_peak, default.allocated + pool.allocated)
        reserved_peak = max(reserved_peak, default.reserved + pool.reserved)
    return CapturedReplay(warmup, kept, pool.reserved, default.allocated, default.allocated + pool.allocated,
                          default.reserved + pool.reserved, allocated_peak, reserved_peak)

# ----------------------------------------------------------------------------- the runtime accounting on CUDA
