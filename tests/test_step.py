"""One step, three views (issue #17): the step the accounting predicts, the meter measures
and fit runs is one ``edgetl.step.Step``; its optimizer and loss are predicted exactly."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from edgetl.errors import CapabilityError
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.step_cost import optimizer_cost
from edgetl.memory.schedule import Schedule, apply_schedule, fit_schedule, prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step

SPEC = BackboneSpec(width=0.35, num_classes=10)
RES, BATCH = 64, 4

STEPS = {
    "adam-foreach": Step.plain("adam", foreach=True),
    "adam-foreach-decay": Step.plain("adam", foreach=True, weight_decay=0.05),
    "adam-decay": Step.plain("adam", weight_decay=0.05),
    "sgd-momentum-nesterov-foreach-decay": Step.plain("sgd", momentum=0.9, nesterov=True, foreach=True,
                                                      weight_decay=1e-4),
    "adam-label-smoothing": Step.plain("adam", label_smoothing=0.1),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_optimizer_and_loss_settings_are_predicted_exactly(name):
    """foreach (PyTorch's default on CUDA), weight decay, momentum and label smoothing:
    the runtime accounting equals the meter to the byte, lean Rep-Net at 64 px."""
    step = STEPS[name]
    torch.manual_seed(0)
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2))
    prepare_step(net, resolution=RES, batch_size=BATCH, step=step)
    predicted = runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH, step=step).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2, step=step)


def test_foreach_costs_a_whole_group_and_the_accounting_sees_it():
    """Multi-tensor Adam's temporaries are a whole group's size; single-tensor Adam's are a
    parameter's (and the one before it, which its loop still holds)."""
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    trainable = [p for p in net.parameters() if p.requires_grad]
    sizes = sorted(p.numel() * p.element_size() for p in trainable)
    single = optimizer_cost(net, Step.plain("adam"))
    multi = optimizer_cost(net, Step.plain("adam", foreach=True))
    assert single.state_bytes == multi.state_bytes == 2 * sum(sizes) + 4 * len(sizes)
    assert 2 * sizes[-1] <= single.step_extra_bytes <= 3 * sizes[-1]
    groups = Step.plain("adam").param_groups(net)
    assert multi.step_extra_bytes == max(sum(p.numel() * 4 for p in g["params"]) for g in groups)


def test_an_unknown_layer_fails_the_simulation_with_its_name():
    """A stock torch layer missing from the rule table is refused by name (a function called
    between layers is measured instead: tests/test_runtime_accounting.py)."""
    net = build_network(SPEC, "repnet", device="meta")
    net.classifier[-1] = nn.Sequential(net.classifier[-1], nn.Softplus())
    with pytest.raises(CapabilityError, match="no rule for torch.s layer Softplus"):
        runtime_report(net, mode="repnet", resolution=RES, batch_size=2)


def test_a_schedule_is_data_and_fitting_it_leaves_the_network_alone():
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    schedule = fit_schedule(net, resolution=RES, batch_size=BATCH)
    assert schedule.whole_batch and all(not m.execution for m in net.modules() if hasattr(m, "execution"))
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    apply_schedule(net, schedule)
    assert sum(any(c.get("backward") == "whole_batch" for c in m.execution.values())
               for m in net.modules() if hasattr(m, "execution")) == len(schedule.whole_batch)


def test_fitting_a_cpu_network_matches_its_meta_twin_and_leaves_it_as_it_was():
    """The fitter tries its choices on a meta copy (``trace.meta_copy``): a CPU network's
    schedule is its meta twin's, and its weights, conv settings and streams stay as they were;
    the copy has the parameters and buffers ``deepcopy(...).to("meta")`` would give."""
    import copy

    from edgetl.memory.trace import meta_copy
    from edgetl.models.lean import FrozenConvBNAct

    lean = LeanOptions(pool=2, stream=2, recompute=True)
    torch.manual_seed(0)
    net = build_network(SPEC, "bias", lean=lean)
    twin = build_network(SPEC, "bias", device="meta", lean=lean)
    state = {k: v.clone() for k, v in net.state_dict().items()}

    def settings(n):
        return [copy.deepcopy(m.execution) for m in n.modules() if isinstance(m, FrozenConvBNAct)]

    before = settings(net)
    schedule = fit_schedule(net, resolution=RES, batch_size=BATCH)
    assert schedule.streams and schedule == fit_schedule(twin, resolution=RES, batch_size=BATCH)
    assert net.streams is None and settings(net) == before
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())

    def tensors(n):
        return [(name, tuple(t.shape), t.dtype, t.device, t.requires_grad, type(t))
                for name, t in (*n.named_parameters(), *n.named_buffers())]

    assert tensors(meta_copy(net)) == tensors(copy.deepcopy(net).to("meta"))
    assert all(t.device.type == "cpu" for _, t in net.state_dict().items())


