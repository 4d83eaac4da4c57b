"""Issue #29 item 4: run folders are owned. A path below a file is one line; a second run into
a folder in use is refused; edgetl never overwrites or removes a file it did not make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgetl.errors import ConfigError
from edgetl.runfolder import MANIFEST, Manifest, check_output_folder, run_lock
from tests.conftest import make_color_folder
from tests.test_divergence_and_data import tree_digest as digest
from tests.test_failures import backbone, error_line, exit_code, finetune_argv  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_color_folder(tmp_path_factory.mktemp("d"), 8, 4)


def test_a_run_folder_below_a_file_is_one_line(tmp_path, capsys, backbone, data):
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "notes.txt" / "run"
    assert exit_code(finetune_argv(data, out, backbone)) == 2
    assert error_line(capsys.readouterr().err) == (
        f"cannot make run folder {out}: {tmp_path / 'notes.txt'} is a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: an unwritable folder cannot be made here")
def test_an_unwritable_parent_is_one_line(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    with pytest.raises(Exception, match="is not writable by this user"):
        check_output_folder(locked / "run")


def test_the_users_files_in_the_run_folder_are_never_overwritten(tmp_path, capsys, backbone, data):
    out = tmp_path / "run"
    out.mkdir()
    (out / "recipe.yaml").write_text("my own notes\n")
    (out / "photo.jpg").write_bytes(b"\xff\xd8 mine")
    before = digest(out)
    assert exit_code(finetune_argv(data, out, backbone)) == 2  # the CLI wants a new or empty folder
    assert error_line(capsys.readouterr().err) == f"run folder {out} is not empty; use --resume or choose another -o"
    assert digest(out) == before
    (tmp_path / "file").write_text("x")
    assert exit_code(finetune_argv(data, tmp_path / "file", backbone)) == 2
    assert error_line(capsys.readouterr().err) == f"run folder {tmp_path / 'file'} is a file, not a folder; choose a folder"
    # the library's own record (what a Python caller's fit and finetune go through)
    manifest = Manifest(out)
    with pytest.raises(ConfigError, match=r"recipe.yaml exists and edgetl did not make it: edgetl never "
                                          r"overwrites files it did not create"):
        manifest.claim(["last.pt", "recipe.yaml"])
    assert digest(out) == before and not (out / MANIFEST).exists()
    (out / "recipe.yaml").unlink()
    manifest.claim(["last.pt", "recipe.yaml"])
    assert Manifest(out).names == {"last.pt", "recipe.yaml"} and Manifest(out).owns("recipe.yaml")
    assert not Manifest(out).owns("photo.jpg")


def test_a_finished_run_records_its_files_and_leaves_no_lock(tmp_path, backbone, data):
    out = tmp_path / "run"
    assert exit_code(finetune_argv(data, out, backbone)) == 0
    assert {"recipe.yaml", "metrics.csv", "last.pt", "best.pt", "model.pt", "model.json"} <= Manifest(out).names
    assert not (out / ".edgetl.lock").exists()


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, capsys, backbone, data):
    out = tmp_path / "run"
    out.mkdir()
    with run_lock(out):  # another run holds it
        assert exit_code(finetune_argv(data, out, backbone)) == 2
        assert error_line(capsys.readouterr().err) == (
            f"{out} is in use by another edgetl run (pid {os.getpid()}); wait for it to end or choose another folder")
        assert sorted(p.name for p in out.iterdir()) == [".edgetl.lock"]
    assert not any(out.iterdir())


def test_the_demo_never_removes_a_folder_it_did_not_make(tmp_path):
    import dataclasses

    from edgetl.demo import DemoReport, _claim_folder
    from edgetl.demo_jobs import Stage, _run_stage

    @dataclasses.dataclass(frozen=True)
    class Made:
        work: str

    out = tmp_path / "demo"
    (out / "pretrain").mkdir(parents=True)
    (out / "pretrain" / "thesis.tex").write_text("mine")
    manifest, report, ran = _claim_folder(out), DemoReport(out), []
    with pytest.raises(ConfigError, match="pretrain exists and edgetl did not make it"):
        _run_stage(Stage("pretrain", "t", lambda ctx, work: ran.append(work), Made), None, manifest, report,
                   lambda *a: None)
    assert not ran and (out / "pretrain" / "thesis.tex").read_text() == "mine"
    # a stage folder of its own, left by a killed stage, is started again
    def killed(ctx, work):
        work.mkdir()
        (work / "half.json").write_text("{")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run_stage(Stage("profile", "t", killed, Made), None, manifest, report, lambda *a: None)
    assert (out / "profile" / "half.json").is_file()
    _run_stage(Stage("profile", "t", lambda ctx, work: work.mkdir() or Made(str(work)), Made), None, manifest,
               report, lambda *a: None)
    assert "profile" in Manifest(out).names and (out / MANIFEST).is_file()
    assert not (out / "profile" / "half.json").exists() and report.stages["profile"] == Made(str(out / "profile"))
    # a rerun reads the stage back from its mark
    again = DemoReport(out)
    _run_stage(Stage("profile", "t", lambda ctx, work: ran.append(work), Made), None, manifest, again,
               lambda *a: None)
    assert not ran and again.stages == report.stages and again.wall_s == report.wall_s
