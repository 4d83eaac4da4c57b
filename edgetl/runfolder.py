"""Output folders edgetl owns: checked before anything starts, locked while a run writes,
and a record of the files edgetl made there, so it never overwrites or deletes anything else.

* ``check_output_folder``: a path below a regular file, or in a folder this user cannot
  write, is one line before any work starts.
* ``Manifest``: ``.edgetl-files`` in the folder lists the names edgetl created there.
  ``claim`` refuses to write a name that exists and is not listed (the user's file), and
  records the names it will write. A run folder from an edgetl without manifests (it holds
  ``last.pt`` and no ``.edgetl-files``) is taken as edgetl's for the names edgetl writes.
* ``run_lock``: ``.edgetl.lock``, held with ``fcntl.flock`` while a run writes; a second
  run into the same folder is refused in one line. The kernel drops the lock if the process
  dies, so a killed run never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from edgetl.errors import ConfigError, ResourceError

MANIFEST = ".edgetl-files"
LOCK = ".edgetl.lock"
LEGACY_MARK = "last.pt"  # a run folder written before manifests existed


def check_output_folder(path: str | Path, what: str = "output folder") -> None:
    """Refuse, in one line, a folder that cannot be made or written: a path that is a file, a
    path below a regular file, or a folder (or the nearest existing parent) this user cannot write."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a folder; choose a folder")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"cannot make {what} {path}: {probe} is a file, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ResourceError(f"cannot write {what} {path}: {probe} is not writable by this user")


class Manifest:
    """The names edgetl made in ``folder`` (read from, and written to, its ``.edgetl-files``)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / MANIFEST
        self.names: set[str] = set()
        if self.path.is_file():
            try:
                self.names = {str(n) for n in json.loads(self.path.read_text())}
            except (ValueError, TypeError, OSError):
                raise ConfigError(f"{self.path} is damaged: it should list the files edgetl made in "
                                  f"{self.folder}; restore or remove it") from None
        self.legacy = not self.path.exists() and (self.folder / LEGACY_MARK).is_file()

    def owns(self, name: str) -> bool:
        """Whether edgetl made ``name`` here (or it does not exist: nothing to lose)."""
        return name in self.names or self.legacy or not (self.folder / name).exists()

    def claim(self, names: Iterable[str]) -> None:
        """Refuse names that exist and are not edgetl's; record the rest (before writing them)."""
        names = list(names)
        foreign = [n for n in names if not self.owns(n)]
        if foreign:
            raise ConfigError(f"{self.folder / foreign[0]} exists and edgetl did not make it: edgetl never "
                              f"overwrites files it did not create; choose another folder or move it")
        self.record(names)

    def record(self, names: Iterable[str]) -> None:
        new = set(names) - self.names
        if not new and self.path.exists():
            return
        self.names |= new
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(sorted(self.names)) + "\n")
        os.replace(tmp, self.path)


def check_not_in_use(folder: str | Path) -> None:
    """Refuse, in one line, a folder whose lock another run holds (before any work starts)."""
    if (Path(folder) / LOCK).is_file():
        with run_lock(folder, keep_file=True):
            pass


@contextlib.contextmanager
def run_lock(folder: str | Path, keep_file: bool = False) -> Iterator[Path]:
    """Hold ``folder``'s lock for the block (the folder must exist); refuse a held one in one line.
    The lock file is removed at the end unless ``keep_file``."""
    import fcntl

    path = Path(folder) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(f"{folder} is in use by another edgetl run (pid {holder}); wait for it to end "
                              f"or choose another folder") from None
        if keep_file:
            yield path
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)  # still held: no other run can have taken it meanwhile
    finally:
        os.close(fd)