def test_a_schedule_of_the_forward_reads_back_and_old_schedules_pack_one_sample_at_a_time():
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    schedule = fit_schedule(net, resolution=RES, batch_size=BATCH)
    assert schedule.mask_chunks and all(m.execution == {} for m in net.modules() if hasattr(m, "execution"))
    data = json.loads(json.dumps(schedule.to_dict()))
    assert Schedule.from_dict(data) == schedule
    del data["forward_mask_chunks"]  # a run recorded before forward chunks
    old = Schedule.from_dict(data)
    assert old.mask_chunks == {} and old.whole_batch == schedule.whole_batch
    apply_schedule(net, schedule)
    convs = dict(net.named_modules())
    for name, (shape, chunk) in schedule.mask_chunks.items():
        assert convs[name].mask_chunk(shape) == chunk and 1 < chunk <= BATCH


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])
def test_forward_mask_chunks_are_predicted_exactly_and_change_no_gradient(chunk):
    """Every chunk size (3 leaves a smaller last chunk): the accounting equals the meter to the
    byte, and the side network's gradients are those of one sample at a time, bit for bit."""
    torch.manual_seed(0)
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2))
    base = fit_schedule(net, resolution=RES, batch_size=BATCH)
    shapes = {name: shape for name, (shape, _) in base.mask_chunks.items()}
    forced = Schedule(BATCH, RES, base.whole_batch, base.sample_by_sample,
                      {name: (shape, chunk) for name, shape in shapes.items()})
    apply_schedule(net, forced)
    predicted = runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH).total_bytes
    twin = build_network(SPEC, "repnet", lean=LeanOptions(pool=2))
    twin.load_state_dict(net.state_dict())
    apply_schedule(twin, Schedule(BATCH, RES, base.whole_batch, base.sample_by_sample))
    grads = []
    for model in (net, twin):
        torch.manual_seed(1)
        x, y = torch.randn(BATCH, 3, RES, RES), torch.randint(0, 10, (BATCH,))
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2)


def test_fitted_forward_chunks_cut_the_ops_and_never_raise_the_peak():
    """224 px, batch 32 (issue #17 item 6): the fitted schedule's forward dispatches far fewer
    ops than one sample at a time, at the same predicted peak or below."""
    from edgetl.memory.meter import count_step_ops

    net = build_network(BackboneSpec(width=1.0, num_classes=102), "repnet", device="meta",
                        lean=LeanOptions(pool=1))
    fitted = prepare_step(net, resolution=224, batch_size=32)
    after_ops = count_step_ops(net, resolution=224, batch_size=32)
    after = runtime_report(net, mode="repnet", resolution=224, batch_size=32).total_bytes
    apply_schedule(net, Schedule(32, 224))
    before_ops = count_step_ops(net, resolution=224, batch_size=32)
    before = runtime_report(net, mode="repnet", resolution=224, batch_size=32).total_bytes
    assert fitted.mask_chunks and after <= before
    assert after_ops.forward * 5 < before_ops.forward and after_ops.total * 5 < before_ops.total
    assert after_ops.optimizer == before_ops.optimizer


