"""CUDA (issue #15): the allocator model's terms checked here; the lean runtime, the meter and the
training loops checked on a real GPU (marker ``cuda``, skipped without one, with the reason).

On a GPU machine: ``bash scripts/gpu_check.sh --device cuda --out DIR`` (docs/cuda.md) runs
the ``cuda`` tests and writes the figures they measured to ``$EDGETL_CUDA_FIGURES`` (JSON),
passing or not, so a failure still tells by how much.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edgetl.memory.cuda import (
    CUBLAS_WORKSPACE_DEFAULT, CUBLAS_WORKSPACE_SM90, LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE,
    CUBLASLT_WORKSPACE_DEFAULT, CachingAllocatorModel, cublas_workspace_bytes, cublaslt_workspace_bytes,
    expandable_segments_enabled, replay_captured, replay_trace, round_block, step_workspace_bytes,
    rounding_bytes, segment_bytes, should_split,
)
from edgetl.memory.meter import measure_training_memory

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
HAVE_CUDA = torch.cuda.is_available()
CUDA_REASON = "needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine, docs/cuda.md)"


def cuda(fn):
    """Marker ``cuda`` + skip with the reason where torch sees no CUDA device."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAVE_CUDA, reason=CUDA_REASON)(fn))


# ============================================================================ allocator terms (any machine)


def test_block_rounding_and_segment_sizes():
    """c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
    kMinLargeAlloc 10 MiB, kLargeBuffer 20 MiB, kRoundLarge 2 MiB."""
    assert [round_block(n) for n in (0, 1, 511, 512, 513, 1000, 1024)] == [0, 512, 512, 512, 1024, 1024, 1024]
    assert round_block(3 * 224 * 224 * 8 * 4) == 4816896  # the 224 px batch of 8: already a multiple of 512
    assert rounding_bytes([1, 512, 513, 4]) == 511 + 0 + 511 + 508
    assert segment_bytes(512) == segment_bytes(SMALL_SIZE) == SMALL_BUFFER
    assert segment_bytes(SMALL_SIZE + 512) == segment_bytes(10 * MiB - 512) == LARGE_BUFFER
    assert segment_bytes(10 * MiB) == 10 * MiB
    assert segment_bytes(10 * MiB + 512) == 12 * MiB
    # small pool splits down to 512 B; large pool only when more than 1 MiB would remain
    assert should_split(SMALL_BUFFER, 1024) and should_split(1536, 1024) and not should_split(1024, 1024)
    assert should_split(LARGE_BUFFER, 3 * MiB) and not should_split(4 * MiB, 3 * MiB)
    assert not should_split(4 * MiB, 3 * MiB + 512) and should_split(4 * MiB, 3 * MiB, expandable=True)


def test_small_blocks_pack_into_2mib_segments():
    m = CachingAllocatorModel()
    for i in range(4):
        m.malloc(i, 500_000)  # 500,224 B blocks: four fit one 2 MiB segment
    assert (m.allocated, m.reserved) == (4 * 500_224, SMALL_BUFFER)
    m.malloc(4, 500_000)  # 5 * 500,224 > 2 MiB: a second segment
    assert (m.allocated, m.reserved) == (5 * 500_224, 2 * SMALL_BUFFER)
    m.free(1)
    m.malloc(5, 400_000)  # best fit: the freed 500,224 B hole, split (100,224 B stays free)
    assert m.reserved == 2 * SMALL_BUFFER and m.allocated == 4 * 500_224 + round_block(400_000)
    assert m.allocated_peak == 5 * 500_224
    assert m.peaks().segments == 2


def test_large_blocks_share_a_20mib_segment_and_unsplit_rests_count_as_allocated():
    m = CachingAllocatorModel()
    m.malloc("a", 3 * MiB)
    m.malloc("b", 3 * MiB)  # from the rest of the same 20 MiB segment
    assert (m.allocated, m.reserved) == (6 * MiB, LARGE_BUFFER)
    m.free("a")  # a 3 MiB hole before b
    m.malloc("c", 2 * MiB + 512 * 1024)  # the hole fits; 0.5 MiB would remain: not split
    assert m.allocated == 6 * MiB  # c counts the whole 3 MiB block
    assert m.requested == 3 * MiB + 2 * MiB + 512 * 1024
    m.malloc("d", 19 * MiB)  # >= 10 MiB: its own segment, rounded to 2 MiB (20 MiB); rest 1 MiB: whole
    assert (m.allocated, m.reserved) == (26 * MiB, 2 * LARGE_BUFFER)


def test_fragmentation_reserves_beyond_allocated_and_merging_repairs_it():
    m = CachingAllocatorModel()
    for k in "abc":
        m.malloc(k, 6 * MiB)  # 18 MiB of one 20 MiB segment; 2 MiB rest stays a free block
    m.free("a")
    m.free("c")  # merges with the 2 MiB rest: free 6 MiB at 0 and 8 MiB at 12 MiB
    m.malloc("d", 12 * MiB)  # neither hole fits: a new 12 MiB segment
    assert (m.allocated, m.reserved) == (18 * MiB, 32 * MiB)
    m.free("b")  # the first segment is whole again (6 + 6 + 8)
    m.free("d")
    m.malloc("e", 20 * MiB)  # fits the merged first segment exactly: nothing new
    assert (m.allocated, m.reserved, m.reserved_peak) == (20 * MiB, 32 * MiB, 32 * MiB)


def test_expandable_segments_grow_by_pages():
    m = CachingAllocatorModel(expandable=True)
    m.malloc("a", 6 * MiB)
    assert m.reserved == LARGE_BUFFER  # one 20 MiB page of the large pool's segment
    m.malloc("b", 6 * MiB)
    m.malloc("c", 6 * MiB)
    m.free("a")
    m.free("c")
    m.malloc("d", 12 * MiB)  # the 8 MiB free tail is extended by one more page
    assert (m.allocated, m.reserved) == (18 * MiB, 2 * LARGE_BUFFER)
    m.malloc("s", 1000)  # the small pool has its own segment, in 2 MiB pages
    assert m.reserved == 2 * LARGE_BUFFER + SMALL_BUFFER
    assert m.allocated == 18 * MiB + 1024
    m.malloc("x", 3 * MiB + 100)  # any block is split with expandable segments: exactly rounded
    assert m.allocated == 18 * MiB + 1024 + round_block(3 * MiB + 100)


