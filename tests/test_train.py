"""The training loop: learning, schedule, checkpoints, exact resume, DDP on 2 CPU processes."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetl import data as D
from edgetl import train as T
from edgetl.errors import CapabilityError, ConfigError, DataError
from edgetl.recipe import Recipe, apply_overrides
from edgetl.step import build_optimizer, param_groups, set_train_mode

def make_toy_folder(root: Path, n_train: int = 16, n_val: int = 8, size: int = 24) -> Path:
    """Three classes told apart by colour, with noise: linearly separable."""
    from tests.conftest import make_color_folder  # not at top: DDP workers import this module

    return make_color_folder(root, n_train, n_val, size)


class Tiny(nn.Module):
    """Conv-BN-ReLU, pool, dropout, linear: has BN statistics and dropout RNG, like the real nets."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def recipe(root: Path, **overrides) -> Recipe:
    base = Recipe.from_dict({
        "data": {"preset": "imagefolder", "root": str(root), "resolution": 32},
        "model": {"mode": "full"},
        "optim": {"name": "adam", "lr": 0.02, "weight_decay": 0.0, "label_smoothing": 0.1, "schedule": "cosine"},
        "train": {"epochs": 3, "batch_size": 8, "seed": 0, "workers": 0, "checkpoint_every": 2},
    })
    return apply_overrides(base, overrides) if overrides else base


def run(rcp: Recipe, out: Path, resume: bool = False, kill_at: int | None = None, model=None, steps=None):
    splits = D.datasets_from_recipe(rcp)
    train_loader, val_loader = D.loaders_from_recipe(rcp, splits)
    if model is None:
        torch.manual_seed(rcp.train.seed)
        model = Tiny(len(splits.classes))

    def on_step(info):
        if steps is not None:
            steps.append(info)
        if kill_at is not None and info["global_step"] == kill_at:
            raise KeyboardInterrupt  # as if the process were killed here

    return T.fit(model=model, train_loader=train_loader, val_loader=val_loader, recipe=rcp,
                 out_dir=out, resume=resume, on_step=on_step)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return make_toy_folder(tmp_path_factory.mktemp("toy") / "data")


