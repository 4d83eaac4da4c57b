"""Entries on disk: a path in, what it is when it is not a readable file (a dangling symlink, a
FIFO, ...) out; and a user's small text file (labels.txt, CUB's tables) in, its lines out.

A data folder may hold entries that cannot be read as files: a symlink whose target is gone
(an unmounted card), a FIFO, a socket, a device. They are named, never passed over in
silence, and never opened the usual way: opening a FIFO for reading waits for a writer
forever, so ``open_regular`` opens without blocking and looks at what it got first.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from edgetl.errors import DataError

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotAFileError(OSError):
    """An entry that is not a readable regular file; the message says what it is instead."""


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "a special file")


def entry_fault(path: str | Path) -> str | None:
    """None if ``path`` is (or links to) a regular file, else what it is, in a few words:
    "a symlink to /media/card/x.jpg, which does not exist", "a FIFO (named pipe)", "a folder".
    Nothing is opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a symlink to {os.readlink(path)}, which does not exist"
        return "no such file or directory"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop (its links lead back to themselves)"
        return f"an entry that cannot be examined ({(exc.strerror or str(exc)).lower()})"
    return _kind(mode)


def open_regular(path: str | Path) -> BinaryIO:
    """``open(path, "rb")`` for a regular file (or a symlink to one); anything else raises
    ``NotAFileError`` saying what it is, without waiting on it (a FIFO, a device)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        fault = entry_fault(path) if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO) else None
        if fault in (kind for _, kind in _KINDS):  # a socket refuses open() with ENXIO
            fault = f"{fault}, not a file"
        raise NotAFileError(fault or (exc.strerror or str(exc)).lower()) from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise NotAFileError(f"{kind}, not a file")
    return os.fdopen(fd, "rb")


def read_text_lines(path: str | Path, what: str) -> list[str]:
    """The lines of a user's text file: UTF-8 with or without a byte-order mark (as Windows
    editors save it), LF or CRLF line ends; each line as written, less its end.

    Args:
        what: what the file holds, for messages ("one class name a line").

    Raises:
        DataError: the file cannot be read, is not a file, is binary or is not UTF-8.
    """
    try:
        with open_regular(path) as f:
            data = f.read()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc if isinstance(exc, NotAFileError) else (exc.strerror or exc)}; "
                        f"expected a text file, {what}") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(f"{path} is UTF-16 text; allowed: UTF-8 text (with or without a byte-order mark), {what}")
    nul = data.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path} is a binary file (NUL byte at offset {nul}); expected a text file, {what}")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                        f"allowed: UTF-8 text, {what}") from None
    return text.splitlines()