def test_cublas_workspace_and_allocator_settings():
    """aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB on sm90, 4096 KiB * 2 + 16 KiB * 8 elsewhere."""
    assert cublas_workspace_bytes((9, 0), env={}) == CUBLAS_WORKSPACE_SM90 == 32 * MiB
    assert cublas_workspace_bytes((8, 7), env={}) == CUBLAS_WORKSPACE_DEFAULT == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((8, 7), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": "junk"}) == 32 * MiB
    assert cublaslt_workspace_bytes({}) == CUBLASLT_WORKSPACE_DEFAULT == MiB
    assert cublaslt_workspace_bytes({"TORCH_CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    # a step: the calling thread's cuBLAS and cuBLASLt workspaces, autograd's thread's cuBLAS one
    assert step_workspace_bytes((8, 7), env={}) == 2 * (8 * MiB + 128 * 1024) + MiB
    assert step_workspace_bytes((9, 0), env={}) == 2 * 32 * MiB + MiB
    assert expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"})
    assert not expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_enabled({})


def test_replay_of_a_real_training_trace():
    """The CPU meter's trace, replayed: unrounded peak = the meter's peak to the byte; rounding and
    packing only add; the cuBLAS workspace appears once, at the first matrix product."""
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import LeanOptions, build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=5), "repnet", lean=LeanOptions(pool=2))
    got = measure_training_memory(net, resolution=64, batch_size=4, steps=2, record_trace=True)
    assert got.allocated_bytes is None and got.reserved_bytes is None and got.peak_bytes == got.tensor_bytes
    kinds = {ev[0] for ev in got.trace}
    assert kinds == {"alloc", "free", "op", "step", "input"}
    plain = replay_trace(got.trace)
    assert plain.tensor_peak_bytes == plain.peaks.requested_peak_bytes == got.tensor_bytes
    allocs = [ev[2] for ev in got.trace if ev[0] == "alloc"]
    assert got.tensor_bytes <= plain.peaks.allocated_peak_bytes
    assert plain.peaks.allocated_peak_bytes <= got.tensor_bytes + (MIN_BLOCK - 1) * len(allocs) + SMALL_SIZE * 4
    assert plain.peaks.reserved_peak_bytes >= plain.peaks.allocated_peak_bytes
    assert plain.peaks.reserved_peak_bytes % SMALL_BUFFER == 0
    # the classifier: a biased addmm in forward, its weight gradient a matrix product in backward
    ops = [ev for ev in got.trace if ev[0] == "op"]
    assert all(len(ev) == 4 for ev in ops)
    assert {ev[1] for ev in ops if ev[3]} == {"addmm"} and not any(ev[2] for ev in ops if ev[3])
    assert any(ev[2] and ev[1] == "mm" for ev in ops) and not ops[0][2] and not ops[-1][2]  # ends with the update
    ws = replay_trace(got.trace, cublas_workspace=CUBLAS_WORKSPACE_DEFAULT,
                      cublaslt_workspace=CUBLASLT_WORKSPACE_DEFAULT)
    assert (ws.cublas_workspace_bytes, ws.cublaslt_workspace_bytes) == (2 * CUBLAS_WORKSPACE_DEFAULT, MiB)
    assert ws.workspace_bytes == step_workspace_bytes((8, 7), env={})
    assert ws.peaks.allocated_peak_bytes >= plain.peaks.allocated_peak_bytes + ws.workspace_bytes
    # batch 1: the addmm has one row, which CUDA runs on plain cuBLAS (no cuBLASLt workspace)
    from edgetl.memory.meter import StorageMeter

    lin = torch.nn.Linear(8, 3)
    for batch, lt in ((1, 0), (2, MiB)):
        with StorageMeter(record_trace=True) as meter:
            lin(torch.randn(batch, 8)).sum().backward()
        assert replay_trace(meter.trace, cublas_workspace=MiB, cublaslt_workspace=MiB).workspace_bytes == 2 * MiB + lt
    # expandable segments split every block: allocated is then the live rounded sizes exactly
    live, rounded, peak = {}, 0, 0
    for ev in got.trace:
        if ev[0] == "alloc":
            live[ev[1]] = round_block(ev[2])
            rounded += live[ev[1]]
            peak = max(peak, rounded)
        elif ev[0] == "free":
            rounded -= live.pop(ev[1])
    expandable = replay_trace(got.trace, expandable=True)
    assert expandable.peaks.allocated_peak_bytes == peak <= plain.peaks.allocated_peak_bytes


def test_empty_cache_gives_back_only_whole_free_segments():
    m = CachingAllocatorModel()
    m.malloc("w", 3 * MiB)  # a 20 MiB segment that keeps a live block
    m.malloc("a", 18 * MiB)  # past the 17 MiB left there: an 18 MiB segment of its own (rounded to 2 MiB)
    m.malloc("s", 1000)  # a 2 MiB small segment
    m.free("a")
    m.free("s")
    m.empty_cache()
    assert m.reserved == LARGE_BUFFER and m.allocated == 3 * MiB and m.peaks().segments == 1
    assert m.reserved_peak == LARGE_BUFFER + 18 * MiB + SMALL_BUFFER  # peaks keep what was held
    m.malloc("b", 5 * MiB)  # from the kept segment's free rest
    assert m.reserved == LARGE_BUFFER
    with pytest.raises(ValueError, match="expandable"):
        CachingAllocatorModel(expandable=True).empty_cache()


def test_replay_captured_step_by_hand():
    """A warm-up step, then the step captured: the warm-up's free segments given back, the input
    made again in the default pool, the captured step's blocks in a private pool of their own
    (figures worked out by hand from the allocator's rules)."""
    K = 1024
    trace = [("alloc", "w", 3 * MiB), ("alloc", "x", MiB), ("input", "x"),
             ("step", 0), ("alloc", "a", 5 * MiB), ("alloc", "b", 600 * K), ("op", "mm", False, False),
             ("free", "a"), ("free", "b"),
             ("step", 1), ("alloc", "a2", 5 * MiB), ("alloc", "b2", 600 * K), ("op", "mm", False, False),
             ("alloc", "loss", 4), ("free", "a2"), ("free", "b2")]
    got = replay_captured(trace, cublas_workspace=2 * MiB)
    # warm-up: w opens a 20 MiB segment, a (5 MiB) and the 2 MiB workspace split its rest; x
    # (1 MiB, small) opens a 2 MiB small segment, where b (600 KiB) fits
    assert got.warmup.peaks.reserved_peak_bytes == LARGE_BUFFER + SMALL_BUFFER
    assert got.warmup.peaks.allocated_peak_bytes == 3 * MiB + MiB + 5 * MiB + 600 * K + 2 * MiB
    assert got.warmup.cublas_workspace_bytes == 2 * MiB
    # given back: the small segment (x moved out, b freed); kept: the large one (w, the workspace);
    # x made again: a new 2 MiB small segment
    assert got.kept_bytes == LARGE_BUFFER + SMALL_BUFFER
    # captured: a2 opens a 20 MiB segment of the pool, b2 and the 512 B loss a 2 MiB small one; the
    # workspace is the warm-up's (same thread, same stream)
    assert got.pool_reserved_bytes == LARGE_BUFFER + SMALL_BUFFER
    assert got.allocated_bytes == 3 * MiB + 2 * MiB + MiB + 512  # w, workspace, x, loss
    assert got.kept_allocated_bytes == 3 * MiB + 2 * MiB + MiB  # the loss is the pool's
    # beyond the eager run's reserve: the pool's two segments (the kept ones' free space unused)
    assert got.extra_bytes == LARGE_BUFFER + SMALL_BUFFER
    assert got.reserved_bytes == 2 * (LARGE_BUFFER + SMALL_BUFFER)
    assert got.reserved_peak_bytes == 2 * (LARGE_BUFFER + SMALL_BUFFER)
    assert got.allocated_peak_bytes == 3 * MiB + 2 * MiB + MiB + 5 * MiB + 600 * K + 512
    with pytest.raises(ValueError, match="1 step"):
        replay_captured(trace[:9])


def test_a_budget_counts_what_graphs_reserve_beyond_an_eager_run():
    """finetune's budget check for a step captured as CUDA graphs (run before anything is written
    when a --budget run will capture): the eager step's tensors (the runtime accounting) plus what
    the graphs reserve beyond an eager run, from the allocator model's replay of three CPU steps;
    refused in one line naming both parts and --eager."""
    from edgetl.errors import BudgetError
    from edgetl.finetune import check_graph_budget, resolve_job
    from edgetl.recipe import load_recipe

    recipe = load_recipe("fashion_mnist", {"train.batch_size": 8, "data.resolution": 96,  # where graphs reserve more
                                           "model.backbone": "mobilenet_v2:random", "model.width": 0.35})
    torch.manual_seed(0)
    job = resolve_job(recipe, 5)
    got = check_graph_budget(job, (8, 7), 10**12)
    replay = got.replay
    assert got.runtime_bytes == job.predicted.total_bytes and got.capability == (8, 7)
    # the kept segments and the pool while the graph replays, beyond the eager steps' reserve
    assert got.extra_bytes == replay.kept_bytes + replay.pool_reserved_bytes - \
        replay.warmup.peaks.reserved_peak_bytes > 0
    assert got.total_bytes == got.runtime_bytes + got.extra_bytes
    assert replay.warmup.cublas_workspace_bytes == 2 * cublas_workspace_bytes((8, 7))  # this thread, autograd's
    assert check_graph_budget(job, (8, 7), got.total_bytes).total_bytes == got.total_bytes
    # traced on the meta device: the same replay as three real CPU steps' trace
    cpu = measure_training_memory(copy.deepcopy(job.net), resolution=96, batch_size=8, steps=3, step=job.step,
                                  record_trace=True)
    assert replay_captured(cpu.trace, cublas_workspace=cublas_workspace_bytes((8, 7)),
                           cublaslt_workspace=cublaslt_workspace_bytes()) == replay
    for budget in (got.total_bytes - 1, got.runtime_bytes):  # the eager step fits the second
        with pytest.raises(BudgetError) as err:
            check_graph_budget(job, (8, 7), budget)
        line = str(err.value)
        assert "\n" not in line and f"{got.total_bytes / 1e6:.1f} MB" in line and "--eager" in line
        assert f"{got.runtime_bytes / 1e6:.1f} MB of tensors + {got.extra_bytes / 1e6:.1f} MB" in line


def test_replay_captured_of_a_real_training_trace():
    """The CPU meter's trace of three steps, captured at the third: what stays allocated while the
    graph replays is every block live at the trace's end (rounded; large blocks may hold an
    unsplit rest), and the pool holds at least the step's own blocks."""
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import LeanOptions, build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=5), "repnet", lean=LeanOptions(pool=2))
    got = measure_training_memory(net, resolution=64, batch_size=4, steps=3, record_trace=True)
    assert [ev[1] for ev in got.trace if ev[0] == "step"] == [0, 1, 2]
    captured = replay_captured(got.trace)
    live: dict = {}
    start = max(i for i, ev in enumerate(got.trace) if ev[0] == "step")
    step_peak = step_live = 0
    for i, ev in enumerate(got.trace):
        if ev[0] == "alloc":
            live[ev[1]] = round_block(ev[2])
            if i > start:
                step_live += live[ev[1]]
                step_peak = max(step_peak, step_live)
        elif ev[0] == "free":
            size = live.pop(ev[1])
            step_live -= size if i > start else 0
    assert sum(live.values()) <= captured.allocated_bytes <= sum(live.values()) + SMALL_SIZE * len(live)
    assert captured.pool_reserved_bytes >= step_peak - got.tensor_bytes  # the step's blocks, freed ones reused
    assert captured.reserved_bytes == captured.kept_bytes + captured.pool_reserved_bytes
    assert captured.allocated_bytes >= captured.kept_allocated_bytes  # and what the capture left live
    assert captured.reserved_peak_bytes >= max(captured.reserved_bytes, captured.warmup.peaks.reserved_peak_bytes)


