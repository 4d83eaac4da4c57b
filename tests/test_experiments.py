"""The accuracy studies of experiments/ as run from the repository root: their command lines, and
--table-only on the committed records (no training: each study's table from its JSON only)."""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
STUDIES = ["levers_accuracy", "storage_accuracy"]
# Each study's main table: the header cell it starts with.
HEADER = {"levers_accuracy": "| config |", "storage_accuracy": "| configuration |"}
# A number in a cell; the '-' of a range such as "70.5-73.4" is no sign.
NUMBER = re.compile(r"(?<![\d.])[+-]?\d+(?:\.\d+)?")


def _study(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m experiments.NAME ARGS`` from the repository root (experiments/ is not installed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", f"experiments.{name}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _rows(markdown: str, header: str) -> dict[str, list[str]]:
    """The data rows of the table whose header line starts with ``header``: config -> its other cells."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    assert set(lines[start + 1]) <= set("|-: "), lines[start + 1]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _numbers(cells: list[str]) -> list[list[float]]:
    return [[float(x) for x in NUMBER.findall(cell)] for cell in cells]


@pytest.mark.parametrize("name", STUDIES)
def test_help_exits_0(name):
    result = _study(name, "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--out", "--seeds", "--samples", "--epochs", "--val-samples", "--threads", "--configs",
                   "--no-grad-check", "--note", "--table-only"):
        assert option in result.stdout, option


@pytest.mark.parametrize("name", STUDIES)
def test_table_only_reproduces_the_committed_table(name, tmp_path):
    """--table-only on a copy of the committed record (at its own scale, whatever --samples says)
    writes the committed table's rows again, and leaves the record's bytes as they were."""
    shutil.copy(BENCH / f"{name}.json", tmp_path / f"{name}.json")
    result = _study(name, "--out", str(tmp_path), "--table-only")
    assert result.returncode == 0, result.stderr
    committed = _rows((BENCH / f"{name}.md").read_text(), HEADER[name])
    written = _rows((tmp_path / f"{name}.md").read_text(), HEADER[name])
    data = json.loads((BENCH / f"{name}.json").read_text())
    assert set(committed) == set(data["results"]), set(committed) ^ set(data["results"])
    assert list(written) == list(committed)
    for config, cells in committed.items():
        assert _numbers(written[config]) == _numbers(cells), config
        assert written[config] == cells, config
    assert (tmp_path / f"{name}.json").read_bytes() == (BENCH / f"{name}.json").read_bytes()


@pytest.mark.parametrize("name", STUDIES)
def test_committed_table_holds_its_records_numbers(name):
    """The committed table's per-seed top-1, mean and predicted peak, recomputed from the JSON here."""
    data = json.loads((BENCH / f"{name}.json").read_text())
    rows = {k: _numbers(v) for k, v in _rows((BENCH / f"{name}.md").read_text(), HEADER[name]).items()}
    # column of: the per-seed top-1, the mean, the peak at batch 8, 224 px
    acc_col, mean_col, paper_col = (0, 1, 7) if name == "levers_accuracy" else (2, 3, 0)
    means = {}
    for config, runs in data["results"].items():
        accs = [runs[s]["best_acc1"] for s in sorted(runs, key=int)]
        means[config] = statistics.mean(accs)
        row = rows[config]
        assert len(row[acc_col]) == len(accs), config
        assert all(abs(a - b) <= 0.05 + 1e-9 for a, b in zip(row[acc_col], accs)), (config, row[acc_col], accs)
        assert abs(row[mean_col][0] - means[config]) <= 0.005 + 1e-9, (config, row[mean_col], means[config])
        assert abs(row[paper_col][0] - data["peaks"][config]["paper"] / 1e6) <= 0.005 + 1e-9, config
        if name == "storage_accuracy":  # mean ± std (min-max)
            assert abs(row[mean_col][1] - statistics.stdev(accs)) <= 0.005 + 1e-9, config
            assert row[mean_col][2:] == [round(min(accs), 1), round(max(accs), 1)], config
    if name == "levers_accuracy":  # Δ mean against the baseline, in points
        base = means["fp32/fp32/pool1"]
        for config, mean in means.items():
            if config != "fp32/fp32/pool1":
                assert abs(rows[config][4][0] - (mean - base)) <= 0.005 + 1e-9, config


@pytest.mark.parametrize("name", STUDIES)
def test_unknown_config_is_a_one_line_usage_error(name, tmp_path):
    out = tmp_path / "study"
    result = _study(name, "--out", str(out), "--configs", "no-such-config", "--table-only")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "'no-such-config'" in errors[0], result.stderr
    assert errors[0] == result.stderr.strip().splitlines()[-1]
    assert not out.exists()  # refused before anything was created
