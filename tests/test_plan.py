"""edgetl plan: search on a tiny backbone (MobileNetV2 0.35, 64 px), monotonicity, YAML, CLI errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from edgetl.cli import main
from edgetl.memory.runtime import runtime_report
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.plan import (
    DEVICES,
    Plan,
    PlanImpossible,
    load_plan,
    plan,
    ratio_for,
    verify_plan,
)
from edgetl.prune import kept_channels

TINY = BackboneSpec(width=0.35)
RES = 64
MB = 10**6
LEVERS = Path(__file__).resolve().parents[1] / "benchmarks" / "levers_accuracy.json"


def tiny_plan(budget_bytes: int, **kw) -> Plan:
    kw.setdefault("batch_size", 8)
    return plan(budget_bytes=budget_bytes, resolution=RES, backbone=TINY, **kw)


def step_of(config):
    """The step a planned configuration runs: plain Adam with its optimizer levers."""
    from edgetl.step import Step

    return Step.plain("adam", fused=config.fused, step_in_backward=config.step_in_backward)


def predicted(config, num_classes: int = 102) -> int:
    """Independent runtime accounting of a configuration."""
    spec = dataclasses.replace(TINY, num_classes=num_classes, hidden=dict(config.kept))
    from edgetl.memory.schedule import prepare_step

    lean = LeanOptions(pool=config.pool, bn="fold", frozen_weights=config.frozen_weights,
                       precision=config.precision, stream=config.stream, uint8_input=config.uint8_input,
                       recompute=config.recompute)
    net = build_network(spec, "repnet", device="meta", lean=lean)
    step = step_of(config)
    prepare_step(net, resolution=RES, batch_size=config.batch_size, step=step)  # streams, as finetune runs it
    return runtime_report(net, mode="repnet", resolution=RES, batch_size=config.batch_size, step=step).total_bytes


@pytest.fixture(scope="module")
def sweep():
    """Plans over a sweep of budgets, batch 8 and auto (one search each). At batch 8: 3.3 MB
    is impossible, 3.45 MB prunes, 4.45 MB needs fused kernels and frozen fp16, 9.0 MB
    nothing; with "auto", 4.45 MB needs both optimizer levers at batch 1, 5.0 MB fused
    kernels."""
    budgets = {8: (3.3, 3.45, 4.45, 9.0), "auto": (4.45, 5.0, 9.0)}
    return {batch: [(int(x * MB), _try(int(x * MB), batch)) for x in xs] for batch, xs in budgets.items()}


def _try(budget, batch):
    try:
        return tiny_plan(budget, batch_size=batch, max_batch_size=32)
    except PlanImpossible as exc:
        return exc


def test_plan_at_64px_prunes_at_k2_not_an_idle_k4(sweep):
    chosen = dict(sweep[8])[int(3.45 * MB)].chosen
    assert chosen.kept and chosen.pool == 2
    assert chosen.fused and chosen.step_in_backward  # pruning comes past every other lever


def test_plans_in_one_process_share_evaluations_and_plan_as_alone(sweep, monkeypatch):
    """The sweep's plans share the runtime accounting (and CUDA-graph replays) of the
    configurations earlier plans evaluated; a plan made with none shared is the same plan,
    field for field but its search time."""
    from edgetl.plan import graphs, path

    budget = int(4.45 * MB)
    shared = dict(sweep[8])[budget]
    assert path._SHARED  # the sweep's evaluations
    monkeypatch.setattr(path, "_SHARED", {})
    monkeypatch.setattr(graphs, "_REPLAYED", {})
    alone = _try(budget, 8)
    assert path._SHARED  # it filled the emptied store
    first, second = shared.to_dict(), alone.to_dict()
    first["search"].pop("seconds"), second["search"].pop("seconds")
    assert first == second


def test_ratio_for_keeps_exactly_the_planned_channels():
    for channels in (16, 32, 96, 144, 960):
        for kept in range(1, channels + 1):
            assert kept_channels(channels, ratio_for(channels, kept)) == kept


def test_sweep_fits_and_matches_accounting(sweep):
    seen_impossible = seen_pruned = False
    for batch, rows in sweep.items():
        for budget, result in rows:
            if isinstance(result, PlanImpossible):
                seen_impossible = True
                assert result.min_budget_bytes > budget
                continue
            c = result.chosen
            assert result.predicted_bytes <= budget
            assert predicted(c) == result.predicted_bytes  # re-checked independently
            assert sum(result.breakdown.values()) == result.predicted_bytes
            if batch == 8:
                assert c.batch_size == 8
            seen_pruned |= bool(c.kept)
    assert seen_impossible and seen_pruned


def test_sweep_takes_the_optimizer_levers_only_where_the_budget_needs_them(sweep):
    """With fewer of them (everything else as chosen) no plan of the sweep would fit."""
    seen = set()
    for batch, rows in sweep.items():
        for budget, result in rows:
            if isinstance(result, PlanImpossible):
                continue
            c = result.chosen
            seen.add((c.fused, c.step_in_backward))
            for fused in {False, c.fused}:
                for inside in {False, c.step_in_backward}:
                    if (fused, inside) != (c.fused, c.step_in_backward):
                        lighter = dataclasses.replace(c, fused=fused, step_in_backward=inside)
                        assert predicted(lighter) > budget, (budget, lighter.describe())
    assert {(False, False), (True, False), (True, True)} <= seen


def test_sweep_is_monotone(sweep):
    """A larger budget never prunes more, never pools coarser, never shrinks the batch."""
    for batch, rows in sweep.items():
        plans = [r for _, r in rows if not isinstance(r, PlanImpossible)]
        assert len(plans) >= 3
        for small, large in zip(plans, plans[1:]):
            a, b = small.chosen, large.chosen
            for block, kept in a.kept.items():
                assert b.kept.get(block, b.channels.get(block, a.channels[block])) >= kept
            assert set(b.kept) <= set(a.kept)
            assert b.pool <= a.pool
            assert b.batch_size >= a.batch_size


def test_objective_prefers_exact_storage_when_it_fits():
    c = tiny_plan(20 * MB).chosen
    assert (c.kept, c.pool, c.precision, c.frozen_weights, c.batch_size) == ({}, 1, "fp32", "fp32", 8)


def test_auto_batch_is_the_largest_that_fits(sweep):
    result = dict(sweep["auto"])[9 * MB]
    c = result.chosen
    assert (c.kept, c.pool, c.precision) == ({}, 1, "fp32")
    assert result.predicted_bytes <= 9 * MB
    assert predicted(dataclasses.replace(c, batch_size=c.batch_size + 1)) > 9 * MB


def test_impossible_reports_the_smallest_budget_that_works(sweep):
    impossible = dict(sweep[8])[int(3.3 * MB)]
    assert isinstance(impossible, PlanImpossible)
    need = impossible.min_budget_bytes
    assert "smallest budget that works" in str(impossible)
    assert predicted(impossible.config) == need  # the most saving configuration, re-checked
    assert impossible.config.pool == 2 and impossible.config.kept  # k=4 stores like k=2 at 64 px
    with pytest.raises(PlanImpossible) as again:
        tiny_plan(need - 1)
    assert again.value.min_budget_bytes == need


def test_process_scope_subtracts_device_overheads():
    device = DEVICES["orin-nano-8gb"]
    budget = 400 * MB
    result = tiny_plan(budget, device_preset="orin-nano-8gb", budget_scope="process")
    assert result.tensor_budget_bytes == int((budget - device.cuda_context_bytes) / (1 + device.allocator_slack))
    assert result.predicted_bytes + sum(result.overheads.values()) <= budget
    assert "CUDA context" in result.overheads
    with pytest.raises(PlanImpossible) as info:
        tiny_plan(302 * MB, device_preset="orin-nano-8gb", budget_scope="process")
    assert info.value.min_budget_bytes > 302 * MB


def test_yaml_round_trip_and_strict_keys(tmp_path, sweep):
    result = dict(sweep[8])[int(3.45 * MB)]
    path = tmp_path / "plan.yaml"
    result.save(path)
    again = load_plan(path)
    assert again.to_dict() == result.to_dict()
    assert again.spec.hidden == result.chosen.kept
    path.write_text(path.read_text().replace("  bn: fold\n", "  bm: fold\n", 1))
    from edgetl.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'bm'"):
        load_plan(path)


def test_verify_measures_within_five_percent():
    result = tiny_plan(5 * MB)
    measured = verify_plan(result, steps=2)
    assert measured <= result.tensor_budget_bytes
    assert abs(measured / result.predicted_bytes - 1) <= 0.05


def replayed_graphs(result, config=None) -> int:
    """What the graphs of a planned step reserve beyond an eager run, from a second instrument:
    three real CPU steps of the network built here from the plan's configuration (``config``,
    else the chosen one), their storage trace replayed as the captured step runs (the plan
    traces a meta copy)."""
    import torch

    from edgetl.memory.cuda import JETSON_ORIN, cublas_workspace_bytes, cublaslt_workspace_bytes, replay_captured
    from edgetl.memory.meter import measure_training_memory
    from edgetl.memory.schedule import prepare_step

    c = config or result.chosen
    torch.manual_seed(0)
    spec = dataclasses.replace(result.spec, hidden={**result.spec.hidden, **c.kept})
    net = build_network(spec, c.mode, lean=c.lean)
    step = step_of(c)
    prepare_step(net, resolution=RES, batch_size=c.batch_size, step=step)
    trace = measure_training_memory(net, resolution=RES, batch_size=c.batch_size, steps=3, step=step,
                                    record_trace=True).trace
    return replay_captured(trace, cublas_workspace=cublas_workspace_bytes(JETSON_ORIN),
                           cublaslt_workspace=cublaslt_workspace_bytes()).extra_bytes


def test_a_plan_for_a_cuda_device_runs_its_step_as_graphs_where_they_fit():
    """On a Jetson preset finetune captures the step as CUDA graphs by default: the plan keeps
    the configuration the objective picks (graphs are speed), and runs it as graphs where its
    tensors and what the graphs reserve beyond an eager run fit the tensor budget (figures
    checked against three real CPU steps' replay), streamed or by a smaller micro-batch if need
    be (the largest that fits), else eagerly (finetune --plan then runs with train.cuda_graph
    false), saying which in a note. A plan for no device counts no graphs."""
    import re

    from edgetl.cli.finetune import planned_values

    nowhere = tiny_plan(40 * MB)
    assert nowhere.cuda_graph is None and not nowhere.eager and nowhere.to_dict()["cuda_graph"] is None
    assert not any("CUDA graphs" in n for n in nowhere.notes)
    assert planned_values(nowhere)["train.cuda_graph"] is None

    fits = tiny_plan(40 * MB, device_preset="orin-nano-8gb")
    assert fits.chosen == nowhere.chosen and not fits.eager
    extra = replayed_graphs(fits)
    assert fits.cuda_graph.extra_bytes == extra > 0 and fits.cuda_graph.capability == (8, 7)
    assert fits.cuda_graph.total_bytes == fits.predicted_bytes + extra <= fits.tensor_budget_bytes
    assert fits.counted_bytes == fits.cuda_graph.total_bytes
    assert any(f"reserve a predicted {extra / MB:.1f} MB beyond an eager run" in n for n in fits.notes)
    assert planned_values(fits)["train.cuda_graph"] is None  # the recipe's default: graphs

    # the same configuration fixed unstreamed (--stream 0), whose graphs do not fit 20 MB: it runs eagerly
    over = tiny_plan(20 * MB, device_preset="orin-nano-8gb", stream=0)
    assert over.chosen == tiny_plan(20 * MB).chosen == fits.chosen and over.eager and over.cuda_graph is None
    assert fits.cuda_graph.total_bytes > 20 * MB
    (note,) = [n for n in over.notes if "CUDA graphs" in n]
    m = re.search(r"would reserve a predicted ([\d.]+) MB beyond an eager run, ([\d.]+) MB with the tensors, over "
                  r"the tensor budget 20.0 MB: the plan runs it eagerly", note)
    assert (float(m.group(1)), float(m.group(2))) == (round(extra / MB, 1), round(fits.cuda_graph.total_bytes / MB, 1))
    assert over.to_dict()["cuda_graph"] is False and planned_values(over)["train.cuda_graph"] is False
    need = float(re.search(r"would run as graphs as it is in a tensor budget of ([\d.]+) MB", note).group(1))
    assert tiny_plan(int(need * MB), device_preset="orin-nano-8gb", stream=0).cuda_graph is not None
    assert tiny_plan(int(need * MB) - 10_000, device_preset="orin-nano-8gb", stream=0).eager  # rounded up by < 0.01 MB

    # the micro-batch free, the largest below the pick's (20 MB: unstreamed; 6 MB: streamed by 7)
    # whose graphs fit: streaming costs no accuracy
    for budget in (20 * MB, 6 * MB):
        eager = tiny_plan(budget)
        graphs = tiny_plan(budget, device_preset="orin-nano-8gb")
        m = graphs.chosen.stream
        assert 1 <= m < (eager.chosen.stream or eager.chosen.batch_size) and not graphs.eager
        assert graphs.chosen == dataclasses.replace(eager.chosen, stream=m)
        assert all(r.config != eager.chosen for r in graphs.runners_up)  # the pick is no runner-up
        assert graphs.predicted_bytes == predicted(graphs.chosen)
        assert graphs.cuda_graph.total_bytes == graphs.predicted_bytes + replayed_graphs(graphs) <= budget
        for larger in range(m + 1, eager.chosen.stream or eager.chosen.batch_size):  # none larger fits
            above = dataclasses.replace(graphs.chosen, stream=larger)
            assert predicted(above) + replayed_graphs(graphs, above) > budget, larger

    # asked for an eager step: no graphs counted, finetune --plan runs eagerly
    asked = tiny_plan(6 * MB, device_preset="orin-nano-8gb", eager=True)
    assert asked.chosen == tiny_plan(6 * MB).chosen and asked.eager and asked.cuda_graph is None
    assert asked.graph_replays == 0
    assert asked.request["eager"] is True and any("--eager" in n for n in asked.notes)
    assert planned_values(asked)["train.cuda_graph"] is False


def test_a_smaller_micro_batch_for_graphs_drops_recomputing_where_that_fits():
    """A streamed pick that recomputes, whose graphs do not fit: at the micro-batch whose graphs
    do, recomputing is dropped where the step without it fits with its graphs too (recomputing
    runs segments forward twice); the figures against three real CPU steps' replay."""
    from edgetl.plan.graphs import with_graphs
    from edgetl.plan.path import _Evaluator

    pick = dataclasses.replace(tiny_plan(6 * MB).chosen, recompute=True)  # streamed by 7
    base = dataclasses.replace(TINY, num_classes=102)
    got = with_graphs(pick, base, _Evaluator(base, RES), 6 * MB, (8, 7), resolution=RES, can_stream=True)
    c = got.config
    assert got.graphs is not None and 1 <= c.stream < pick.stream
    result = tiny_plan(6 * MB, device_preset="orin-nano-8gb")  # a plan to read the spec from
    plain = dataclasses.replace(c, recompute=False)
    assert c.recompute == (predicted(plain) + replayed_graphs(result, plain) > 6 * MB)
    assert got.graphs.total_bytes == predicted(c) + replayed_graphs(result, c) <= 6 * MB


def test_a_plans_cuda_graph_figures_are_read_back_and_checked(tmp_path):
    """The figures round-trip through YAML; a hand edit that breaks their agreement with the
    tensors, the device, the budget or the request is refused naming the key."""
    import re

    from edgetl.errors import ConfigError

    fits = tiny_plan(40 * MB, device_preset="orin-nano-8gb")
    path = tmp_path / "plan.yaml"
    fits.save(path)
    again = load_plan(path)
    assert again.to_dict() == fits.to_dict() and again.cuda_graph == fits.cuda_graph
    g = fits.to_dict()["cuda_graph"]
    edits = [
        ({"cuda_graph": {**g, "extra_bytes": g["extra_bytes"] + 1}}, "plan.cuda_graph.total_bytes: "),
        ({"cuda_graph": {**g, "capability": [9, 0]}}, "plan.cuda_graph.capability: [9, 0] disagrees with device"),
        ({"cuda_graph": {**g, "capability": [8]}}, "plan.cuda_graph.capability: [8]; allowed: [major, minor]"),
        ({"cuda_graph": True}, "plan.cuda_graph is True; allowed: null, false"),
        ({"request": {**fits.request, "eager": True}}, "the figures of graphs disagrees with plan.request.eager true"),
        ({"cuda_graph": {**g, "extra_bytes": 41 * MB, "total_bytes": fits.predicted_bytes + 41 * MB}},
         "exceeds plan.budget.tensor_budget_bytes 40000000: the step captured as CUDA graphs does not fit"),
    ]
    nowhere = tiny_plan(40 * MB).to_dict()
    for edit, needle in edits + [({"budget": nowhere["budget"]}, "plan.cuda_graph: device none has no GPU")]:
        path.write_text(json.dumps({**fits.to_dict(), **edit}))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_plan(path)


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "256"], "no unit"),
    (["--budget", "256mb"], "unknown unit"),
    (["--budget", "256 parsecs"], "unknown unit"),
    (["--budget", "lots"], "not a number with a unit"),
    (["--budget", "256MB", "--device", "jetson-tx2"], "invalid choice"),
    (["--budget", "256MB", "--batch-size", "eight"], "batch size 'eight'"),
    (["--budget", "256MB", "--batch-size", "0"], "batch size '0'"),
    (["--budget", "256MB", "--budget-scope", "device"], "invalid choice"),
])
def test_cli_parse_errors_are_one_line(argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv, "-o", str(tmp_path / "p.yaml")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_cli_plan_and_impossible(capsys, tmp_path, monkeypatch):
    out = tmp_path / "plan.yaml"
    common = ["--resolution", str(RES), "--width", "0.35", "-o", str(out)]
    assert main(["plan", "--budget", "20MB", *common]) == 0
    text = capsys.readouterr().out
    assert f"saved to {out}" in text and "next: edgetl finetune --plan" in text
    assert load_plan(out).chosen.batch_size == 8
    # only what was asked is written: --json alone writes no YAML, no flag writes nothing
    only_json = tmp_path / "only" / "plan.json"
    only_json.parent.mkdir()
    assert main(["plan", "--budget", "20MB", "--resolution", str(RES), "--width", "0.35",
                 "--json", str(only_json)]) == 0
    assert sorted(p.name for p in only_json.parent.iterdir()) == ["plan.json"]
    same = load_plan(out).to_dict()
    assert {k: v for k, v in json.loads(only_json.read_text()).items() if k != "search"} == \
        {k: v for k, v in same.items() if k != "search"}
    monkeypatch.chdir(only_json.parent)
    assert main(["plan", "--budget", "20MB", "--resolution", str(RES), "--width", "0.35"]) == 0
    assert "not saved: add -o plan.yaml" in capsys.readouterr().out
    assert sorted(p.name for p in only_json.parent.iterdir()) == ["plan.json"]
    assert main(["plan", "--budget", "3MB", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smallest budget that works" in err[0]


def test_a_terminal_sees_the_search_counted_while_it_runs_and_a_pipe_does_not(capsys, monkeypatch):
    """On a terminal, edgetl plan counts the configurations evaluated on stderr while it searches
    (from 0, as often as the line redraws, never past the summary's count); where stderr is no
    terminal it writes nothing there. The planner calls ``on_evaluation`` once per configuration."""
    import io
    import re
    import sys

    from edgetl.plan import graphs, path

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(path, "_SHARED", {})  # a search of its own, seconds long
    monkeypatch.setattr(graphs, "_REPLAYED", {})
    args = ["plan", "--budget", "5MB", "--resolution", str(RES), "--width", "0.35"]
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(args) == 0
    n = int(re.search(r"search: (\d+) runtime-accounting evaluations", capsys.readouterr().out)[1])
    counted = [int(c) for c in re.findall(r"searching: (\d+) configurations evaluated", terminal.getvalue())]
    assert counted[0] == 0 and counted == sorted(counted) and 1 <= counted[-1] <= n and n > 3
    monkeypatch.undo()
    assert main(args) == 0
    piped = capsys.readouterr()
    assert piped.err == "" and f"search: {n} runtime-accounting evaluations" in piped.out
    seen = []
    assert tiny_plan(5 * MB, on_evaluation=seen.append).evaluations == n and seen == list(range(1, n + 1))


def test_cli_plan_for_a_jetson_prints_its_graphs_and_eager_runs_eagerly(capsys, tmp_path):
    """edgetl plan on a Jetson preset prints what the graphs reserve and the headroom left
    beside them, and finetune's own check of the run it resolves from the plan (built there
    from the recipe, traced on a CPU copy) gets the same figures; --eager plans an eager
    step, which finetune --plan then runs eagerly."""
    from edgetl.cli import build_parser
    from edgetl.cli.finetune import recipe_from_args

    common = ["--budget", "40MB", "--resolution", str(RES), "--width", "0.35", "--device", "orin-nano-8gb"]
    graphs, eager = tmp_path / "graphs.yaml", tmp_path / "eager.yaml"
    assert main(["plan", *common, "-o", str(graphs)]) == 0
    text = capsys.readouterr().out
    g = load_plan(graphs)
    assert f"CUDA graphs beyond an eager run (predicted, sm87)  {g.cuda_graph.extra_bytes / MB:.2f}" in text
    assert f"predicted with CUDA graphs  {g.cuda_graph.total_bytes / MB:.2f}" in text
    assert f"headroom  {(40 * MB - g.cuda_graph.total_bytes) / MB:.2f}" in text
    assert "runtime-accounting evaluations, 1 CUDA-graph replay," in text
    assert main(["plan", *common, "--eager", "-o", str(eager)]) == 0
    text = capsys.readouterr().out
    assert "CUDA graphs beyond" not in text and "note: planned for an eager step (--eager)" in text
    assert load_plan(eager).eager and load_plan(eager).chosen == g.chosen

    def recipe_of(path, *extra):
        return recipe_from_args(build_parser(only="finetune").parse_args(
            ["finetune", "--recipe", "fashion_mnist", "--plan", str(path), "--set", "model.width=0.35",
             "--set", f"data.resolution={RES}", "-o", str(tmp_path / "run"), *extra])).recipe

    assert recipe_of(graphs).train.cuda_graph is True and recipe_of(eager).train.cuda_graph is False
    assert recipe_of(graphs, "--eager").train.cuda_graph is False
    # finetune's own budget check of the run it resolves from the plan: the plan's figures
    import torch

    from edgetl.finetune import check_graph_budget, resolve_job

    torch.manual_seed(0)
    job = resolve_job(recipe_of(graphs, "--backbone", "mobilenet_v2:random"), g.num_classes)
    assert job.predicted.total_bytes == g.predicted_bytes
    assert check_graph_budget(job, (8, 7), g.tensor_budget_bytes).total_bytes == g.cuda_graph.total_bytes


def test_plan_refuses_a_step_that_cannot_train_and_reads_a_stream_past_the_batch(capsys, tmp_path):
    """A batch of 1 whose smallest side map is 1x1 gives BatchNorm one value per channel: no plan
    (finetune refuses it too), one line; a fixed micro-batch at or past the batch streams
    nothing, and the saved plan says so and loads."""
    argv = ["plan", "--budget", "4MB", "--resolution", str(RES), "--width", "0.35", "--batch-size", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resolution: 64 px is too small for the Rep-Net side network at batch size 1" in err[0]
    past = tiny_plan(40 * MB, stream=16)
    path = tmp_path / "plan.yaml"
    past.save(path)
    assert past.chosen.stream == load_plan(path).chosen.stream == 0 and past.request["stream"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("budget, batch", [(32 * MB, 8), (128 * MB, "auto")])
def test_224px_plans_verify(budget, batch):
    result = plan(budget_bytes=budget, batch_size=batch, resolution=224, num_classes=102)
    measured = verify_plan(result, steps=3)
    assert measured <= budget
    assert abs(measured / result.predicted_bytes - 1) <= 0.05


def test_prune_and_finetune_take_the_plan(tmp_path, sweep, capsys):
    from edgetl.cli import build_parser
    from edgetl.cli.finetune import recipe_from_args
    from edgetl.errors import ConfigError
    from edgetl.models.backbone import read_backbone_spec

    result = dict(sweep[8])[int(3.45 * MB)]
    assert result.chosen.kept
    path = tmp_path / "plan.yaml"
    result.save(path)
    pruned = tmp_path / "pruned"
    assert main(["prune", "--plan", str(path), "--width", "0.35", "--importance", "weight-l2",
                 "--resolution", str(RES), "-o", str(pruned)]) == 0
    assert read_backbone_spec(pruned).hidden == result.chosen.kept

    def finetune_args(*extra):
        return build_parser(only="finetune").parse_args(["finetune", "--recipe", "fashion_mnist", "--plan", str(path),
                                          "--set", f"data.resolution={RES}", "-o", str(tmp_path / "run"),
                                          *extra])

    args = finetune_args("--backbone", str(pruned), "--pool", "2")
    recipe, _, budget = recipe_from_args(args)
    c = result.chosen
    assert (recipe.model.pool, recipe.model.precision, recipe.model.frozen_weights) == (2, c.precision,
                                                                                         c.frozen_weights)
    assert recipe.train.batch_size == c.batch_size and budget == result.tensor_budget_bytes
    with pytest.raises(ConfigError, match="plans hidden channels"):
        recipe_from_args(finetune_args())  # no pruned backbone
    with pytest.raises(ConfigError, match="planned at 64 px"):
        recipe_from_args(build_parser(only="finetune").parse_args(
            ["finetune", "--recipe", "fashion_mnist", "--plan", str(path), "--backbone", str(pruned),
             "--set", "data.resolution=96", "-o", str(tmp_path / "run")]))


# ----------------------------------------------------------------------------- modes (issue #16 item 4)
