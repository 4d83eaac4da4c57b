"""Atomic file writes: a path and content in, the file appearing whole (or not at all) out.

A write that fails (full disk, read-only folder, file-size limit) raises a one-line
ResourceError naming the file, about what it needed and what is free there; the
temporary file is removed and an earlier version of the file stays as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from edgetl.errors import ResourceError
from edgetl.units import MB


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


def existing_folder(path: str | Path) -> Path:
    """``path`` itself if it is a folder, else its nearest ancestor that exists."""
    path = Path(path).absolute()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes free for this user on the filesystem that holds (or would hold) ``path``."""
    return shutil.disk_usage(existing_folder(path)).free


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` and the dicts, lists and tuples nested in it."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def tensor_bytes(obj) -> int:
    """Bytes of tensor data torch.save writes for ``obj``: each storage once, whole."""
    seen: dict[tuple, int] = {}
    for x in tensors_in(obj):
        storage = x.untyped_storage()
        seen[(storage.device.type, storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def write_error(path: Path, exc: BaseException, needed_bytes: int | None = None) -> ResourceError:
    """A one-line ResourceError for a failed write of ``path``: the cause, what it needed, what is free."""
    cause = exc if isinstance(exc, OSError) else exc.__context__
    if isinstance(cause, OSError) and cause.strerror:
        reason = cause.strerror.lower()
    else:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    free = free_bytes(path)
    need = f"about {needed_bytes / MB:.1f} MB needed, " if needed_bytes else ""
    return ResourceError(f"cannot write {path}: {reason} ({need}{free / MB:.1f} MB free in {existing_folder(path.parent)})")


def _tmp_or_error(path: Path) -> Path:
    try:
        return _tmp_beside(path)
    except OSError as exc:
        raise write_error(path, exc) from None


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    tmp = _tmp_or_error(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc, len(data)) from None
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
    """torch.save through a temporary file, so a killed run never leaves half a checkpoint.

    torch.save writes into a Python file object: a failing write then carries the OSError
    (e.g. "no space left on device") as the context of torch's own error.
    """
    path = Path(path)
    tmp = _tmp_or_error(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, RuntimeError) and not isinstance(exc.__context__, OSError):
            raise  # not a write failure
        raise write_error(path, exc, tensor_bytes(obj)) from None
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
