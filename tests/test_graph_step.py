"""The training step as CUDA graphs (edgetl.train.graph): what decides whether a run is captured,
the optimizer set up for capture, checkpoints that resume either way, and the loop reading each
step's loss a step later. Capturing itself needs a GPU: tests/test_cuda.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from edgetl.cli import build_parser
from edgetl.cli.finetune import recipe_from_args
from edgetl.recipe import load_recipe
from edgetl.train.graph import (
    capture_error, eager_state_dict, graph_autocast, host_batch, make_capturable, rate_changes, why_eager,
)
from edgetl.train.schedule import build_scheduler

CUDA = torch.device("cuda")  # a device name: nothing here runs on it


def _recipe(**changes):
    values = {"train.epochs": 2, "train.batch_size": 4, "data.root": "unused"}
    return load_recipe("imagefolder", {**values, **changes})


def test_a_run_is_captured_only_where_its_step_has_no_host_synchronisation():
    adam = _recipe()
    assert adam.train.cuda_graph and adam.optim.name == "adam"
    assert why_eager(adam, CUDA) is None
    assert why_eager(adam, torch.device("cpu")) == "CUDA graphs need a CUDA device; this run is on cpu"
    assert why_eager(_recipe(**{"train.cuda_graph": False}), CUDA) == \
        "train.cuda_graph is off (--eager, or a plan whose step runs eagerly)"
    assert "2 processes under DDP" in why_eager(adam, CUDA, world=2)
    assert "fp16 loss scaling" in why_eager(adam, CUDA, scaler=object())
    assert "distillation" in why_eager(adam, CUDA, teacher=nn.Linear(1, 1))
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=None))
    assert why_eager(adam, CUDA, model=net) == ("1 averages its batch statistics cumulatively (momentum None), "
                                                "reading its batch count on the host")
    assert why_eager(adam, CUDA, model=nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))) is None
    # compressed storage: a transform's matrices come from host memory at every call (no copy
    # from pageable memory may run inside a capture); thresholding has no transform
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import LeanOptions, build_network

    spec = BackboneSpec(width=0.35, num_classes=3)
    for storage in ("haar", "db3", "dct", "threshold"):
        net = build_network(spec, "full", lean=LeanOptions(storage=storage, keep=0.1))
        reason = why_eager(adam, CUDA, model=net)
        assert (reason is None) == (storage == "threshold"), (storage, reason)
        assert storage == "threshold" or f"through the {storage} transform" in reason
    from edgetl.bench import _graph_trainer  # the bench does not try such a row: its reason instead

    trainer, error = _graph_trainer(lambda: build_network(spec, "full", lean=LeanOptions(storage="dct", keep=0.1)),
                                    resolution=32, batch_size=2, num_classes=3, device=CUDA, lr=1e-3, seed=0)
    assert trainer is None and error.startswith("not captured: ") and "dct transform" in error
    sgd = {"optim.name": "sgd", "optim.momentum": 0.9}
    assert rate_changes(_recipe(**sgd))  # the bundled recipe's cosine schedule
    assert "SGD's unfused update" in why_eager(_recipe(**sgd), CUDA)
    assert why_eager(_recipe(**sgd, **{"optim.fused": True}), CUDA) is None  # fused SGD takes a tensor rate
    constant = _recipe(**sgd, **{"optim.schedule": "constant", "optim.warmup_epochs": 0})
    assert not rate_changes(constant) and why_eager(constant, CUDA) is None  # its rate never changes


def test_eager_flag_sets_the_recipe_and_the_default_captures():
    parser = build_parser("finetune")
    base = ["finetune", "--recipe", "imagefolder", "--data", "d", "-o", "run"]
    assert recipe_from_args(parser.parse_args(base)).recipe.train.cuda_graph is True
    assert recipe_from_args(parser.parse_args(base + ["--eager"])).recipe.train.cuda_graph is False


def _adam(lr=0.01):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return net, torch.optim.Adam([{"params": net[0].parameters(), "lr": lr},
                                  {"params": net[2].parameters(), "lr": lr / 10}])


def _train(net, optimizer, scheduler, steps):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def test_the_schedule_fills_tensor_rates_in_place_and_the_update_is_the_same():
    """make_capturable after the schedule is built: the schedule keeps computing numbers and
    fills the groups' rate tensors in place (a captured graph reads them there); the weights
    equal those of the run with float rates up to float32 rounding (Adam's single-tensor update,
    on the CPU)."""
    optim = _recipe().optim
    runs = {}
    for tensor_lr in (False, True):
        net, opt = _adam()
        sched = build_scheduler(opt, optim, steps_per_epoch=3, epochs=2)
        make_capturable(opt, torch.device("cpu"), tensor_lr=tensor_lr)
        for g in opt.param_groups:  # Adam's capturable update needs a CUDA device: off for the CPU
            g["capturable"] = False
        if tensor_lr:
            rates = [g["lr"] for g in opt.param_groups]
            assert all(isinstance(r, torch.Tensor) and r.ndim == 0 for r in rates)
        _train(net, opt, sched, 4)
        if tensor_lr:
            assert [g["lr"] for g in opt.param_groups] == rates  # the same tensors, filled in place
            assert [float(r) for r in rates] == pytest.approx([sched.base_lrs[0] * sched.lr_lambdas[0](4) * f
                                                               for f in (1, 0.1)])
        runs[tensor_lr] = [p.detach().clone() for p in net.parameters()]
    # a float32 tensor rate rounds where a Python float does not: equal up to that
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(runs[False], runs[True]))


def test_make_capturable_turns_adam_capturable_fused_or_not_and_leaves_sgd_alone():
    net, adam = _adam()
    make_capturable(adam, torch.device("cpu"), tensor_lr=False)
    assert all(g["capturable"] for g in adam.param_groups)
    assert all(isinstance(g["lr"], float) for g in adam.param_groups)  # a constant rate stays a number
    fused = torch.optim.Adam(net.parameters(), lr=0.1, fused=True)
    make_capturable(fused, torch.device("cpu"), tensor_lr=True)
    # fused Adam checks capturable too when a graph captures its step
    assert fused.param_groups[0]["capturable"] and isinstance(fused.param_groups[0]["lr"], torch.Tensor)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    make_capturable(sgd, torch.device("cpu"), tensor_lr=False)
    assert "capturable" not in sgd.param_groups[0]


def test_a_captured_runs_checkpoint_resumes_eagerly_with_the_same_state():
    """eager_state_dict: rates as numbers, capturable off; loaded into a fresh eager optimizer
    the next steps equal those of the optimizer that kept going (up to the rounding of its float32
    tensor rates)."""
    net, opt = _adam()
    sched = build_scheduler(opt, _recipe().optim, steps_per_epoch=3, epochs=2)
    _train(net, opt, sched, 2)
    make_capturable(opt, torch.device("cpu"), tensor_lr=True)
    state = eager_state_dict(opt)
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in state["param_groups"])
    assert all(isinstance(g["lr"], torch.Tensor) and g["capturable"] for g in opt.param_groups)  # untouched
    for g in opt.param_groups:
        g["capturable"] = False  # the original goes on eagerly on the CPU too
    net2, opt2 = _adam()
    net2.load_state_dict(net.state_dict())
    sched2 = build_scheduler(opt2, _recipe().optim, steps_per_epoch=3, epochs=2)
    opt2.load_state_dict(copy.deepcopy(state))  # as from last.pt, in the loop's order (train.loop._resume)
    sched2.load_state_dict(sched.state_dict())
    _train(net, opt, sched, 3)
    _train(net2, opt2, sched2, 3)
    diff = max(float((a - b).abs().max()) for a, b in zip(net.state_dict().values(), net2.state_dict().values()))
    assert diff <= 1e-6, diff


def test_graph_autocast_drops_the_weight_cache():
    plain = graph_autocast(lambda: torch.autocast("cpu", dtype=torch.bfloat16))()
    assert isinstance(plain, torch.autocast) and plain._cache_enabled is False
    assert plain.fast_dtype == torch.bfloat16
    import contextlib

    assert graph_autocast(contextlib.nullcontext) is contextlib.nullcontext


def test_the_loop_reads_each_loss_one_step_later_and_stops_at_the_step_that_diverged(tmp_path):
    """Every step reaches on_step once, in order; the epoch's train loss is the mean of the steps'
    losses; a non-finite loss stops the run naming that step (read after the next step was
    launched), and nothing of a run that diverged before its first checkpoint is left."""
    from edgetl.errors import DivergedError
    from tests.test_train import Tiny, make_toy_folder, recipe, run

    toy = make_toy_folder(tmp_path / "toy")  # 48 training images: 6 steps of 8 an epoch, 3 epochs
    rcp = recipe(toy, **{"train.checkpoint_every": 0})
    seen = []
    result = run(rcp, tmp_path / "ok", steps=seen)
    assert [s["global_step"] for s in seen] == list(range(1, 19))
    for epoch, row in enumerate(result.history):
        losses = [s["loss"] for s in seen if s["epoch"] == epoch]
        assert row["train_loss"] == pytest.approx(sum(losses) / len(losses))  # batches of 8 both

    class Poison(Tiny):  # the third step's forward makes the loss NaN
        calls = 0

        def forward(self, x):
            Poison.calls += 1
            return super().forward(x) * (float("nan") if Poison.calls == 3 else 1.0)

    seen.clear()
    torch.manual_seed(0)
    with pytest.raises(DivergedError, match="at epoch 1 step 3: the loss is nan"):
        run(rcp, tmp_path / "nan", model=Poison(), steps=seen)
    assert [s["global_step"] for s in seen] == [1, 2]  # the step that diverged never reached on_step
    assert math.isfinite(seen[-1]["loss"])


@pytest.mark.parametrize("graphs", [True, False])
def test_an_eager_run_never_calls_the_capture_hook(tmp_path, graphs):
    """fit calls ``before_capture`` (finetune's budget check of the graph's pool) only when the step
    will be captured: never on the CPU, whether the recipe asks for graphs or --eager turned them off."""
    from edgetl import train as T
    from edgetl.data import datasets_from_recipe, loaders_from_recipe
    from tests.test_train import Tiny, make_toy_folder, recipe

    rcp = recipe(make_toy_folder(tmp_path / "toy"), **{"train.epochs": 1, "train.checkpoint_every": 0,
                                                       "train.cuda_graph": graphs})
    splits = datasets_from_recipe(rcp)
    train_loader, val_loader = loaders_from_recipe(rcp, splits)
    calls = []
    result = T.fit(model=Tiny(len(splits.classes)), train_loader=train_loader, val_loader=val_loader, recipe=rcp,
                   out_dir=tmp_path / "run", before_capture=calls.append)
    assert calls == [] and result.execution.startswith("eager: ")


def test_a_failed_capture_names_the_steps_own_error_first():
    """torch's graph context ends a capture the step raised inside, and the error of that ending
    replaces the step's own (its ``__context__``): the summary's line names the step's first."""
    from edgetl.errors import one_line

    ending = "CUDA error: operation not permitted when stream is capturing"
    try:
        try:
            raise ValueError("the step's own error, at its line")
        except ValueError:
            raise RuntimeError(ending)  # noqa: B904 - as torch's capture_end raises it, context kept
    except RuntimeError as exc:
        said = capture_error(exc)
    assert said == f"ValueError: the step's own error, at its line (then, ending the capture: RuntimeError: {ending})"
    alone = MemoryError("the graph's pool found no memory")
    assert capture_error(alone) == one_line(alone)
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a  # a cycle ends
    assert capture_error(a) == "RuntimeError: b (then, ending the capture: RuntimeError: a)"


def test_a_host_batch_is_changed_to_the_networks_layout_and_dtype_on_the_host_once():
    """``host_batch`` (pinned batches: tests/test_cuda.py): a batch in another layout or dtype is
    copied into both, its values those ``Tensor.to`` gives; one already in both is itself."""
    images = torch.randn(4, 3, 8, 8)
    out = host_batch(images, torch.channels_last)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert torch.equal(out, images) and out.dtype == torch.float32 and not out.is_pinned()
    assert host_batch(images, torch.contiguous_format) is images
    assert host_batch(out, torch.channels_last) is out
    assert host_batch(out, torch.channels_last, torch.float32) is out
    for layout in (torch.channels_last, torch.contiguous_format):
        for dtype in (torch.bfloat16, torch.float16):
            cast = host_batch(images, layout, dtype)
            assert cast.dtype == dtype and cast.is_contiguous(memory_format=layout)
            assert torch.equal(cast, images.to(dtype)), (layout, dtype)
            assert host_batch(cast, layout, dtype) is cast