def test_count_step_ops_counts_what_the_meter_sees_dispatched():
    """An independent count: the storage meter's op events over the same step on meta."""
    from edgetl.memory.meter import count_step_ops
    from tests.conftest import meter_op_count

    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    prepare_step(net, resolution=RES, batch_size=BATCH)
    ops = count_step_ops(net, resolution=RES, batch_size=BATCH)
    assert ops.total == meter_op_count(net, BATCH, RES)
    assert ops.forward > 0 and ops.backward > 0 and ops.optimizer > 0


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def recorded_steps(monkeypatch):
    """Every call of ``training_step`` from the meter and from fit, as its aten op sequence."""
    import edgetl.memory.meter as meter
    import edgetl.train as train
    from edgetl import step as step_module

    calls: dict[str, list[list[str]]] = {"meter": [], "fit": []}

    def recording(where):
        def run(*args, **kwargs):
            with _Ops() as ops:
                out = step_module.training_step(*args, **kwargs)
            calls[where].append(ops.ops)
            return out
        return run

    monkeypatch.setattr(meter, "training_step", recording("meter"))
    monkeypatch.setattr(train, "training_step", recording("fit"))
    return calls


@pytest.mark.slow
def test_profile_plan_verify_preflight_and_finetune_run_one_step(recorded_steps, tmp_path):
    """The step that profile --measure, plan --verify and finetune's pre-flight measure is,
    aten op for aten op, the step fit runs (second step: optimizer state exists)."""
    from edgetl.finetune import finetune
    from edgetl.plan import plan, verify_plan
    from edgetl.profile import profile
    from edgetl.recipe import load_recipe
    from tests.conftest import make_color_folder

    lean = dict(pool=2, precision="fp32", frozen_weights="int8")
    chosen = plan(budget_bytes=10**9, batch_size=BATCH, resolution=RES, num_classes=3, width=0.35,
                  pool=lean["pool"], precision=lean["precision"], frozen_weights=lean["frozen_weights"])
    assert not chosen.chosen.kept  # nothing pruned: the network finetune builds below
    verify_plan(chosen, steps=2)
    plan_ops = recorded_steps["meter"].pop()
    profile(mode="repnet", accounting="runtime", resolution=RES, batch_size=BATCH, num_classes=3,
            width=0.35, measure=True, measure_steps=2,
            lean=LeanOptions(pool=2, frozen_weights="int8", precision="fp32"))
    profile_ops = recorded_steps["meter"].pop()

    data = make_color_folder(tmp_path / "data", 3 * BATCH, BATCH, size=RES)
    recipe = load_recipe("imagefolder", {
        "data.root": str(data), "data.resolution": RES, "model.backbone": "mobilenet_v2:random",
        "model.width": 0.35, "model.pool": 2, "model.frozen_weights": "int8", "train.batch_size": BATCH,
        "train.epochs": 1, "train.workers": 0, "optim.label_smoothing": 0.0})
    finetune(recipe=recipe, out_dir=tmp_path / "run", measure=True)
    preflight_ops = recorded_steps["meter"].pop()
    fit_ops = recorded_steps["fit"][1]
    assert len(fit_ops) > 1000
    assert preflight_ops == fit_ops
    assert plan_ops == fit_ops
    assert profile_ops == fit_ops


