"""Predicted CUDA memory of the training step eager and captured as a CUDA graph, from a storage
trace recorded on the CPU (``edgetl.memory.cuda.replay_trace`` and ``replay_captured``), for a
GPU of the given compute capability (default: Jetson Orin, sm87). 224 px, batch 8; docs/cuda.md.
The second table is what a ``--budget`` counts: the eager step's tensors (the runtime
accounting), and with graphs what they reserve beyond an eager run on top (``CapturedReport``,
what finetune checks).

    python scripts/captured_memory.py [--capability 8.7]
"""

from __future__ import annotations

import argparse
import copy

import torch

from edgetl.bench import METHODS, build_method, pruned_hidden
from edgetl.memory.cuda import cublas_workspace_bytes, cublaslt_workspace_bytes, replay_captured, replay_trace
from edgetl.memory.cuda_step import CapturedReport
from edgetl.memory.meter import measure_training_memory
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.units import MB

CONFIGS = {  # the table's name -> the bench's method
    "paper configuration": "repnet-pruned-pool2",
    "paper configuration + bf16 + int8": "repnet-pruned-pool2-bf16-int8",
    "stock Rep-Net": "repnet-stock",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capability", default="8.7", help="compute capability, major.minor (default 8.7)")
    a = p.parse_args()
    capability = tuple(int(x) for x in a.capability.split("."))
    workspaces = {"cublas_workspace": cublas_workspace_bytes(capability), "cublaslt_workspace": cublaslt_workspace_bytes()}
    torch.set_num_threads(1)
    print("| configuration | eager reserved | with graphs reserved (kept + pool) |\n|---|---|---|")
    budget = []
    for name, key in CONFIGS.items():
        method = METHODS[key]
        torch.manual_seed(0)
        net = build_method(method, width=1.0, num_classes=102, device="cpu",
                           hidden=pruned_hidden(1.0, 102) if method.pruned else None)
        if method.lean is not None:
            prepare_step(net, resolution=224, batch_size=8)
        trace = measure_training_memory(copy.deepcopy(net), resolution=224, batch_size=8, steps=3,
                                        record_trace=True).trace
        eager, captured = replay_trace(trace, **workspaces), replay_captured(trace, **workspaces)
        print(f"| {name} | {eager.peaks.reserved_peak_bytes / MB:.1f} MB | {captured.reserved_bytes / MB:.1f} MB "
              f"({captured.kept_bytes / MB:.1f} + {captured.pool_reserved_bytes / MB:.1f}) |")
        runtime = runtime_report(net, mode=method.mode, resolution=224, batch_size=8).total_bytes
        counted = CapturedReport(runtime, captured, capability)
        budget.append(f"| {name} | {runtime / MB:.1f} MB | {counted.total_bytes / MB:.1f} MB "
                      f"({runtime / MB:.1f} + {counted.extra_bytes / MB:.1f}) |")
    print("\n| configuration | a budget counts, eager | with graphs (tensors + reserved beyond eager) |\n|---|---|---|")
    print("\n".join(budget))


if __name__ == "__main__":
    main()
