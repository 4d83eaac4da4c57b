"""A training step's CUDA figures: the runtime accounting plus the allocator model's replay of a metered step.

Composes ``edgetl.memory.runtime`` (tensor peak), ``edgetl.memory.meter`` (a real step's
storage trace) and ``edgetl.memory.cuda`` (cuBLAS workspace, caching-allocator replay);
those three never import each other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgetl.memory.cuda import (JETSON_ORIN, CapturedReplay, cublas_workspace_bytes, cublaslt_workspace_bytes,
                                expandable_segments_enabled, replay_captured, replay_trace, step_workspace_bytes)

if TYPE_CHECKING:
    from torch import nn

    from edgetl.step import Step


@dataclass
class CudaReport:
    """The runtime accounting of a training step, answered for a CUDA device (bytes).

    Attributes:
        runtime_bytes: the runtime accounting's tensor peak (DESIGN 2b), as on CPU.
        cublas_workspace_bytes: the library workspaces the step holds (cuBLAS for the calling
            thread and for autograd's device thread, cuBLASLt for the classifier's biased
            addmm; ``edgetl.memory.cuda``): the replay's, or ``step_workspace_bytes``.
        allocated_bytes: what ``max_memory_allocated`` should say: with a trace, the replay's
            allocated peak (rounding, unsplit blocks, the workspace); without, runtime +
            workspace. cuDNN workspaces are not in it (measured on the device, see above).
        reserved_bytes: what ``max_memory_reserved`` should say (the replay's), None without a trace.
        capability: the compute capability the figures are for.
        expandable: whether expandable segments were modelled.
    """

    runtime_bytes: int
    cublas_workspace_bytes: int
    allocated_bytes: int
    reserved_bytes: int | None
    capability: tuple[int, int]
    expandable: bool

    @property
    def slack(self) -> float | None:
        """reserved / allocated: the allocator slack for a plan on this device (None without a trace)."""
        return None if self.reserved_bytes is None else self.reserved_bytes / self.allocated_bytes


def cuda_report(net: "nn.Module", *, mode: str, resolution: int, batch_size: int,
                capability: tuple[int, int] = JETSON_ORIN, expandable: bool | None = None,
                optimizer: str = "adam", trace: bool = True, env: dict[str, str] | None = None) -> CudaReport:
    """Runtime accounting + the CUDA terms for ``net``'s training step at ``batch_size``.

    Args:
        net: a built network (trainability set); with ``trace`` it must have real weights
            (a CPU copy runs two real training steps to record the storage trace).
        mode, resolution, batch_size, optimizer: as ``runtime_report``.
        capability: the target GPU's compute capability (default: Jetson Orin, sm87).
        expandable: model expandable segments; None reads ``PYTORCH_CUDA_ALLOC_CONF`` from ``env``.
        trace: replay one real step through the allocator model (seconds on a CPU at 224 px);
            False gives the allocated figure without packing and no reserved figure.
        env: environment for ``CUBLAS_WORKSPACE_CONFIG`` / ``PYTORCH_CUDA_ALLOC_CONF`` (default os.environ).
    """
    from edgetl.memory.runtime import runtime_report

    runtime = runtime_report(net, mode=mode, resolution=resolution, batch_size=batch_size,
                             optimizer=optimizer).total_bytes
    expandable = expandable_segments_enabled(env) if expandable is None else expandable
    if not trace:
        workspace = step_workspace_bytes(capability, env)
        return CudaReport(runtime, workspace, runtime + workspace, None, tuple(capability), expandable)
    from edgetl.memory.meter import measure_training_memory

    probe = copy.deepcopy(net).to("cpu")
    got = measure_training_memory(probe, resolution=resolution, batch_size=batch_size, steps=2,
                                  optimizer=optimizer, record_trace=True)
    del probe
    replay = replay_trace(got.trace, expandable=expandable, cublas_workspace=cublas_workspace_bytes(capability, env),
                          cublaslt_workspace=cublaslt_workspace_bytes(env))
    return CudaReport(runtime, replay.workspace_bytes, replay.peaks.allocated_peak_bytes, replay.peaks.reserved_peak_bytes,
                      tuple(capability), expandable)


@dataclass
class CapturedReport:
    """The training step captured as a CUDA graph (``edgetl.train.graph.CapturedStep``), answered
    for a CUDA device (bytes): what a ``--budget`` counts when the step runs as graphs.

    Attributes:
        runtime_bytes: the runtime accounting's tensor peak: what a budget counts for the eager step.
        replay: the allocator model's replay of the captured step (``replay_captured``).
        capability: the compute capability the figures are for.
    """

    runtime_bytes: int
    replay: CapturedReplay
    capability: tuple[int, int]

    @property
    def extra_bytes(self) -> int:
        """What the captured run reserves beyond an eager one (``CapturedReplay.extra_bytes``)."""
        return self.replay.extra_bytes

    @property
    def total_bytes(self) -> int:
        """What a budget counts for the captured step: the eager step's tensors, and the device
        memory the graph holds beyond an eager run's (an eager run's own allocator slack is not
        counted, as for an eager step)."""
        return self.runtime_bytes + self.extra_bytes


def captured_report(net: "nn.Module", *, runtime_bytes: int, resolution: int, batch_size: int,
                    step: "Step | None" = None, capability: tuple[int, int] = JETSON_ORIN,
                    env: dict[str, str] | None = None) -> CapturedReport:
    """The memory of ``net``'s training step captured as a CUDA graph, beside its runtime
    accounting ``runtime_bytes``: a meta copy runs three steps (two warm-up steps, then the step
    the graph records) to record the storage trace ``replay_captured`` replays for
    ``capability``. On the meta device nothing is computed (under a second at 224 px, on a
    Jetson's CPU too); the trace is a CPU run's, event for event (tests/test_cuda.py). Fused
    optimizer kernels have no meta implementation: their step runs on a CPU copy. ``net``:
    its lean schedule applied."""
    from edgetl.memory.meter import measure_training_memory

    device = "cpu" if step is not None and step.optim.fused else "meta"
    probe = copy.deepcopy(net).to(device)
    got = measure_training_memory(probe, resolution=resolution, batch_size=batch_size, steps=3, step=step,
                                  record_trace=True, device=device)
    del probe
    replay = replay_captured(got.trace, cublas_workspace=cublas_workspace_bytes(capability, env),
                             cublaslt_workspace=cublaslt_workspace_bytes(env))
    return CapturedReport(runtime_bytes, replay, tuple(capability))
