"""`edgetl finetune`: pre-flight budget, learning on real data, resume, stock weights, bad input."""

import json

import pytest
import torch

from edgetl.cli import main
from edgetl.errors import BudgetError
from edgetl.finetune import build_model, finetune, predict_peak, resolve_job, stock_state_dict
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network, make_lean
from edgetl.recipe import load_recipe

from tests.conftest import FMNIST_REASON, HAVE_FMNIST

needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def target_recipe(backbone, **overrides):
    values = {"model.backbone": str(backbone), "data.max_samples": 1000, "data.max_val_samples": 500,
              "train.epochs": 2, "train.checkpoint_every": 4}
    values.update(overrides)
    return load_recipe("fashion_mnist", values)


@pytest.mark.slow
@needs_fmnist
def test_finetune_learns_and_pooled_storage_costs_under_a_point(pretrained_backbone, tmp_path):
    """k=2 ends within 1 point of k=1, mean best val top-1 over seeds 0-2 (about 6 minutes).

    The README's configuration: 2000 images, 3 epochs, 1000 validation images. Measured
    (2026-11-23, printed with -s): k=1 76.6 / 77.3 / 75.9, k=2 77.3 / 78.4 / 74.7; single
    seeds differ by up to 1.2 points either way, so the mean is what is asserted. Pooling
    every side map regardless of size (before effective_pool) gave 73.5 at seed 0.
    """
    acc = {1: [], 2: []}
    for seed in (0, 1, 2):
        for k in (1, 2):
            recipe = target_recipe(pretrained_backbone, **{
                "model.pool": k, "train.seed": seed, "train.epochs": 3, "data.max_samples": 2000,
                "data.max_val_samples": 1000, "train.checkpoint_every": 100})
            result = finetune(recipe=recipe, out_dir=tmp_path / f"k{k}s{seed}", measure=False)
            acc[k].append(max(row["val_acc1"] for row in result.history))
            assert result.classes == ["Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    print("best val top-1 by pool k, seeds 0-2:", acc)
    mean = {k: sum(v) / len(v) for k, v in acc.items()}
    assert mean[1] > 70.0, acc  # 5 classes: chance is 20 %
    assert mean[2] >= mean[1] - 1.0, acc


@needs_fmnist
def test_resume_after_kill_equals_uninterrupted(calibrated_backbone, tmp_path):
    recipe = target_recipe(calibrated_backbone, **{"data.max_samples": 200, "data.max_val_samples": 50,
                                        "model.pool": 2})
    finetune(recipe=recipe, out_dir=tmp_path / "whole", measure=False)
    # side conv inputs at 64 px: 8, 8, 4, 2, 2, 1 pixels; only the 8x8 maps keep 4x4 cells when pooled
    assert json.loads((tmp_path / "whole" / "model.json").read_text())["lean"]["side_pools"] == [2, 2, 1, 1, 1, 1]

    class Killed(Exception):
        pass

    def kill(info):
        if info["global_step"] == 9:  # mid-epoch 2, one step after the step-8 checkpoint
            raise Killed

    with pytest.raises(Killed):
        finetune(recipe=recipe, out_dir=tmp_path / "killed", measure=False, on_step=kill)
    assert not (tmp_path / "killed" / "model.pt").exists()
    finetune(recipe=recipe, out_dir=tmp_path / "killed", resume=True, measure=False)
    whole = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "killed" / "model.pt", weights_only=True)["model"]
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@needs_fmnist
def test_run_folder_exports_the_network_that_trained(calibrated_backbone, tmp_path):
    """model.pt (stock layout) rebuilt by export's loader gives the lean network's logits."""
    from edgetl.export import load_run_model
    from edgetl.train import load_checkpoint

    recipe = target_recipe(calibrated_backbone, **{"data.max_samples": 100, "train.epochs": 1,
                                        "model.mode": "repnet+bias"})
    finetune(recipe=recipe, out_dir=tmp_path / "run", measure=False)
    info = json.loads((tmp_path / "run" / "model.json").read_text())
    assert info["lean"]["pool"] == 1 and info["mode"] == "repnet+bias"
    assert info["lean"]["side_pools"] == [1] * 6
    assert len(info["labels"]) == info["backbone"]["num_classes"] == 5
    exported = load_run_model(tmp_path / "run").net.eval()
    lean = build_model(recipe, 5)
    make_lean(lean, LeanOptions(pool=1))
    lean.load_state_dict(load_checkpoint(tmp_path / "run" / "best.pt")["model"])
    lean.eval()
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(exported(x), lean(x), atol=1e-4, rtol=1e-4)


