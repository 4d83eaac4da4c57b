#!/usr/bin/env python3
"""Benchmark an exported edgetl model: an ONNX file or TensorRT engine in, latency percentiles and throughput out.

Inputs are random tensors of the sidecar's input shape (preprocessing is not timed).

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
from classify import load_sidecar, open_model  # noqa: E402


def benchmark(model_path: str | Path, batches: list[int], iters: int = 50, warmup: int = 10,
              threads: int | None = None) -> list[dict]:
    """Per batch size: p50 / p90 / p99 latency (ms) and throughput (images/s) over ``iters`` runs."""
    meta = load_sidecar(model_path)
    model = open_model(model_path, meta, threads=threads)
    _, c, h, w = meta["input"]["shape"]
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
        for _ in range(warmup):
            model(x)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
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
    parser = argparse.ArgumentParser(description="Latency and throughput of an edgetl ONNX model or TensorRT engine.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = benchmark(args.model, args.batch, iters=args.iters, warmup=args.warmup, threads=args.threads)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'batch':>5}  {'p50 ms':>8}  {'p90 ms':>8}  {'p99 ms':>8}  {'images/s':>9}  runtime")
    for r in rows:
        print(f"{r['batch']:>5}  {r['p50_ms']:>8.2f}  {r['p90_ms']:>8.2f}  {r['p99_ms']:>8.2f}  "
              f"{r['images_per_s']:>9.1f}  {r['runtime']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
