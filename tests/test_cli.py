"""The ``edgetl`` entry point: a command builds only its own stage's parser."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edgetl.cli import COMMANDS, _command_of, main


@pytest.mark.parametrize("argv,command", [
    (["plan", "--budget", "1GB"], "plan"),
    (["-v", "doctor"], "doctor"),
    (["--help"], None),
    (["nosuch"], None),
    ([], None),
])
def test_command_of(argv, command):
    assert _command_of(argv) == command


def test_a_command_imports_only_its_own_stage():
    """``edgetl doctor`` does not import the other stages (nor torch, through them)."""
    code = (
        "import sys\n"
        "from edgetl.cli import build_parser, _command_of\n"
        "build_parser(only=_command_of(['-v', 'doctor']))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('edgetl.cli.') or m == 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "edgetl.cli.doctor" in out
    assert not [m for m in out if m in {f"edgetl.cli.{c}" for c in COMMANDS if c != "doctor"}], out
    assert "torch" not in out


def test_unknown_command_lists_every_stage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["nosuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(f"'{c}'" in err for c in COMMANDS)
