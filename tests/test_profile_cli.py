"""`edgetl profile` end to end: JSON contract, printed figures, plot, bad input."""

import json
import struct
import subprocess
import sys

import pytest

from edgetl.cli import main
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import build_network
from edgetl.profile import paper_report


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract_and_values(tmp_path, capsys):
    path = tmp_path / "r.json"
    code, out, _ = run_cli(["profile", "--mode", "repnet", "--accounting", "paper",
                            "--num-classes", "102", "--json", str(path)], capsys)
    assert code == 0
    data = json.loads(path.read_text())
    for key in ("accounting", "mode", "resolution", "batch_size", "num_classes", "blocks",
                "peak_activation_bytes", "param_bytes", "total_bytes", "sensitive_blocks"):
        assert key in data
    assert set(data["blocks"][0]) >= {"index", "tmp_bytes", "cugrd_bytes", "peak_bytes"}
    assert [b["index"] for b in data["blocks"]] == list(range(20))
    expected = paper_report(build_network(BackboneSpec(num_classes=102), "repnet", device="meta"),
                            mode="repnet", resolution=224, batch_size=8)
    assert data["total_bytes"] == expected.total_bytes
    assert data["peak_activation_bytes"] == 5_720_064
    assert data["total_bytes"] == 8 * data["peak_activation_bytes"] + data["param_bytes"]
    # the printed figures are the JSON's
    assert f"{data['peak_activation_bytes'] / 1e6:.2f} MB" in out
    assert f"{data['total_bytes'] / 1e6:.2f} MB" in out
    assert "sensitive blocks: 0, 1, 2, 3, 4" in out


def test_runtime_profile_prints_its_schedule_and_the_ops_of_its_step(tmp_path, capsys):
    """The schedule and op counts printed are those of a network prepared independently."""
    from edgetl.memory.meter import count_step_ops
    from edgetl.memory.schedule import prepare_step
    from edgetl.models.side import LeanOptions

    path = tmp_path / "r.json"
    code, out, _ = run_cli(["profile", "--accounting", "runtime", "--width", "0.35", "--resolution", "64",
                            "--batch-size", "4", "--num-classes", "10", "--json", str(path)], capsys)
    assert code == 0
    data = json.loads(path.read_text())
    net = build_network(BackboneSpec(width=0.35, num_classes=10), "repnet", device="meta", lean=LeanOptions())
    schedule = prepare_step(net, resolution=64, batch_size=4)
    ops = count_step_ops(net, resolution=64, batch_size=4)
    assert data["schedule"] == json.loads(json.dumps(schedule.to_dict()))
    assert data["step_ops"] == {"forward": ops.forward, "backward": ops.backward, "optimizer": ops.optimizer}
    assert (f"forward {ops.forward:,}, backward {ops.backward:,}, optimizer {ops.optimizer:,}") in out
    assert (f"masked backward on the whole batch in {len(schedule.whole_batch)} frozen convs "
            f"({len(schedule.sample_by_sample)} sample by sample)") in out
    assert f"4 samples at a time in {len(schedule.mask_chunks)} convs" in out


def test_plot_is_a_real_png(tmp_path, capsys):
    path = tmp_path / "p.png"
    code, _, _ = run_cli(["profile", "--width", "0.35", "--resolution", "64",
                          "--plot", str(path)], capsys)
    assert code == 0
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (1200, 540)  # 10 x 4.5 in at 120 dpi


def exit_code(argv) -> int:
    """main()'s exit code, whether argparse exits or the command returns."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--resolution", "0"], "--resolution"),
        (["--batch-size", "-1"], "--batch-size"),
        (["--mode", "everything"], "--mode"),
        (["--width", "abc"], "--width"),
        (["--json", "/nonexistent-dir/r.json"], "/nonexistent-dir"),
        (["--resolution", "48"], "resolution 48 is too small"),
        (["--checkpoint", "/nonexistent-backbone"], "does not exist"),
    ],
)
def test_bad_input_one_line_exit_2(args, needle, capsys):
    assert exit_code(["profile", *args]) == 2
    out, err = capsys.readouterr()
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert out == ""


def test_unwritable_json_path_fails_before_work(tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    assert exit_code(["profile", "--json", str(blocker / "r.json")]) == 2
    out, err = capsys.readouterr()
    assert "is a file, not a folder" in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-folder"]


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "edgetl", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("edgetl ")


@pytest.mark.parametrize("argv, message", [
    (["--mode", "full", "--storage", "dct"],
     "storage dct does not apply to paper accounting (the papers' model of stock modules): it needs accounting runtime or measure"),
    (["--mode", "full", "--storage", "dct", "--accounting", "runtime"],
     "storage dct does not apply to mode full on stock modules: it needs the lean runtime (runtime lean; modes "
     "repnet, repnet+bias, last, bias, full)"),
    (["--mode", "repnet", "--storage", "dct", "--accounting", "runtime"],
     "storage dct does not apply to mode repnet: it needs mode full (lean full fine-tuning)"),
    (["--mode", "full", "--runtime", "lean", "--storage", "pool2", "--keep", "0.3", "--accounting", "runtime"],
     "keep 0.3 does not apply to mode full: it needs a compressor storage (haar, db3, dct, threshold)"),
    (["--mode", "bias", "--pool", "4", "--accounting", "runtime"],
     "pool 4 does not apply to mode bias: it needs a Rep-Net mode (repnet, repnet+bias): it pools the side "
     "network's activations"),
    (["--fused"], "fused True does not apply to paper accounting (the papers' model of stock modules): it needs "
                  "accounting runtime or measure"),
    (["--accounting", "runtime", "--frozen-bits", "16"],
     "frozen_bits 16 applies to paper accounting; the runtime's frozen weights are frozen_weights (fp32, fp16, int8)"),
])
def test_an_option_the_profile_would_ignore_is_refused(argv, message, capsys):
    """Issue #29: no option is silently ignored (profile --mode full --storage dct used to report
    the stock network's 658.7 MB and exit 0)."""
    from edgetl.cli import main

    assert main(["profile", "--resolution", "64", "--width", "0.35", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"edgetl: error: {message}\n"
