"""`edgetl demo --quick`: the whole pipeline on real data; figures checked, rerun reuses stages."""

import json
from pathlib import Path

import pytest
import torch

from edgetl.cli import main
from edgetl.demo import STREAM
from edgetl.models.backbone import BackboneSpec
from tests.conftest import FMNIST_REASON, HAVE_FMNIST


@pytest.mark.slow  # about 4 minutes on 2 cores: .ci/run runs it after `make test`
@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert list(report) == ["pretrain", "profile", "plan", "prune", "retrain",
                            "ft_pruned", "ft_repnet", "ft_streamed", "ft_full", "export"]
    pruned, repnet, streamed = report["ft_pruned"], report["ft_repnet"], report["ft_streamed"]
    # on a CPU the Rep-Net runs are channels-last, the full fine-tune plain (its recipe says so too)
    assert [report[s]["channels_last"] for s in ("ft_pruned", "ft_repnet", "ft_streamed", "ft_full")] == [
        True, True, True, False]
    assert "channels_last: true" in (out / "ft_streamed" / "recipe.yaml").read_text()
    assert pruned["target_acc1"] > 40.0  # 5 target classes: chance is 20 %
    # the method's point: the pruned side-network run really holds less memory
    assert pruned["measured_bytes"] < repnet["measured_bytes"]
    # the other route: the unpruned backbone streamed holds less than unstreamed, unpruned
    assert streamed["measured_bytes"] < repnet["measured_bytes"] and streamed["stream"] == STREAM
    assert streamed["target_acc1"] > 40.0
    for run in (pruned, repnet):  # the accounting the budget check trusts is the measurement
        assert run["predicted_bytes"] == run["measured_bytes"]
    # The streamed run measures what it predicts when this test runs alone (and in
    # tests/test_stream.py, tests/test_finetune.py), but in one full-suite run its measured
    # peak came out 5.6 % above the prediction (5,893,716 vs 5,578,936 B), not reproduced
    # since: an open question of issue #14, bounded here rather than hidden.
    assert streamed["predicted_bytes"] <= streamed["measured_bytes"] <= 1.1 * streamed["predicted_bytes"]
    assert report["plan"]["predicted_bytes"] <= report["plan"]["budget_bytes"]
    assert report["export"]["max_abs_diff"] <= 1e-4
    assert f"{pruned['target_acc1']:.1f}" in printed
    # pruning follows the plan (or the paper's ratios when the plan needs none)
    spec = json.loads((out / "prune" / "backbone.json").read_text())["spec"]
    assert sorted(map(int, spec["hidden"])) == sorted(report["prune"]["blocks"])

    # a rerun reuses every finished stage and reports the same figures
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.count("reused from") == 10
    assert json.loads((out / "report.json").read_text()) == report


# --- another backbone (issue #42): the stages' choices, checked without training -----------------


def _ctx(arch, done=None, root="/nonexistent/fashion-mnist"):
    from edgetl.demo import QUICK, _Context

    return _Context(QUICK, "cpu", root, None, done or {}, arch)


def test_the_pretrained_backbone_is_the_architecture_at_random_init(tmp_path):
    """MobileNetV2 keeps the recipe it always had (no backbone: the default, width 0.35); ResNet-18,
    which has no width multiplier, starts from resnet18:random at width 1.0."""
    default = _ctx("mobilenet_v2", root=str(tmp_path))
    model = default.source_recipe(1, default.initial_backbone).model
    assert (model.backbone, model.width, model.mode) == (None, 0.35, "full")
    resnet = _ctx("resnet18", root=str(tmp_path))
    model = resnet.source_recipe(1, resnet.initial_backbone).model
    assert (model.backbone, model.width, model.mode) == ("resnet18:random", 1.0, "full")


