"""README "Your own data on a Jetson, step by step": its commands, read from the README, run end to end.

Small scale: 64 px instead of 224 (flags appended to each command, which argparse lets
win), a budget that makes the plan prune at 64 px, one epoch; a real ImageFolder made of
Fashion-MNIST PNG files; a stand-in ImageNet weights file in a temporary TORCH_HOME.
"""

import glob
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from edgetl.cli import main
from tests.conftest import FMNIST_REASON, HAVE_FMNIST, make_fmnist_folder, place_imagenet_weights

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Your own data on a Jetson, step by step"
CLASSES = [5, 6, 7, 8, 9]
# What each command gets appended at this scale.
SMALL = {
    # fp32 activations: a CPU without native bf16 convolutions runs bf16 ones 10-50x slower
    "plan": ["--resolution", "64", "--budget", "10MB", "--precision", "fp32"],
    "prune": ["--resolution", "64", "--calib-batches", "2"],
    "retrain": ["--set", "data.resolution=64", "--batch-size", "32", "--set", "train.workers=0",
                "--set", "train.val_batch_size=50"],
    "finetune": ["--set", "data.resolution=64", "--epochs", "1", "--set", "train.workers=0"],
}


def readme_commands() -> list[str]:
    text = README.read_text()
    block = re.search(re.escape(SECTION) + r".*?```sh\n(.*?)```", text, re.S)
    assert block, f"README has no {SECTION!r} section with a sh block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines()
            if line.strip() and not line.startswith("#")]


def test_readme_walkthrough_names_every_stage():
    stages = [shlex.split(c)[1] if c.startswith("edgetl") else "classify" for c in readme_commands()]
    assert stages == ["doctor", "plan", "prune", "retrain", "finetune", "export", "classify"]


@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_readme_walkthrough_runs_end_to_end(tmp_path, monkeypatch, capsys):
    home = tmp_path / "torch_home"
    weights = place_imagenet_weights(home)
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    make_fmnist_folder(tmp_path / "data", CLASSES, n_train=24, n_val=6)
    printed = {}
    for command in readme_commands():
        argv = shlex.split(command)
        if argv[0] == "edgetl":
            stage = argv[1]
            code = main(argv[1:] + SMALL.get(stage, []))
            out, err = capsys.readouterr()
            assert code == 0, (command, err)
            printed[stage] = out
        else:
            files = [f for a in argv[4:] for f in sorted(glob.glob(a))]
            script = Path(__file__).resolve().parents[1] / argv[1]
            proc = subprocess.run([sys.executable, str(script), *argv[2:4], *files],
                                  capture_output=True, text=True, check=False)
            assert proc.returncode == 0, proc.stderr
            printed["classify"] = proc.stdout

    plan = (tmp_path / "plan.yaml").read_text()
    assert "kept" in plan
    pruned = json.loads((tmp_path / "pruned" / "backbone.json").read_text())
    assert pruned["base"]["weights"] == "mobilenet_v2:IMAGENET1K_V1" and pruned["spec"]["hidden"]
    retrained = json.loads((tmp_path / "retrained" / "backbone.json").read_text())
    assert retrained["spec"]["hidden"] == pruned["spec"]["hidden"]
    assert retrained["base"]["weights"] == "mobilenet_v2:IMAGENET1K_V1"
    model = json.loads((tmp_path / "runs" / "mine" / "model.json").read_text())
    assert model["backbone_source"]["folder"] == "retrained"
    assert model["labels"] == ["Ankle_boot", "Bag", "Sandal", "Shirt", "Sneaker"]  # sorted folder names
    assert (tmp_path / "runs" / "mine" / "export" / "model.onnx").is_file()
    # classify printed one labelled line per validation image
    lines = printed["classify"].strip().splitlines()
    assert len(lines) == len(CLASSES) * 6
    assert all(any(label in line for label in model["labels"]) for line in lines)
    # the printed summaries name what was made
    assert "saved to plan.yaml" in printed["plan"] and "saved to pruned" in printed["prune"]
    assert "backbone: retrained" in printed["finetune"]
    # the summary says how the step ran: on this CPU eagerly, and why
    assert "step: eager: CUDA graphs need a CUDA device; this run is on cpu" in printed["finetune"]
    assert weights["features.0.0.weight"].shape[0] == 32  # the stand-in is a width-1.0 file
