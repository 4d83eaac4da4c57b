"""Issue #41: a plan document edited by hand is parsed, never coerced. Every value is of its
type (an integer no float, a boolean no string or number, an enumeration one of its values),
its redundant values agree with each other, and a plan is refused by ``finetune`` and
``prune`` when made for another backbone width or resolution; ``plan --width`` beside a
backbone folder is refused. Each refusal: exit 2, one line naming the value, no traceback,
nothing written, the plan file byte-identical. Hypothesis edits a real plan and checks that
``load_plan`` refuses the edit naming the key, or returns exactly the edited values.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetl.cli import main
from edgetl.errors import ConfigError
from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
from edgetl.plan import OBJECTIVE, Candidate, GraphMemory, Plan, PlanConfig, load_plan
from tests.test_divergence_and_data import tree_digest
from tests.test_recipe_files import run_cli

RES = 64
# tiny MobileNetV2 0.35 at 64 px, batch 4, the step's levers and precision fixed: the search
# prunes (blocks 1-7) at k=2 in a few seconds, with runners-up that fit and do not
PRUNING = ["--budget", "4.54MB", "--resolution", str(RES), "--width", "0.35", "--batch-size", "4", "--stream", "0",
           "--no-fused", "--no-step-in-backward", "--precision", "fp32"]
UNPRUNED = ["--budget", "6MB", "--resolution", str(RES), "--width", "0.35", "--batch-size", "4", "--stream", "0",
            "--no-fused", "--no-step-in-backward", "--precision", "fp32"]
# the unpruned plan for a Jetson preset, whose step runs as CUDA graphs (their figures in the plan)
JETSON = ["--device", "orin-nano-8gb", *UNPRUNED[2:], "--budget", "40MB"]
FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def refused(code: int, err: str) -> str:
    """The one error line of a refusal (exit 2, no traceback); argparse's names the command."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"edgetl( \w+)?: error: ", lines[0]), err
    return lines[0].split(": error: ", 1)[1]


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """Three plans made by ``edgetl plan``: one prunes, one does not, one runs as CUDA graphs on a Jetson."""
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for name, argv in (("pruning", PRUNING), ("unpruned", UNPRUNED), ("jetson", JETSON)):
        out[name] = folder / f"{name}.yaml"
        assert main(["plan", *argv, "-o", str(out[name])]) == 0
    assert load_plan(out["pruning"]).chosen.kept and load_plan(out["pruning"]).runners_up
    assert not load_plan(out["unpruned"]).chosen.kept
    assert load_plan(out["jetson"]).cuda_graph is not None
    return out


@pytest.fixture(scope="module")
def folder_05(tmp_path_factory) -> Path:
    """A backbone folder of width 0.5 (random weights)."""
    folder = tmp_path_factory.mktemp("backbone05")
    torch.manual_seed(0)
    save_backbone(folder, build_backbone(BackboneSpec(width=0.5, num_classes=3)).eval())
    return folder