# ============================================================================ the entry point, on CPU


SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _script(name: str):
    """A module of scripts/ (not a package), loaded from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_graph_tests_gpu_check_runs_first_exist():
    """scripts/gpu_check.py runs the CUDA-graph tests first by node id: each names a test here."""
    for node in _script("gpu_check").GRAPH_TESTS:
        path, name = node.split("::")
        assert path == "tests/test_cuda.py" and callable(globals().get(name)), node


def test_the_graph_check_compares_weights_and_buffers_name_by_name():
    """The graph check's weight difference (parameters and buffers, name by name; the GPU runs
    it on the captured and the eager networks), and how the docs render a row with and without
    the capturable eager run."""
    check = _script("gpu_check")

    def weight_diff(x, y):
        return check.weight_diff(x.state_dict(), y.state_dict())

    a = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    b = copy.deepcopy(a)
    assert weight_diff(a, b) == 0.0
    b[1].running_var.add_(0.25)
    assert weight_diff(a, b) == 0.25
    with torch.no_grad():
        b[0].weight[1, 2] -= 0.5
    assert weight_diff(a, b) == 0.5 and weight_diff(b, a) == 0.5
    with pytest.raises(ValueError, match="names"):
        weight_diff(a, torch.nn.Sequential(torch.nn.Linear(3, 2)))
    render = _script("render_docs")._graph_weights
    assert render({"max_abs_weight_diff": 0.0, "exact": True}) == "equal"
    assert render({"max_abs_weight_diff": 0.0335, "exact": False}) == "0.034"
    new = {"max_abs_weight_diff": 0.0335, "same_arithmetic_steps": 8}
    assert render({**new, "same_arithmetic_diff": 0.0, "same_arithmetic_exact": True}) == \
        "0.034 (capturable Adam run eagerly, after 8 steps: equal)"
    assert render({**new, "same_arithmetic_diff": 2.5e-07, "same_arithmetic_exact": False}) == \
        "0.034 (capturable Adam run eagerly, after 8 steps: 2.5e-07)"


def test_gpu_check_runs_on_cpu(tmp_path):
    """scripts/gpu_check.sh end to end at tiny scale: the same driver a GPU session launches."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out", str(out), "--quick",
         "--tests", "tests/test_cuda.py", "--methods", "repnet-pruned-pool2", "--batch-size", "2",
         "--budget", "1MB"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["allocator.json", "bench.csv", "bench.json", "bench.md", "bench.png", "pytest.log",
                     "summary.json"]
    assert all(SAFE_NAME.match(f) and (out / f).stat().st_size < 16 * MiB for f in files)  # device rules
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["complete"] and summary["facts"]["torch"] == torch.__version__
    tests = summary["parts"]["tests"]["counts"]
    cuda_tests = sum(1 for name, fn in globals().items() if name.startswith("test_")
                     and any(m.name == "cuda" for m in getattr(fn, "pytestmark", [])))
    assert cuda_tests >= 7
    assert (tests["passed"], tests["failures"], tests["errors"]) == (0, 0, 0)
    assert tests["skipped"] >= cuda_tests  # parametrized ones count once per case
    assert tests["skip_reasons"] and all(CUDA_REASON in r for r in tests["skip_reasons"])
    from edgetl.bench import BenchResult
    from edgetl.memory.runtime import runtime_report

    result = BenchResult.load_json(out / "bench.json")
    (row,) = result.rows
    assert (row.method, result.device, result.batch_size, result.resolution) == ("repnet-pruned-pool2", "cpu", 2, 64)
    assert row.reserved_bytes is None and row.tensor_bytes is None  # CPU: one measured column
    assert row.largest_batch == 0  # 1 MB fits not even one image
    # the measured peak agrees with an independent runtime accounting of the same network
    from edgetl.bench import METHODS, build_method, pruned_hidden

    meta = build_method(METHODS["repnet-pruned-pool2"], width=0.35, num_classes=102, device="meta",
                        hidden=pruned_hidden(0.35, 102))
    accounted = runtime_report(meta, mode="repnet", resolution=64, batch_size=2).total_bytes
    assert abs(row.measured_bytes / accounted - 1) <= 0.05
    md = (out / "bench.md").read_text()
    assert "| measured MB |" in md and f"| {row.measured_bytes / 1e6:.1f} |" in md
    # the allocator check: on CPU a prediction for the Jetson Orin (sm87) from the step's trace
    alloc = json.loads((out / "allocator.json").read_text())
    assert list(alloc) == ["default"]  # expandable segments only where CUDA can start with them
    d = alloc["default"]
    assert (d["capability"], d["cublas_workspace_bytes"], d["expandable"]) == ([8, 7], CUBLAS_WORKSPACE_DEFAULT, False)
    (a,) = d["rows"]
    assert a["runtime_bytes"] == accounted and a["allocated_bytes"] is None
    assert a["tensor_bytes"] == row.measured_bytes  # the same step measured twice, to the byte
    jetson = step_workspace_bytes((8, 7), env={})
    assert a["predicted_allocated_bytes"] == accounted + jetson
    assert a["tensor_bytes"] + jetson <= a["replay_allocated_bytes"] <= a["replay_reserved_bytes"]