def test_rep_net_fine_tunes_run_channels_last_on_a_cpu_and_plain_elsewhere(tmp_path):
    """The Rep-Net stages' recipes ask for channels-last on a CPU (faster conv kernels there);
    full fine-tuning, which trains its convs plain, never; on CUDA none does. A recipe builds
    a network laid out as it says, and a stage recorded before the option reads as plain."""
    from edgetl.demo import STAGES, FineTuned, Planned, Trained, _Context, QUICK
    from edgetl.demo_jobs import _read_mark
    from edgetl.models.side import build_network

    done = {"pretrain": Trained("pre", None), "retrain": Trained("re", None),
            "plan": Planned(1, 1, "plan.yaml", [], [], 2, "k=2")}
    stages = {s.name: s.run for s in STAGES if s.result is FineTuned}
    assert sorted(stages) == ["ft_full", "ft_pruned", "ft_repnet", "ft_streamed"]
    recipes = {}
    for device, expected in (("cpu", {"ft_full": False, "ft_pruned": True, "ft_repnet": True, "ft_streamed": True}),
                             ("cuda", dict.fromkeys(stages, False))):
        ctx = _Context(QUICK, device, "/nonexistent/fashion-mnist", None, done, "mobilenet_v2")
        recipes[device] = {name: run.recipe(ctx) for name, run in stages.items()}
        assert {name: r.model.channels_last for name, r in recipes[device].items()} == expected, device
        streamed = recipes[device]["ft_streamed"].model  # the other levers as before, on either device
        assert (streamed.stream, streamed.uint8_input, streamed.recompute, streamed.pool) == (STREAM, True, True, 2)
    spec = BackboneSpec(width=QUICK.width, num_classes=5)
    for device, layout in (("cpu", torch.channels_last), ("cuda", torch.contiguous_format)):
        net = build_network(spec, "repnet", device="meta", lean=recipes[device]["ft_repnet"].model.lean())
        assert net.input_memory_format == layout, device
    mark = tmp_path / "ft_repnet.json"  # what the demo wrote before the option existed
    old = {"run": "r", "mode": "repnet", "pool": 2, "stream": 0, "backbone": "pre", "uint8_input": False,
           "recompute": False, "target_acc1": 87.5, "predicted_bytes": 1, "measured_bytes": 1, "runtime": "lean",
           "wall_s": 3.0}
    mark.write_text(json.dumps(old))
    record, wall_s = _read_mark(mark, FineTuned)
    assert record.channels_last is False and wall_s == 3.0


def test_prune_follows_the_plan_then_the_papers_ratios_then_the_papers_rule():
    from edgetl.demo import DemoReport, Planned, prune_rule

    fitted = Planned(1, 1, "plan.yaml", [], [], 2, "prune none")
    pruning = Planned(1, 1, "plan.yaml", [1, 2], [0.5, 0.25], 2, "prune 1, 2")
    assert [prune_rule(a, pruning) for a in ("mobilenet_v2", "resnet18")] == ["plan", "plan"]
    assert [prune_rule(a, fitted) for a in ("mobilenet_v2", "resnet50")] == ["paper", "auto"]
    report = DemoReport(Path("demo"), stages={"plan": fitted}, arch="resnet50")
    assert report.prune_source == ("the paper's rule (edgetl prune --auto) on the profile's sensitive blocks: "
                                   "no paper pruned ResNet-50, and the plan fitted without pruning")
    assert DemoReport(Path("demo"), stages={"plan": fitted}).prune_source == (
        "the paper's ratios for MobileNetV2 (the plan fitted without pruning)")


def test_the_papers_rule_on_resnet18_prunes_nothing_and_the_pipeline_goes_on(tmp_path):
    """ResNet-18's one sensitive block at 64 px is its stem (paper accounting, edgetl.prune's
    default_blocks), which has no hidden channels: the prune stage saves the network as it is."""
    from edgetl.demo import Planned, Trained, _prune
    from edgetl.models.backbone import BackboneSpec, build_backbone, load_backbone, save_backbone
    from edgetl.profile import profile

    assert profile(mode="repnet", accounting="paper", resolution=64, batch_size=32, num_classes=5,
                   checkpoint="resnet18:random").sensitive_blocks == [0]
    (tmp_path / "pretrain").mkdir()
    save_backbone(tmp_path / "pretrain", build_backbone(BackboneSpec(arch="resnet18", num_classes=5)))
    done = {"pretrain": Trained(str(tmp_path / "pretrain"), None),
            "plan": Planned(1, 1, "plan.yaml", [], [], 1, "prune none")}
    pruned = _prune(_ctx("resnet18", done), tmp_path / "prune")
    assert (pruned.blocks, pruned.ratios, pruned.hidden) == ([], [], {})
    before, after = load_backbone(tmp_path / "pretrain"), load_backbone(pruned.backbone)
    assert after.spec == before.spec
    assert all(torch.equal(a, b) for a, b in zip(after.state_dict().values(), before.state_dict().values()))