def test_lr_schedule_warmup_then_cosine_to_zero():
    total, warm = 20, 4
    factors = [T.lr_factor(s, total, warm, "cosine") for s in range(total + 1)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    for s in range(warm, total + 1):
        assert factors[s] == pytest.approx(0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    assert factors[-1] == pytest.approx(0.0, abs=1e-12)
    assert T.lr_factor(7, 20, 0, "constant") == 1.0
    # through a real optimizer: lr after step s equals base * factor(s)
    rcp = recipe(Path("/x"), **{"optim.warmup_epochs": 1})
    seen = scheduled_lrs(rcp, steps_per_epoch=4, epochs=3)
    expected = [0.1 * T.lr_factor(s, 12, 4, "cosine") for s in range(12)]
    assert seen == pytest.approx(expected)


def scheduled_lrs(rcp: Recipe, steps_per_epoch: int, epochs: int) -> list[float]:
    """The learning rate before each optimizer step of a real optimizer + scheduler (base 0.1)."""
    p = nn.Parameter(torch.zeros(1))
    opt = build_optimizer([{"params": [p], "lr": 0.1, "weight_decay": 0.0}], rcp.optim)
    sched = T.build_scheduler(opt, rcp.optim, steps_per_epoch=steps_per_epoch, epochs=epochs)
    seen = []
    for _ in range(steps_per_epoch * epochs):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def test_warmup_longer_than_half_the_run_is_clamped_and_said(caplog):
    """A recipe's 1-epoch warmup in a 1-epoch trial run warms up for half of it, then anneals."""
    rcp = recipe(Path("/x"), **{"optim.warmup_epochs": 1, "train.epochs": 1})
    assert T.warmup_steps(rcp.optim, steps_per_epoch=10, epochs=1) == 5
    assert "warming up for 5 of 10 steps" in caplog.text
    assert T.warmup_steps(rcp.optim, steps_per_epoch=10, epochs=2) == 10  # half of 20: as written
    seen = scheduled_lrs(rcp, steps_per_epoch=10, epochs=1)
    assert seen == pytest.approx([0.1 * T.lr_factor(s, 10, 5, "cosine") for s in range(10)])
    assert seen[4] == pytest.approx(0.1) and seen[-1] < 0.01


def test_fit_learns_and_writes_run_folder(toy, tmp_path):
    rcp = recipe(toy)
    steps: list[dict] = []
    result = run(rcp, tmp_path / "run", steps=steps)
    hist = result.history
    assert len(hist) == 3 and len(steps) == 3 * 6  # 48 images / batch 8
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    assert hist[-1]["val_acc1"] >= 90.0  # chance is 33 %
    assert steps[-1]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert [s["step"] for s in steps[:6]] == [1, 2, 3, 4, 5, 6]
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == [".edgetl-files", "best.pt", "last.pt", "metrics.csv",
                                                     "metrics.jsonl", "recipe.yaml"]
    assert T.read_metrics(out) == json.loads(json.dumps(hist))
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["val_acc1"]) == pytest.approx(hist[-1]["val_acc1"])
    last = torch.load(out / "last.pt", weights_only=True)
    assert (last["epoch"], last["step_in_epoch"], last["global_step"]) == (3, 0, 18)
    # what ran: on the CPU the step runs eagerly, and the recipe the run records says so
    assert Recipe.from_dict(last["recipe"]) == dataclasses.replace(
        rcp, train=dataclasses.replace(rcp.train, cuda_graph=False))
    assert rcp.train.cuda_graph and result.execution.startswith("eager: CUDA graphs need a CUDA device")
    assert set(last) >= {"model", "optimizer", "scheduler", "scaler", "rank_state", "best_acc1"}
    best_epoch = max(range(3), key=lambda e: (hist[e]["val_acc1"], -e)) + 1
    best = T.load_checkpoint(out / "best.pt")
    assert best["best_epoch"] == result.best_epoch == best_epoch and best["epoch"] == best_epoch
    assert best["best_acc1"] == pytest.approx(max(h["val_acc1"] for h in hist))
    # the saved weights reproduce the reported accuracy
    model = Tiny()
    model.load_state_dict(last["model"])
    _, val_loader = D.loaders_from_recipe(rcp, D.datasets_from_recipe(rcp))
    assert T.evaluate(model, val_loader, "cpu")["acc1"] == pytest.approx(hist[-1]["val_acc1"])


@pytest.mark.parametrize("kill_at", [11, 13])  # after a mid-epoch checkpoint (step 10), after an epoch end
def test_resume_ends_with_identical_weights(toy, tmp_path, kill_at):
    rcp = recipe(toy, **{"train.checkpoint_every": 4})
    full = run(rcp, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run(rcp, tmp_path / "killed", kill_at=kill_at)
    partial = T.load_checkpoint(tmp_path / "killed" / "last.pt")
    assert (partial["epoch"], partial["step_in_epoch"]) == ((1, 4) if kill_at == 11 else (2, 0))
    steps: list[dict] = []
    torch.manual_seed(999)  # resume must not depend on the caller's generator state
    resumed = run(rcp, tmp_path / "killed", resume=True, model=Tiny(), steps=steps)
    assert steps[0]["global_step"] == partial["global_step"] + 1 and steps[-1]["global_step"] == 18
    assert len(steps) == 18 - partial["global_step"]
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert full.history == [dict(h, epoch_time_s=f["epoch_time_s"], images_per_s=f["images_per_s"])
                            for h, f in zip(resumed.history, full.history)]
    assert len(T.read_metrics(tmp_path / "killed")) == 3


def test_resume_guards(toy, tmp_path):
    rcp = recipe(toy, **{"train.epochs": 1})
    with pytest.raises(DataError, match="nothing to resume"):
        run(rcp, tmp_path / "r", resume=True)
    run(rcp, tmp_path / "r")
    with pytest.raises(ConfigError, match="already holds a run"):
        run(rcp, tmp_path / "r")
    with pytest.raises(ConfigError, match="recipe differs in optim.lr"):
        run(apply_overrides(rcp, {"optim.lr": 0.5}), tmp_path / "r", resume=True)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="is damaged or not an edgetl checkpoint"):
        T.load_checkpoint(tmp_path / "bad.pt")


def test_param_groups_and_frozen_bn(toy, tmp_path):
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=3), "repnet")
    rcp = recipe(toy, **{"model.mode": "repnet", "optim.lr": None, "optim.lr_head": 1e-3, "optim.lr_side": 5e-3,
                         "optim.decay_norm_and_bias": False, "optim.weight_decay": 0.1})
    groups = {g["name"]: g for g in param_groups(net, rcp.optim)}
    side = {id(p) for p in net.side.parameters()}
    assert {id(p) for n in ("side", "side_no_decay") for p in groups[n]["params"]} == side
    assert groups["side"]["lr"] == 5e-3 and groups["head"]["lr"] == 1e-3
    assert groups["side_no_decay"]["weight_decay"] == 0.0 and groups["side"]["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in groups["head_no_decay"]["params"])
    n_trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert sum(p.numel() for g in groups.values() for p in g["params"]) == n_trainable
    # bn "fold": frozen backbone BN keeps its statistics; the side network's BN trains
    set_train_mode(net, "fold")
    assert not net.features[3].conv[1][1].training and net.side.blocks[0].bn1.training
    set_train_mode(net, "batch")
    assert net.features[3].conv[1][1].training


def calibrate_bn(net: nn.Module, root: Path) -> None:
    """Set every BN layer's running statistics from training images (stands in for pretraining)."""
    splits = D.build_datasets(preset="imagefolder", root=root, resolution=64)
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    net.train()
    with torch.no_grad():
        for start in range(0, len(splits.train), 16):
            net(torch.stack([splits.train[(i, 0)][0] for i in range(start, min(start + 16, len(splits.train)))]))
    for m in bns:
        m.momentum = 0.1


def test_repnet_tiny_trains_side_only(toy, tmp_path):
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import build_network

    torch.manual_seed(0)
    net = build_network(BackboneSpec(width=0.35, num_classes=3), "repnet")
    calibrate_bn(net, toy)  # a random backbone's BN statistics collapse its activations; a pretrained one's do not
    frozen = {k: v.clone() for k, v in net.state_dict().items() if not k.startswith(("side.", "classifier."))}
    side_before = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("side.")}
    rcp = recipe(toy, **{"model.mode": "repnet", "data.resolution": 64, "train.epochs": 3,
                         "optim.lr": None, "optim.lr_head": 1e-3, "optim.lr_side": 1e-2})
    hist = run(rcp, tmp_path / "rep", model=net).history
    # 18 steps on a random backbone: slow, but better than chance (loss ln 3, accuracy 33 %)
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    assert hist[-1]["val_loss"] < math.log(3) and hist[-1]["val_acc1"] > 100 / 3
    after = net.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # backbone weights and BN stats fixed
    assert not torch.equal(after["side.blocks.5.conv1.weight"], side_before["side.blocks.5.conv1.weight"])