def _backward_that_warns(message: str) -> None:
    """A backward whose Function warns ``message`` (the line is kept as ``.line``)."""
    import warnings

    class Warns(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            warnings.warn(message)
            return grad * 2

    Warns.apply(torch.ones(2, requires_grad=True)).sum().backward()


_backward_that_warns.line = _backward_that_warns.__code__.co_firstlineno + 11


def test_the_warm_up_sync_check_keeps_only_the_steps_sync_warnings(monkeypatch):
    """CapturedStep's sync check (edgetl.train.graph._host_syncs) routes the warnings PyTorch's
    sync debug mode raises: this thread's and a backward's (autograd runs a CUDA backward on a
    device thread) are recorded with their line; another thread's (the loader's pinning thread)
    and other warnings are shown as usual. The mode itself is a CUDA
    setting this machine cannot make: its two calls are replaced here by a recorder; on a GPU
    test_a_step_that_cannot_be_captured_runs_on_eagerly_and_says_why runs the real one."""
    import threading
    import warnings

    from edgetl.train import graph

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    sync = "called a synchronizing CUDA operation"
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with graph._host_syncs(True) as found:
            warnings.warn(sync)
            line = sys._getframe().f_lineno - 1
            other = threading.Thread(target=lambda: warnings.warn(sync + " elsewhere"))
            other.start()
            other.join()
            backward = threading.Thread(target=_backward_that_warns, args=(sync + " in a backward",))
            backward.start()  # as autograd's device thread runs a CUDA backward's Functions
            backward.join()
            warnings.warn("something else")
        with graph._host_syncs(False) as off:
            warnings.warn(sync + " unchecked")
    assert found[0] == f"{sync} ({__file__}:{line})" and off == []
    assert found[1:] == [f"{sync} in a backward ({__file__}:{_backward_that_warns.line})"]
    assert [str(w.message) for w in shown] == [sync + " elsewhere", "something else", sync + " unchecked"]
    assert modes == ["warn", 0]  # set for the check, put back after


def test_gpu_check_skips_what_the_deadline_leaves_no_time_for(tmp_path):
    """A part with less than MIN_PART_S left before --deadline is not started: summary.json
    (written after every part) names it skipped, and the check exits 1 rather than pass as whole."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--out",
                           str(out), "--quick", "--no-tests", "--deadline", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == ["bench", "allocator-default"]
    assert all(set(p) == {"skipped"} for p in summary["parts"].values())
    assert summary["ok"] and not summary["complete"]  # nothing that ran failed; not every part ran
    assert "passed what ran; skipped at the deadline: bench, allocator-default" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


# ============================================================================ on the GPU


@pytest.fixture(scope="session")
def _all_figures() -> dict:
    """What this run's tests measure, added to what an earlier run of the same check wrote
    (scripts/gpu_check.py runs the CUDA-graph tests first, then the others, into one file)."""
    path = os.environ.get("EDGETL_CUDA_FIGURES")
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}


@pytest.fixture
def figures(_all_figures):
    """Figures measured by the CUDA tests; written to $EDGETL_CUDA_FIGURES after each test that
    records some, pass or fail, so a test run stopped at its deadline keeps what its finished
    tests measured."""
    yield _all_figures
    path = os.environ.get("EDGETL_CUDA_FIGURES")
    if path and _all_figures:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(_all_figures, indent=2, default=str) + "\n")
        os.replace(tmp, path)


@pytest.fixture
def exact_fp32():
    """fp32 convolutions and matrix products in IEEE fp32 on CUDA, not TF32 (torch's default for
    cuDNN convolutions on Ampere and later, the Jetson Orin included): a CPU comparison needs it."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def deterministic_cudnn():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def _capability() -> tuple[int, int]:
    p = torch.cuda.get_device_properties(0)
    return (p.major, p.minor)


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _stock_with_statistics(width=0.35, num_classes=5, res=64):
    """A stock Rep-Net with non-trivial BN statistics and side BNs whose gamma is not 0."""
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=width, num_classes=num_classes), "repnet")
    net.train()
    with torch.no_grad():
        for _ in range(2):
            net(torch.randn(8, 3, res, res) * 1.5 + 0.3)
        for m in net.side.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
    return net


LEAN_CASES = {
    # name: (lean options, forward tol, grad tol) as relative L2 errors, CUDA vs CPU
    "fp32": (dict(pool=1), 1e-4, 1e-3),
    "fp32-pool2": (dict(pool=2), 1e-4, 1e-3),
    "bn-batch": (dict(pool=1, bn="batch"), 1e-4, 1e-3),
    "int8-frozen": (dict(pool=2, frozen_weights="int8"), 1e-4, 1e-3),
    "fp16-frozen": (dict(pool=2, frozen_weights="fp16"), 1e-3, 1e-2),
    # half precision: two implementations round differently and a ReLU6 mask bit can flip at
    # 0 or 6; a wrong kernel or layout gives errors of order 1, far above these
    "bf16": (dict(pool=2, precision="bf16"), 5e-2, 1e-1),
    "fp16": (dict(pool=2, precision="fp16"), 2e-2, 5e-2),
    "bf16-int8": (dict(pool=2, precision="bf16", frozen_weights="int8"), 5e-2, 1e-1),
}


