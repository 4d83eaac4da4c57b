"""Issue #42, must show: a ResNet-18 plan that fits its budget (predicted = measured), fine-tuned
from the plan on an ImageFolder and exported, through the command line a user types."""

from __future__ import annotations

import json

import pytest

from edgetl.cli import main
from tests.conftest import make_color_folder

RES = 64


def run_cli_output(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit code and everything printed (stdout then stderr) of one command line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_plan_finetune_export_a_resnet18(tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("EDGETL_OFFLINE", "1")
    data = make_color_folder(tmp_path / "data", n_train=4, n_val=2, size=RES)
    plan = tmp_path / "plan.yaml"
    code, out = run_cli_output(capsys, ["plan", "--backbone", "resnet18", "--budget", "30MB", "--batch-size", "4",
                              "--num-classes", "3", "--resolution", str(RES), "--verify", "-o", str(plan)])
    assert code == 0, out
    from edgetl.plan.document import load_plan

    done = load_plan(plan)
    assert done.spec.arch == "resnet18" and done.measured_bytes == done.predicted_bytes <= 30 * 10**6
    run = tmp_path / "run"
    code, out = run_cli_output(capsys, ["finetune", "--plan", str(plan), "--backbone", "resnet18:random", "--recipe",
                              "imagefolder", "--data", str(data), "--epochs", "1", "--set",
                              f"data.resolution={RES}", "-o", str(run)])
    assert code == 0, out
    model = json.loads((run / "model.json").read_text())
    assert model["backbone"]["arch"] == "resnet18"
    code, out = run_cli_output(capsys, ["export", "--run", str(run), "-o", str(tmp_path / "model.onnx")])
    assert code == 0 and "parity" in out, out
    # a plan made for ResNet-18 refuses another network, naming both
    code, out = run_cli_output(capsys, ["finetune", "--plan", str(plan), "--recipe", "imagefolder", "--data", str(data),
                              "--set", f"data.resolution={RES}", "-o", str(tmp_path / "other")])
    assert code == 2 and "planned for ResNet-18; the backbone" in out and "--backbone resnet18" in out
    assert not (tmp_path / "other").exists()
