#!/usr/bin/env python3
"""The GPU check (issue #15): a device in, one folder of results out (CUDA tests, bench, facts).

One command for a bare GPU machine (no virtual environment, no network): it runs the
tests marked ``cuda`` and ``edgetl bench`` (stock Rep-Net, lean Rep-Net, the paper's
configuration, the streamed rows where edgetl has them; allocated and reserved peaks,
images/s, largest batch in the budget), and the allocator check: each bench method's
training step measured (tensor, allocated and reserved peaks) beside the runtime accounting
and the allocator model's replay of the same step (``edgetl.memory.cuda``), with PyTorch's
default allocator and, on CUDA, once more with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. It writes into ``--out``:

    summary.json        device and library facts, each part's exit code, time and test counts; ok, complete
    pytest.log          the test run's output (failures in full)
    cuda-figures.json   what the cuda tests measured (allocated, reserved, accounting, errors), pass or fail
    bench.json / .csv / .png / .md    the bench result (the .md is the docs/bench.md table)
    allocator.json      per method: runtime accounting, measured and replayed allocated/reserved peaks

On CUDA, summary.json also holds the CUDA-graph check: the whole training step captured
as ``edgetl finetune`` captures it (edgetl.train.graph.CapturedStep) and replayed, against
eager steps: how far the weights end apart, and both median step times (a row whose step
could not be captured fails the part). On CUDA the parts run what has never been measured
first: the CUDA-graph tests (keeping time for the next two), the CUDA graph check, the bench,
then every other cuda test and the allocator check with the time left.

summary.json is rewritten after every part, so a device command killed on its way still
brings back what finished: ``ok`` says that no part that ran failed, ``complete`` that the
check ended and every part ran (false in every write before the last, so a file from a
killed command never reads as a whole pass). A part left less than ``MIN_PART_S`` seconds
before ``--deadline`` is not started: ``skipped`` names it, and the check exits 1.

Eight files at most, so a device call brings every one back. ``--device cpu`` with
``--quick`` runs the same code here in seconds (``tests/test_cuda.py``), so the
check cannot rot between GPU sessions. ``scripts/gpu_check.sh`` installs the carried
torch-pruning wheel and sets PYTHONPATH first. Exit code: 0 when every part passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# stock vs lean vs the paper's configuration (pruned 0.3/0.78/0.46/0.46, k=2), and its half version
# run before the other cuda tests: the captured step's memory against the allocator model, and
# finetune captured as CUDA graphs (what has never run on a GPU)
GRAPH_TESTS = ("tests/test_cuda.py::test_captured_step_memory_equals_the_model",
               "tests/test_cuda.py::test_finetune_captured_as_cuda_graphs_trains_as_eager_does",
               "tests/test_cuda.py::test_a_step_that_cannot_be_captured_runs_on_eagerly_and_says_why")
BENCH_METHODS = ["repnet-stock", "repnet-lean", "repnet-pruned-pool2", "repnet-pruned-pool2-bf16-int8"]
# largest_cap: a streamed row's largest batch runs to hundreds, and its steps at batch 256 took
# 14 s each on an H100 (per-sample loops): the check times at most batch 32 there
FULL = {"resolution": 224, "width": 1.0, "budget": "256MB", "steps": 20, "warmup": 3, "verify_images": 64,
        "largest_cap": 32}
# graph replays after the warm-up compared with the same arithmetic run eagerly (graph_rows)
SAME_ARITHMETIC_REPLAYS = 4
MIN_PART_S = 20.0  # a part with less time than this left before the deadline is skipped, not started
QUICK = {"resolution": 64, "width": 0.35, "budget": "24MB", "steps": 1, "warmup": 0, "verify_images": 0,
         "largest_cap": 32}


def bench_methods() -> list[str]:
    """The bench rows: the fixed ones, then every streamed method edgetl defines, less the fused-kernel
    rows (their CUDA kernels are checked by tests/test_fused_masks.py)."""
    from edgetl.bench import METHODS
    from edgetl.bench.methods import fused_kernels

    return [m for m in BENCH_METHODS if m in METHODS] + [m for m in METHODS if "stream" in m
                                                         and m not in BENCH_METHODS and not fused_kernels(METHODS[m])]


def facts(device: str) -> dict:
    """Versions and the device, as this process sees them."""
    import torch

    info = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device, "cuda_available": torch.cuda.is_available(), "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "PYTHONPATH")},
    }
    for mod in ("torchvision", "torch_pruning", "onnx", "onnxruntime", "yaml", "matplotlib", "numpy"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError as exc:
            info[mod] = f"missing: {exc}"
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = {"name": p.name, "capability": [p.major, p.minor], "memory_bytes": p.total_memory,
                       "multiprocessors": p.multi_processor_count,
                       "integrated": bool(getattr(p, "is_integrated", False))}
    return info


def run_part(name: str, argv: list[str], *, log_path: Path | None, timeout_s: float,
             env: dict[str, str] | None = None, append: bool = False) -> dict:
    """Run one part in a child process (a crash or hang there cannot take the summary down);
    its output into ``log_path`` (after what is there with ``append``)."""
    start = time.perf_counter()
    print(f"== {name}: {' '.join(argv)}", flush=True)
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        rc, out = 124, text(exc.stdout) + text(exc.stderr) + f"\n{name}: timed out after {timeout_s:.0f} s\n"
    seconds = round(time.perf_counter() - start, 1)
    if log_path is not None:
        with open(log_path, "a" if append else "w") as f:
            f.write(out)
    tail = out[-3000:]
    print(tail, flush=True)
    return {"argv": argv, "rc": rc, "seconds": seconds, "tail": tail[-1500:]}


def junit_counts(path: Path) -> dict:
    """Tests, failures, errors, skips (with reasons) from a pytest junit XML file."""
    if not path.exists():
        return {"error": "no junit file"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    reasons: dict[str, int] = {}
    failed = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for child in case:
            if child.tag == "skipped":
                reason = child.get("message", "")
                reasons[reason] = reasons.get(reason, 0) + 1
            elif child.tag in ("failure", "error"):
                failed.append({"test": name, "message": (child.get("message") or "")[:500]})
    counts["skip_reasons"] = reasons
    counts["failed"] = failed
    return counts


def allocator_rows(*, device: str, methods: list[str], resolution: int, width: float, batch_size: int,
                   num_classes: int = 102, on_row=None) -> dict:
    """Each method's step: runtime accounting, measured peaks and the allocator model's replay.

    ``on_row(rows)`` is called after each method (the caller writes what is done so far: a
    part stopped at its time limit still reports the rows it finished)."""
    import torch

    from edgetl.bench import METHODS, build_method, pruned_hidden
    from edgetl.memory.cuda import (cublas_workspace_bytes, cublaslt_workspace_bytes, expandable_segments_enabled,
                                    replay_trace, step_workspace_bytes)
    from edgetl.memory.meter import measure_training_memory
    from edgetl.memory.runtime import runtime_report
    from edgetl.memory.schedule import prepare_step

    cuda = device.startswith("cuda")
    if cuda:
        p = torch.cuda.get_device_properties(torch.device(device))
        capability = (p.major, p.minor)
    else:
        capability = (8, 7)  # no device: predict for the Jetson Orin
    expandable = expandable_segments_enabled()
    workspace = cublas_workspace_bytes(capability)
    workspaces = step_workspace_bytes(capability)
    rows = []
    for name in methods:
        method = METHODS[name]
        if method.planned or method.checkpoint:
            continue  # the plan row needs the budget search; recomputation has no accounting
        torch.manual_seed(0)
        net = build_method(method, width=width, num_classes=num_classes, device=device,
                           hidden=pruned_hidden(width, num_classes) if method.pruned else {})
        if method.lean is not None:
            prepare_step(net, resolution=resolution, batch_size=batch_size)
        runtime = runtime_report(net, mode=method.mode, resolution=resolution, batch_size=batch_size).total_bytes
        got = measure_training_memory(net, resolution=resolution, batch_size=batch_size, steps=2, record_trace=True)
        replay = replay_trace(got.trace, expandable=expandable, cublas_workspace=workspace,
                              cublaslt_workspace=cublaslt_workspace_bytes())
        rows.append({
            "method": name, "runtime_bytes": runtime, "tensor_bytes": got.tensor_bytes,
            "allocated_bytes": got.allocated_bytes, "reserved_bytes": got.reserved_bytes, "other_bytes": got.other_bytes,
            "replay_allocated_bytes": replay.peaks.allocated_peak_bytes,
            "replay_reserved_bytes": replay.peaks.reserved_peak_bytes, "replay_segments": replay.peaks.segments,
            "replay_workspace_bytes": replay.workspace_bytes,
            "predicted_allocated_bytes": runtime + workspaces, "trace_events": len(got.trace),
        })
        del net, got
        if on_row is not None:
            on_row(rows)
    return {"device": device, "capability": list(capability), "expandable": expandable,
            "cublas_workspace_bytes": workspace, "step_workspace_bytes": workspaces, "resolution": resolution, "width": width,
            "batch_size": batch_size, "num_classes": num_classes, "rows": rows}


def graph_rows(*, device: str, methods: list[str], resolution: int, width: float, batch_size: int,
               steps: int = 20, num_classes: int = 102, on_row=None) -> dict:
    """The whole training step captured as CUDA graphs (edgetl.train.graph.CapturedStep, what
    ``edgetl finetune`` runs by default on CUDA), against the eager step.

    Per method: copies of the network from the same weights, each with the plain step's Adam;
    one runs ``training_step`` eagerly, one through ``CapturedStep`` (three eager warm-up steps
    on a side stream, then captured once and replayed; its Adam capturable), and one eagerly
    with its Adam capturable too (the graph's arithmetic, never captured). All see the same
    fixed batch for the same number of steps; the row gives the median step time of the first
    two (the captured step's includes copying the batch from pinned host memory into its static
    buffers) and how far the captured weights are from each eager run's:
    ``max_abs_weight_diff`` from plain Adam's at the end (capturable Adam's arithmetic differs
    by itself), ``same_arithmetic_diff`` from the capturable eager run's after the warm-up and
    ``SAME_ARITHMETIC_REPLAYS`` replays (``same_arithmetic_steps`` steps; a few, so that the
    streamed rows' slow eager steps keep the part within its time; ``same_arithmetic_exact``
    where it is 0): the graph's own difference, and cuDNN's run-to-run one where an algorithm
    it picks sums with atomics (the check leaves cuDNN as ``finetune`` runs it). A capture that
    fails is reported, not raised, and so is a capturable eager run that fails
    (``same_arithmetic_error``). ``on_row(rows)`` is called after each method, as in
    ``allocator_rows``; the result's ``compared_after_steps`` is the steps each network has
    taken when ``max_abs_weight_diff`` is read.
    """
    import statistics

    import torch

    # the bench's own trainers: the eager one, and its twin captured through CapturedStep
    from edgetl.bench import METHODS, _Trainer, _graph_trainer, build_method, interleaved_step_times, pruned_hidden
    from edgetl.errors import one_line
    from edgetl.memory.schedule import prepare_step
    from edgetl.train.graph import WARMUP_STEPS, make_capturable

    dev = torch.device(device)
    taken = WARMUP_STEPS + 1 + SAME_ARITHMETIC_REPLAYS  # a captured copy's steps when its weights are kept
    rows = []
    for name in methods:
        method = METHODS[name]
        if method.planned or method.checkpoint:
            continue
        torch.manual_seed(0)
        net = build_method(method, width=width, num_classes=num_classes, device=dev,
                           hidden=pruned_hidden(width, num_classes) if method.pruned else {})
        if method.lean is not None:
            prepare_step(net, resolution=resolution, batch_size=batch_size)
        for m in net.modules():  # dropout draws random masks: eager and replay would differ
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        kwargs = dict(resolution=resolution, batch_size=batch_size, num_classes=num_classes, device=dev,
                      lr=1e-3, seed=1)
        graph, error = _graph_trainer(lambda: copy.deepcopy(net), **kwargs)  # warmed up and captured
        row: dict = {"method": name}
        if graph is None:
            row["capture_error"] = error
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            continue
        same = copy.deepcopy(net)  # before the eager run's steps change ``net``
        for _ in range(SAME_ARITHMETIC_REPLAYS):
            graph.step()
        replayed = {k: v.detach().clone() for k, v in graph.net.state_dict().items()}
        eager = _Trainer(net, **kwargs)
        for _ in range(taken):
            eager.step()
        times = interleaved_step_times({"eager": eager, "graph": graph}, steps=steps, warmup=0)
        row.update({
            "eager_step_s": statistics.median(times["eager"]), "graph_step_s": statistics.median(times["graph"]),
            "speedup": statistics.median(times["eager"]) / statistics.median(times["graph"]),
            "max_abs_weight_diff": weight_diff(eager.net.state_dict(), graph.net.state_dict()),
            "graphs": graph.captured.describe(), "capture_s": sum(graph.captured.capture_seconds),
        })
        twin = None
        try:  # the graph's arithmetic run eagerly, as many steps as ``replayed`` had taken
            twin = _Trainer(same, **kwargs)
            make_capturable(twin.opt, dev, tensor_lr=False)
            for _ in range(taken):
                twin.step()
            row["same_arithmetic_diff"] = weight_diff(twin.net.state_dict(), replayed)
            row["same_arithmetic_steps"] = taken
            row["same_arithmetic_exact"] = row["same_arithmetic_diff"] == 0.0
        except Exception as exc:  # noqa: BLE001 - reported in its row; the graph's figures stand
            row["same_arithmetic_error"] = one_line(exc)
        finally:
            twin = same = replayed = None  # off the device before the next method's capture
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return {"device": device, "resolution": resolution, "width": width, "batch_size": batch_size,
            "steps": steps, "compared_after_steps": taken + steps, "rows": rows}


def weight_diff(sa: dict, sb: dict) -> float:
    """The largest absolute difference between two networks' floating-point states
    (``state_dict``: parameters and buffers, name by name)."""
    if sa.keys() != sb.keys():
        raise ValueError("the two networks' state differs in its names")
    return max((float((sa[k].float() - sb[k].float()).abs().max()) for k in sa if sa[k].is_floating_point()),
               default=0.0)


def _child_result(key: str, part: dict, tmp: Path) -> dict:
    """A child's JSON (``{key: data}``: whatever its exit code, where it wrote the file whole), or
    the rows it finished before it stopped; removes its files."""
    data = None
    for path in (tmp, Path(f"{tmp}.partial")):
        if data is None and path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:  # killed while writing it
                pass
        path.unlink(missing_ok=True)
    return {} if data is None else {key: data}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--out", default="gpu-results", help="results folder (created)")
    ap.add_argument("--quick", action="store_true", help="tiny bench: width 0.35, 64 px, one timed round")
    ap.add_argument("--tests", default="tests", help="pytest paths for the cuda-marked tests (space-separated)")
    ap.add_argument("--no-tests", action="store_true", help="skip the test run")
    ap.add_argument("--no-bench", action="store_true", help="skip the bench")
    ap.add_argument("--methods", help="bench methods, comma-separated (default: " + ",".join(BENCH_METHODS)
                    + " and the streamed ones)")
    ap.add_argument("--batch-size", type=int, default=8, help="bench batch size")
    ap.add_argument("--budget", help="bench budget for the largest-batch column (default 256MB, --quick 24MB)")
    ap.add_argument("--no-allocator", action="store_true", help="skip the allocator check")
    ap.add_argument("--test-timeout", type=float, default=240, help="seconds for the test run")
    ap.add_argument("--bench-timeout", type=float, default=180, help="seconds for the bench")
    ap.add_argument("--allocator-timeout", type=float, default=60, help="seconds for each allocator run")
    ap.add_argument("--allocator-json", help=argparse.SUPPRESS)  # a child process: measure, write, exit
    ap.add_argument("--graphs-json", help=argparse.SUPPRESS)  # a child process: CUDA graph check, write, exit
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA graph check (CUDA only)")
    ap.add_argument("--graphs-timeout", type=float, default=90, help="seconds for the CUDA graph check")
    ap.add_argument("--deadline", type=float, default=570,
                    help="seconds for everything (a device command is killed at 600): later parts get what is left")
    args = ap.parse_args(argv)
    scale = QUICK if args.quick else FULL
    methods = args.methods or ",".join(bench_methods())
    for child, rows_of in ((args.allocator_json, "allocator_rows"), (args.graphs_json, "graph_rows")):
        if child:  # a child process: measure, writing the rows finished so far after each method
            sys.path.insert(0, str(ROOT))
            path = Path(child)
            partial = Path(f"{child}.partial")

            def write_partial(rows, path=partial):
                path.write_text(json.dumps({"partial": True, "rows": rows}, indent=2) + "\n")

            data = globals()[rows_of](device=args.device, methods=methods.split(","),
                                      resolution=scale["resolution"], width=scale["width"],
                                      batch_size=args.batch_size, on_row=write_partial)
            path.write_text(json.dumps(data, indent=2) + "\n")
            partial.unlink(missing_ok=True)
            # a row whose step could not be captured is a failed part: the check does not pass
            return 1 if any("capture_error" in row for row in data["rows"]) else 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    started = time.perf_counter()
    summary: dict = {"command": [sys.executable, *sys.argv], "facts": facts(args.device), "parts": {}}
    cuda = args.device.startswith("cuda")
    if cuda and not summary["facts"]["cuda_available"]:
        summary["error"] = "--device cuda but torch sees no CUDA device"
    py = sys.executable

    def time_left() -> float:
        return args.deadline - (time.perf_counter() - started)

    def budget(own: float, keep: float = 0.0) -> float:  # what a part may take, so summary.json is
        # always written; ``keep``: seconds left for the parts after it that must run
        return max(5.0, min(own, time_left() - keep))

    def no_time(name: str) -> bool:
        """Whether part ``name`` has too little time left to start (then recorded as skipped)."""
        left = time_left()
        if left >= MIN_PART_S:
            return False
        summary["parts"][name] = {"skipped": f"{left:.0f} s left before --deadline {args.deadline:.0f} s"}
        print(f"== {name}: skipped, {left:.0f} s left before the deadline", flush=True)
        save()
        return True

    def save(final: bool = False) -> bool:
        """Write summary.json as it stands (after every part; ``final``: the check has ended)."""
        ran = [p for p in summary["parts"].values() if "rc" in p]
        summary["seconds"] = round(time.perf_counter() - started, 1)
        summary["ok"] = "error" not in summary and all(p["rc"] == 0 for p in ran)
        summary["skipped"] = [name for name, p in summary["parts"].items() if "skipped" in p]
        summary["complete"] = final and summary["ok"] and not summary["skipped"]
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary["complete"]

    # On CUDA, what has never been measured comes first: the CUDA-graph tests (the default test
    # paths), keeping time for the CUDA graph check and the bench, which follow; every other cuda
    # test after the bench (they ran on earlier GPUs), then the allocator check with whatever
    # time is left. Elsewhere: the tests, the bench, the allocator check. One log, one figures
    # file (each test run adds to it).
    graphs_first = cuda and not args.no_graphs
    first = list(GRAPH_TESTS) if cuda and args.tests == "tests" else []
    test_runs = [("tests (CUDA graphs)", first)] if first else []
    test_runs.append(("tests", [*args.tests.split(), *(f"--deselect={t}" for t in first)]))
    logged = [False]  # whether pytest.log has a run's output (a later run appends)

    def run_tests(runs: list[tuple[str, list[str]]], keep: float) -> None:
        for name, paths in runs:
            if no_time(name):
                continue
            junit = out / "junit.xml"
            part = run_part(name, [py, "-m", "pytest", "-m", "cuda", "-rs", "-p", "no:cacheprovider",
                                   f"--junitxml={junit}", *paths],
                            log_path=out / "pytest.log", append=logged[0],
                            timeout_s=budget(args.test_timeout, keep=keep),
                            env={"EDGETL_CUDA_FIGURES": str(out / "cuda-figures.json")})
            logged[0] = True
            part["counts"] = junit_counts(junit)
            junit.unlink(missing_ok=True)  # its figures are in summary.json: fewer files to bring back
            summary["parts"][name] = part
            save()

    if not args.no_tests:
        keep = (min(args.graphs_timeout, 90) + (0 if args.no_bench else min(args.bench_timeout, 120))
                if graphs_first else 0)
        run_tests(test_runs[:1] if first else test_runs, keep=keep)

    if cuda and not args.no_graphs and not no_time("graphs"):  # results go into summary.json: 8 files at most
        tmp = out / ".graphs.json"
        part = run_part("CUDA graph of the whole step", [
            py, str(Path(__file__).resolve()), "--device", args.device, "--methods", methods,
            "--batch-size", str(args.batch_size), "--graphs-json", str(tmp)] + (["--quick"] if args.quick else []),
            log_path=None, timeout_s=budget(args.graphs_timeout))
        summary.update(_child_result("graphs", part, tmp))
        summary["parts"]["graphs"] = part
        save()

    if not args.no_bench and not no_time("bench"):
        common = [py, "-m", "edgetl", "bench", "--device", args.device, "--methods", methods,
                  "--resolution", str(scale["resolution"]), "--width", str(scale["width"]),
                  "--batch-size", str(args.batch_size), "--budget", args.budget or scale["budget"],
                  "--steps", str(scale["steps"]), "--warmup", str(scale["warmup"]),
                  "--verify-images", str(scale["verify_images"]), "--largest-cap", str(scale["largest_cap"])]
        files = ["--json", str(out / "bench.json"), "--csv", str(out / "bench.csv"), "--plot", str(out / "bench.png")]
        part = run_part("bench", common + files, log_path=None, timeout_s=budget(args.bench_timeout))
        if part["rc"] == 0:
            from edgetl.bench import BenchResult, to_markdown

            (out / "bench.md").write_text(to_markdown(BenchResult.load_json(out / "bench.json")))
        summary["parts"]["bench"] = part
        save()

    if not args.no_tests and first:
        run_tests(test_runs[1:], keep=0)

    if not args.no_allocator:
        # a fresh process each: the allocator setting is read once, when CUDA starts
        settings = {"default": "", "expandable": "expandable_segments:True"} if cuda else {"default": ""}
        merged = {}
        for key, conf in settings.items():
            if no_time(f"allocator-{key}"):
                continue
            tmp = out / f".allocator-{key}.json"
            argv_ = [py, str(Path(__file__).resolve()), "--device", args.device, "--methods", methods,
                     "--batch-size", str(args.batch_size), "--allocator-json", str(tmp)] + (["--quick"] if args.quick else [])
            part = run_part(f"allocator ({key})", argv_, log_path=None, timeout_s=budget(args.allocator_timeout),
                            env={"PYTORCH_CUDA_ALLOC_CONF": conf})
            summary["parts"][f"allocator-{key}"] = part
            merged.update(_child_result(key, part, tmp))
            (out / "allocator.json").write_text(json.dumps(merged, indent=2) + "\n")
            save()

    complete = save(final=True)
    said = "passed" if complete else ("FAILED" if not summary["ok"] else
                                      f"passed what ran; skipped at the deadline: {', '.join(summary['skipped'])}")
    print(f"gpu check {said} in {summary['seconds']} s; results in {out}", flush=True)
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