@cuda
@pytest.mark.parametrize("case", list(LEAN_CASES))
def test_lean_layers_on_cuda_equal_cpu(case, figures, exact_fp32):
    """Every lean leaf's forward output and every trainable gradient: CUDA vs CPU, same weights.

    The CPU reference runs in the same activation dtype where the CPU has that convolution,
    else in fp32 (then the tolerance covers the half-precision rounding as well).
    """
    from edgetl.models.lean import check_act_dtype
    from edgetl.models.side import LeanOptions, make_lean

    opts, fwd_tol, grad_tol = LEAN_CASES[case]
    stock = _stock_with_statistics()
    ref_opts = dict(opts)
    if opts.get("precision") in ("bf16", "fp16"):
        try:
            check_act_dtype(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[opts["precision"]]), "cpu")
        except Exception:  # noqa: BLE001 - CapabilityError: this CPU lacks the dtype, compare with fp32
            ref_opts["precision"] = "fp32"
    cpu = make_lean(copy.deepcopy(stock), LeanOptions(**ref_opts))
    gpu = make_lean(copy.deepcopy(stock), LeanOptions(**opts)).to("cuda")
    torch.manual_seed(1)
    x = torch.randn(8, 3, 64, 64) * 1.2
    y = torch.randint(0, 5, (8,))
    results = {}
    for tag, net, dev in (("cpu", cpu, "cpu"), ("cuda", gpu, "cuda")):
        outs: dict[str, torch.Tensor] = {}
        def keep(m, a, o, n):
            if isinstance(o, torch.Tensor):
                outs[n] = o.detach().float().cpu()

        hooks = [m.register_forward_hook(lambda m, a, o, n=n: keep(m, a, o, n))
                 for n, m in net.named_modules() if not list(m.children()) and n]
        net.train()
        for m in net.modules():  # dropout masks would differ between the devices
            if isinstance(m, torch.nn.Dropout):
                m.eval()
        logits = net(x.to(dev, getattr(net, "input_dtype", torch.float32)))
        F.cross_entropy(logits.float(), y.to(dev)).backward()
        for h in hooks:
            h.remove()
        grads = {n: p.grad.detach().float().cpu() for n, p in net.named_parameters() if p.requires_grad}
        results[tag] = (outs, grads)
    (outs_c, grads_c), (outs_g, grads_g) = results["cpu"], results["cuda"]
    assert outs_c.keys() == outs_g.keys() and len(outs_c) > 30
    fwd = {n: _relerr(outs_g[n], outs_c[n]) for n in outs_c if outs_c[n].norm() > 0}
    # a gradient that is zero in exact arithmetic (a BN bias whose output a batch-statistics BN
    # normalises again) is rounding noise on both devices: compared by size, not by direction
    scale = max(float(g.norm()) for g in grads_c.values())
    noise = {n for n in grads_c if grads_c[n].norm() <= 1e-6 * scale}
    grad = {n: _relerr(grads_g[n], grads_c[n]) for n in grads_c if n not in noise}
    loud = {n: float(grads_g[n].norm()) for n in noise if grads_g[n].norm() > 1e-5 * scale}
    assert not loud, (loud, scale)
    figures.setdefault("lean_cuda_vs_cpu", {})[case] = {
        "reference": ref_opts, "forward_max_relerr": max(fwd.values()), "grad_max_relerr": max(grad.values()),
        "worst_forward": max(fwd, key=fwd.get), "worst_grad": max(grad, key=grad.get)}
    assert len(grad) >= 10  # side convs, side BNs, classifier
    bad_fwd = {n: e for n, e in fwd.items() if e > fwd_tol}
    bad_grad = {n: e for n, e in grad.items() if e > grad_tol}
    assert not bad_fwd, bad_fwd
    assert not bad_grad, bad_grad


@cuda
def test_bit_masks_pack_and_unpack_the_same_on_cuda():
    from edgetl.models.lean import pack_mask, unpack_mask

    torch.manual_seed(0)
    for shape in ((8, 16, 7, 7), (3, 5, 9, 11), (1, 1, 1, 13)):
        mask = torch.rand(shape) > 0.4
        packed_cpu = pack_mask(mask)
        packed_gpu = pack_mask(mask.cuda())
        assert packed_gpu.device.type == "cuda" and torch.equal(packed_gpu.cpu(), packed_cpu)
        assert torch.equal(unpack_mask(packed_gpu, shape).cpu(), mask)


@cuda
def test_a_pinned_batch_stays_pinned_in_the_networks_layout_and_dtype():
    """The loader's pinned batch changed to the network's layout or dtype on the host is pinned
    again: a pageable batch's ``non_blocking`` copy to the device would wait for the stream."""
    from edgetl.train.graph import host_batch

    images = torch.randn(4, 3, 8, 8).pin_memory()
    out = host_batch(images, torch.channels_last)
    assert out.is_pinned() and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, images) and out.data_ptr() != images.data_ptr()
    assert host_batch(images, torch.contiguous_format) is images
    assert host_batch(out, torch.channels_last) is out
    for layout in (torch.channels_last, torch.contiguous_format):
        cast = host_batch(images, layout, torch.bfloat16)
        assert cast.is_pinned() and cast.dtype == torch.bfloat16 and cast.is_contiguous(memory_format=layout)
        assert torch.equal(cast, images.to(torch.bfloat16))


@cuda
def test_cuda_meter_reports_allocated_and_reserved(figures):
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import LeanOptions, build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=5), "repnet", device="cuda",
                        lean=LeanOptions(pool=2))
    got = measure_training_memory(net, resolution=64, batch_size=8, steps=2, record_trace=True)
    ws = step_workspace_bytes(_capability())
    replay = replay_trace(got.trace, cublas_workspace=cublas_workspace_bytes(_capability()),
                          cublaslt_workspace=cublaslt_workspace_bytes())
    assert replay.workspace_bytes == ws
    figures["meter_64px"] = {"tensor": got.tensor_bytes, "allocated": got.allocated_bytes,
                             "reserved": got.reserved_bytes, "other": got.other_bytes,
                             "replay_allocated": replay.peaks.allocated_peak_bytes,
                             "replay_reserved": replay.peaks.reserved_peak_bytes, "workspaces": ws}
    assert got.peak_bytes == got.allocated_bytes
    assert got.tensor_bytes <= got.allocated_bytes <= got.reserved_bytes
    assert got.reserved_bytes % SMALL_BUFFER == 0
    # what the libraries take inside kernels (cuDNN workspaces) is the rest: reported, bounded
    assert abs(got.allocated_bytes - replay.peaks.allocated_peak_bytes) <= 4 * MiB


WORKSPACE_PROBE = """
import json, threading
import torch, torch.nn.functional as F
a = torch.cuda.memory_allocated
x = torch.randn(64, 64, device="cuda")
w = torch.randn(64, 64, device="cuda", requires_grad=True)
b = torch.randn(64, device="cuda", requires_grad=True)
out, t = {}, a()
torch.mm(x, x); torch.cuda.synchronize(); out["mm"], t = a() - t, a()
torch.addmm(b.detach(), x, x); torch.cuda.synchronize(); out["addmm"], t = a() - t, a()
y = F.linear(x, w, b); torch.cuda.synchronize(); t = a()
y.sum().backward(); torch.cuda.synchronize(); out["backward"], t = a() - t, a()
th = threading.Thread(target=lambda: (torch.mm(x, x), torch.cuda.synchronize())); th.start(); th.join()
out["thread"] = a() - t
print(json.dumps(out))
"""


