"""The bench's result: measured rows in; ratios, the JSON/CSV record, tables and the plot out."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import edgetl.models.archs as archs
from edgetl.errors import ConfigError
from edgetl.memory.report import MB


@dataclass
class BenchRow:
    """One method's figures. Bytes are whole bytes; ``None`` where a view does not model the method."""

    method: str
    label: str
    mode: str
    runtime: str  # "stock", "lean" or "stock+checkpoint"
    lean: dict | None
    hidden: dict[str, int]
    trainable_params: int
    paper_bytes: int | None
    runtime_bytes: int | None
    measured_bytes: int
    images_per_s: float
    step_seconds: list[float]
    largest_batch: int
    largest_batch_source: str  # "runtime" (accounting) or "measured" (meter bisection)
    largest_batch_bytes: int | None  # at largest_batch, by largest_batch_source
    next_batch_bytes: int | None  # at largest_batch + 1, by largest_batch_source
    largest_batch_measured_bytes: int | None  # measured at largest_batch (verification), if run
    memory_ratio: float | None = None  # measured / reference measured
    throughput_ratio: float | None = None  # images/s / reference images/s
    note: str = ""
    reserved_bytes: int | None = None  # CUDA: max_memory_reserved over the measured steps
    tensor_bytes: int | None = None  # CUDA: live tensor peak (storage meter) over the same steps
    step_ops: int | None = None  # aten ops one training step dispatches (GPU: kernel launches)
    forward_ops: int | None = None  # of which in the network's forward
    unstreamed: str | None = None  # a streamed row's unstreamed twin
    unstreamed_throughput_ratio: float | None = None  # images/s / the twin's images/s
    largest_images_per_s: float | None = None  # throughput at largest_batch (seed 003: what memory buys)
    largest_step_seconds: list[float] = field(default_factory=list)  # the steps it is the median of
    largest_timed_batch: int | None = None  # the batch timed: largest_batch, or the bench's cap
    # CUDA: the same step captured as CUDA graphs (edgetl.train.graph), timed beside the eager one
    graph_images_per_s: float | None = None
    graph_step_seconds: list[float] = field(default_factory=list)
    graph_throughput_ratio: float | None = None  # graph images/s / the reference row's eager images/s
    largest_graph_images_per_s: float | None = None  # at largest_timed_batch, captured
    graph_error: str | None = None  # why the step could not be captured (the row keeps its eager figures)


@dataclass
class BenchResult:
    """The benchmark table and how it was made."""

    resolution: int
    batch_size: int
    num_classes: int
    width: float
    budget_bytes: int
    steps: int
    warmup: int
    optimizer: str
    device: str
    threads: int
    torch_version: str
    reference: str
    rows: list[BenchRow] = field(default_factory=list)
    command: str | None = None
    cpu: str | None = None  # the processor, on CPU (``edgetl.bench.cpu_name``)
    # OpenMP's wait policy when timed on CPU ("PASSIVE", "ACTIVE", "unset"; None: not recorded,
    # files from before it was): idle threads that spin make every op cheaper alone and a shared
    # machine's steps 10-200x slower (benchmarks/busy_cores.json)
    omp_wait_policy: str | None = None
    # the CPU heap policy when timed on CPU (``edgetl.heap.heap_policy``; None: not recorded, files
    # from before it was, whose steps ran on glibc's default): a step that maps its freed memory
    # back in each time runs up to 1.5x slower, and unequally by row
    heap: str | None = None
    # the backbone (a registered architecture); files from before the bench took one are MobileNetV2's
    arch: str = archs.DEFAULT_ARCH

    def row(self, method: str) -> BenchRow:
        for r in self.rows:
            if r.method == method:
                return r
        raise KeyError(method)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchResult":
        data = dict(data)
        data["rows"] = [BenchRow(**r) for r in data["rows"]]
        return cls(**data)

    def save_json(self, path: str | Path) -> None:
        from edgetl.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load_json(cls, path: str | Path) -> "BenchResult":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"cannot read bench results {path}: {exc}") from None

    def save_csv(self, path: str | Path) -> None:
        from edgetl.io import atomic_write_text

        lists = ("step_seconds", "largest_step_seconds", "graph_step_seconds")
        cols = [f.name for f in dataclasses.fields(BenchRow) if f.name not in ("lean", "hidden", *lists)]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(cols + ["lean", "hidden", *lists])
        for r in self.rows:
            d = dataclasses.asdict(r)
            writer.writerow([("" if d[c] is None else d[c]) for c in cols]
                            + [json.dumps(d["lean"]), json.dumps(d["hidden"])]
                            + [" ".join(f"{s:.4f}" for s in d[name]) for name in lists])
        atomic_write_text(path, buf.getvalue())


