"""Issue #41 item 2 and 3 (export): an export's outputs never land on its inputs or on a file
edgetl did not make; flags are checked before anything is made; an ONNX file and its sidecar
appear together or not at all (also when the export is killed between the two writes); an
opset the installed exporter cannot write is refused in one line, never replaced by another;
a read-only output folder is one line. Each refusal: exit 2, one line, no traceback, the run
folder byte-identical, nothing left behind. The run is a real (tiny) ``edgetl finetune`` run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgetl.errors import DataError, ResourceError
from edgetl.export import build_engine, opset_range, runtime_max_opset, written_opset
from edgetl.io import StagedFiles
from tests.conftest import make_color_folder
from tests.test_divergence_and_data import tree_digest
from tests.test_failures import backbone, error_line, exit_code, finetune_argv  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def run(tmp_path_factory, backbone) -> Path:
    """A finished ``edgetl finetune`` run folder (1 epoch, 3 colour classes, 64 px): model.pt,
    model.json, best.pt, last.pt, recipe.yaml, metrics and edgetl's record of them."""
    root = tmp_path_factory.mktemp("hostile_export")
    data = make_color_folder(root / "data", 8, 4)
    assert exit_code(finetune_argv(data, root / "run", backbone)) == 0
    return root / "run"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` (hidden ones too): files by content."""
    entries = tree_digest(folder)
    entries.update({str(p.relative_to(folder)) + "/": "dir" for p in folder.rglob("*") if p.is_dir()})
    return entries


def export(run_dir: Path, *args) -> list[str]:
    return ["export", "--run", str(run_dir), "--legacy-exporter", *map(str, args)]


def refused(argv: list[str], capsys, *needles: str, watch: list[Path]) -> str:
    """Run ``edgetl ARGV``: exit 2, one line naming every needle, and every watched folder as it was."""
    before = {folder: snapshot(folder) for folder in watch}
    code = exit_code(argv)
    err = capsys.readouterr().err
    line = error_line(err)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in line, (needle, line)
    for folder in watch:
        assert snapshot(folder) == before[folder], f"{folder} changed"
    return line


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- outputs never land on inputs -------------------------------------------------------------

@pytest.mark.parametrize("name, needle", [
    ("model.pt", "is the run's checkpoint model.pt, which this export reads"),
    ("best.pt", "is the run's checkpoint best.pt, which this export reads"),
    ("last.pt", "is the run's checkpoint last.pt, which this export reads"),
    ("model.json", "is the run's model.json, which this export reads"),
    ("notes.json", "ends in .json, the sidecars' suffix"),
    ("model", "model.json (the sidecar of model) is the run's model.json, which this export reads"),
    ("recipe.yaml", "is a file edgetl made for another purpose"),
    ("metrics.csv", "is a file edgetl made for another purpose"),
    (".edgetl-files", "is a file edgetl made for another purpose"),
])
def test_an_output_on_a_file_of_the_run_is_refused(run, capsys, name, needle):
    refused(export(run, "-o", run / name), capsys, str(run / name), needle, watch=[run.parent])


@pytest.mark.parametrize("name, needle", [
    ("model", "model.json (the sidecar of model) is the run's model.json"),  # the engine's sidecar
    ("model.pt", "is the run's checkpoint model.pt"),  # the engine itself
])
def test_an_engine_whose_files_land_on_the_run_is_refused(run, capsys, name, needle):
    """--format engine writes four files (ONNX, engine, a sidecar each); every one is checked,
    before TensorRT is looked for."""
    refused(["export", "--run", str(run), "--format", "engine", "-o", str(run / name)], capsys, needle,
            watch=[run.parent])


def test_an_engine_whose_onnx_sidecar_is_the_users_is_refused(run, tmp_path, capsys):
    (tmp_path / "m.onnx.json").write_text("{}")  # beside m.engine, where the engine's ONNX sidecar goes
    refused(["export", "--run", str(run), "--format", "engine", "-o", str(tmp_path / "m.engine")], capsys,
            "m.onnx.json (the sidecar of m.onnx) exists and is not an edgetl export", watch=[run.parent, tmp_path])


def test_a_link_to_the_checkpoint_and_a_path_below_it_are_refused(run, tmp_path, capsys):
    link = tmp_path / "weights.onnx"
    link.symlink_to(run / "model.pt")
    refused(export(run, "-o", link), capsys, f"output {link} is the run's checkpoint model.pt",
            watch=[run.parent, tmp_path])
    elsewhere = tmp_path / "mine.onnx"
    (tmp_path / "target.bin").write_bytes(b"mine")
    elsewhere.symlink_to(tmp_path / "target.bin")
    refused(export(run, "-o", elsewhere), capsys, f"output {elsewhere} is a symbolic link", watch=[run.parent, tmp_path])
    below = run / "model.pt" / "x.onnx"
    refused(export(run, "-o", below), capsys, f"{run / 'model.pt'} is a file, not a folder", watch=[run.parent])


def test_a_file_edgetl_did_not_make_is_never_overwritten(run, tmp_path, capsys):
    (tmp_path / "notes.onnx").write_bytes(b"my own model, from another tool")
    refused(export(run, "-o", tmp_path / "notes.onnx"), capsys, str(tmp_path / "notes.onnx"),
            "exists and is not an edgetl export", watch=[run.parent, tmp_path])
    (tmp_path / "m.onnx.json").write_text('{"mine": true}\n')  # the sidecar's name is the user's
    refused(export(run, "-o", tmp_path / "m.onnx"), capsys, "m.onnx.json (the sidecar of m.onnx) exists and is not "
            "an edgetl export", watch=[run.parent, tmp_path])
    (tmp_path / "dir.onnx").mkdir()
    refused(export(run, "-o", tmp_path / "dir.onnx"), capsys, "is a folder", watch=[run.parent, tmp_path])


# --- flags: checked before anything is made ----------------------------------------------------

def _opset_cases():
    low, high, _ = opset_range(dynamo=True)
    legacy_low, legacy_high, _ = opset_range(dynamo=False)
    return [
        (["--batch", "4"], ["a largest batch (4) applies to TensorRT engines only"]),
        (["--fp16"], ["fp16 applies to TensorRT engines only"]),
        (["--format", "tflite"], ["unknown export format 'tflite'"]),
        (["--opset", str(low - 1)], [f"ONNX opset {low - 1} is not available with the dynamo exporter",
                                     f"allowed: {low} <= opset <= {high}", "--legacy-exporter"]),
        (["--opset", str(high + 1)], [f"ONNX opset {high + 1} is not available", f"{low} <= opset <= {high}"]),
        (["--legacy-exporter", "--opset", str(legacy_high + 1)],
         [f"ONNX opset {legacy_high + 1} is not available with the legacy exporter",
          f"allowed: {legacy_low} <= opset <= {legacy_high}"]),
        (["--legacy-exporter", "--opset", str(legacy_low - 1)], [f"{legacy_low} <= opset <= {legacy_high}"]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_refused_flag_makes_nothing(run, tmp_path, capsys, case):
    """Neither the default RUN/export folder nor a new -o folder is made for a refused export."""
    flags, needles = _opset_cases()[case]
    refused(["export", "--run", str(run), *flags], capsys, *needles, watch=[run.parent])
    assert not (run / "export").exists()
    refused(["export", "--run", str(run), "-o", str(tmp_path / "new" / "deep" / "m.onnx"), *flags], capsys, *needles,
            watch=[run.parent, tmp_path])
    assert not (tmp_path / "new").exists()


def test_the_opset_range_is_the_installed_exporters(tmp_path):
    """The bounds are read from torch, onnx and onnxruntime, re-checked here independently:
    onnxruntime loads a model at the top opset and not one above it."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from torch.onnx import _constants

    def loads(version: int) -> bool:
        value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy"]
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", value[:1], value[1:])
        ops = [helper.make_opsetid("", version)]
        model = helper.make_model(graph, opset_imports=ops, ir_version=helper.find_min_ir_version_for(ops))
        options = ort.SessionOptions()
        options.log_severity_level = 4
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:
            return False
        return True

    top = runtime_max_opset()
    assert loads(top) and (top >= onnx.defs.onnx_opset_version() or not loads(top + 1))
    low, high, why = opset_range(dynamo=True)
    assert high == min(top, onnx.defs.onnx_opset_version()) and low <= 18 <= high
    legacy = opset_range(dynamo=False)
    assert legacy[:2] == (_constants.ONNX_MIN_OPSET, min(_constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET, top))
    assert "onnxruntime" in why and str(top) in why


def test_an_opset_the_exporter_cannot_write_for_this_network_is_one_line(run, tmp_path, capsys):
    """Opset 7 is in torch's legacy range, but the side network's resize needs opset 9 there:
    the exporter's failure is one line, and the folder it would have made is gone."""
    low = opset_range(dynamo=False)[0]
    refused(export(run, "--opset", low), capsys, f"legacy exporter cannot export this network at opset {low}",
            watch=[run.parent])
    assert not (run / "export").exists()


def test_the_top_opset_is_written_as_asked(run, tmp_path, capsys):
    """Valid but unusual: the highest opset allowed exports, and the file says that opset."""
    import onnx

    high = opset_range(dynamo=True)[1]
    out = tmp_path / "top.onnx"
    assert exit_code(["export", "--run", str(run), "--opset", str(high), "-o", str(out)]) == 0, capsys.readouterr()
    assert written_opset(onnx.load(str(out))) == high
    assert json.loads(Path(f"{out}.json").read_text())["opset"] == high


# --- complete or absent ------------------------------------------------------------------------

def test_an_export_writes_both_files_and_records_the_models_sha256(run, tmp_path, capsys):
    work = tmp_path / "run"
    shutil.copytree(run, work)
    before = snapshot(work)
    assert exit_code(export(work)) == 0, capsys.readouterr().err
    after = snapshot(work)
    assert {k: v for k, v in after.items() if not k.startswith("export")} == before, "the run's files as they were"
    assert sorted(k for k in after if k.startswith("export")) == ["export/", "export/model.onnx",
                                                                  "export/model.onnx.json"]
    meta = json.loads((work / "export" / "model.onnx.json").read_text())
    assert meta["sha256"] == sha256(work / "export" / "model.onnx")
    assert oct((work / "export" / "model.onnx").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    # Again over the earlier export (valid): both replaced; and over one whose sidecar predates sha256.
    assert exit_code(export(work, "--opset", "13")) == 0
    meta = json.loads((work / "export" / "model.onnx.json").read_text())
    assert meta["opset"] == 13 and meta["sha256"] == sha256(work / "export" / "model.onnx")
    meta.pop("sha256")
    (work / "export" / "model.onnx.json").write_text(json.dumps(meta))
    assert exit_code(export(work)) == 0
    assert sorted(p.name for p in (work / "export").iterdir()) == ["model.onnx", "model.onnx.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_sidecar_write_leaves_neither_half(run, tmp_path, capsys, monkeypatch):
    """The sidecar write fails (a full disk); no model.onnx without it, no temporary file, no
    folder; and over an earlier export, the earlier pair stays byte-identical."""
    import edgetl.export as export_module

    def full_disk(path, data):
        raise ResourceError(f"cannot write {path}: no space left on device")

    out = tmp_path / "new" / "m.onnx"
    monkeypatch.setattr(export_module, "atomic_text_json", full_disk)
    refused(export(run, "-o", out), capsys, "no space left on device", watch=[run.parent, tmp_path])
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    assert exit_code(export(run, "-o", tmp_path / "m.onnx")) == 0
    monkeypatch.setattr(export_module, "atomic_text_json", full_disk)
    refused(export(run, "-o", tmp_path / "m.onnx", "--opset", "13"), capsys, "no space left", watch=[run.parent, tmp_path])


KILL_AT_SIDECAR = """import os, signal, sys
import edgetl.export as export_module
from edgetl.cli import main
def killed(path, data):  # the model is written; the process dies before its sidecar is
    os.kill(os.getpid(), signal.SIGKILL)
export_module.atomic_text_json = killed
sys.exit(main(sys.argv[1:]))
"""


def test_an_export_killed_between_the_two_writes_leaves_no_model_without_its_sidecar(run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(run, work)
    before = snapshot(work)
    out = subprocess.run([sys.executable, "-c", KILL_AT_SIDECAR, *export(work)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == -signal.SIGKILL, out.stderr
    left = sorted(p.name for p in (work / "export").iterdir()) if (work / "export").exists() else []
    assert "model.onnx" not in left and "model.onnx.json" not in left, left
    assert all(name.startswith(".") and name.endswith(".tmp") for name in left), left  # SIGKILL: no clean-up
    assert {k: v for k, v in snapshot(work).items() if not k.startswith("export")} == before
    # The next export goes through (its temporary names are new), and a reader finds a whole pair.
    assert exit_code(export(work)) == 0
    meta = json.loads((work / "export" / "model.onnx.json").read_text())
    assert meta["sha256"] == sha256(work / "export" / "model.onnx")


def test_edgetl_refuses_an_onnx_file_without_its_sidecar(run, tmp_path, capsys):
    assert exit_code(export(run, "-o", tmp_path / "m.onnx")) == 0
    capsys.readouterr()
    (tmp_path / "m.onnx.json").unlink()
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=r"sidecar .*m.onnx.json is missing: it holds the labels and preprocessing"):
        build_engine(tmp_path / "m.onnx", tmp_path / "m.engine")
    assert snapshot(tmp_path) == before
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 40, 40)).save(tmp_path / "red.png")
    out = subprocess.run([sys.executable, str(DEPLOY / "classify.py"), "--model", str(tmp_path / "m.onnx"),
                          str(tmp_path / "red.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    assert f"sidecar {tmp_path / 'm.onnx.json'} is missing" in out.stderr


# --- a read-only output folder -----------------------------------------------------------------

@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` read-only for this process: a read-only bind mount as root (root writes
    through permissions), its mode otherwise."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and no bind mount allowed here: a read-only folder cannot be made")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("root, and no read-only remount allowed here")
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_output_folder_is_one_line(run, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    work = tmp_path / "run"
    shutil.copytree(run, work)
    with read_only(ro):
        refused(export(run, "-o", ro / "m.onnx"), capsys, f"cannot write export folder {ro}", "not writable",
                watch=[run.parent, tmp_path])
        # The write itself, where the folder turned read-only after the checks: one ResourceError.
        with pytest.raises(ResourceError, match=f"cannot write {ro / 'm.onnx'}: read-only file system"
                           if os.geteuid() == 0 else f"cannot write {ro / 'm.onnx'}"):
            with StagedFiles() as stage:
                stage.tmp(ro / "m.onnx")
        assert not list(ro.iterdir())
    with read_only(work):  # the default RUN/export cannot be made in a read-only run folder
        refused(export(work), capsys, f"cannot write export folder {work / 'export'}", watch=[tmp_path])