@cuda
def test_library_workspaces_per_thread_on_cuda(figures):
    """The workspaces edgetl.memory.cuda models, measured in a fresh process: the calling thread's
    first matrix product takes a cuBLAS workspace, its first biased addmm a cuBLASLt one, backward
    (autograd's device thread) a cuBLAS one of its own, and so does any other thread."""
    proc = subprocess.run([sys.executable, "-c", WORKSPACE_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["workspaces"] = got
    ws, lt = cublas_workspace_bytes(_capability()), cublaslt_workspace_bytes()
    assert (got["mm"], got["addmm"], got["thread"]) == (ws, lt, ws), got
    assert ws < got["backward"] <= ws + 2 * round_block(64 * 64 * 4), got  # and the weight's gradients


def _accounting_configs():
    from edgetl.models.side import LeanOptions

    lean = LeanOptions
    # name -> (lean options, pruned, architecture, mode)
    return {
        "stock": (None, False, "mobilenet_v2", "repnet"),
        "stock-pruned": (None, True, "mobilenet_v2", "repnet"),
        "lean-fp32": (lean(pool=1), False, "mobilenet_v2", "repnet"),
        "lean-pruned-k2": (lean(pool=2), True, "mobilenet_v2", "repnet"),  # the paper's configuration
        "lean-bf16": (lean(pool=2, precision="bf16"), False, "mobilenet_v2", "repnet"),
        "lean-pruned-bf16-int8": (lean(pool=2, precision="bf16", frozen_weights="int8"), True, "mobilenet_v2", "repnet"),
        "lean-pruned-fp16-frozen16": (lean(pool=2, precision="fp16", frozen_weights="fp16"), True, "mobilenet_v2",
                                      "repnet"),
        # issue #42: ResNet-18 (the seeds' network), Rep-Net stock and lean, lean full with pooled storage
        "resnet18-stock": (None, False, "resnet18", "repnet"),
        "resnet18-lean": (lean(pool=2), False, "resnet18", "repnet"),
        "resnet18-full-lean-pool2": (lean(storage="pool2"), False, "resnet18", "full"),
    }


def _accounting_net(config: str):
    """The network of an accounting configuration on CUDA (seed 0), its lean step fitted for
    224 px, batch 8; and its mode."""
    from edgetl.bench import pruned_hidden
    from edgetl.memory.schedule import prepare_step
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import build_network

    lean, pruned, arch, mode = _accounting_configs()[config]
    spec = BackboneSpec(arch=arch, width=1.0, num_classes=102, hidden=pruned_hidden(1.0, 102) if pruned else {})
    torch.manual_seed(0)
    net = build_network(spec, mode, device="cuda", lean=lean)
    if lean is not None:
        prepare_step(net, resolution=224, batch_size=8)
    return net, mode


@cuda
@pytest.mark.parametrize("config", list(_accounting_configs()))
def test_allocated_peak_equals_cuda_accounting_224px(config, figures):
    """Measured allocated peak within 5 % of runtime accounting + the library workspaces (224 px,
    batch 8); the tensor peak equal to the runtime accounting to the byte; the allocator model's
    replay of the step within 4 MiB of the allocated peak (the rest: cuDNN workspaces)."""
    from edgetl.memory.runtime import runtime_report

    net, mode = _accounting_net(config)
    runtime = runtime_report(net, mode=mode, resolution=224, batch_size=8).total_bytes
    ws = step_workspace_bytes(_capability())
    got = measure_training_memory(net, resolution=224, batch_size=8, steps=2, record_trace=True)
    replay = replay_trace(got.trace, cublas_workspace=cublas_workspace_bytes(_capability()),
                          cublaslt_workspace=cublaslt_workspace_bytes())
    predicted = runtime + ws
    figures.setdefault("accounting_224px", {})[config] = {
        "runtime": runtime, "workspaces": ws, "predicted": predicted, "tensor": got.tensor_bytes,
        "allocated": got.allocated_bytes, "reserved": got.reserved_bytes, "other": got.other_bytes,
        "replay_allocated": replay.peaks.allocated_peak_bytes, "replay_reserved": replay.peaks.reserved_peak_bytes,
        "allocated_vs_predicted": got.allocated_bytes / predicted - 1,
        "tensor_vs_runtime": got.tensor_bytes / runtime - 1,
        "unexplained": got.allocated_bytes - replay.peaks.allocated_peak_bytes,
    }
    assert got.tensor_bytes == runtime, figures["accounting_224px"][config]
    assert replay.workspace_bytes == ws, figures["accounting_224px"][config]
    assert abs(got.allocated_bytes / predicted - 1) <= 0.05, figures["accounting_224px"][config]
    assert abs(got.allocated_bytes - replay.peaks.allocated_peak_bytes) <= 4 * MiB, figures["accounting_224px"][config]
    assert got.reserved_bytes >= got.allocated_bytes


@cuda
@pytest.mark.parametrize("config", ["stock", "lean-pruned-k2", "lean-pruned-bf16-int8"])
def test_captured_step_memory_equals_the_model(config, figures):
    """The step captured by finetune's ``CapturedStep`` (224 px, batch 8): what the allocator holds
    while the graph replays, against ``replay_captured`` of the same step's trace (recorded eagerly
    on the device with the optimizer made capturable): allocated and reserved, and the graph's
    private pool read from the allocator's segments (a second instrument). Within 1 %."""
    from edgetl.memory.meter import _prepare_cuda
    from edgetl.step import Step, set_train_mode, training_step
    from edgetl.train.graph import CapturedStep

    net, _ = _accounting_net(config)
    step = Step.plain("adam", 1e-3)  # the step both run
    set_train_mode(net, step.bn)  # as the measurement sets its probe
    net.cpu()  # and back: the weights packed anew, without the holes the lean conversion left
    torch.cuda.empty_cache()
    net.cuda()
    probe = copy.deepcopy(net)
    got = measure_training_memory(probe, resolution=224, batch_size=8, steps=3, step=step, record_trace=True,
                                  capturable=True)
    del probe
    model = replay_captured(got.trace, cublas_workspace=cublas_workspace_bytes(_capability()),
                            cublaslt_workspace=cublaslt_workspace_bytes())
    # the measurement's cuBLAS workspaces and cached segments released, peaks reset; other: what
    # is allocated beside the network (nothing, unless earlier tests left tensors alive)
    other = _prepare_cuda(torch.device("cuda"), net)
    dtype = getattr(net, "input_dtype", torch.float32)  # the batch as the trace has it: no cast in the graph
    captured = CapturedStep(training_step, net, step, step.optimizer(net), torch.device("cuda"), dtype=dtype,
                            tensor_lr=False)
    images = torch.randn(8, 3, 224, 224).to(dtype).pin_memory()
    labels = torch.randint(0, 102, (8,)).pin_memory()
    for _ in range(5):  # 3 eager warm-up steps, the capture (replayed at once), a replay
        captured(images, labels)
    torch.cuda.synchronize()
    pooled = [seg for seg in torch.cuda.memory_snapshot()
              if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]  # (0, 0): the default pool
    pool = sum(seg["total_size"] for seg in pooled)
    # the live blocks outside the pool (the model's kept_allocated_bytes)
    kept_allocated = torch.cuda.memory_allocated() - other - sum(seg["allocated_size"] for seg in pooled)
    row = {"predicted_allocated": model.allocated_bytes, "allocated": torch.cuda.memory_allocated() - other,
           "predicted_reserved": model.reserved_bytes, "reserved": torch.cuda.memory_reserved(),
           "predicted_pool": model.pool_reserved_bytes, "pool": pool,
           "predicted_kept_allocated": model.kept_allocated_bytes, "kept_allocated": kept_allocated,
           "predicted_reserved_peak": model.reserved_peak_bytes, "reserved_peak": torch.cuda.max_memory_reserved(),
           "predicted_allocated_peak": model.allocated_peak_bytes,
           "allocated_peak": torch.cuda.max_memory_allocated() - other, "other": other,
           "execution": captured.describe()}
    captured.release()
    figures.setdefault("captured_224px", {})[config] = row
    for key in ("allocated", "reserved", "pool", "kept_allocated"):
        assert abs(row[key] / row[f"predicted_{key}"] - 1) <= 0.01, (key, row)


@cuda
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_cannot_be_captured_runs_on_eagerly_and_says_why(where):
    """A step no capture allows (here a hook reads the logits or a gradient on the host) costs the run
    nothing: the warm-up's sync check finds the host read, no capture is begun (a failed one can
    leave the RNG and the allocator in capture state), every batch trains eagerly, the thread is
    back on its own stream, and describe() names the synchronizing call and the batch."""
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import LeanOptions, build_network
    from edgetl.step import Step, training_step
    from edgetl.train.graph import WARMUP_STEPS, CapturedStep

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=3), "repnet", device="cuda", lean=LeanOptions(pool=2))
    if where == "forward":  # a host read on the calling thread
        net.classifier.register_forward_hook(lambda module, args, out: float(out.sum()))
    else:  # on autograd's device thread
        net.classifier.weight.register_hook(lambda grad: float(grad.sum()))
    step = Step.plain("adam", 1e-3)
    captured = CapturedStep(training_step, net, step, step.optimizer(net), torch.device("cuda"), tensor_lr=False)
    images, labels = torch.randn(4, 3, 64, 64).pin_memory(), torch.randint(0, 3, (4,)).pin_memory()
    losses = [float(captured(images, labels)[0]) for _ in range(WARMUP_STEPS + 3)]
    assert torch.isfinite(torch.tensor(losses)).all()
    assert captured.failed is not None and captured.failed_at == 4 and not captured.graphs
    assert captured.never_captured and captured.captures == 0
    assert captured.eager_steps == WARMUP_STEPS + 3  # every batch trained eagerly
    said = captured.describe()
    assert said.startswith("CUDA graph: not captured (the step synchronizes with the host"), said
    assert "synchronizing CUDA operation" in said and "test_cuda.py" in said, said  # the hook's line
    assert torch.cuda.get_sync_debug_mode() == 0  # put back
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def _color_data(root: Path) -> Path:
    from tests.conftest import make_color_folder

    return make_color_folder(root, n_train=24, n_val=8, size=64)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


