"""Issue #41 item 3: failures the environment causes end in one line and exit 2 at the one place
every command passes through (a closed pipe, a full standard output, a device that is not
there, a damaged weights file); issue #43 item 4: the program, not the library, sets passive
OpenMP waiting before torch loads."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from edgetl.errors import DataError
from edgetl.io import load_state, load_torch_file, read_json
from edgetl.models.backbone import BackboneSpec, build_backbone, load_backbone, save_backbone
from tests.test_failures import exit_code

ROOT = Path(__file__).resolve().parents[1]
# a command that prints a few kB quickly and reads nothing: the paper accounting of a small network
PRINTS = ["profile", "--width", "0.35", "--resolution", "64", "--batch-size", "2"]


def one_line(err: str) -> str:
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def edgetl(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    return subprocess.run([sys.executable, "-m", "edgetl", *argv], cwd=ROOT, env=env, **kwargs)


# --- standard output --------------------------------------------------------------------------


def test_a_closed_pipe_is_one_line_and_exit_2():
    """`edgetl profile ... | head -0`: the reader is gone before edgetl writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = edgetl(*PRINTS, stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr) == ("edgetl: error: standard output was closed before edgetl finished "
                                     "writing (a closed pipe)")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_standard_output_is_one_line_and_exit_2():
    with open("/dev/full", "w") as full:
        proc = edgetl(*PRINTS, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr) == "edgetl: error: cannot write standard output: no space left on device"