def doc(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def finetune_argv(plan: Path, out: Path, *extra: str) -> list[str]:
    # a data folder that does not exist: a plan wrongly accepted fails there, before any training
    return ["finetune", "--recipe", "imagefolder", "--data", str(out.parent / "no-data"), "--plan", str(plan),
            "--backbone", "mobilenet_v2:random", "--set", "model.width=0.35", "--set", f"data.resolution={RES}",
            "-o", str(out), *extra]


def prune_argv(plan: Path, out: Path, *extra: str) -> list[str]:
    return ["prune", "--plan", str(plan), "--importance", "weight-l2", "--resolution", str(RES), "-o", str(out),
            *extra]


def test_the_plans_pass_finetune_up_to_the_data(plans, tmp_path, capsys):
    """The control of the refusals below: the same command with the plan as written gets past
    the plan and stops at the data folder that does not exist."""
    out = tmp_path / "run"
    line = refused(*run_cli(capsys, finetune_argv(plans["unpruned"], out)))
    assert "no-data" in line and not out.exists()


# --- hand edits: coerced values and disagreeing fields, refused by both commands --------------------


def _set(path: tuple, value):
    def edit(d: dict) -> None:
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _both(*edits):
    def edit(d: dict) -> None:
        for e in edits:
            e(d)
    return edit


EDITS = {
    # values of the wrong type, each once coerced (int(8.5) = 8, bool("no") = True, int(True) = 1)
    "fractional batch": (_set(("finetune", "batch_size"), 4.5), "batch_size"),
    "integral float batch": (_set(("finetune", "batch_size"), 4.0), "batch_size"),
    "batch as text": (_set(("finetune", "batch_size"), "4"), "batch_size"),
    "pool true": (_set(("finetune", "pool"), True), "pool"),
    "pool 3": (_set(("finetune", "pool"), 3), "pool"),
    "recompute 'no'": (_set(("finetune", "recompute"), "no"), "recompute"),
    "fused 'no'": (_set(("finetune", "fused"), "no"), "fused"),
    "uint8_input 0": (_set(("finetune", "uint8_input"), 0), "uint8_input"),
    "precision fp64": (_set(("finetune", "precision"), "fp64"), "precision"),
    "frozen weights 8": (_set(("finetune", "frozen_weights"), 8), "frozen_weights"),
    "stream -1": (_set(("finetune", "stream"), -1), "stream"),
    "stream as text": (_set(("finetune", "stream"), "0"), "stream"),
    "mode Repnet": (_set(("finetune", "mode"), "Repnet"), "mode"),
    "bn batch": (_set(("finetune", "bn"), "batch"), "bn"),
    "kept fractional": (_set(("prune", "kept", 2), 4.5), "kept"),
    "channels as text": (_set(("prune", "channels", 2), "48"), "channels"),
    "block as text key": (_set(("prune", "kept", "two"), 3), "kept"),
    "ratio as text": (_set(("prune", "ratios", 0), "0.5"), "ratios"),
    "ratio nan": (_set(("prune", "ratios", 0), float("nan")), "ratios"),
    "resolution 64.0": (_set(("resolution",), 64.0), "resolution"),
    "classes as text": (_set(("num_classes",), "102"), "num_classes"),
    "budget as text": (_set(("budget", "budget_bytes"), "4540000"), "budget_bytes"),
    "scope Tensors": (_set(("budget", "scope"), "Tensors"), "scope"),
    "device unknown": (_set(("budget", "device"), "jetson-tx2"), "device"),
    "request batch 4.5": (_set(("request", "batch_size"), 4.5), "batch_size"),
    "request fused 'no'": (_set(("request", "fused"), "no"), "fused"),
    "width as text": (_set(("backbone", "width"), "0.35"), "width"),
    "runner fits 'yes'": (_set(("runners_up", 0, "fits"), "yes"), "fits"),
    "runner pool true": (_set(("runners_up", 0, "config", "finetune", "pool"), True), "pool"),
    "verify steps 2.5": (_set(("verify",), {"measured_bytes": 1, "steps": 2.5}), "steps"),
    "search seconds text": (_set(("search", "seconds"), "1.5"), "seconds"),
    "notes a number": (_set(("notes",), [1]), "notes"),
    "unknown key": (_set(("finetune", "pools"), 2), "pools"),
    "missing key": (lambda d: d["finetune"].pop("batch_size"), "batch_size"),
    "missing section": (lambda d: d.pop("budget"), "budget"),
    # redundant values that disagree: each was resolved by trusting one of them
    "ratio keeps another count": (_set(("prune", "ratios", 0), 0.1), "ratio"),
    "kept past channels": (_both(_set(("prune", "kept", 2), 60), _set(("prune", "ratios", 1), 0.0)), "kept"),
    "channels not the backbone's": (_set(("prune", "channels", 1), 17), "channels"),
    # found by the generated edits below: no 6-digit ratio names a kept count of 2**40 channels
    "channels past any network": (_set(("prune", "channels", 1), 2**40), "channels"),
    # found by the generated edits too: a meta build of width 2**40 overflowed torch's storage size
    "width past any network": (_set(("backbone", "width"), 2**40), "width"),
    "classes past any classifier": (_both(_set(("num_classes",), 10**16), _set(("backbone", "num_classes"), 10**16)),
                                    "num_classes"),
    "a block only in kept": (_set(("prune", "kept", 9), 100), "kept"),
    "a block twice": (lambda d: d["prune"]["blocks"].append(1), "blocks"),
    "block 18": (_set(("prune", "blocks", 0), 18), "blocks"),
    "classes vs backbone classes": (_set(("num_classes",), 10), "num_classes"),
    "tensor budget vs budget": (_set(("budget", "budget_bytes"), 9_000_000), "budget_bytes"),
    "total vs breakdown": (_set(("predicted", "total_bytes"), 1_000_000), "total_bytes"),
    "does not fit its budget": (_both(_set(("budget", "budget_bytes"), 1_000_000),
                                      _set(("budget", "tensor_budget_bytes"), 1_000_000)), "tensor_budget_bytes"),
    "overheads vs device": (_set(("budget", "overheads"), {"CUDA context": 1}), "overheads"),
    "runner fits vs budget": (lambda d: d["runners_up"][0].update(fits=not d["runners_up"][0]["fits"]), "fits"),
    "uint8 without streaming": (_set(("finetune", "uint8_input"), True), "uint8_input"),
    "precision vs request": (_set(("finetune", "precision"), "bf16"), "precision"),
    "batch vs request": (_both(_set(("finetune", "batch_size"), 8), _set(("runners_up",), [])), "batch_size"),
    "resolution too small": (_set(("resolution",), 32), "resolution"),
    "storage outside mode full": (_set(("finetune", "storage"), "pool2"), "storage"),
    # how the step runs on the device: null, false (eager) or the CUDA-graph figures of a device with a GPU
    "cuda_graph true": (_set(("cuda_graph",), True), "cuda_graph"),
    "request eager 'no'": (_set(("request", "eager"), "no"), "eager"),
    "eager asked, not planned": (_set(("request", "eager"), True), "eager"),
    "graphs on no GPU": (lambda d: d.update(cuda_graph={"capability": [8, 7], "extra_bytes": 0,
                                                        "total_bytes": d["predicted"]["total_bytes"]}), "cuda_graph"),
    "graph replays -1": (_set(("search", "graph_replays"), -1), "graph_replays"),
}


def write_edit(plans: dict, tmp_path: Path, name: str) -> tuple[Path, str]:
    edit, key = EDITS[name]
    data = doc(plans["pruning"])
    edit(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, key


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_hand_edit_is_refused_in_one_line_by_finetune(plans, tmp_path, capsys, name):
    path, key = write_edit(plans, tmp_path, name)
    before = tree_digest(tmp_path)
    out = tmp_path / "run"
    line = refused(*run_cli(capsys, finetune_argv(path, out)))
    assert line.startswith(f"{path}: ") and key in line, line
    assert tree_digest(tmp_path) == before and not out.exists()


@pytest.mark.parametrize("name", ["fractional batch", "pool true", "recompute 'no'", "ratio keeps another count",
                                  "channels not the backbone's", "kept fractional", "unknown key"])
def test_a_hand_edit_is_refused_in_one_line_by_prune(plans, tmp_path, capsys, name):
    path, key = write_edit(plans, tmp_path, name)
    before = tree_digest(tmp_path)
    out = tmp_path / "pruned"
    line = refused(*run_cli(capsys, prune_argv(path, out, "--width", "0.35")))
    assert line.startswith(f"{path}: ") and key in line, line
    assert tree_digest(tmp_path) == before and not out.exists()


def test_a_ratio_that_keeps_the_same_channels_agrees(plans, tmp_path):
    """A hand-rounded ratio that makes prune keep exactly ``kept`` is no disagreement."""
    data = doc(plans["pruning"])
    b = data["prune"]["blocks"][0]
    kept, channels = data["prune"]["kept"][b], data["prune"]["channels"][b]
    data["prune"]["ratios"][0] = round(1 - (kept + 0.9) / channels, 3)
    path = tmp_path / "rounded.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_plan(path).chosen == load_plan(plans["pruning"]).chosen


# --- a plan applied to another backbone or resolution ---------------------------------------------


def test_finetune_refuses_a_plan_for_another_width(plans, tmp_path, capsys, folder_05):
    path = plans["unpruned"]
    before = path.read_bytes()
    cases = [
        (["--set", "model.width=0.5"], "mobilenet_v2:random is width 0.5"),  # the flag after wins
        (["--backbone", str(folder_05)], f"{folder_05} is width 0.5"),
    ]
    for extra, needle in cases:
        out = tmp_path / "run"
        line = refused(*run_cli(capsys, finetune_argv(path, out, *extra)))
        assert f"{path} was planned for MobileNetV2 width 0.35" in line and needle in line, line
        assert not out.exists()
    # no backbone named: the recipe's (imagefolder: the ImageNet weights, width 1.0)
    out = tmp_path / "run"
    argv = ["finetune", "--recipe", "imagefolder", "--data", str(tmp_path / "no-data"), "--plan", str(path),
            "--set", f"data.resolution={RES}", "-o", str(out)]
    line = refused(*run_cli(capsys, argv))
    assert "planned for MobileNetV2 width 0.35" in line and "is width 1" in line, line
    assert not out.exists() and path.read_bytes() == before


def test_finetune_refuses_a_plan_for_another_resolution_or_pruning(plans, tmp_path, capsys):
    out = tmp_path / "run"
    line = refused(*run_cli(capsys, finetune_argv(plans["unpruned"], out, "--set", "data.resolution=96")))
    assert "planned at 64 px" in line and "96 px" in line, line
    line = refused(*run_cli(capsys, finetune_argv(plans["pruning"], out)))
    assert "plans hidden channels" in line and "unpruned" in line, line
    assert not out.exists()


def test_prune_refuses_a_plan_for_another_width(plans, tmp_path, capsys, folder_05):
    path = plans["pruning"]
    before = path.read_bytes()
    for extra, needle in ((["--width", "0.5"], "this input is width 0.5"),
                          (["--checkpoint", str(folder_05)], "this input is width 0.5")):
        out = tmp_path / "pruned"
        line = refused(*run_cli(capsys, prune_argv(path, out, *extra)))
        assert f"{path} was planned for backbone width 0.35" in line and needle in line, line
        assert not out.exists()
    assert path.read_bytes() == before


# --- plan: --width beside a backbone that has its own ---------------------------------------------


@pytest.mark.parametrize("extra, needle", [
    (["--backbone", "FOLDER", "--width", "0.35"], "has its own width (0.5)"),
    (["--backbone", "FOLDER", "--width", "0.5"], "has its own width (0.5)"),
    (["--backbone", "mobilenet_v2:IMAGENET1K_V1", "--width", "0.35"], "width 1.0 only"),
    (["--width", "inf"], "--width"),
    (["--width", "1e12"], "width 1e+12 is not allowed; allowed: more than 0, at most 4"),
    (["--num-classes", str(10**16)], "num_classes 10000000000000000 is not allowed; allowed: 1..1,000,000"),
    (["--batch-size", "8", "--max-batch-size", "16"], "--max-batch-size 16 needs --batch-size auto"),
])
def test_plan_refuses_flags_it_would_ignore(tmp_path, capsys, folder_05, extra, needle):
    extra = [str(folder_05) if e == "FOLDER" else e for e in extra]
    out = tmp_path / "p.yaml"
    before = tree_digest(folder_05)
    line = refused(*run_cli(capsys, ["plan", "--budget", "20MB", "--resolution", str(RES), *extra, "-o", str(out)]))
    assert needle in line, line
    assert not out.exists() and tree_digest(folder_05) == before


def test_profile_refuses_a_width_beside_a_backbone_folder_as_plan_does(capsys, folder_05):
    line = refused(*run_cli(capsys, ["profile", "--checkpoint", str(folder_05), "--width", "0.35"]))
    assert line == (f"width 0.35 is for the default backbone; the backbone folder {folder_05} has its own "
                    "width (0.5): leave the width out")
    assert main(["profile", "--checkpoint", str(folder_05), "--resolution", str(RES)]) == 0  # its own width
    assert "peak activation memory per image" in capsys.readouterr().out


def test_prune_takes_the_plans_resolution_and_refuses_another(plans, tmp_path, capsys):
    out = tmp_path / "pruned"
    argv = ["prune", "--plan", str(plans["pruning"]), "--importance", "weight-l2", "--width", "0.35", "-o", str(out)]
    line = refused(*run_cli(capsys, [*argv, "--resolution", str(RES + 32)]))
    assert line == (f"{plans['pruning']} was planned at {RES} px; --resolution is {RES + 32}: leave --resolution "
                    f"out, or plan again with --resolution {RES + 32}")
    assert not out.exists()
    assert main(argv) == 0  # without --resolution: the plan's (its memory table says at what size)
    assert f" | {RES} px | temporary memory per image" in capsys.readouterr().out


def test_plan_with_a_backbone_folder_takes_its_width(tmp_path, capsys, folder_05):
    out = tmp_path / "p.yaml"
    assert main(["plan", "--budget", "20MB", "--resolution", str(RES), "--backbone", str(folder_05),
                 "--batch-size", "2", "--stream", "0", "-o", str(out)]) == 0
    assert load_plan(out).backbone["width"] == 0.5


# --- unusual but valid: a byte-order mark, CRLF line ends, JSON ------------------------------------


def test_a_plan_with_a_byte_order_mark_and_crlf_loads(plans, tmp_path):
    text = plans["pruning"].read_text()
    want = load_plan(plans["pruning"]).to_dict()
    bom = tmp_path / "windows.yaml"
    bom.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert load_plan(bom).to_dict() == want
    as_json = tmp_path / "windows.json"  # JSON keys are strings: block "2" is block 2
    as_json.write_bytes(b"\xef\xbb\xbf" + json.dumps(want, indent=2).replace("\n", "\r\n").encode())
    assert load_plan(as_json).chosen == load_plan(plans["pruning"]).chosen


# --- generated hand edits --------------------------------------------------------------------------


def leaf_paths(node, prefix=()) -> list[tuple]:
    """Every path to a value in a document (mappings and lists walked; the empty ones are values)."""
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in [prefix + (k,)] + leaf_paths(v, prefix + (k,))]
    if isinstance(node, list) and node:
        return [p for i, v in enumerate(node) for p in [prefix + (i,)] + leaf_paths(v, prefix + (i,))]
    return []


VALUES = st.one_of(
    st.integers(-3, 300), st.integers(min_value=2**40, max_value=2**70), st.sampled_from([0, 1, 2, 4, 8, 64]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 4.0, 0.5, 0.35, 2.5]),
    st.booleans(), st.none(),
    st.sampled_from(["no", "yes", "true", "8", "4.5", "fp16", "int8", "auto", "repnet", "full", "fold", "",
                     "tensors", "none", "orin-nano-8gb", "pool2"]),
    st.text(max_size=8), st.lists(st.integers(0, 20), max_size=3), st.just({}), st.just({"a": 1}),
)
UNKNOWN = st.one_of(st.sampled_from(["pools", "batchsize", "Pool", "extra", "bn ", "ratio"]), st.integers(18, 40))


