"""The measurement scripts that write committed benchmark files still run against today's library
(a script that only runs when someone regenerates its figures breaks unseen: busy_cores.py built
the bench's setting without the architecture field for a while)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_busy_cores_child_times_both_methods():
    """The timed process of scripts/busy_cores.py, at tiny scale: one step of each method."""
    argv = [sys.executable, str(SCRIPTS / "busy_cores.py"), "--child", "--steps", "2", "--warmup", "0",
            "--resolution", "64", "--batch-size", "2", "--width", "0.35", "--num-classes", "3"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["seconds"]) == {"repnet-lean", "repnet-lean-stream"}
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())


def test_step_time_parts_splits_each_step_and_bounds_its_speed(tmp_path):
    """scripts/step_time_parts.py at tiny scale: each row's convolution kernels are a part of its
    step, and the speed-up it allows with the rest at 0 is never below the row's measured one."""
    out = tmp_path / "parts.json"
    argv = [sys.executable, str(SCRIPTS / "step_time_parts.py"), "--resolution", "64", "--steps", "2",
            "--warmup", "1", "--profiled", "1", "--methods", "repnet-stock,bias-lean,bias-lean-stream",
            "--json", str(out)]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    for name, r in rows.items():
        assert 0 < r["conv_share"] < 1 and 0 < r["conv_s"] < r["step_s"], name
        assert r["vs_reference_bound"] > r["vs_reference"], name
    assert rows["bias-lean-stream"]["vs_twin_bound"] > rows["bias-lean-stream"]["vs_twin"]
    assert rows["repnet-stock"]["vs_reference"] == 1.0
    # stock Rep-Net again, channels-last (the default --channels-last), measured against the same reference
    assert rows["repnet-stock@channels-last"]["label"] == "Rep-Net, stock modules, channels-last"
    assert rows["repnet-stock@channels-last"]["vs_twin"] is None