def test_the_same_command_with_a_reader_prints_its_table():
    """The control: the command above is not failing for another reason."""
    proc = edgetl(*PRINTS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "sensitive blocks" in proc.stdout and len(proc.stdout) > 1000


def test_an_os_error_no_stage_caught_is_one_line(monkeypatch, capsys):
    """A read-only or vanished destination a stage did not anticipate: one line naming it."""
    from edgetl.cli import profile as stage

    def raises(args):
        raise PermissionError(13, "Permission denied", "/somewhere/report.json")

    monkeypatch.setattr(stage, "run", raises)
    assert exit_code(PRINTS) == 2
    assert one_line(capsys.readouterr().err) == "edgetl: error: cannot use /somewhere/report.json: permission denied"


# --- devices -----------------------------------------------------------------------------------

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")


@needs_no_gpu
@pytest.mark.parametrize("argv", [
    ["profile", "--measure", "--device", "cuda"],
    ["finetune", "--recipe", "imagefolder", "--data", "DATA", "--device", "cuda", "-o", "OUT"],
    ["bench", "--quick", "--device", "cuda:0", "-o", "OUT"],
    ["demo", "--device", "cuda", "-o", "OUT"],
], ids=["profile", "finetune", "bench", "demo"])
def test_a_gpu_that_is_not_there_is_refused_before_any_work(argv, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(out) if a == "OUT" else str(tmp_path) if a == "DATA" else a for a in argv]
    assert exit_code(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.endswith("argument --device: cuda: no CUDA device is available here; allowed: cpu (see --help)") \
        or line.endswith("argument --device: cuda:0: no CUDA device is available here; allowed: cpu (see --help)")
    assert not out.exists()


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0", "cuda:", "CUDA", "cuda:1234"])
def test_a_device_that_is_no_device_is_refused(device, capsys):
    assert exit_code(["profile", "--measure", "--device", device]) == 2
    assert f"argument --device: {device!r} is not a device; allowed: cpu, cuda, cuda:N" in one_line(
        capsys.readouterr().err)


def test_profile_refuses_a_device_it_would_not_use(capsys):
    """--device is --measure's; without --measure it would be silently ignored."""
    assert exit_code(["profile", "--device", "cpu"]) == 2
    assert one_line(capsys.readouterr().err) == ("edgetl: error: --device cpu is the device of --measure; "
                                                  "add --measure, or drop --device")


# --- damaged weights ---------------------------------------------------------------------------


def _zip_with(good: bytes, change) -> bytes:
    src, buf = zipfile.ZipFile(io.BytesIO(good)), io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for name in src.namelist():
            out.writestr(name, change(name, src.read(name)))
    return buf.getvalue()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


DAMAGE = {
    "empty": (lambda good: b"", "is empty; allowed: a state_dict"),
    "one byte": (lambda good: b"x", "is damaged or not a state_dict: it holds objects other than tensors"),
    "truncated": (lambda good: good[: len(good) // 2], "is damaged or not a state_dict: PytorchStreamReader failed"),
    "empty pickle": (lambda good: _zip_with(good, lambda n, d: b"" if n.endswith("data.pkl") else d),
                     "is damaged or not a state_dict: the file ends before its data does"),
    "short storage": (lambda good: _zip_with(good, lambda n, d: d[:4] if n.endswith("data/0") else d),
                      "is damaged or not a state_dict: record size (4 bytes) does not match"),
    "plain pickle": (lambda good: pickle.dumps(3), "is damaged or not a state_dict: Invalid magic number"),
    "a list": (lambda good: _saved([1, 2]), "does not hold a state_dict for the network backbone.json "
                                            "describes (it holds a list)"),
    "other keys": (lambda good: _saved({"a": torch.zeros(1)}), "does not fit the network backbone.json "
                                                                "describes: 314 missing (features.0.0.weight, "
                                                                "features.0.1.weight, features.0.1.bias and 311 "
                                                                "more); 1 unexpected (a)"),
}


@pytest.fixture(scope="module")
def backbone_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("backbone")
    save_backbone(folder, build_backbone(BackboneSpec(width=0.35, num_classes=3)))
    return folder


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_weights_file_is_one_short_line(damage, backbone_folder, tmp_path):
    """Each way a weights file can be damaged names the file and the cause in one line of at
    most 300 characters (an empty message from torch used to fail building the message)."""
    make, expected = DAMAGE[damage]
    folder = tmp_path / "bb"
    folder.mkdir()
    (folder / "backbone.json").write_bytes((backbone_folder / "backbone.json").read_bytes())
    (folder / "backbone.pt").write_bytes(make((backbone_folder / "backbone.pt").read_bytes()))
    with pytest.raises(DataError) as caught:
        load_backbone(folder)
    message = str(caught.value)
    assert message == f"{folder / 'backbone.pt'} {expected}" or message.startswith(f"{folder / 'backbone.pt'} {expected}")
    assert "\n" not in message and len(message) <= 300 + len(str(folder))
    assert "weights_only=False" not in message  # torch's advice is what edgetl must never do


def test_a_damaged_backbone_through_the_cli_is_one_line_and_changes_nothing(backbone_folder, tmp_path, capsys):
    folder = tmp_path / "bb"
    folder.mkdir()
    (folder / "backbone.json").write_bytes((backbone_folder / "backbone.json").read_bytes())
    (folder / "backbone.pt").write_bytes(b"")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    out = tmp_path / "pruned"
    assert exit_code(["prune", "--checkpoint", str(folder), "--ratios", "0.3", "--blocks", "2",
                      "--resolution", "64", "-o", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == f"edgetl: error: {folder / 'backbone.pt'} is empty; allowed: a state_dict"
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before
    assert not out.exists()


def test_a_state_that_fits_loads_and_one_of_another_shape_is_named(tmp_path):
    net = build_backbone(BackboneSpec(width=0.35, num_classes=3))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    other = build_backbone(BackboneSpec(width=0.35, num_classes=3))
    load_state(other, state, tmp_path / "w.pt", "the network")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())
    state["classifier.1.weight"] = torch.zeros(5, 3)
    with pytest.raises(DataError, match=r"w.pt does not fit the network: 1 of another shape "
                                        r"\(classifier.1.weight \(5, 3\) for \(3, 1280\)\)$"):
        load_state(other, state, tmp_path / "w.pt", "the network")


def test_an_unreadable_torch_file_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"cannot read .*folder.pt: is a directory$"):
        (tmp_path / "folder.pt").mkdir()
        load_torch_file(tmp_path / "folder.pt", "a checkpoint")


# --- unusual but valid text --------------------------------------------------------------------


def test_json_with_a_byte_order_mark_and_crlf_reads_as_without(tmp_path):
    plain, marked = tmp_path / "plain.json", tmp_path / "marked.json"
    document = {"format": "x/1", "labels": ["a", "b"]}
    plain.write_text(json.dumps(document, indent=2))
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps(document, indent=2).replace("\n", "\r\n").encode())
    assert read_json(marked) == read_json(plain) == document


# --- the threading policy (issue #43 item 4) ---------------------------------------------------

PROBE = ("import os, sys; from edgetl.cli import entry; sys.argv = ['edgetl', '--version']\n"
         "try:\n    entry()\nexcept SystemExit:\n    pass\n"
         "import torch; print(os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads())")
OPENMP = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")


def _probe(code: str, **env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in OPENMP}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout.split()[-2:]  # after the version line


def test_the_program_waits_passively_leaves_a_core_and_the_library_import_sets_nothing():
    cores = len(os.sched_getaffinity(0))
    # torch's own count of its threads, read after the program set the policy before loading it
    assert _probe(PROBE) == ["PASSIVE", str(max(1, cores - 1))]
    assert _probe(PROBE, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="2") == ["ACTIVE", "2"]  # the user's are kept
    library = ("import os, edgetl, edgetl.cli, edgetl.step, edgetl.finetune; "
               "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('OMP_NUM_THREADS'))")
    assert _probe(library) == ["None", "None"]


# --- outputs replace only edgetl's own files of the same kind (issue #41 item 2) -----------------

PROFILE = ["profile", "--width", "0.35", "--resolution", "64", "--batch-size", "2"]


@pytest.mark.parametrize("flag, name, kind", [
    ("--json", "report.json", "an edgetl profile report"),
    ("--plot", "chart.png", "an edgetl chart"),
])
@pytest.mark.parametrize("theirs", [b"my notes\n", b'{"accounting": 1}', b"\x89PNG\r\n\x1a\nnot ours", b""],
                         ids=["text", "other-json", "other-png", "empty"])
def test_an_output_onto_a_file_edgetl_did_not_write_is_refused_before_any_work(flag, name, kind, theirs,
                                                                                 tmp_path, capsys):
    target = tmp_path / name
    target.write_bytes(theirs)
    assert exit_code([*PROFILE, flag, str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the profile ran
    assert one_line(captured.err).endswith(
        f"argument {flag}: {target} exists and is not {kind}; edgetl replaces only files it wrote of the same "
        f"kind: give another path, or move that file away (see --help)")
    assert target.read_bytes() == theirs and sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_outputs_onto_the_commands_own_earlier_outputs_are_replaced(tmp_path, capsys):
    report, chart = tmp_path / "report.json", tmp_path / "chart.png"
    assert exit_code([*PROFILE, "--json", str(report), "--plot", str(chart)]) == 0
    assert b"Software\x00edgetl" in chart.read_bytes()[:4096]  # the mark a later run recognises
    first = json.loads(report.read_text())
    assert exit_code([*PROFILE, "--resolution", "96", "--json", str(report), "--plot", str(chart)]) == 0
    assert json.loads(report.read_text())["resolution"] == 96 != first["resolution"]
    # a chart is not a report, nor a report a chart: each kind replaces only its own
    assert exit_code([*PROFILE, "--json", str(chart)]) == 2
    assert exit_code([*PROFILE, "--plot", str(report)]) == 2
    capsys.readouterr()


def test_a_symlink_at_an_output_path_is_replaced_only_if_it_leads_to_edgetls_file(tmp_path, capsys):
    mine = tmp_path / "mine.json"
    mine.write_text('{"keep": true}')
    (tmp_path / "link.json").symlink_to(mine)
    assert exit_code([*PROFILE, "--json", str(tmp_path / "link.json")]) == 2
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    assert exit_code([*PROFILE, "--json", str(tmp_path / "dangling.json")]) == 2
    assert mine.read_text() == '{"keep": true}' and not (tmp_path / "nowhere.json").exists()
    capsys.readouterr()


def test_an_empty_output_path_is_refused(capsys):
    assert exit_code([*PROFILE, "--json", ""]) == 2
    assert one_line(capsys.readouterr().err).endswith("argument --json: an empty path; give a file path (see --help)")


def test_a_working_folder_that_was_deleted_is_one_line(tmp_path):
    program = Path(sys.executable).parent / "edgetl"
    if not program.exists():
        pytest.skip("the edgetl console script is not installed beside this Python")
    script = f"mkdir gone && cd gone && rmdir ../gone && exec {program} plan --budget 256MB"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr) == ("edgetl: error: the working folder no longer exists (deleted or unmounted); "
                                     "cd to a folder that exists")


@pytest.mark.parametrize("argv", [
    ["prune", "--ratios", "0.3", "--blocks", "2", "-o", ""],
    ["retrain", "--backbone", "mobilenet_v2", "-o", ""],
    ["finetune", "--recipe", "imagefolder", "-o", ""],
    ["demo", "-o", " "],
    ["export", "--run", "RUN", "-o", ""],
], ids=["prune", "retrain", "finetune", "demo", "export"])
def test_an_empty_output_path_is_refused_by_every_command(argv, capsys, tmp_path, monkeypatch):
    """Path("") is the working folder: an output there would land among the user's files."""
    monkeypatch.chdir(tmp_path)
    assert exit_code(argv) == 2
    assert one_line(capsys.readouterr().err).endswith("an empty path; allowed: a path (see --help)")
    assert list(tmp_path.iterdir()) == []
