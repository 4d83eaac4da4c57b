"""scripts/barley_table1.py in, its figures checked: every row against a real CPU forward of
ResNet-18, the committed JSON against a fresh run, the paper's Table 1 as transcribed against its
own Sum row, and the rendered table in docs/resnet.md against the JSON."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _module("barley_table1")


@pytest.fixture(scope="module")
def built(script):
    return json.loads(json.dumps(script.build()))  # as the committed file holds it (lists, not tuples)


@pytest.fixture(scope="module")
def real_inputs():
    """Each conv's real input tensor in a CPU forward of one 224 px image, and the conv itself."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18().eval()
    seen = {}
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    for name, conv in convs.items():
        conv.register_forward_pre_hook(lambda _m, args, name=name: seen.__setitem__(name, args[0]))
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    return {n: (seen[n], convs[n]) for n in convs}


def test_rows_equal_a_real_forward_scaled_to_batch_32(built, real_inputs):
    """X and Z are the real input's and the real avg_pool2d output's nbytes at batch 1, times 32; W the
    conv's parameter nbytes."""
    rows = {r["layer"]: r for r in built["rows"]}
    assert list(rows) == list(real_inputs) and len(rows) == 20
    for name, (x, conv) in real_inputs.items():
        b = rows[name]["bytes"]
        assert rows[name]["input_shape"] == [32, *x.shape[1:]]
        assert b["W"] == sum(p.nbytes for p in conv.parameters())
        assert b["X"] == 32 * x.nbytes
        for k in (2, 4):
            z = F.avg_pool2d(x, kernel_size=k)  # torch's default stride = kernel, floor
            assert b[f"Z{k}"] == 32 * z.nbytes, (name, k)
            assert rows[name]["pooled_shape"][f"Z{k}"] == list(z.shape[2:])
        assert rows[name]["edgetl_mib"] == {c: round(v / MIB, 2) for c, v in b.items()}


def test_odd_maps_pool_by_floor_as_the_paper_prints(built):
    """The paper's layer4.0.conv2 (7x7 input) reads 0.56 / 0.06 MiB: 3x3 and 1x1 cells, not 4x4 and 2x2."""
    row = next(r for r in built["rows"] if r["layer"] == "layer4.0.conv2")
    assert row["input_shape"] == [32, 512, 7, 7]
    assert row["pooled_shape"] == {"Z2": [3, 3], "Z4": [1, 1]}
    per_cell = 32 * 512 * 4 / MIB
    assert round(9 * per_cell, 2) == row["paper_mib"]["Z2"] == 0.56 and round(16 * per_cell, 2) == 1.0
    assert round(1 * per_cell, 2) == row["paper_mib"]["Z4"] == 0.06 and round(4 * per_cell, 2) == 0.25
    ceil = next(t for t in built["totals"] if t["label"].startswith("edgetl, the paper's 17 rows, ceil_mode"))
    assert ceil["mib"]["Z2"] != built["paper_sum"]["mib"]["Z2"] and ceil["mib"]["Z4"] != built["paper_sum"]["mib"]["Z4"]


def test_committed_json_is_what_the_script_writes(built):
    committed = json.loads((ROOT / "benchmarks" / "barley_table1_resnet18.json").read_text())
    assert committed == built, "run python scripts/barley_table1.py (then python scripts/render_docs.py)"


def test_paper_sum_row_as_transcribed(script):
    """Table 1's Sum row is what its transcribed cells add to (within the rounding of 17 cells), its
    percentages and Section 5.3's 191 / 239 MiB follow from the sums."""
    rows = script.PAPER_ROWS
    assert len(rows) == 17 and len({r[0] for r in rows}) == 17
    for i, col in enumerate(script.COLUMNS, start=1):
        assert abs(sum(r[i] for r in rows) - script.PAPER_SUM[col]) <= 17 * 0.005, col
    total = script.PAPER_SUM
    assert (total["W"], total["X"], total["Z2"], total["Z4"]) == (41.94, 254.19, 63.34, 15.35)
    for z in ("Z2", "Z4"):
        assert round(100 * (total[z] / total["X"] - 1)) == script.PAPER_SUM_PERCENT[z]
        assert round(total["X"] - total[z]) == script.PAPER_SAVED_MIB[z]


def test_paper_sums_are_edgetls_exact_sums_over_its_rows(built, script):
    """X, Z2 and Z4: edgetl's exact bytes over the paper's 17 rows, rounded, are the paper's sums; W
    only over the convs its W column really lists."""
    paper_rows = [r for r in built["rows"] if r["paper_mib"]]
    assert [r["layer"] for r in paper_rows] == [r[0] for r in script.PAPER_ROWS]
    for col in ("X", "Z2", "Z4"):
        assert round(sum(r["bytes"][col] for r in paper_rows) / MIB, 2) == script.PAPER_SUM[col], col
    by_name = {r["layer"]: r for r in built["rows"]}
    w_column = [by_name[r["paper_w_source"]]["bytes"]["W"] for r in paper_rows]
    assert round(sum(w_column) / MIB, 2) == script.PAPER_SUM["W"]
    assert round(sum(r["bytes"]["W"] for r in paper_rows) / MIB, 2) != script.PAPER_SUM["W"]
    totals = {t["label"]: t for t in built["totals"]}
    assert totals["edgetl, all 20 convs"]["mib"] == {"W": 42.6, "X": 266.44, "Z2": 66.0, "Z4": 15.76}


def test_every_difference_is_the_w_column_or_a_missing_row(built):
    """X and Z agree in every row the paper prints; each W cell is its paper_w_source's W; a row differs
    (and says why) exactly where a cell differs or the paper has no row."""
    by_name = {r["layer"]: r for r in built["rows"]}
    missing = [r["layer"] for r in built["rows"] if r["paper_mib"] is None]
    assert missing == ["layer4.0.downsample.0", "layer4.1.conv1", "layer4.1.conv2"]
    sources = [r["paper_w_source"] for r in built["rows"] if r["paper_mib"]]
    assert sources == [n for n in by_name if "downsample" not in n]  # the 17 convs, in order
    for r in built["rows"]:
        if r["paper_mib"] is None:
            assert r["difference"].startswith("not in the paper's table")
            continue
        for col in ("X", "Z2", "Z4"):
            assert r["edgetl_mib"][col] == r["paper_mib"][col], (r["layer"], col)
        assert r["paper_mib"]["W"] == by_name[r["paper_w_source"]]["edgetl_mib"]["W"]
        differs = r["edgetl_mib"]["W"] != r["paper_mib"]["W"]
        assert (r["difference"] is not None) == differs, r["layer"]
        if differs:
            assert r["paper_w_source"] in r["difference"]
    assert sum(r["difference"] is not None for r in built["rows"]) == 7 + 3


def test_resnet_doc_renders_the_committed_json():
    """docs/resnet.md's two blocks are what scripts/render_docs.py renders from the JSON now."""
    rd = _module("render_docs")
    path = ROOT / "docs" / "resnet.md"
    text = path.read_text()
    assert "<!-- render:barley-table1 -->" in text and "<!-- render:barley-table1-totals -->" in text
    assert rd.render_text(text, {}, "docs/resnet.md") == text, "run python scripts/render_docs.py"
    assert "| `layer4.0.conv2` | 512×7×7 | 9.00 | 3.06 | 0.56 | 0.06 | 9.00 / 3.06 / 0.56 / 0.06 |" in text