def test_stock_state_dict_inverts_bn_folding():
    """Lean layers with trained biases and batch statistics convert back to stock BN layers."""
    torch.manual_seed(0)
    spec = BackboneSpec(width=0.35, num_classes=4)
    for bn_mode in ("fold", "batch"):
        stock = build_network(spec, "repnet+bias")
        stock.train()
        with torch.no_grad():  # non-trivial running statistics
            for _ in range(3):
                stock(torch.randn(8, 3, 64, 64) * 2 + 1)
        reference = build_network(spec, "repnet+bias")
        reference.load_state_dict(stock.state_dict())
        make_lean(stock, LeanOptions(pool=1, bn=bn_mode))
        with torch.no_grad():
            for name, p in stock.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
            if bn_mode == "batch":
                stock.train()
                stock(torch.randn(8, 3, 64, 64))
        back = build_network(spec, "repnet+bias")
        back.load_state_dict(stock_state_dict(stock, reference))
        stock.eval(), back.eval()
        x = torch.randn(2, 3, 64, 64)
        with torch.no_grad():
            assert torch.allclose(stock(x), back(x), atol=1e-4, rtol=1e-3), bn_mode


def test_the_job_refuses_over_budget_and_names_the_batch_that_fits(tmp_path):
    """``resolve_job``, the path ``finetune`` takes: the prediction at the recipe's batch against the
    budget, and the lean network it hands on carrying the schedule that prediction fitted."""
    from edgetl.memory.schedule import fit_schedule

    recipe = load_recipe("fashion_mnist", {"train.batch_size": 32, "model.backbone": "mobilenet_v2:random"})
    net = build_model(recipe, 5)
    at = {b: predict_peak(net, recipe, b).total_bytes for b in (8, 9, 32)}
    assert at[8] < at[9] < at[32]
    budget = (at[8] + at[9]) // 2
    with pytest.raises(BudgetError, match=r"the largest batch that fits is 8 \(--batch-size 8\)"):
        resolve_job(recipe, 5, budget)
    job = resolve_job(recipe, 5, at[32])
    assert job.predicted.total_bytes == at[32] and job.net is not job.stock
    refit = fit_schedule(job.net, resolution=recipe.data.resolution, batch_size=32, step=job.step)
    assert refit.to_dict() == job.schedule.to_dict()  # fitted once, on the meta copy, and applied as is
    assert "not even batch 1 fits" in str(pytest.raises(BudgetError, resolve_job, recipe, 5, 1000).value)


@needs_fmnist
@pytest.mark.parametrize("make_args, needle", [
    (lambda d: ["--recipe", "imagefolder", "--data", str(d / "missing")], "does not exist"),
    (lambda d: ["--recipe", "imagefolder", "--data", str(d)], "train"),
    (lambda d: ["--set", "model.poool=2"], "did you mean"),
    (lambda d: ["--budget", "1MB"], "exceeds the budget"),
    (lambda d: ["--budget", "256"], "has no unit"),
])
def test_bad_input_exit_2_no_run_folder(tmp_path, capsys, make_args, needle):
    out = tmp_path / "run"
    args = make_args(tmp_path)
    argv = ["finetune", "--recipe", "fashion_mnist", "--backbone", "mobilenet_v2:random", "-o", str(out), *args]
    if "--recipe" in args:
        argv = ["finetune", "-o", str(out), *args]
    assert exit_code(argv) == 2
    _, err = capsys.readouterr()
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_empty_class_folder_is_refused(tmp_path, capsys):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            folder = tmp_path / "data" / split / cls
            folder.mkdir(parents=True)
            if not (split == "train" and cls == "dog"):
                Image.new("RGB", (8, 8)).save(folder / "a.png")
    out = tmp_path / "run"
    assert exit_code(["finetune", "--recipe", "imagefolder", "--data", str(tmp_path / "data"), "-o", str(out)]) == 2
    _, err = capsys.readouterr()
    assert "dog" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@needs_fmnist
def test_streamed_finetune_trains_as_the_unstreamed_run_and_records_its_segments(calibrated_backbone, tmp_path):
    """model.stream (issue #14): the pre-flight's prediction is the measured peak, the run folder
    records the streamed segments, and the run follows the unstreamed one. Gradients agree to
    about 1e-6 (tests/test_stream.py); Adam turns such differences in near-zero gradients into
    lr-sized steps, so the losses are compared, not the weights bit for bit."""
    runs, losses = {}, {}
    for m in (0, 1):
        recipe = target_recipe(calibrated_backbone, **{"data.max_samples": 64, "data.max_val_samples": 32,
                                                       "train.epochs": 1, "model.mode": "repnet+bias",
                                                       "model.stream": m, "train.batch_size": 8})
        losses[m] = []
        runs[m] = finetune(recipe=recipe, out_dir=tmp_path / f"m{m}",
                           on_step=lambda info, m=m: losses[m].append(info["loss"]))
        assert runs[m].measured_peak_bytes == runs[m].predicted.total_bytes
    assert runs[1].predicted.total_bytes < runs[0].predicted.total_bytes
    schedule = json.loads((tmp_path / "m1" / "model.json").read_text())["lean"]["schedule"]
    assert [s["micro_batch"] for s in schedule["streamed_segments"]] == [1] * 12
    assert len(losses[0]) == len(losses[1]) == 8
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-5)
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