@st.composite
def hand_edits(draw, data: dict):
    """A copy of ``data`` with one edit (a value replaced, a key deleted, a key added) and the
    path of the edited key."""
    data = copy.deepcopy(data)
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if kind == "add":
        mappings = [()] + [p for p in leaf_paths(data) if isinstance(get(data, p), dict)]
        at = draw(st.sampled_from(mappings))
        key = draw(UNKNOWN)
        node = get(data, at)
        if key in node:
            key = "extra"
        node[key] = draw(VALUES)
        return data, at + (key,), kind
    paths = [p for p in leaf_paths(data) if p != ("format",)]
    path = draw(st.sampled_from(paths))
    parent = get(data, path[:-1])
    if kind == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(VALUES)
    return data, path, kind


def get(data, path: tuple):
    for key in path:
        data = data[key]
    return data


def naive_config(d: dict) -> PlanConfig:
    """A configuration with the document's values as they are, defaults only for keys that
    plans before them did not write (written apart from edgetl.plan.document)."""
    p, f = d["prune"], d["finetune"]
    return PlanConfig(kept=dict(p["kept"]), channels=dict(p["channels"]), pool=f["pool"], precision=f["precision"],
                      frozen_weights=f["frozen_weights"], batch_size=f["batch_size"], stream=f.get("stream", 0),
                      mode=f["mode"], conv_storage=f.get("storage", "exact"), recompute=f.get("recompute", False),
                      fused=f.get("fused", False), step_in_backward=f.get("step_in_backward", False))


