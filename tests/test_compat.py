"""The supported torch range: versions parsed as NVIDIA and PyPI spell them, the floor refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgetl import compat
from edgetl.cli import main as cli_main
from edgetl.errors import CapabilityError

ROOT = Path(__file__).resolve().parents[1]


def test_release_reads_every_spelling():
    assert compat.release("2.5.0a0+872d972e41.nv24.08") == (2, 5)  # NVIDIA's JetPack 6.1 wheel
    assert compat.release("2.14.1+cu130") == (2, 14)
    assert compat.release("0.20.1") == (0, 20)
    with pytest.raises(ValueError):
        compat.release("main")


def test_pyproject_states_the_floor():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+)
    assert f'"torch>={".".join(map(str, compat.TORCH_FLOOR))}",' in text
    assert f'"torchvision>={".".join(map(str, compat.TORCHVISION_FLOOR))}",' in text


def test_an_older_torch_is_refused_in_one_line(monkeypatch, capsys):
    versions = {"torch": "2.4.1", "torchvision": "0.19.1"}
    monkeypatch.setattr(compat.metadata, "version", lambda name: versions[name])
    with pytest.raises(CapabilityError, match=r"torch 2\.4\.1 .* torch >= 2\.5"):
        compat.check_supported()
    assert cli_main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch >= 2.5" in err and "Traceback" not in err
    versions.update(torch="2.5.0a0+872d972e41.nv24.08", torchvision="0.20.0")
    compat.check_supported()  # the Jetson image's versions pass