def set_ratios(result: BenchResult) -> None:
    """Memory and throughput ratios against the reference row (None without it), and each
    streamed row's throughput against its unstreamed twin."""
    _set_unstreamed_ratios(result)
    try:
        ref = result.row(result.reference)
    except KeyError:
        return
    for row in result.rows:
        row.memory_ratio = row.measured_bytes / ref.measured_bytes
        row.throughput_ratio = row.images_per_s / ref.images_per_s
        if row.graph_images_per_s is not None:
            row.graph_throughput_ratio = row.graph_images_per_s / ref.images_per_s


def _set_unstreamed_ratios(result: BenchResult) -> None:
    """A streamed row's speed against its unstreamed twin, where the twin ran too."""
    names = {r.method: r for r in result.rows}
    for row in result.rows:
        twin = names.get(row.unstreamed) if row.unstreamed else None
        row.unstreamed_throughput_ratio = None if twin is None else row.images_per_s / twin.images_per_s


# ----------------------------------------------------------------------------- rendering


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / MB:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _unstreamed(row: BenchRow) -> str:
    if row.unstreamed_throughput_ratio is None:
        return ""
    return f" ({row.unstreamed_throughput_ratio:.2f}x unstreamed)"


def _ops(row: BenchRow) -> str:
    return "-" if row.step_ops is None else f"{row.step_ops:,} ({row.forward_ops:,})"


def _at_largest(row: BenchRow) -> str:
    if row.largest_images_per_s is None:
        return "-"
    capped = f" (at batch {row.largest_timed_batch})" if row.largest_timed_batch != row.largest_batch else ""
    return f"{row.largest_images_per_s:.1f}{capped}"


def has_graphs(result: BenchResult) -> bool:
    """Whether the result timed captured steps (CUDA graph columns)."""
    return any(r.graph_images_per_s is not None or r.graph_error for r in result.rows)


def _graph_cells(row: BenchRow) -> list[str]:
    if row.graph_images_per_s is None:
        return ["not captured", "-", "-"]
    largest = "-" if row.largest_graph_images_per_s is None else f"{row.largest_graph_images_per_s:.1f}"
    return [f"{row.graph_images_per_s:.1f}", _ratio(row.graph_throughput_ratio), largest]


def has_reserved(result: BenchResult) -> bool:
    """Whether the result comes from a CUDA device (allocated and reserved columns)."""
    return any(r.reserved_bytes is not None for r in result.rows)