def naive_plan(d: dict) -> Plan:
    b, verify, search = d["budget"], d.get("verify") or {}, d.get("search") or {}
    return Plan(
        budget_bytes=b["budget_bytes"], budget_scope=b["scope"], tensor_budget_bytes=b["tensor_budget_bytes"],
        device=b["device"], overheads=b["overheads"] or {},
        device_process_limit_bytes=b.get("device_process_limit_bytes"),
        resolution=d["resolution"], num_classes=d["num_classes"], request=d["request"], backbone=d["backbone"],
        chosen=naive_config(d), predicted_bytes=d["predicted"]["total_bytes"], breakdown=d["predicted"]["breakdown"],
        runners_up=[Candidate(naive_config(c["config"]), c["predicted_bytes"], c["fits"], c.get("why", ""))
                    for c in d.get("runners_up") or []],
        objective=d.get("objective", OBJECTIVE), evaluations=search.get("evaluations", 0),
        search_seconds=search.get("seconds", 0.0), notes=d.get("notes") or [],
        measured_bytes=verify.get("measured_bytes"), verify_steps=verify.get("steps"),
        cuda_graph=(GraphMemory(tuple(d["cuda_graph"]["capability"]), d["cuda_graph"]["extra_bytes"],
                                d["cuda_graph"]["total_bytes"]) if isinstance(d.get("cuda_graph"), dict) else None),
        eager=d.get("cuda_graph") is False, graph_replays=search.get("graph_replays", 0),
    )