@pytest.mark.slow  # bf16 convolutions are slow on CPUs without bf16 units (9 min here)
def test_a_bf16_lean_run_records_bf16_and_resumes_in_bf16(tmp_path, monkeypatch):
    """finetune no longer rewrites the recipe to fp32 for fit (the lean layers cast
    themselves; fit gets amp=False): recipe.yaml, the checkpoint and model.json say bf16,
    and --resume with the run's own recipe continues the same run in bf16."""
    import yaml

    import edgetl.train as train
    from edgetl.finetune import finetune
    from edgetl.recipe import load_recipe
    from edgetl.train import load_checkpoint
    from tests.conftest import make_color_folder

    data = make_color_folder(tmp_path / "data", 4 * BATCH, BATCH, size=RES)
    recipe = load_recipe("imagefolder", {
        "data.root": str(data), "data.resolution": RES, "model.backbone": "mobilenet_v2:random",
        "model.width": 0.35, "model.pool": 2, "model.precision": "bf16", "train.batch_size": BATCH,
        "train.epochs": 2, "train.workers": 0, "train.checkpoint_every": 2})
    out = tmp_path / "run"

    class Killed(Exception):
        pass

    def kill(info):
        if info["global_step"] == 3:
            raise Killed

    with pytest.raises(Killed):
        finetune(recipe=recipe, out_dir=out, measure=False, on_step=kill)
    assert yaml.safe_load((out / "recipe.yaml").read_text())["model"]["precision"] == "bf16"
    assert load_checkpoint(out / "last.pt")["recipe"]["model"]["precision"] == "bf16"
    dtypes = []
    real = train.training_step

    def spy(net, step, optimizer, images, labels, **kw):
        dtypes.append(images.dtype)
        assert kw.get("scaler") is None
        return real(net, step, optimizer, images, labels, **kw)

    monkeypatch.setattr(train, "training_step", spy)
    finetune(recipe=load_recipe(out / "recipe.yaml"), out_dir=out, resume=True, measure=False)
    assert dtypes and set(dtypes) == {torch.bfloat16}
    model = json.loads((out / "model.json").read_text())
    assert model["recipe"]["model"]["precision"] == "bf16" and model["lean"]["precision"] == "bf16"
    assert model["lean"]["schedule"]["batch_size"] == BATCH


# ----------------------------------------------------------------------------- step in backward (issue #14 item 3)

IN_BACKWARD_NETS = {
    "repnet-lean": ("repnet", LeanOptions(pool=2)),
    "repnet-lean-stream": ("repnet", LeanOptions(pool=1, stream=1)),
    "bias-lean-stream": ("bias", LeanOptions(pool=1, stream=1)),
    "full-lean-pool2": ("full", LeanOptions(storage="pool2")),
    "full-stock": ("full", None),
}


@pytest.mark.parametrize("name", sorted(IN_BACKWARD_NETS))
def test_step_in_backward_gives_the_ordinary_steps_weights(name):
    """Bit for bit the weights of the ordinary step after three steps (Adam with weight
    decay, SGD with momentum), and no gradient left once backward returns."""
    import copy

    from edgetl.step import training_step

    mode, lean = IN_BACKWARD_NETS[name]
    torch.manual_seed(0)
    net = build_network(SPEC, mode, lean=lean)
    x, y = torch.randn(BATCH, 3, RES, RES), torch.randint(0, 10, (BATCH,))
    for opt, kw in (("adam", dict(weight_decay=1e-4)), ("sgd", dict(momentum=0.9))):
        a, b = copy.deepcopy(net), copy.deepcopy(net)
        plain, hooked = Step.plain(opt, 1e-2, **kw), Step.plain(opt, 1e-2, step_in_backward=True, **kw)
        for model, step in ((a, plain), (b, hooked)):
            prepare_step(model, resolution=RES, batch_size=BATCH, step=step)
        oa = plain.optimizer(a)
        hooked.optimizer(b)  # an optimizer made again for the same model replaces the first one's hooks
        ob = hooked.optimizer(b)
        for i in range(3):
            torch.manual_seed(i)  # the classifier's dropout draws the same mask
            training_step(a, plain, oa, x, y)
            torch.manual_seed(i)
            training_step(b, hooked, ob, x, y)
            assert all(p.grad is None for p in b.parameters())
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (name, opt, n)


@pytest.mark.parametrize("name", sorted(IN_BACKWARD_NETS))
def test_step_in_backward_is_predicted_exactly(name):
    """Each update inside backward (its own temporaries, then its gradient freed) is in the
    runtime accounting: equal to the meter to the byte."""
    mode, lean = IN_BACKWARD_NETS[name]
    step = Step.plain("adam", weight_decay=1e-4, step_in_backward=True)
    torch.manual_seed(0)
    net = build_network(SPEC, mode, lean=lean)
    prepare_step(net, resolution=RES, batch_size=BATCH, step=step)
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=BATCH, step=step).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2, step=step)
    assert optimizer_cost(net, step).param_step_bytes is not None


