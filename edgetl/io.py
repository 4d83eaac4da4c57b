"""Atomic file writes: a path and content in, the file appearing whole (or not at all) out."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _chmod_to_umask(folder: Path) -> None:
    """mkdtemp/mkstemp make private (0700/0600) entries; give them the usual modes."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for entry in folder.rglob("*"):
        entry.chmod((0o777 if entry.is_dir() else 0o666) & ~mask)


def _tmp_beside(path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    tmp = _tmp_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | Path):
    """Parse a JSON file; a damaged one is a one-line DataError naming the file."""
    from edgetl.errors import DataError

    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is corrupted: {exc}") from None


def atomic_text_json(path: str | Path, data) -> None:
    """Write ``data`` as indented JSON, atomically."""
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def atomic_torch_save(obj, path: str | Path) -> None:
    """torch.save through a temporary file, so a killed run never leaves half a checkpoint."""
    path = Path(path)
    tmp = _tmp_beside(path)
    try:
        torch.save(obj, tmp)
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it into place when the block succeeds.

    On error the temporary folder is removed, so no half-written output folder is left.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"output folder {path} already exists; choose another or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _chmod_to_umask(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