@cuda
def test_finetune_one_epoch_and_resume_on_cuda_then_export(tmp_path, figures, deterministic_cudnn):
    """Lean Rep-Net (k=2) one epoch on CUDA; killed mid-epoch and resumed it ends where an
    uninterrupted run ends (as close as two uninterrupted runs are: CUDA's bilinear backward
    adds with atomics); the run exports to ONNX with onnxruntime matching PyTorch."""
    from edgetl.export import export_run
    from edgetl.finetune import finetune
    from edgetl.recipe import load_recipe

    from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone

    data = _color_data(tmp_path / "data")
    torch.manual_seed(0)
    (tmp_path / "backbone").mkdir()
    save_backbone(tmp_path / "backbone", build_backbone(BackboneSpec(width=0.35, num_classes=3)).eval())
    recipe = load_recipe("imagefolder", {
        "data.root": str(data), "data.resolution": 64, "model.backbone": str(tmp_path / "backbone"), "model.pool": 2,
        "train.epochs": 1, "train.batch_size": 8, "train.workers": 0, "train.checkpoint_every": 4})
    finetune(recipe=recipe, out_dir=tmp_path / "a", device="cuda", measure=False)
    finetune(recipe=recipe, out_dir=tmp_path / "b", device="cuda", measure=False)

    class Killed(Exception):
        pass

    def kill(info):
        if info["global_step"] == 6:  # 9 steps an epoch; the last checkpoint was at step 4
            raise Killed

    with pytest.raises(Killed):
        finetune(recipe=recipe, out_dir=tmp_path / "k", device="cuda", measure=False, on_step=kill)
    finetune(recipe=recipe, out_dir=tmp_path / "k", device="cuda", measure=False, resume=True)
    a, b, k = (_weights(tmp_path / r / "model.pt") for r in "abk")
    rerun, resumed = _max_diff(a, b), _max_diff(a, k)
    figures["finetune_resume"] = {"rerun_max_abs_diff": rerun, "resume_max_abs_diff": resumed}
    if rerun == 0:
        assert resumed == 0, resumed  # bit for bit, as on CPU
    else:
        assert resumed <= 10 * rerun + 1e-6, (resumed, rerun)
    result = export_run(tmp_path / "a")
    figures["export_parity"] = result.parity_max_abs_diff
    assert result.max_abs_diff < 1e-4, result.parity_max_abs_diff