@pytest.mark.parametrize("changes, needle", [
    (dict(foreach=True), "optim.step_in_backward cannot run with optim.foreach"),
])
def test_step_in_backward_refuses_what_it_cannot_run(changes, needle):
    from edgetl.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        Step.plain("adam", step_in_backward=True, **changes)
    with pytest.raises(ConfigError, match="cannot run with DDP"):
        Step(optim=Step.plain("adam", step_in_backward=True).optim, ddp=True)


# ----------------------------------------------------------------------------- fused optimizer kernels (issue #14)


@pytest.mark.parametrize("optimizer, kw", [("adam", dict(weight_decay=1e-4)), ("sgd", dict(momentum=0.9))])
@pytest.mark.parametrize("in_backward", [False, True])
def test_fused_updates_are_predicted_exactly_and_allocate_nothing(optimizer, kw, in_backward):
    """Fused kernels (no meta implementation: the accounting runs them on CPU zeros) add no
    temporaries beyond the state; the whole step equals the meter to the byte."""
    step = Step.plain(optimizer, 1e-2, fused=True, step_in_backward=in_backward, **kw)
    torch.manual_seed(0)
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=1, stream=1, uint8_input=True))
    cost = optimizer_cost(net, step)
    assert cost.step_extra_bytes == 0 and not any((cost.param_step_bytes or {}).values())
    prepare_step(net, resolution=RES, batch_size=BATCH, step=step)
    predicted = runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH, step=step).total_bytes
    assert predicted == measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2, step=step)


def test_fused_in_backward_gives_the_ordinary_fused_weights_and_unfused_ones_nearly():
    import copy

    from edgetl.step import training_step

    torch.manual_seed(0)
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2))
    x, y = torch.randn(BATCH, 3, RES, RES), torch.randint(0, 10, (BATCH,))
    nets = [copy.deepcopy(net) for _ in range(3)]
    steps = [Step.plain("adam", 1e-2, fused=True), Step.plain("adam", 1e-2, fused=True, step_in_backward=True),
             Step.plain("adam", 1e-2)]
    optimizers = [s.optimizer(n) for s, n in zip(steps, nets)]
    for i in range(3):
        for n, s, o in zip(nets, steps, optimizers):
            torch.manual_seed(i)
            training_step(n, s, o, x, y)
    for (name, p), q, r in zip(nets[0].named_parameters(), nets[1].parameters(), nets[2].parameters()):
        assert torch.equal(p, q), name
        # unfused: another rounding, within a tenth of one step's size (lr) after 3 steps
        assert (p - r).abs().max() < 1e-3, name


def test_fused_and_foreach_are_refused_together():
    from edgetl.errors import ConfigError
    from edgetl.recipe import load_recipe

    with pytest.raises(ConfigError, match="optim.fused and optim.foreach are both on"):
        load_recipe("fashion_mnist", {"optim.fused": True, "optim.foreach": True})


def test_fused_steps_count_their_ops():
    """Fused kernels cannot run on meta; their update's ops are counted on CPU zeros: a
    handful per step, against a few per parameter unfused; forward and backward unchanged."""
    from edgetl.memory.meter import count_step_ops

    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    prepare_step(net, resolution=RES, batch_size=BATCH)
    plain = count_step_ops(net, resolution=RES, batch_size=BATCH, step=Step.plain("adam"))
    fused = count_step_ops(net, resolution=RES, batch_size=BATCH, step=Step.plain("adam", fused=True))
    inside = count_step_ops(net, resolution=RES, batch_size=BATCH,
                            step=Step.plain("adam", fused=True, step_in_backward=True))
    assert (fused.forward, fused.backward) == (plain.forward, plain.backward)
    trainable = sum(1 for p in net.parameters() if p.requires_grad)
    assert 0 < fused.optimizer < trainable < plain.optimizer
    assert inside.backward == plain.backward and inside.optimizer >= trainable