def test_a_demo_folder_of_another_backbone_is_refused(tmp_path):
    from edgetl.demo import _check_arch
    from edgetl.errors import ConfigError
    from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone

    (tmp_path / "pretrain").mkdir()
    save_backbone(tmp_path / "pretrain", build_backbone(BackboneSpec(width=0.35, num_classes=5)))
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "pretrain.json").write_text(json.dumps({"backbone": str(tmp_path / "pretrain")}))
    _check_arch(tmp_path, "mobilenet_v2")
    with pytest.raises(ConfigError, match=rf"^demo folder {tmp_path} holds the mobilenet_v2 demo, not resnet18; "
                                          r"choose another folder for --backbone resnet18$"):
        _check_arch(tmp_path, "resnet18")
    _check_arch(tmp_path / "new", "resnet18")  # nothing made yet


# --- the lean fine-tunes' mask kernels ---------------------------------------------------------


def test_the_rep_net_fine_tunes_run_the_chosen_mask_kernels_and_full_fine_tuning_has_none(tmp_path):
    """A stage's recipe carries the demo's choice to every Rep-Net fine-tune (streamed too); full
    fine-tuning has no lean layers. A stage recorded before the choice existed ran torch's ops."""
    from edgetl.demo import STAGES, FineTuned, Planned, Trained, _Context, QUICK
    from edgetl.demo_jobs import _read_mark

    done = {"pretrain": Trained("pre", None), "retrain": Trained("re", None),
            "plan": Planned(1, 1, "plan.yaml", [], [], 2, "k=2")}
    stages = {s.name: s.run for s in STAGES if s.result is FineTuned}
    for kernels in ("fused", "aten"):
        ctx = _Context(QUICK, "cpu", "/nonexistent/fashion-mnist", None, done, "mobilenet_v2", kernels)
        ran = {name: run.recipe(ctx).model.mask_kernels for name, run in stages.items()}
        assert ran == {"ft_pruned": kernels, "ft_repnet": kernels, "ft_streamed": kernels, "ft_full": "aten"}
    mark = tmp_path / "ft_streamed.json"
    mark.write_text(json.dumps({"run": "r", "mode": "repnet", "pool": 2, "stream": 4, "backbone": "pre",
                                "uint8_input": True, "recompute": True, "target_acc1": 87.1, "predicted_bytes": 1,
                                "measured_bytes": 1, "runtime": "lean", "channels_last": True, "wall_s": 82.0}))
    assert _read_mark(mark, FineTuned)[0].mask_kernels == "aten"


def test_the_mask_kernels_choice_says_what_runs_and_why(monkeypatch):
    from edgetl.demo import choose_mask_kernels
    from edgetl.errors import ConfigError

    assert choose_mask_kernels("aten", "cpu") == ("aten", "asked for")
    assert choose_mask_kernels("auto", "cuda") == (
        "aten", "auto: the fused kernels are the demo's choice on a CPU only, not on cuda")
    with pytest.raises(ConfigError, match=r"^mask_kernels 'triton' is not allowed; allowed: auto, aten, fused$"):
        choose_mask_kernels("triton", "cpu")
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # no compiler: auto takes torch's ops and says so
    assert choose_mask_kernels("auto", "cpu") == (
        "aten", "auto: building the fused kernels needs a C++ compiler (CXX, else c++), not found here")


@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_a_compiler_that_fails_falls_back_under_auto_and_refuses_fused_before_the_folder_is_made(tmp_path):
    """A compiler that fails (``CXX=/bin/false``, an empty extension cache): auto runs torch's ops
    and names the failure; ``--mask-kernels fused`` is one line, exit 2, and no demo folder."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    code = "from edgetl.demo import choose_mask_kernels; print(*choose_mask_kernels('auto', 'cpu'), sep='\\n')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    kernels, why = proc.stdout.splitlines()
    assert kernels == "aten" and why.startswith("auto: mask_kernels fused: compiling masks.cpp failed"), proc.stdout
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "edgetl", "demo", "--quick", "--mask-kernels", "fused", "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "mask_kernels fused: compiling masks.cpp failed" in lines[0], proc.stderr
    assert not out.exists()