def test_distillation_loss_and_guards(toy, tmp_path):
    s = torch.randn(4, 5)
    assert T.distill_loss(s, s, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    t = torch.randn(4, 5)
    p_t = torch.softmax(t / 2, 1)
    manual = (p_t * (torch.log(p_t) - torch.log_softmax(s / 2, 1))).sum(1).mean() * 4
    assert T.distill_loss(s, t, 2.0).item() == pytest.approx(manual.item(), rel=1e-5)
    rcp = recipe(toy, **{"distill.teacher": "x", "distill.temperature": 2.0, "distill.weight": 1.0,
                         "train.epochs": 2, "optim.label_smoothing": 0.0})
    with pytest.raises(ConfigError, match="needs a teacher"):
        run(rcp, tmp_path / "d0")
    # weight 1: the student learns only from the teacher, so it comes to agree with it
    torch.manual_seed(1)
    teacher = Tiny()
    with torch.no_grad():
        teacher.classifier[1].weight.mul_(10)  # confident predictions, so there is something to learn
    splits = D.datasets_from_recipe(rcp)
    train_loader, val_loader = D.loaders_from_recipe(rcp, splits)
    torch.manual_seed(0)
    student = Tiny()

    def agreement():
        xs = torch.stack([splits.val[i][0] for i in range(len(splits.val))])
        student.eval(), teacher.eval()
        with torch.no_grad():
            return (student(xs).argmax(1) == teacher(xs).argmax(1)).float().mean().item()

    before = agreement()
    T.fit(model=student, train_loader=train_loader, val_loader=val_loader, recipe=rcp,
          out_dir=tmp_path / "d1", teacher=teacher)
    after = agreement()
    assert after >= 0.95 and after > before


def test_precision_needs_cuda(toy, tmp_path):
    with pytest.raises(CapabilityError, match="needs a CUDA device"):
        run(recipe(toy, **{"model.precision": "fp16"}), tmp_path / "p")


# --- distributed: 2 CPU processes with gloo through torchrun -------------------------------

DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, {tests!r})
    from test_train import Tiny, recipe
    from edgetl import data as D, train as T

    toy, out = sys.argv[1], sys.argv[2]
    device = T.setup_distributed("cpu")
    rank, world = T.get_rank(), T.get_world_size()
    rcp = recipe(toy, **{{"train.checkpoint_every": 2, "train.batch_size": 4}})
    splits = D.datasets_from_recipe(rcp)

    def go(out_dir, resume=False, kill_at=None):
        train_loader, val_loader = D.loaders_from_recipe(rcp, splits)
        torch.manual_seed(0)
        losses = []
        def on_step(info):
            losses.append(info["loss"])
            if kill_at is not None and info["global_step"] == kill_at:
                raise KeyboardInterrupt
        model = Tiny()
        try:
            res = T.fit(model=model, train_loader=train_loader, val_loader=val_loader, recipe=rcp,
                        out_dir=out_dir, device=device, resume=resume, on_step=on_step)
        except KeyboardInterrupt:
            return None, losses, model, train_loader
        return res, losses, model, train_loader

    res, losses, model, loader = go(out + "/full")
    loader.sampler.set_epoch(0)
    indices = [i for i, _ in loader.sampler]
    go(out + "/killed", kill_at=5)
    go(out + "/killed", resume=True)
    torch.save(model.state_dict(), out + f"/rank{{rank}}_weights.pt")
    report = {{"rank": rank, "world": world, "indices": indices, "history": res.history,
              "first_losses": losses[:3], "last_losses": losses[-3:]}}
    with open(out + f"/rank{{rank}}.json", "w") as f:
        json.dump(report, f)
    T.exit_worker(0)  # leaves the group and ends the worker, as edgetl's own commands do