def same(a, b) -> bool:
    """Equal and of the same types all the way down (8 is not 8.0, 1 is not True)."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(map(repr, a)) == list(map(repr, b))
                and all(same(v, b[k]) for k, v in a.items()))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return isinstance(a, float) and isinstance(b, int) and not isinstance(b, bool) and a == b
    return a == b


@FAST
@pytest.mark.parametrize("name", ["pruning", "jetson"])
@given(data=st.data())
def test_generated_hand_edits_are_refused_naming_the_key_or_read_exactly(plans, tmp_path, name, data):
    original = doc(plans[name])
    edited, path, kind = data.draw(hand_edits(original), label="edit")
    file = tmp_path / "edited.yaml"
    file.write_text(yaml.safe_dump(edited, sort_keys=False))
    edited = yaml.safe_load(file.read_text())  # the document as the file holds it
    try:
        plan = load_plan(file)
    except ConfigError as exc:
        line = str(exc)
        assert "\n" not in line and line.startswith(f"{file}: "), line
        names = [str(k) for k in path if isinstance(k, str)][-2:]
        if kind == "add":  # the key added; a part added to the breakdown is freely named: the sum is refused
            names = [str(path[-1]), *(["breakdown"] if path[:-1] == ("predicted", "breakdown") else [])]
        assert any(name in line for name in names), (path, line)
        return
    # a key added is refused, but in the breakdown, whose parts are named freely (one of 0 bytes adds up)
    assert kind != "add" or path[:-1] == ("predicted", "breakdown"), (path, "an unknown key was accepted")
    # read exactly: every value as written (an int written for a float is read as that float)
    assert same(plan, naive_plan(edited)), path


def test_finetune_refuses_a_plan_for_another_class_count_before_writing(plans, tmp_path, capsys):
    """The plan's class count is the data's: read with the data, refused before the run folder."""
    from tests.conftest import make_color_folder

    data = make_color_folder(tmp_path / "colors", 4, 2, size=24)  # 3 classes
    planned = load_plan(plans["unpruned"]).spec.num_classes
    assert planned != 3
    out = tmp_path / "run"
    argv = finetune_argv(plans["unpruned"], out)
    argv[argv.index("--data") + 1] = str(data)
    line = refused(*run_cli(capsys, argv))
    assert line == f"{plans['unpruned']} was planned for {planned} classes; the data has 3: plan again with --num-classes 3"
    assert not out.exists()