def table_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells (MB = 10^6 B) shared by the terminal and markdown tables.

    On CUDA "measured" is split into the allocator's allocated and reserved peaks, and where the
    bench timed captured steps their images/s stand beside the eager ones.
    """
    cuda, graphs = has_reserved(result), has_graphs(result)
    measured = ["allocated MB", "reserved MB"] if cuda else ["measured MB"]
    headers = ["method", "trainable params", "paper MB", "runtime MB", *measured, "memory vs Rep-Net",
               "images/s", "speed vs Rep-Net", "ops/step (forward)",
               f"largest batch in {result.budget_bytes / MB:g} MB", "images/s at largest batch"]
    if graphs:
        headers += ["images/s, CUDA graph", "graph vs Rep-Net eager", "images/s at largest batch, CUDA graph"]
    rows = []
    for r in result.rows:
        batch = str(r.largest_batch) + (" (measured)" if r.largest_batch_source == "measured" else "")
        cells = [_mb(r.measured_bytes), _mb(r.reserved_bytes)] if cuda else [_mb(r.measured_bytes)]
        rows.append([r.label, f"{r.trainable_params:,}", _mb(r.paper_bytes), _mb(r.runtime_bytes),
                     *cells, _ratio(r.memory_ratio), f"{r.images_per_s:.1f}",
                     _ratio(r.throughput_ratio) + _unstreamed(r), _ops(r), batch,
                     _at_largest(r), *(_graph_cells(r) if graphs else [])])
    return headers, rows


def backbone_title(result: BenchResult) -> str:
    """The backbone as captions name it: "MobileNetV2 0.35" (its width multiplier), "ResNet-18"."""
    try:
        entry = archs.get(result.arch)
    except ConfigError:  # a result of an architecture this edgetl does not register
        return f"{result.arch} {result.width:g}" if result.width != 1.0 else result.arch
    return f"{entry.title} {result.width:g}" if entry.width_multiplier else entry.title


def caption(result: BenchResult) -> str:
    return (f"{backbone_title(result)}, {result.resolution} px, batch {result.batch_size}, "
            f"{result.num_classes} classes, Adam, {result.device} ("
            f"{result.cpu + '; ' if result.cpu else ''}{result.threads} thread"
            f"{'s' if result.threads != 1 else ''}"
            f"{', OpenMP wait policy ' + result.omp_wait_policy if result.omp_wait_policy else ''}"
            f"{', heap: ' + result.heap if result.heap else ''}"
            f", torch {result.torch_version}); throughput: median of "
            f"{result.steps} interleaved steps after {result.warmup} warm-up; MB = 10^6 bytes")


def _measured_text(result: BenchResult) -> str:
    if has_reserved(result):
        return ("Allocated / reserved: the CUDA caching allocator's max_memory_allocated / "
                "max_memory_reserved over real training steps (the CUDA context excluded).")
    return "Measured: peak live tensor bytes over real training steps."


def to_markdown(result: BenchResult) -> str:
    """The bench table (docs/bench.md), rendered from a result (e.g. a committed JSON)."""
    headers, rows = table_rows(result)
    right = [":---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    lines.append(caption(result) + ".")
    lines.append("Paper accounting: the TinyTL/Rep-Net profiler (4 B activations, 8-bit frozen weights, "
                 "stock modules: it models neither pooling, bf16 nor the lean layers). Runtime accounting: "
                 "edgetl's model of what its runtime holds. " + _measured_text(result)
                 + " Ops/step: the aten ops one training step dispatches (each a kernel launch on a "
                 "GPU; the bench counts its second measured step), the forward's in brackets."
                 + " Largest batch by runtime accounting (\"measured\": by the meter); images/s at "
                 "largest batch: the median of a few steps at that batch (at most the bench's cap), each "
                 "method on its own (Liu et al.: what the memory saved buys).")
    if has_graphs(result):
        lines.append("CUDA graph: the same step captured as CUDA graphs and replayed, as edgetl finetune runs "
                     "it on CUDA (3 eager warm-up steps, then one capture; the batch copied in from pinned "
                     "host memory counts), timed interleaved with the eager steps; \"graph vs Rep-Net eager\": "
                     "against the reference row's eager images/s.")
    notes = [f"{r.label}: {r.note}" for r in result.rows if r.note]
    notes += [f"{r.label}: not captured ({r.graph_error})" for r in result.rows if r.graph_error]
    if notes:
        lines.append("Notes: " + "; ".join(notes) + ".")
    if result.command:
        lines.append("")
        lines.append(f"Made with `{result.command}`.")
    return "\n".join(lines) + "\n"


def plot_bench(result: BenchResult, path: str | Path) -> None:
    """PNG: measured peak per method as bars with paper/runtime markers; throughput beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgetl.io import PNG_SOFTWARE, atomic_write_bytes

    rows = result.rows
    idx = list(range(len(rows)))
    labels = [r.label.replace(", ", ",\n").replace(" + ", "\n+ ") for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(17, 7.5), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    ax.bar(idx, [r.measured_bytes / MB for r in rows], color="#337ab7",
           label="allocated peak (CUDA)" if has_reserved(result) else "measured peak")
    pi = [i for i, r in enumerate(rows) if r.paper_bytes is not None]
    ri = [i for i, r in enumerate(rows) if r.runtime_bytes is not None]
    ax.plot(pi, [rows[i].paper_bytes / MB for i in pi], "o", color="#d9534f", label="paper accounting")
    ax.plot(ri, [rows[i].runtime_bytes / MB for i in ri], "x", color="k", ms=9, label="runtime accounting")
    si = [i for i, r in enumerate(rows) if r.reserved_bytes is not None]
    if si:
        ax.plot(si, [rows[i].reserved_bytes / MB for i in si], "_", color="#f0ad4e", ms=22, mew=3,
                label="CUDA reserved")
    for i, r in enumerate(rows):
        ax.annotate(f"{r.measured_bytes / MB:.0f}", (i, r.measured_bytes / MB), ha="center",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("training memory, MB (10^6 B), log scale")
    ax.set_xticks(idx, labels, rotation=70, ha="right", fontsize=7)
    ax.set_title(f"memory at batch {result.batch_size}")
    ax.legend(fontsize=8)
    bx.barh([i - 0.2 for i in idx], [r.images_per_s for r in rows], height=0.4, color="#5cb85c",
            label=f"at batch {result.batch_size}")
    li = [i for i, r in enumerate(rows) if r.largest_images_per_s is not None]
    if li:
        bx.barh([i + 0.2 for i in li], [rows[i].largest_images_per_s for i in li], height=0.4,
                color="#9fd49f", hatch="//", label=f"at the largest batch in {result.budget_bytes / MB:g} MB")
    for i, r in enumerate(rows):
        bx.annotate(f"{r.images_per_s:.1f}", (r.images_per_s, i - 0.2), va="center", xytext=(3, 0),
                    textcoords="offset points", fontsize=7)
        if r.largest_images_per_s is not None:
            bx.annotate(f"{r.largest_images_per_s:.1f} (b{r.largest_timed_batch})", (r.largest_images_per_s, i + 0.2),
                        va="center", xytext=(3, 0), textcoords="offset points", fontsize=7)
    gi = [i for i, r in enumerate(rows) if r.graph_images_per_s is not None]
    if gi:
        bx.plot([rows[i].graph_images_per_s for i in gi], [i - 0.2 for i in gi], "D", color="#2e6b2e", ms=5,
                label=f"at batch {result.batch_size}, captured as CUDA graphs")
    bx.legend(fontsize=7, loc="lower right")
    bx.set_yticks(idx, [r.label for r in rows], fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("training throughput, images/s (median)")
    bx.set_title("speed")
    fig.suptitle(caption(result), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": PNG_SOFTWARE})  # edgetl may replace it later
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