""")


def test_ddp_two_cpu_processes(toy, tmp_path):
    from tests.conftest import launch_failure, torchrun_command  # here: the workers import this module
    script = tmp_path / "ddp_worker.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent)))
    out = tmp_path / "out"
    out.mkdir()
    cmd, env = torchrun_command(script, [str(toy), str(out)])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, launch_failure(proc.stderr)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in reports] == [2, 2]
    a, b = (set(r["indices"]) for r in reports)
    assert not a & b and a | b == set(range(48))  # disjoint shards covering the 48 images
    # metrics are reduced across ranks: both ranks report the same epoch rows
    assert reports[0]["history"] == [dict(h, epoch_time_s=g["epoch_time_s"], images_per_s=g["images_per_s"])
                                     for h, g in zip(reports[1]["history"], reports[0]["history"])]
    hist = reports[0]["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"] and hist[-1]["val_acc1"] >= 90.0
    # only rank 0 wrote the run folders; DDP kept both ranks' weights identical
    assert sorted(p.name for p in (out / "full").iterdir()) == [
        ".edgetl-files", "best.pt", "last.pt", "metrics.csv", "metrics.jsonl", "recipe.yaml"]
    full = torch.load(out / "full" / "last.pt", weights_only=True)
    assert full["world_size"] == 2 and len(full["rank_state"]) == 2
    r0 = torch.load(out / "rank0_weights.pt", weights_only=True)
    r1 = torch.load(out / "rank1_weights.pt", weights_only=True)
    resumed = torch.load(out / "killed" / "last.pt", weights_only=True)
    params = {name for name, _ in Tiny().named_parameters()}  # BN buffers are per rank in DDP
    assert all(torch.equal(r0[key], r1[key]) for key in params)
    for key in full["model"]:
        assert torch.equal(full["model"][key], resumed["model"][key]), key
