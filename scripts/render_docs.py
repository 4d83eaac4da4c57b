#!/usr/bin/env python3
"""Committed results (benchmarks/*.json) in, the tables of README.md and docs/*.md out.

Every table of figures in the documentation that a committed result file holds is written
by this script between marker comments, never by hand:

    <!-- render:NAME -->
    ...generated...
    <!-- /render -->

    python scripts/render_docs.py            # rewrite every block in place
    python scripts/render_docs.py --check    # exit 1 if any block differs from its render
    python scripts/render_docs.py --list     # the block names and where their figures come from

Blocks (NAME: source):

* ``results``: README's summary, rows and columns of ``benchmarks/table1_224.json``
* ``table1``: the whole bench table of ``benchmarks/table1_224.json`` (``edgetl bench``'s own
  markdown, ``edgetl.bench.to_markdown``)
* ``table1-resnet18``: the same table on ResNet-18, ``benchmarks/bench_resnet18_224.json``
  (``edgetl bench --backbone resnet18``)
* ``cuda-h100``: rows and columns of ``benchmarks/cuda_h100_bench.json``
* ``cuda-accounting``, ``cuda-parity``: ``benchmarks/cuda_h100_figures.json`` (what the cuda tests measured)
* ``cuda-allocator``: ``benchmarks/cuda_h100_allocator.json``
* ``cuda-graphs``: ``benchmarks/cuda_h100_graphs_summary.json``
* ``levers``, ``levers-grad``: ``benchmarks/levers_accuracy.json`` (summarised as
  ``experiments/levers_accuracy.py`` does)
* ``storage``: ``benchmarks/storage_accuracy.json`` (summarised as ``experiments/storage_accuracy.py`` does)
* ``stream``: ``benchmarks/stream_figures_224.md`` (``scripts/stream_figures.py``'s output; that
  script writes markdown only, so its committed table is the source)
* ``paper-model``, ``prune``: ``benchmarks/paper_figures_224.json`` (``scripts/paper_figures.py``: ``edgetl
  prune`` and ``edgetl profile --accounting paper``); the papers' own figures beside them are quoted
* ``step-peaks-repnet``, ``step-peaks-full``: ``benchmarks/step_peaks_224.json`` (``scripts/step_peaks.py``)
* ``demo``: ``benchmarks/demo_report.json`` (the ``report.json`` of ``edgetl demo -o DIR``)
* ``step-ops``: ``benchmarks/step_ops_224.json`` (``scripts/step_ops.py --json``)
* ``plan-verify``: ``benchmarks/plan_verify_224.json`` (``scripts/plan_figures.py``: ``edgetl plan
  --verify`` at each budget)
* ``step-time-parts``: ``benchmarks/step_time_parts_224.json`` (``scripts/step_time_parts.py``: each
  step's convolution kernels and the rest, and the speed-up each row allows)
* ``busy-cores``: ``benchmarks/busy_cores_*.json`` (``scripts/busy_cores.py``: a step under each
  OpenMP wait policy, alone and beside busy processes)
* ``heap-policy``: ``benchmarks/heap_policy.json`` (``scripts/heap_policy.py``: steps with glibc's
  default heap and with the program's, each setting in a process of its own)
* ``barley-table1``, ``barley-table1-totals``: ``benchmarks/barley_table1_resnet18.json``
  (``scripts/barley_table1.py``: Barley & Fröning's Table 1 recomputed, the paper's cells beside)
* ``resnet-peaks``, ``resnet-plans``: ``benchmarks/resnet_peaks_224.json`` (``scripts/resnet_peaks.py``: ResNet-18 full
  fine-tuning at batch 32 with the seeds' storages, ResNet-50 Rep-Net; measured beside predicted)
* ``tested-on``: ``benchmarks/jetson_check_summary.json`` through ``scripts/tested_on.py``; a
  one-line placeholder while that file is not committed
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BENCH = ROOT / "benchmarks"
BLOCK = re.compile(r"(<!-- render:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /render -->)", re.S)
TESTED_ON_PLACEHOLDER = ("No platform summary is committed yet: `make jetson-check` writes "
                         "`jetson-check/summary.json`; committed as `benchmarks/jetson_check_summary.json`, "
                         "`python scripts/render_docs.py` fills this section.\n")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _script(name: str):
    """A module of scripts/ by file name (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"_render_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _study(name: str):
    """An accuracy study of experiments/ (a package of the checkout, not installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"experiments.{name}")


def _signed(n: int) -> str:
    return f"{n:+,}" if n else "0"


def _table(headers: list[str], rows: list[list[str]], align: list[str]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _bench_subset(path: Path, methods: list[str], columns: list[str], first_header: str | None = None,
                  labels: dict[str, str] | None = None, with_caption: bool = True) -> str:
    """Chosen rows (by method id) and columns (by header) of a bench result, cells as the bench prints them."""
    from edgetl.bench import BenchResult, caption, table_rows

    result = BenchResult.load_json(path)
    headers, rows = table_rows(result)
    by_method = {r.method: cells for r, cells in zip(result.rows, rows)}
    missing = [m for m in methods if m not in by_method]
    if missing:
        raise KeyError(f"{path.name} has no rows {missing}")
    idx = [0] + [headers.index(c) for c in columns]
    shown = [headers[i] for i in idx]
    if first_header:
        shown[0] = first_header
    labels = labels or {}
    cells = [[labels.get(m, by_method[m][0])] + [by_method[m][i] for i in idx[1:]] for m in methods]
    text = _table(shown, cells, [":---"] + ["---:"] * len(columns))
    if with_caption:
        text += "\n" + caption(result) + ".\n"
    return text


def render_results() -> str:
    return _bench_subset(
        BENCH / "table1_224.json",
        ["full", "full-lean-pool2", "bias-lean", "repnet-stock", "repnet-lean", "repnet-lean-stream",
         "repnet-pruned", "repnet-pruned-pool2", "repnet-pruned-pool2-bf16-int8",
         "repnet-pruned-pool2-bf16-int8-stream", "repnet-stock-cl", "repnet-lean-cl", "repnet-pruned-pool2-cl"],
        ["paper MB", "runtime MB", "measured MB", "images/s", "largest batch in 256 MB"])


def render_table1() -> str:
    from edgetl.bench import BenchResult, to_markdown

    return to_markdown(BenchResult.load_json(BENCH / "table1_224.json"))


def render_table1_resnet18() -> str:
    from edgetl.bench import BenchResult, to_markdown

    return to_markdown(BenchResult.load_json(BENCH / "bench_resnet18_224.json"))


def render_cuda() -> str:
    return _bench_subset(
        BENCH / "cuda_h100_bench.json",
        ["repnet-stock", "repnet-lean", "repnet-pruned-pool2", "repnet-pruned-pool2-bf16-int8",
         "repnet-pruned-pool2-bf16-int8-stream"],
        ["runtime MB", "allocated MB", "reserved MB", "images/s"],
        first_header="method (224 px, batch 8, H100)",
        # the pruned backbone's own row did not run on the H100: name the configuration in full
        labels={"repnet-pruned-pool2": PAPER_ON_H100})


PAPER_ON_H100 = "Rep-Net, lean, pruned backbone, pooled storage k=2 (the paper's)"


def _cuda_labels() -> dict[str, str]:
    """Method id -> label as the H100 bench names them; rows that extend the one above named in full."""
    rows = json.loads((BENCH / "cuda_h100_bench.json").read_text())["rows"]
    return {**{r["method"]: r["label"] for r in rows}, "repnet-pruned-pool2": PAPER_ON_H100,
            "repnet-pruned-pool2-bf16-int8": "the paper's + bf16 activations, int8 frozen weights",
            "repnet-pruned-pool2-bf16-int8-stream": "the paper's + bf16, int8 + streamed by 1, uint8 batch, recompute"}


def render_cuda_allocator() -> str:
    """Per bench method on the H100: the allocator's peaks against the allocator model's replay."""
    data = json.loads((BENCH / "cuda_h100_allocator.json").read_text())
    labels = _cuda_labels()
    expandable = {r["method"]: r for r in data["expandable"]["rows"]}
    out = []
    for r in data["default"]["rows"]:
        e = expandable[r["method"]]
        out.append([labels.get(r["method"], r["method"]), f"{r['runtime_bytes'] / 1e6:.2f}",
                    _signed(r["tensor_bytes"] - r["runtime_bytes"]), f"{r['allocated_bytes'] / 1e6:.2f}",
                    f"{(r['allocated_bytes'] - r['replay_allocated_bytes']) / 1e3:+,.0f}",
                    f"{r['reserved_bytes'] / 1e6:.1f}",
                    f"{(e['allocated_bytes'] - e['replay_allocated_bytes']) / 1e3:+,.0f}",
                    f"{e['reserved_bytes'] / 1e6:.1f}"])
    ws = data["default"]["step_workspace_bytes"]
    return _table(["method (224 px, batch 8)", "runtime MB", "tensor peak - runtime (B)", "allocated MB",
                   "allocated - model (kB)", "reserved MB", "expandable: allocated - model (kB)",
                   "expandable: reserved MB"], out, [":---"] + ["---:"] * 7) + (
        f"\nEach method in a process of its own; library workspaces in every step: {ws / 2**20:g} MiB. "
        "Model: the allocator model's replay of the step's allocation trace.\n")


ACCOUNTING_LABELS = {
    "stock": "Rep-Net, stock modules",
    "stock-pruned": "Rep-Net, stock modules, pruned backbone",
    "lean-fp32": "Rep-Net, lean, fp32",
    "lean-pruned-k2": "Rep-Net, lean, pruned, k=2 (the paper's configuration)",
    "lean-bf16": "Rep-Net, lean, k=2, bf16 activations",
    "lean-pruned-bf16-int8": "Rep-Net, lean, pruned, k=2, bf16 activations, int8 frozen weights",
    "lean-pruned-fp16-frozen16": "Rep-Net, lean, pruned, k=2, fp16 activations, fp16 frozen weights",
}


def render_cuda_accounting() -> str:
    """The cuda tests' configurations on the H100: allocated peak against runtime accounting + workspaces."""
    figures = json.loads((BENCH / "cuda_h100_figures.json").read_text())
    out = []
    for key, f in figures["accounting_224px"].items():
        out.append([ACCOUNTING_LABELS.get(key, key), f"{f['runtime'] / 1e6:.2f}", _signed(f["tensor"] - f["runtime"]),
                    f"{f['workspaces'] / 1e6:.2f}", f"{f['allocated'] / 1e6:.2f}",
                    f"{100 * f['allocated_vs_predicted']:+.2f} %", f"{f['unexplained'] / 1e6:+.2f}",
                    f"{f['reserved'] / 1e6:.1f}"])
    return _table(["configuration (224 px, batch 8)", "runtime MB", "tensor peak - runtime (B)", "workspaces MB",
                   "allocated MB", "allocated vs runtime + workspaces", "allocated - model (MB)", "reserved MB"],
                  out, [":---"] + ["---:"] * 7)


def render_cuda_parity() -> str:
    """Lean layers on CUDA against the CPU: the largest relative L2 error of any output and gradient."""
    figures = json.loads((BENCH / "cuda_h100_figures.json").read_text())
    out = []
    for key, f in figures["lean_cuda_vs_cpu"].items():
        opts = ", ".join(f"{k}={v}" for k, v in f["reference"].items())
        out.append([key, opts, f"{f['forward_max_relerr']:.1e}", f"{f['grad_max_relerr']:.1e}"])
    return _table(["case", "lean options", "forward, max rel. error", "gradients, max rel. error"], out,
                  ["---", "---", "---:", "---:"])


def render_cuda_graphs() -> str:
    """The whole training step as one CUDA graph against eager steps (H100)."""
    graphs = json.loads((BENCH / "cuda_h100_graphs_summary.json").read_text())["graphs"]
    labels = _cuda_labels()
    out = [[labels.get(r["method"], r["method"]), f"{1e3 * r['eager_step_s']:.1f}", f"{1e3 * r['graph_step_s']:.1f}",
            f"{r['speedup']:.1f}x", _graph_weights(r),
            f"{r['capture_s']:.2f}" if "capture_s" in r else "not recorded"]  # recorded since CapturedStep times it
           for r in graphs["rows"]]
    return _table(["method (224 px, batch 8)", "eager step ms", "graph step ms", "speed-up",
                   f"weights after {graphs.get('compared_after_steps', graphs['steps'])} steps, graph vs eager "
                   "(max abs diff)", "capture s"], out,
                  [":---"] + ["---:"] * 5)


def _graph_weights(row: dict) -> str:
    """How far a graph check row's captured weights ended from the eager run's; where the row
    also ran the graph's own arithmetic (capturable Adam) eagerly, from that run's too."""
    plain = "equal" if row["max_abs_weight_diff"] == 0.0 else f"{row['max_abs_weight_diff']:.2g}"
    if "same_arithmetic_diff" not in row:
        return plain
    same = row["same_arithmetic_diff"]
    return (f"{plain} (capturable Adam run eagerly, after {row['same_arithmetic_steps']} steps: "
            f"{'equal' if same == 0.0 else f'{same:.2g}'})")


def render_levers() -> str:
    levers = _study("levers_accuracy")
    data = json.loads((BENCH / "levers_accuracy.json").read_text())
    rows = {r["config"]: r for r in levers.summarize(data["results"], data["peaks"])}
    pruning = levers.PAPER_RATIOS
    labels = {
        levers.BASELINE: "fp32 / fp32 / 1 (baseline)",
        **{f"{a}/{w}/pool1": f"{a} / {w} / 1" for a in ("fp32", "bf16", "fp16") for w in ("fp32", "fp16", "int8")
           if f"{a}/{w}/pool1" != levers.BASELINE},
        "fp32/fp32/pool2": "fp32 / fp32 / 2",
        "fp32/fp32/pool4": "fp32 / fp32 / 4",
        "pruned (not retrained)": f"pruned {', '.join(map(str, pruning))} (blocks 1-4), not retrained",
        "pruned+retrained": "pruned, retrained 3 epochs on the source",
        "control: unpruned+retrained": "control: unpruned, retrained the same 3 epochs",
    }
    order = [levers.BASELINE, "fp32/fp16/pool1", "fp32/int8/pool1", "fp16/fp32/pool1", "bf16/fp32/pool1",
             "fp16/fp16/pool1", "bf16/fp16/pool1", "fp16/int8/pool1", "bf16/int8/pool1", "fp32/fp32/pool2",
             "fp32/fp32/pool4", "pruned (not retrained)", "pruned+retrained", "control: unpruned+retrained"]
    # At 64 px pool 2 and pool 4 store the same maps: one run, shown once when the results agree.
    if rows["fp32/fp32/pool2"]["acc"] == rows["fp32/fp32/pool4"]["acc"]:
        labels["fp32/fp32/pool2"] = "fp32 / fp32 / 2 and 4 (one run: same storage at 64 px)"
        order.remove("fp32/fp32/pool4")
    out = []
    for name in order:
        r = rows[name]
        base = name == levers.BASELINE
        out.append([labels[name], f"{r['mean']:.2f} ({r['min']:.1f}-{r['max']:.1f})",
                    "—" if base else f"{r['delta']:+.2f}", f"{r['saved'].get('paper', 0) / 1e6:.2f}",
                    "—" if r["points_per_mb"] is None else f"{r['points_per_mb']:+.3f}"])
    return _table(["activations / frozen weights / pool", "top-1 mean (seeds: min-max)", "Δ vs baseline (points)",
                   "MB saved", "points per MB"], out, ["---", "---", "---:", "---:", "---:"])


def render_levers_grad() -> str:
    """One batch's gradients under half-precision activations against fp32 (levers_accuracy.json's grad_check)."""
    data = json.loads((BENCH / "levers_accuracy.json").read_text())
    out = []
    for start, per in data["grad_check"].items():
        for act, g in per.items():
            flow = g["backbone_flow"]
            out.append([start, act, f"{g['side_cosine_to_fp32']:.3f}", f"{100 * flow['nonzero_below_2^-24']:.2f} %",
                        f"{100 * flow['nonzero_below_2^-14']:.2f} %"])
    return _table(["weights", "activations", "side-network gradient: cosine to fp32",
                   "nonzero backbone gradient elements < 2^-24", "< 2^-14"], out, ["---", "---", "---:", "---:", "---:"])


def render_storage() -> str:
    storage = _study("storage_accuracy")
    data = json.loads((BENCH / "storage_accuracy.json").read_text())
    cos = {k: v["storages"] for k, v in data.get("grad_cosine", {}).items()}
    keep = data["meta"].get("keep", storage.KEEP)
    labels = {"full-stock": "stock (BN training)", "bias-lean": "TinyTL-B (bias), lean", "repnet": "Rep-Net, lean"}
    out, first_compressor = [], True
    for r in storage.summarize(data):
        config = storage.CONFIGS[r["config"]]
        lean_full = config["mode"] == "full" and config["runtime"] == "lean"
        label = labels.get(r["config"], f"lean, {config['storage']}")
        if lean_full and config["storage"] not in ("exact", "pool2", "pool4") and first_compressor:
            label += f" (keep {keep:g})"
            first_compressor = False

        def cosine(key: str) -> str:
            c = cos.get(key, {}).get(config["storage"]) if lean_full else None
            return "" if c is None else f"{c['mean']:.2f} / {c['min']:.2f}"

        out.append([label, f"{r['peak']['paper'] / 1e6:.2f}", f"{r['mean']:.2f} ± {r['std']:.2f}",
                    cosine("init_64"), cosine("init_224")])
    return _table(["full fine-tuning", "MB at 224 px, b8", "top-1 mean ± std (%)", "grad cosine, 64 px (mean / min)",
                   "at 224 px"], out, ["---", "---:", "---:", "---:", "---:"])


def render_stream() -> str:
    """The committed output of scripts/stream_figures.py, less its timing column."""
    path = BENCH / "stream_figures_224.md"
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    keep = [header.index(c) for c in ("configuration", "target MB", "step", "predicted MB", "measured MB",
                                       "measured - predicted (B)")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    align = [c.strip() for c in lines[1].strip("|").split("|")]
    return _table([header[i] for i in keep], [[r[i] for i in keep] for r in rows], [align[i] for i in keep])


def render_plan_verify() -> str:
    """Each budget's plan and its measured peak (``scripts/plan_figures.py``'s JSON)."""
    data = json.loads((BENCH / "plan_verify_224.json").read_text())
    rows = [[r["budget"], r["batch"], r["backbone"], r["chosen"].replace("|", "·"),
             f"{r['predicted_bytes'] / 1e6:.2f}", f"{r['measured_bytes'] / 1e6:.2f}",
             str(r["measured_bytes"] - r["predicted_bytes"]), str(r["evaluations"])] for r in data["rows"]]
    table = _table(["budget", "batch", "backbone", "chosen", "predicted MB", "measured MB",
                    "measured - predicted (B)", "accounting evaluations"], rows,
                   ["---", "---", "---", "---", "---:", "---:", "---:", "---:"])
    return table + (f"\n`edgetl plan --budget B --batch-size N|auto --num-classes 102 --verify` (224 px, Rep-Net, "
                    f"Adam), torch {data['torch']}; measured: live tensor bytes over "
                    f"{data['rows'][0]['verify_steps']} real training steps on CPU.\n")


# what the papers print for the same configurations (TinyTL's profiler; Rep-Net's Fig. 1 and Table I)
PAPER_QUOTES = {"full": "TinyTL's profiler: 447.7 MB", "repnet": "Fig. 1: 5.72 MB; Table I: 51 MB",
                "pruned": "2.02 MB; 21 MB"}


def render_paper_model() -> str:
    """The paper memory model at 224 px beside the papers' figures (``scripts/paper_figures.py``)."""
    data = json.loads((BENCH / "paper_figures_224.json").read_text())
    full, before, after = data["full"], data["prune"]["before"]["memory"], data["prune"]["after"]["memory"]
    tmp2 = before["tmp_bytes"]["2"]
    rows = [
        ["full fine-tune (`--mode full`)", f"{full['peak_activation_bytes'] / 1e6:.2f} MB",
         f"{full['total_bytes'] / 1e6:.1f} MB", PAPER_QUOTES["full"]],
        ["Rep-Net (`--mode repnet`)",
         f"{before['peak_activation_bytes_per_image'] / 1e6:.2f} MB (block 2 temporary: {tmp2 / 1e6:.2f} MB)",
         f"{before['total_bytes'] / 1e6:.1f} MB", PAPER_QUOTES["repnet"]],
        ["Rep-Net, backbone pruned " + "/".join(f"{r:g}" for r in data["prune"]["pruning"]["ratios"]),
         f"{after['peak_activation_bytes_per_image'] / 1e6:.2f} MB", f"{after['total_bytes'] / 1e6:.1f} MB",
         PAPER_QUOTES["pruned"]],
    ]
    return _table(["configuration", "peak activation / image", f"total at batch {before['batch_size']}", "paper"],
                  rows, ["---", "---", "---", "---"])


def render_prune() -> str:
    """``edgetl prune`` with the paper's ratios: its record of before and after (``scripts/paper_figures.py``)."""
    data = json.loads((BENCH / "paper_figures_224.json").read_text())["prune"]
    before, after = data["before"], data["after"]

    def change(a: float, b: float) -> str:
        return f" ({(b / a - 1) * 100:.1f} %)"

    def hidden(side: dict) -> str:
        return " / ".join(str(side["hidden"][str(b)]) for b in data["pruning"]["blocks"])

    mb, mb_after = before["memory"], after["memory"]
    rows = [
        ["hidden channels, blocks " + ", ".join(str(b) for b in data["pruning"]["blocks"]),
         hidden(before), hidden(after)],
        ["params", f"{before['params']:,}", f"{after['params']:,}"],
        ["MACs", f"{before['macs'] / 1e6:.1f} M", f"{after['macs'] / 1e6:.1f} M" + change(before["macs"], after["macs"])],
        ["peak activation / image", f"{mb['peak_activation_bytes_per_image'] / 1e6:.2f} MB",
         f"{mb_after['peak_activation_bytes_per_image'] / 1e6:.2f} MB"
         + change(mb["peak_activation_bytes_per_image"], mb_after["peak_activation_bytes_per_image"])],
        [f"Rep-Net total at batch {mb['batch_size']}", f"{mb['total_bytes'] / 1e6:.2f} MB",
         f"{mb_after['total_bytes'] / 1e6:.2f} MB" + change(mb["total_bytes"], mb_after["total_bytes"])],
    ]
    return _table([f"{mb['resolution']} px, paper accounting", "before", "after"], rows, ["---", "---", "---"])


def _step_peaks() -> tuple[dict, str]:
    data = json.loads((BENCH / "step_peaks_224.json").read_text())
    rows = data["rows"]
    exact = sum(r["measured_bytes"] == r["predicted_bytes"] for r in rows)
    caption = (f"\n{data['resolution']} px, batch {data['batch_size']}, {data['num_classes']} classes, Adam, CPU, "
               f"torch {data['torch']}: measured = predicted (runtime accounting) to the byte in {exact} of "
               f"{len(rows)} configurations.\n")
    return data, caption


def render_step_peaks_repnet() -> str:
    """Rep-Net's measured step peak by runtime (``scripts/step_peaks.py``)."""
    data, caption = _step_peaks()
    rows = [r for r in data["rows"] if r["table"] == "repnet"]
    columns = list(dict.fromkeys(r["column"] for r in rows))
    labels = {"Rep-Net": "Rep-Net",
              "pruned": "Rep-Net, backbone pruned 0.3/0.78/0.46/0.46 (the paper's configuration), k=2"}
    out = []
    for name, label in labels.items():
        cells = {r["column"]: r for r in rows if r["row"] == name}
        out.append([label] + [f"{cells[c]['measured_bytes'] / 1e6:.2f} MB" for c in columns])
    return _table(["configuration", *columns], out, ["---"] * (1 + len(columns))) + caption


def render_step_peaks_full() -> str:
    """Full fine-tuning's measured step peak by storage (``scripts/step_peaks.py``)."""
    data, caption = _step_peaks()
    out = [[r["row"], f"{r['measured_bytes'] / 1e6:.2f}", f"{r['stored_bytes'] / 1e6:.1f}"]
           for r in data["rows"] if r["table"] == "full"]
    return _table(["full fine-tuning", "measured MB", "of which stored for backward"], out,
                  ["---", "---:", "---:"]) + caption


DEMO_STAGES = {  # the demo's fine-tuning stages, as the pipeline page names them
    "ft_pruned": "Rep-Net, pruned backbone (the method)",
    "ft_repnet": "Rep-Net, unpruned backbone",
    "ft_streamed": "Rep-Net, unpruned backbone, streamed by {stream}, uint8 batch, recompute",
    "ft_full": "full fine-tune (stock modules)",
}


def render_demo() -> str:
    """The demo's target-task rows and stage times (its ``report.json``)."""
    report = json.loads((BENCH / "demo_report.json").read_text())
    rows = []
    for stage, label in DEMO_STAGES.items():
        r = report[stage]
        name = label.format(**r) + (", channels-last" if r.get("channels_last") else "")
        name += ", fused mask kernels" if r.get("mask_kernels") == "fused" else ""
        rows.append([name, f"k={r['pool']}" if r["mode"] == "repnet" else "-", f"{r['target_acc1']:.1f} %",
                     f"{r['predicted_bytes'] / 1e6:.2f} MB", f"{r['measured_bytes'] / 1e6:.2f} MB"])
    table = _table(["target task (5 classes)", "side pooling", "val top-1", "predicted peak", "measured peak"],
                   rows, ["---", "---", "---", "---", "---"])
    times = ", ".join(f"{name} {r['wall_s']:.0f} s" for name, r in report.items())
    return table + (f"\nSource task top-1: pretrained {report['pretrain']['source_acc1']:.1f} %, pruned + retrained "
                    f"{report['retrain']['source_acc1']:.1f} %; ONNX export max abs diff "
                    f"{report['export']['max_abs_diff']:.1e}. Stages: {times}.\n")


def render_step_ops() -> str:
    """Aten ops per step and the kernels among them, one sample at a time against the fitted
    schedule, stock Rep-Net first (``scripts/step_ops.py``)."""
    data = json.loads((BENCH / "step_ops_224.json").read_text())
    rows = [[r["label"], r["schedule"], f"{r['forward']:,}", f"{r['backward']:,}", f"{r['optimizer']:,}",
             f"{r['total']:,}", f"{r['kernel_total']:,}", f"{r['predicted_bytes'] / 1e6:.2f}"] for r in data["rows"]]
    return _table([f"method ({data['resolution']} px, batch {data['batch_size']}, {data['num_classes']} classes)",
                   "schedule", "forward ops", "backward ops", "optimizer ops", "ops/step", "kernels/step",
                   "predicted peak MB"],
                  rows, ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"])


def render_step_time_parts() -> str:
    """Each step's convolution kernels and the rest (``scripts/step_time_parts.py``'s own table)."""
    return _script("step_time_parts").render(json.loads((BENCH / "step_time_parts_224.json").read_text()))


def render_heap_policy() -> str:
    """Steps with glibc's default heap and with the program's (``scripts/heap_policy.py``'s own table)."""
    return _script("heap_policy").render(json.loads((BENCH / "heap_policy.json").read_text()))


def render_busy_cores() -> str:
    """A step's time under each OpenMP policy, alone and beside busy processes (``scripts/busy_cores.py``):
    per policy and method, the median step of each round, alone / busy, and the worst busy round's
    slowdown against torch's default alone."""
    out = []
    for path in sorted(BENCH.glob("busy_cores_*.json")):
        data = json.loads(path.read_text())
        rows = data["rows"]
        methods = list(rows[0]["median_step_s"])
        policies = list(dict.fromkeys(r["policy"] for r in rows))

        def steps(policy: str, busy: bool, m: str) -> list[float]:
            return [r["median_step_s"][m] for r in rows if r["policy"] == policy and bool(r["busy_processes"]) == busy]

        lines = []
        for policy in policies:
            cells = [policy]
            for m in methods:
                alone, busy = steps(policy, False, m), steps(policy, True, m)
                base = min(steps("default", False, m))
                cells += [" / ".join(f"{s * 1000:.0f}" for s in alone), " / ".join(f"{s * 1000:.0f}" for s in busy),
                          f"{max(busy) / base:.1f}x"]
            lines.append(cells)
        headers = [f"OpenMP ({data['resolution']} px, width {data['width']:g}, batch {data['batch_size']})"]
        for m in methods:
            headers += [f"{m} alone, ms", f"{m} busy, ms", f"{m} worst busy / default alone"]
        out.append(_table(headers, lines, ["---"] + ["---:"] * (len(headers) - 1)))
        rounds = max(r["round"] for r in rows)
        out.append(f"\n`{data['command']}` on {data['cpu']}, {data['cores']} cores: the median of {data['steps']} "
                   f"steps after {data['warmup']} warm-up, {rounds} round{'s' * (rounds > 1)} (one figure a round); "
                   f"busy: {rows[-1]['busy_processes']} Python busy loops beside it.\n")
    return "\n".join(out) if out else "No result of scripts/busy_cores.py is committed yet.\n"


def _barley() -> dict:
    return json.loads((BENCH / "barley_table1_resnet18.json").read_text())


def render_barley_table1() -> str:
    """Barley & Fröning's Table 1 row by row: edgetl's figures, the paper's, and why they differ
    (``scripts/barley_table1.py``)."""
    data = _barley()
    cols = ("W", "X", "Z2", "Z4")
    out = []
    for r in data["rows"]:
        paper = r["paper_mib"]
        why = r["difference"] or ("same" + (f"; {r['note']}" if r["note"] else ""))
        out.append([f"`{r['layer']}`", "×".join(map(str, r["input_shape"][1:])),
                    *(f"{r['edgetl_mib'][c]:.2f}" for c in cols),
                    " / ".join(f"{paper[c]:.2f}" for c in cols) if paper else "(no row)", why])
    pool = data["pooling"]
    return _table(["conv (torchvision name)", "input C×H×W", "W", "X", "Z 2×2", "Z 4×4",
                   "paper: W / X / Z 2×2 / Z 4×4", "difference"], out,
                  ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---"]) + (
        f"\nMiB, batch {data['batch_size']}, {data['resolution']} px, {data['dtype']}; Z = `{pool['op']}` with "
        f"ceil_mode={pool['ceil_mode']}. Written by `{data['command']}`.\n")


def render_barley_table1_totals() -> str:
    """The sums of Barley & Fröning's Table 1 against edgetl's over the same and over all convs."""
    data = _barley()
    paper = data["paper_sum"]
    pct = paper["percent_printed"]
    out = [[paper["label"] + " (as printed)", str(sum(r["paper_mib"] is not None for r in data["rows"])), f"{paper['mib']['W']:.2f}",
            f"{paper['mib']['X']:.2f}", f"{paper['mib']['Z2']:.2f} ({pct['Z2']}%)",
            f"{paper['mib']['Z4']:.2f} ({pct['Z4']}%)", paper["how"]]]
    for t in data["totals"]:
        m, share = t["mib"], t["percent_of_X"]
        out.append([t["label"], str(t["rows"]), f"{m['W']:.2f}", f"{m['X']:.2f}",
                    f"{m['Z2']:.2f} ({share['Z2'] - 100:.0f}%)", f"{m['Z4']:.2f} ({share['Z4'] - 100:.0f}%)",
                    t["difference"] or "same as the paper's Sum row"])
    return _table(["sum", "convs", "W", "X", "Z 2×2", "Z 4×4", "difference"], out,
                  ["---", "---:", "---:", "---:", "---:", "---:", "---"])


RESNET_PAPER = {  # the seeds' own figures beside edgetl's rows (quoted, not computed)
    "pool2": "29 % lower overall peak (Barley & Fröning, ResNet-18, batch 32)",
    "pool4": "36 % lower overall peak (Barley & Fröning)",
}


def render_resnet_peaks() -> str:
    """ResNet-18 full fine-tuning at batch 32 and ResNet-50 Rep-Net, measured beside predicted
    (``scripts/resnet_peaks.py``)."""
    data = json.loads((BENCH / "resnet_peaks_224.json").read_text())
    rows = data["rows"]
    stock = {r["table"]: r["measured_bytes"] for r in rows if r["lean"] is None}
    out = []
    for r in rows:
        base = stock[r["table"]]
        below = "-" if r["lean"] is None else f"{1 - r['measured_bytes'] / base:.0%}"
        same = "=" if r["measured_bytes"] == r["predicted_bytes"] else f"{r['predicted_bytes'] / 1e6:,.2f}"
        paper = RESNET_PAPER.get((r["lean"] or {}).get("storage", ""), "") if r["arch"] == "resnet18" and \
            not r["step"] and not (r["lean"] or {}).get("uint8_input") else ""
        out.append([f"{r['arch']}", r["row"], str(r["batch_size"]), f"{r['stored_bytes'] / 1e6:,.1f}",
                    f"{r['measured_bytes'] / 1e6:,.2f}", same, below, r["peak_block"], paper])
    exact = sum(r["measured_bytes"] == r["predicted_bytes"] for r in rows)
    caption = (f"\n{data['resolution']} px, {data['num_classes']} classes, {data['optimizer'].capitalize()}, CPU, "
               f"torch {data['torch']}, random weights; MB = 10^6 B; predicted \"=\": the runtime accounting's "
               f"prediction equals the measured peak to the byte ({exact} of {len(rows)} rows). \"below stock\": "
               f"against the same table's stock row; \"stored\": kept for backward at the end of the forward; \"peak in\": "
               f"the block whose backward or forward the peak falls in.\n")
    return _table(["backbone", "configuration", "batch", "stored MB", "measured peak MB", "predicted MB",
                   "below stock", "peak in", "the paper's figure"], out,
                  ["---", "---", "---:", "---:", "---:", "---:", "---:", "---", "---"]) + caption


def render_resnet_plans() -> str:
    """``edgetl plan --verify`` on ResNet-18 and ResNet-50 (``scripts/resnet_peaks.py``)."""
    data = json.loads((BENCH / "resnet_peaks_224.json").read_text())
    out = [[p["arch"], f"{p['budget_bytes'] / 1e6:.0f} MB", str(p["batch_size"]), p["chosen"].replace(" | ", "; "),
            f"{p['predicted_bytes'] / 1e6:.2f}", f"{p['measured_bytes'] / 1e6:.2f}",
            "yes" if p["measured_bytes"] == p["predicted_bytes"] else "no"] for p in data["plans"]]
    caption = (f"\n`edgetl plan --backbone ARCH --budget B --batch-size 8 --num-classes {data['num_classes']} "
               f"--verify` at {data['resolution']} px (random weights, CPU, torch {data['torch']}); measured: 3 real "
               f"steps of the planned network; MB = 10^6 B.\n")
    return _table(["backbone", "budget", "batch", "the plan's pick", "predicted MB", "measured MB", "equal"], out,
                  ["---", "---:", "---:", "---", "---:", "---:", "---"]) + caption


def render_tested_on() -> str:
    summary = BENCH / "jetson_check_summary.json"
    if not (summary.is_file() and (SCRIPTS / "tested_on.py").is_file()):
        return TESTED_ON_PLACEHOLDER
    host = BENCH / "host_check_summary.json"  # the same checks natively on x86-64, when committed
    summaries = [summary, host] if host.is_file() else [summary]
    return _script("tested_on").render([json.loads(p.read_text()) for p in summaries])


RENDERERS: dict[str, tuple[Callable[[], str], str]] = {
    "results": (render_results, "benchmarks/table1_224.json"),
    "table1": (render_table1, "benchmarks/table1_224.json"),
    "table1-resnet18": (render_table1_resnet18, "benchmarks/bench_resnet18_224.json (edgetl bench --backbone resnet18)"),
    "cuda-h100": (render_cuda, "benchmarks/cuda_h100_bench.json"),
    "cuda-accounting": (render_cuda_accounting, "benchmarks/cuda_h100_figures.json"),
    "cuda-allocator": (render_cuda_allocator, "benchmarks/cuda_h100_allocator.json"),
    "cuda-graphs": (render_cuda_graphs, "benchmarks/cuda_h100_graphs_summary.json"),
    "cuda-parity": (render_cuda_parity, "benchmarks/cuda_h100_figures.json"),
    "levers": (render_levers, "benchmarks/levers_accuracy.json"),
    "levers-grad": (render_levers_grad, "benchmarks/levers_accuracy.json"),
    "storage": (render_storage, "benchmarks/storage_accuracy.json"),
    "stream": (render_stream, "benchmarks/stream_figures_224.md"),
    "paper-model": (render_paper_model, "benchmarks/paper_figures_224.json (scripts/paper_figures.py)"),
    "prune": (render_prune, "benchmarks/paper_figures_224.json (scripts/paper_figures.py)"),
    "step-peaks-repnet": (render_step_peaks_repnet, "benchmarks/step_peaks_224.json (scripts/step_peaks.py)"),
    "step-peaks-full": (render_step_peaks_full, "benchmarks/step_peaks_224.json (scripts/step_peaks.py)"),
    "demo": (render_demo, "benchmarks/demo_report.json (edgetl demo's report.json)"),
    "step-ops": (render_step_ops, "benchmarks/step_ops_224.json (scripts/step_ops.py --json)"),
    "plan-verify": (render_plan_verify, "benchmarks/plan_verify_224.json (scripts/plan_figures.py)"),
    "step-time-parts": (render_step_time_parts,
                        "benchmarks/step_time_parts_224.json (scripts/step_time_parts.py)"),
    "busy-cores": (render_busy_cores, "benchmarks/busy_cores_*.json (scripts/busy_cores.py)"),
    "heap-policy": (render_heap_policy, "benchmarks/heap_policy.json (scripts/heap_policy.py)"),
    "barley-table1": (render_barley_table1, "benchmarks/barley_table1_resnet18.json (scripts/barley_table1.py)"),
    "barley-table1-totals": (render_barley_table1_totals,
                             "benchmarks/barley_table1_resnet18.json (scripts/barley_table1.py)"),
    "resnet-peaks": (render_resnet_peaks, "benchmarks/resnet_peaks_224.json (scripts/resnet_peaks.py)"),
    "resnet-plans": (render_resnet_plans, "benchmarks/resnet_peaks_224.json (scripts/resnet_peaks.py)"),
    "tested-on": (render_tested_on, "benchmarks/{jetson,host}_check_summary.json (scripts/tested_on.py)"),
}


def render_text(text: str, cache: dict[str, str], where: str = "") -> str:
    """The text with every marked block replaced by its render (cache: name -> render)."""
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise KeyError(f"{where}: unknown render block {name!r} (known: {', '.join(RENDERERS)})")
        if name not in cache:
            cache[name] = RENDERERS[name][0]()
        return match.group(1) + cache[name] + match.group(4)

    return BLOCK.sub(replace, text)


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def stale(root: Path = ROOT) -> dict[Path, str]:
    """Files whose marked blocks differ from their render, with a unified diff each."""
    cache: dict[str, str] = {}
    out = {}
    for path in doc_files(root):
        text = path.read_text()
        new = render_text(text, cache, str(path.relative_to(root)))
        if new != text:
            out[path] = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                     str(path.relative_to(root)), "rendered"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Blocks: " + ", ".join(RENDERERS))
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs from its render")
    p.add_argument("--list", action="store_true", help="print each block name, its source and the files using it")
    args = p.parse_args(argv)
    if args.list:
        for name, (_, source) in RENDERERS.items():
            users = [str(f.relative_to(ROOT)) for f in doc_files() if f"<!-- render:{name} -->" in f.read_text()]
            print(f"{name:16s} {source}  ->  {', '.join(users) or '(unused)'}")
        return 0
    try:
        diffs = stale()
    except (KeyError, OSError, ValueError) as exc:
        print(f"render_docs: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for diff in diffs.values():
            sys.stdout.write(diff)
        if diffs:
            print(f"render_docs: {len(diffs)} file(s) out of date: "
                  f"{', '.join(str(f.relative_to(ROOT)) for f in diffs)}; run python scripts/render_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    cache: dict[str, str] = {}
    for path in diffs:
        _atomic_write(path, render_text(path.read_text(), cache, str(path.relative_to(ROOT))))
        print(f"rendered {path.relative_to(ROOT)}")
    if not diffs:
        print("every rendered block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
