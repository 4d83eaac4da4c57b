#!/usr/bin/env python3
"""Benchmark an exported edgetl model: an ONNX file or TensorRT engine in, latency percentiles and throughput out.

Inputs are random tensors of the sidecar's input shape (preprocessing is not timed). Bad input
(a missing or damaged model or sidecar; a count below its minimum) ends in one line on stderr,
``benchmark.py: error: ...``, and exit code 2.

    python deploy/benchmark.py --model runs/x/export/model.onnx --batch 1 8 --iters 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from classify import (  # noqa: E402
    DeployError, OneLineParser, check_count, check_logits, check_sha256, check_threads, count_arg, load_sidecar,
    open_model, run_main,
)


def available_bytes() -> int | None:
    """Memory the kernel says is available to new allocations (Linux /proc/meminfo), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def benchmark(model_path: str | Path, batches: list[int], iters: int = 50, warmup: int = 10,
              threads: int | None = None) -> list[dict]:
    """Per batch size: p50 / p90 / p99 latency (ms) and throughput (images/s) over ``iters`` runs.

    Raises:
        DeployError: a bad model or sidecar file; a batch or ``iters`` below 1, ``warmup``
            below 0 (0: no warm-up), ``threads`` below 1, or a batch above an engine's
            largest (it would be timed in pieces).
    """
    if not batches:
        raise DeployError("no batch sizes given")
    for batch in batches:
        check_count("batch", batch)
    check_count("iters", iters)
    check_count("warmup", warmup, minimum=0)
    check_threads(threads)
    meta = load_sidecar(model_path)
    if meta["artifact"] == "tensorrt-engine" and max(batches) > meta["batch"]["max"]:
        raise DeployError(f"batch {max(batches)} is larger than engine {model_path}'s largest, "
                          f"{meta['batch']['max']} (its sidecar's batch.max); build it with a larger --batch")
    _, c, h, w = meta["input"]["shape"]
    free = available_bytes()
    need = max(batches) * c * h * w * 4  # the input alone; the activations need several times more
    if free is not None and need > free:
        raise DeployError(f"batch {max(batches)} needs {need / 2**30:.1f} GiB for its input alone, more than the "
                          f"{free / 2**30:.1f} GiB of memory available here; choose a smaller --batch")
    model = open_model(model_path, meta, threads=threads)
    check_sha256(model_path, meta)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        try:
            x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
        except MemoryError:
            raise DeployError(f"batch {batch} does not fit in memory here ({batch * c * h * w * 4 / 2**30:.1f} GiB "
                              "for its input alone); choose a smaller --batch") from None
        times = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            out = model(x)
            elapsed = time.perf_counter() - start
            if i == 0:  # the model answers as its sidecar says (checked outside the timing)
                check_logits(out, batch, meta, model_path)
            if i >= warmup:
                times.append(elapsed)
        t = np.asarray(times)
        rows.append({
            "batch": batch,
            "p50_ms": float(np.percentile(t, 50) * 1e3),
            "p90_ms": float(np.percentile(t, 90) * 1e3),
            "p99_ms": float(np.percentile(t, 99) * 1e3),
            "images_per_s": float(batch * len(t) / t.sum()),
            "iters": iters,
            "runtime": ", ".join(model.providers),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="benchmark.py",
                           description="Latency and throughput of an edgetl ONNX model or TensorRT engine.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=count_arg(1), nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=count_arg(1), default=50)
    parser.add_argument("--warmup", type=count_arg(0), default=10, help="untimed runs first (0: none)")
    parser.add_argument("--threads", type=count_arg(1), default=None,
                        help="onnxruntime intra-op threads (default: onnxruntime's choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    return run_main("benchmark.py", lambda: report(args))


def report(args: argparse.Namespace) -> int:
    rows = benchmark(args.model, args.batch, iters=args.iters, warmup=args.warmup, threads=args.threads)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'batch':>5}  {'p50 ms':>8}  {'p90 ms':>8}  {'p99 ms':>8}  {'images/s':>9}  runtime")
    for r in rows:
        print(f"{r['batch']:>5}  {r['p50_ms']:>8.2f}  {r['p90_ms']:>8.2f}  {r['p99_ms']:>8.2f}  "
              f"{r['images_per_s']:>9.1f}  {r['runtime']}")
    sys.stdout.flush()  # a closed pipe shows here, inside run_main
    return 0


if __name__ == "__main__":
    sys.exit(main())