def test_step_time_parts_runs_only_stock_methods_channels_last():
    argv = [sys.executable, str(SCRIPTS / "step_time_parts.py"), "--channels-last", "repnet-lean"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()  # one line, no usage text
    assert "--channels-last: 'repnet-lean' is not a stock method; allowed: " in line and "repnet-stock" in line


def test_channels_last_trainer_runs_the_stock_step_in_that_layout():
    """A converted stock trainer's weights, batch and conv outputs are channels-last, and its step
    gives the default layout's loss (other kernels, the same sums up to rounding)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from step_time_parts import to_channels_last
    finally:
        sys.path.remove(str(SCRIPTS))
    from edgetl.bench import cpu_trainers
    from edgetl.step import training_step

    def trainer():
        return cpu_trainers(["repnet-stock"], resolution=64, batch_size=2, num_classes=5, width=0.35)["repnet-stock"]

    default, converted = trainer(), trainer()
    converted.net.load_state_dict(default.net.state_dict())
    converted = to_channels_last(converted)
    convs = [m for m in converted.net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    assert converted.image.is_contiguous(memory_format=torch.channels_last)
    outputs = []
    hook = convs[0].register_forward_hook(lambda m, i, o: outputs.append(o))  # the stem: 32 x 32 px
    losses = [training_step(t.net, t.spec, t.opt, t.image, t.labels)[0] for t in (default, converted)]
    hook.remove()
    assert outputs[0].is_contiguous(memory_format=torch.channels_last) and not outputs[0].is_contiguous()
    torch.testing.assert_close(losses[1], losses[0])


def test_heap_policy_child_times_each_method_under_either_policy():
    """The measuring process of scripts/heap_policy.py, at tiny scale, with glibc's default and held."""
    said = {}
    for policy in ("default", "held"):
        setting = {"policy": policy, "schedule": "interleaved", "methods": ["repnet-stock", "repnet-lean"],
                   "resolution": 64, "batch_size": 2, "width": 0.35, "steps": 2, "warmup": 0}
        argv = [sys.executable, str(SCRIPTS / "heap_policy.py"), "--child", json.dumps(setting)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
        result = json.loads(out.strip().splitlines()[-1])
        assert set(result["rows"]) == {"repnet-stock", "repnet-lean"}
        for row in result["rows"].values():
            assert len(row["steps_s"]) == 2 and row["step_s"] > 0 and row["faults_per_step"] >= 0
            assert row["maxrss_bytes"] > 10**8  # torch alone is larger
        said[policy] = result["heap"]
    assert said["default"] == "the C library's default" and said["held"] != said["default"]


def test_conv_kernels_are_told_from_the_rest():
    sys.path.insert(0, str(SCRIPTS))
    try:
        from step_time_parts import is_conv_kernel
    finally:
        sys.path.remove(str(SCRIPTS))
    for name in ("aten::convolution_backward", "aten::mkldnn_convolution", "aten::_slow_conv2d_forward",
                 "aten::mm", "aten::addmm", "aten::conv2d"):
        assert is_conv_kernel(name), name
    for name in ("aten::copy_", "aten::native_batch_norm", "aten::hardtanh_backward", "aten::index_select",
                 "_FrozenConvFn", "Optimizer.step#Adam.step", "aten::mul_"):
        assert not is_conv_kernel(name), name


def test_cpu_speed_summarises_each_rows_ratios_per_setting():
    """scripts/cpu_speed.py's summary: each row's ratio to stock in every run, their median, and a
    streamed row's ratio to its twin, as the bench's rows carry them."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from cpu_speed import summary
    finally:
        sys.path.remove(str(SCRIPTS))

    def run(lean: float, twin: float) -> dict:
        return {"rows": [{"method": "repnet-stock", "images_per_s": 30.0, "throughput_ratio": 1.0},
                         {"method": "repnet-lean", "images_per_s": 30.0 * lean, "throughput_ratio": lean},
                         {"method": "repnet-lean-stream", "images_per_s": 30.0 * lean * twin,
                          "throughput_ratio": lean * twin, "unstreamed_throughput_ratio": twin}]}

    got = summary([run(1.1, 0.9), run(1.3, 0.8), run(1.2, 1.0)])
    assert got["repnet-lean"]["vs_stock"] == [1.1, 1.3, 1.2] and got["repnet-lean"]["vs_stock_median"] == 1.2
    assert got["repnet-lean-stream"]["vs_twin_median"] == 0.9 and got["repnet-stock"]["vs_twin_median"] is None


def test_cpu_speed_runs_the_bench_on_the_methods_asked_for():
    """scripts/cpu_speed.py --methods: its bench arguments parse with edgetl bench's own parser
    and carry those methods (the default ones where not given), timed as every run is."""
    from edgetl.cli import build_parser

    sys.path.insert(0, str(SCRIPTS))
    try:
        from cpu_speed import METHODS, bench_args
    finally:
        sys.path.remove(str(SCRIPTS))
    for methods in (METHODS, "repnet-stock,repnet-lean-cl"):
        args = build_parser(only="bench").parse_args(["bench", *bench_args(methods), "--json", "x.json"])
        assert args.methods == methods.split(","), args.methods
        assert (args.steps, args.warmup, args.largest_steps) == (10, 2, 0)


def test_step_ops_sources_add_up_to_the_counted_step():
    """scripts/step_ops.py --sources: the ops it lists by source line (its own dispatch mode) are
    the ops ``count_step_ops`` counts, line by line summed; a negative count is one line, exit 2."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from step_ops import op_sources
    finally:
        sys.path.remove(str(SCRIPTS))
    from edgetl.bench import METHODS, build_method
    from edgetl.memory.meter import count_step_ops
    from edgetl.memory.schedule import prepare_step

    for name in ("repnet-stock", "repnet-lean-cl"):
        net = build_method(METHODS[name], width=0.35, num_classes=5, device="meta")
        prepare_step(net, resolution=64, batch_size=4)
        lines = op_sources(net, resolution=64, batch_size=4)
        assert sum(lines.values()) == count_step_ops(net, resolution=64, batch_size=4).total
        wheres = {where for where, _ in lines}
        assert any(w.startswith("edgetl/models/") for w in wheres) and any(w.startswith("edgetl/step.py:")
                                                                           for w in wheres)
        if name == "repnet-lean-cl":  # the pixel rows: one view each, from the layout helpers
            assert any(op == "as_strided" and where.startswith("edgetl/models/lean/layout.py:")
                       for where, op in lines)
    done = subprocess.run([sys.executable, str(SCRIPTS / "step_ops.py"), "--sources", "-2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line == "step_ops.py: --sources: -2 is negative; allowed: 0 (none) or more lines"