@cuda
def test_finetune_captured_as_cuda_graphs_trains_as_eager_does(tmp_path, figures, deterministic_cudnn):
    """finetune's default on CUDA (train.cuda_graph): three eager warm-up steps, then the step
    captured and replayed. One training image turns unreadable once the run has checked its
    files (data.on_bad_image: skip), so one batch an epoch has 5 images instead of 6: a second
    graph in the same pool. Step by step the losses, and at the end the weights, are those of the
    same run never captured (capturable Adam and the device-tensor rate the schedule fills, run
    eagerly: the graphs' arithmetic), as close as two eager runs are; against plain eager Adam the
    weights differ by at most twice what the capturable arithmetic alone moves them (float32
    bias corrections on the device, float64 on the host). recipe.yaml records what ran, and
    a captured run killed mid-epoch resumes eagerly. Records both runs' allocated and reserved
    peaks, and what the allocator holds pool by pool while the graphs replay. With a --budget the
    captured run predicts its graphs' memory, and a budget the eager step fits but the graphs'
    extra does not is refused before anything is written."""
    import functools

    import yaml

    import edgetl.train
    from edgetl.errors import BudgetError
    from edgetl.finetune import finetune
    from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
    from edgetl.recipe import load_recipe
    from edgetl.train.graph import CapturedStep

    data = _color_data(tmp_path / "data")  # 72 training images: 12 batches of 6 an epoch
    bad = data / "train" / "c0" / "0.png"
    good = bad.read_bytes()

    def corrupt(_check):  # after the pre-flight check of every file: skipped while training
        bad.write_bytes(b"no longer a PNG")

    torch.manual_seed(0)
    (tmp_path / "backbone").mkdir()
    save_backbone(tmp_path / "backbone", build_backbone(BackboneSpec(width=0.35, num_classes=3)).eval())
    values = {"data.root": str(data), "data.resolution": 64, "data.on_bad_image": "skip",
              "model.backbone": str(tmp_path / "backbone"), "model.pool": 2, "train.epochs": 2,
              "train.batch_size": 6, "train.workers": 2, "train.checkpoint_every": 5}  # workers pin beside the capture
    graph, eager = (load_recipe("imagefolder", {**values, "train.cuda_graph": on}) for on in (True, False))

    def run(recipe, name, **kwargs):
        bad.write_bytes(good)
        return finetune(recipe=recipe, out_dir=tmp_path / name, device="cuda", measure=False,
                        on_images=corrupt, **kwargs)

    memory, runs, pools = {}, {}, {}

    def by_pool(info):  # what the allocator holds while the graphs replay, pool by pool: the
        if info["global_step"] in (10, 22):  # figures a model of the captured step must give
            segments = torch.cuda.memory_snapshot()
            pools[info["global_step"]] = {
                "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "pools": [{"pool": str(tuple(seg.get("segment_pool_id", ()))), "stream": seg["stream"],
                           "segment": seg["total_size"], "allocated": seg["allocated_size"],
                           "blocks": [(b["size"], b["state"]) for b in seg["blocks"]]} for seg in segments]}

    losses: dict[str, list[float]] = {}

    def on_step(name):
        def record(info):
            losses.setdefault(name, []).append(info["loss"])
            if name == "g":
                by_pool(info)
        return record

    # "ec": the captured run's recipe, its step never captured (a warm-up longer than the run)
    for name, recipe in (("g", graph), ("e", eager), ("e2", eager), ("ec", graph)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # a budget makes the captured run predict its graph's memory
        with pytest.MonkeyPatch.context() as mp:
            if name == "ec":
                mp.setattr(edgetl.train, "CapturedStep", functools.partial(CapturedStep, warmup=10**9))
            runs[name] = run(recipe, name, on_step=on_step(name),
                             **({"budget_bytes": 10**10} if name == "g" else {}))
        memory[name] = {"max_allocated": torch.cuda.max_memory_allocated(),
                        "max_reserved": torch.cuda.max_memory_reserved()}
    figures["finetune_graph_pools"] = pools
    # 3 warm-up steps; the first batch of 5 runs eagerly too unless it fell among them, after
    # the graph of 6 is released (captured again at the next batch of 6)
    assert re.fullmatch(r"CUDA graph: (3 eager step\(s\)|4 eager step\(s\)) \(warm-up, and each batch size's "
                        r"first\), then 2 graph\(s\) captured and replayed \(batch sizes 6, 5\)"
                        r"(; 3 captures: the graphs were released 1 time\(s\) to run a new batch size's first batch "
                        r"eagerly)?", runs["g"].execution), runs["g"].execution
    assert runs["g"].execution.startswith("CUDA graph: 3") != runs["g"].execution.endswith("eagerly")
    assert runs["e"].execution == "eager: train.cuda_graph is off (--eager, or a plan whose step runs eagerly)"
    assert " then 0 graph(s) captured" in runs["ec"].execution, runs["ec"].execution
    assert all(len(r.skipped) == 1 for r in runs.values())
    g_memory = runs["g"].graph_memory
    assert runs["e"].graph_memory is None and g_memory.runtime_bytes == runs["g"].predicted.total_bytes
    figures["finetune_graph_budget"] = {"runtime": g_memory.runtime_bytes, "extra": g_memory.extra_bytes,
                                        "predicted_reserved": g_memory.replay.reserved_bytes}
    if g_memory.extra_bytes:  # a budget the eager step fits and the graphs' extra does not: refused, nothing written
        with pytest.raises(BudgetError, match="with CUDA graphs .* --eager runs it in"):
            run(graph, "r", budget_bytes=g_memory.total_bytes - 1)
        assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    for name, on in (("g", True), ("e", False)):
        assert yaml.safe_load((tmp_path / name / "recipe.yaml").read_text())["train"]["cuda_graph"] is on

    class Killed(Exception):
        pass

    def kill(info):  # on_step comes a step late: raised while step 19 runs; last.pt is from epoch 2 step 5
        if info["global_step"] == 18:
            raise Killed

    with pytest.raises(Killed):
        run(graph, "k", on_step=kill)
    resumed = run(eager, "k", resume=True)
    assert resumed.execution.startswith("eager")
    g, e, e2, k, ec = (_weights(tmp_path / r / "model.pt") for r in ("g", "e", "e2", "k", "ec"))
    rerun, captured, mixed = _max_diff(e, e2), _max_diff(g, e), _max_diff(g, k)
    replayed, arithmetic = _max_diff(g, ec), _max_diff(ec, e)
    figures["finetune_graph"] = {
        "rerun_max_abs_diff": rerun, "graph_vs_eager_max_abs_diff": captured, "graph_resumed_eager_max_abs_diff": mixed,
        "graph_vs_uncaptured_max_abs_diff": replayed, "capturable_vs_plain_adam_max_abs_diff": arithmetic,
        "step_loss": losses, "train_loss": {n: [r["train_loss"] for r in runs[n].history] for n in runs},
        "memory": memory, "execution": runs["g"].execution}
    assert replayed <= max(10 * rerun, 1e-3), figures["finetune_graph"]  # what the graphs alone change
    assert len(losses["g"]) == len(losses["ec"]) == 24
    assert losses["g"] == pytest.approx(losses["ec"], rel=1e-4), figures["finetune_graph"]
    tolerance = max(10 * rerun, 2 * arithmetic, 1e-3)
    assert captured <= tolerance and mixed <= tolerance, figures["finetune_graph"]


@cuda
def test_retrain_with_autocast_and_gradscaler(tmp_path, figures):
    """``edgetl retrain`` on CUDA in fp16 autocast with a GradScaler: finite loss, fp32 weights
    that moved, the scaler's state in the checkpoint, and a resume that picks it up."""
    from edgetl import train as T
    from edgetl.recipe import RECIPE_DIR, load_recipe
    from edgetl.retrain import retrain

    data = _color_data(tmp_path / "data")
    recipe = load_recipe(RECIPE_DIR / "imagenet_retrain.yaml", {
        "data.preset": "imagefolder", "data.root": str(data), "data.resolution": 64, "model.width": 0.35,
        "model.precision": "fp16", "train.epochs": 2, "train.batch_size": 8, "train.workers": 0,
        "train.checkpoint_every": 2, "optim.lr": 0.01, "optim.warmup_epochs": 0, "distill": None})
    result = retrain(recipe=recipe, out_dir=tmp_path / "r", device="cuda")
    losses = [r["train_loss"] for r in result.history]
    ckpt = T.load_checkpoint(tmp_path / "r" / "last.pt")
    figures["retrain_fp16"] = {"losses": losses, "scale": ckpt["scaler"] and ckpt["scaler"].get("scale")}
    assert all(torch.isfinite(torch.tensor(losses)))
    assert ckpt["scaler"] is not None and ckpt["scaler"]["scale"] > 0
    weights = ckpt["model"]
    assert all(v.dtype in (torch.float32, torch.int64) for v in weights.values())
    assert all(torch.isfinite(v.float()).all() for v in weights.values())
    assert losses[-1] < losses[0] * 1.5  # trains, does not diverge


@cuda
def test_bench_on_cuda_reports_allocated_and_reserved(tmp_path):
    from edgetl.bench import bench, table_rows

    result = bench(resolution=64, width=0.35, num_classes=10, batch_size=8, budget_bytes=64 * 10**6,
                   methods=["repnet-stock", "repnet-pruned-pool2"], steps=2, warmup=1, device="cuda",
                   verify_images=0)
    for row in result.rows:
        assert row.tensor_bytes <= row.measured_bytes <= row.reserved_bytes
        # captured by default on CUDA, timed beside the eager step, at the largest batch too
        assert row.graph_error is None and len(row.graph_step_seconds) == 2, row.graph_error
        assert row.graph_images_per_s > 0 and row.largest_graph_images_per_s > 0
    headers, _ = table_rows(result)
    assert "allocated MB" in headers and "reserved MB" in headers and "images/s, CUDA graph" in headers


def test_cuda_report_answers_the_runtime_accounting_for_a_jetson():
    """Runtime accounting + the step's workspaces; with a trace, the replayed allocated and reserved peaks."""
    from edgetl.memory.cuda import JETSON_ORIN
    from edgetl.memory.cuda_step import cuda_report
    from edgetl.memory.runtime import runtime_report
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import LeanOptions, build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=5), "repnet", lean=LeanOptions(pool=2))
    runtime = runtime_report(net, mode="repnet", resolution=64, batch_size=4).total_bytes
    plain = cuda_report(net, mode="repnet", resolution=64, batch_size=4, trace=False, env={})
    jetson = 2 * CUBLAS_WORKSPACE_DEFAULT + CUBLASLT_WORKSPACE_DEFAULT
    assert (plain.runtime_bytes, plain.allocated_bytes) == (runtime, runtime + jetson)
    assert plain.reserved_bytes is None and plain.slack is None and plain.capability == JETSON_ORIN
    traced = cuda_report(net, mode="repnet", resolution=64, batch_size=4, env={})
    assert traced.cublas_workspace_bytes == jetson
    assert runtime + jetson <= traced.allocated_bytes <= traced.reserved_bytes
    assert traced.allocated_bytes - plain.allocated_bytes < 2 * MiB  # rounding and packing: small here
    assert traced.reserved_bytes % SMALL_BUFFER == 0 and traced.slack >= 1
    grown = cuda_report(net, mode="repnet", resolution=64, batch_size=4, capability=(9, 0),
                        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert grown.expandable and grown.cublas_workspace_bytes == 2 * CUBLAS_WORKSPACE_SM90 + MiB
    assert grown.allocated_bytes >= runtime + grown.cublas_workspace_bytes
