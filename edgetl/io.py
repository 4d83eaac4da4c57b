"""Atomic file writes: a path and content in, the file appearing whole (or not at all) out.

A write that fails (full disk, read-only folder, file-size limit) raises a one-line
ResourceError naming the file, about what it needed and what is free there; the
temporary file is removed and an earlier version of the file stays as it was.

User YAML files (recipes, plans) are read through ``read_yaml``, which bounds what a file
can cost (size, nesting, no aliases) and refuses a bad one in one ConfigError line; torch
files (weights, checkpoints) through ``load_torch_file`` and ``load_state``, which say in one
DataError line what is wrong with a damaged or mismatched one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from edgetl.errors import ConfigError, DataError, ResourceError
from edgetl.units import MB
# The Software text chunk of every PNG edgetl writes: the mark by which a later command knows a
# chart is edgetl's to replace (edgetl.cli._common.output_file).
PNG_SOFTWARE = "edgetl"


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
    try:
        # utf-8-sig: a byte-order mark, as Windows editors save UTF-8, is not part of the text
        return json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is corrupted: {exc}") from None


def error_reason(exc: BaseException, limit: int = 160) -> str:
    """One short line saying why ``exc`` happened: its first non-empty line, or its type's
    name where it has no message (torch raises empty EOFError and IndexError for some
    damaged files), cut to ``limit`` characters."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    line = next((" ".join(x.split()) for x in str(exc).splitlines() if x.strip()), "")
    if line.startswith("Weights only load failed"):
        # torch's advice that follows (load with weights_only=False) is what edgetl must never do
        line = "it holds objects other than tensors and plain values, or is not a torch file"
    if not line:
        line = "the file ends before its data does" if isinstance(exc, EOFError) else type(exc).__name__
    if len(line) > limit and ". " in line:  # torch's long messages: the first sentence says it
        line = line.split(". ", 1)[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def load_torch_file(path: str | Path, what: str, map_location: str | torch.device = "cpu"):
    """``torch.load(weights_only=True)`` of a file edgetl reads: an unreadable or damaged one
    is a one-line DataError naming the file and ``what`` it should be (never code execution)."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise DataError(f"{path} is empty; allowed: {what}")
        with warnings.catch_warnings():  # torch warns about foreign pickles on stderr; the error says it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"cannot read {path}: {error_reason(exc)}") from None
    except Exception as exc:  # torch raises many types for a damaged file
        raise DataError(f"{path} is damaged or not {what}: {error_reason(exc)}") from None


def _names(keys: list[str], limit: int = 3) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_state(module: torch.nn.Module, state, path: str | Path, what: str) -> None:
    """``module.load_state_dict(state)``; a state that does not fit is one DataError line naming
    ``path``, how many entries are missing, unexpected or of another shape, and the first few."""
    if not isinstance(state, dict):
        raise DataError(f"{path} does not hold a state_dict for {what} (it holds a {type(state).__name__})")
    want = module.state_dict()
    missing = [k for k in want if k not in state]
    unexpected = [str(k) for k in state if k not in want]
    shapes = [f"{k} {tuple(state[k].shape)} for {tuple(v.shape)}" for k, v in want.items()
              if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    wrong = [k for k in want if k in state and not isinstance(state[k], torch.Tensor)]
    parts = [f"{len(missing)} missing ({_names(missing)})" if missing else "",
             f"{len(unexpected)} unexpected ({_names(unexpected)})" if unexpected else "",
             f"{len(shapes)} of another shape ({_names(shapes, 2)})" if shapes else "",
             f"{len(wrong)} not tensors ({_names(wrong)})" if wrong else ""]
    detail = "; ".join(p for p in parts if p)
    if not detail:
        try:
            module.load_state_dict(state)
            return
        except (RuntimeError, TypeError, ValueError, KeyError) as exc:
            detail = error_reason(exc)
    raise DataError(f"{path} does not fit {what}: {detail}")


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


class StagedFiles:
    """Output files written under temporary names beside their final paths, renamed into place
    only when every one of them is complete (``commit``); ``discard`` removes the temporary
    files and the folders made for them. So the files of one artifact (a model and its
    sidecar) appear together or not at all (issue #41). Used as a context manager: an
    exception (or Ctrl-C) inside the block discards.

    ``commit`` renames in the order the files were staged: stage a sidecar before its
    artifact, so a reader never finds a new artifact without a sidecar; a new sidecar beside
    an old artifact (a re-export killed between the two renames, microseconds) is refused by
    its SHA-256.
    """

    def __init__(self) -> None:
        self.tmps: dict[Path, Path] = {}  # final path -> temporary file
        self.made: list[Path] = []  # folders this made, outermost first

    def __enter__(self) -> "StagedFiles":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.discard()

    def folder(self, folder: Path) -> None:
        """Make ``folder`` and its missing parents (removed again by ``discard``)."""
        missing = []
        probe = folder
        while not probe.exists() and probe != probe.parent:
            missing.append(probe)
            probe = probe.parent
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise write_error(path, exc) from None
            self.made.append(path)

    def tmp(self, final: Path) -> Path:
        """A new empty temporary file beside ``final`` (its folder is made first)."""
        self.folder(final.parent)
        tmp = _tmp_or_error(final)
        self.tmps[final] = tmp
        return tmp

    def commit(self) -> None:
        """Rename every staged file into place, in the order they were staged."""
        mode = 0o666 & ~_umask()
        try:
            for final, tmp in list(self.tmps.items()):
                tmp.chmod(mode)  # mkstemp makes 0600 files; an exporter writing into one keeps it
                os.replace(tmp, final)
                del self.tmps[final]
        except OSError as exc:
            self.discard()
            raise write_error(final, exc) from None
        self.made = []

    def discard(self) -> None:
        for tmp in self.tmps.values():
            tmp.unlink(missing_ok=True)
        self.tmps = {}
        for folder in reversed(self.made):
            try:
                folder.rmdir()  # only if empty: never a file that appeared there meanwhile
            except OSError:
                break
        self.made = []


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


# --- safe YAML reading (issue #29) --------------------------------------------------------

MAX_YAML_BYTES = 2**20  # a recipe or plan is a few kB
MAX_YAML_DEPTH = 32  # a recipe nests 3 levels; deep nesting would exhaust the parser's recursion


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML that a user file may not contain (an alias, a repeated key, ...)."""


class YamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader for user files: refuses aliases, repeated keys and deep nesting.

    Aliases are refused outright: a few nested ones ("billion laughs") expand to a
    structure that grows exponentially once anything walks or copies it, and a recipe
    has no need for them. A repeated key would silently lose its first value. YAML 1.1
    reads ``1e-3`` (no dot) as a string; recipes mean a number.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(None, None, f"aliases (*{event.anchor}) are not allowed; write the value out",
                           event.start_mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise _Refused(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels; allowed: "
                           f"at most {MAX_YAML_DEPTH}", self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:  # unhashable: SafeConstructor refuses it below
                    continue
                if repeated:
                    raise _Refused(None, None, f"key {_short(key)} appears twice; allowed: each key once",
                                   key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:  # e.g. an integer of more than 4300 digits
            raise _Refused(None, None, f"value {_short(node.value)} cannot be read: {str(exc).split(';')[0]}",
                           node.start_mark) from None


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def yaml_loads(text: str, name: str) -> Any:
    """Parse YAML text with YamlLoader; any problem is a one-line ConfigError naming ``name`` and the line."""
    try:
        return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as exc:
        mark = exc.problem_mark
        raise ConfigError(f"{name} line {mark.line + 1}: {exc.problem}") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        char = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
        raise ConfigError(f"{name} line {line}: character {char} is not allowed in YAML "
                          "(control characters other than tab and line breaks)") from None
    except yaml.MarkedYAMLError as exc:
        problem = ", ".join(str(x) for x in (exc.context, exc.problem) if x)  # "while parsing ..., expected ..."
        problem = " ".join(problem.split())
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{name} is not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name} is not valid YAML: {' '.join(str(exc).split())}") from None


def read_yaml(path: str | Path, what: str = "YAML file", max_bytes: int = MAX_YAML_BYTES) -> dict:
    """A user's YAML file (recipe, plan) as a dict, read without writing anything.

    Refused in one ConfigError line naming the file: unreadable, over ``max_bytes``,
    binary (a NUL byte), not UTF-8, not valid YAML (with its line), aliases, repeated keys,
    nesting deeper than MAX_YAML_DEPTH, and a top level that is not a mapping.

    Args:
        path: the file.
        what: what the file is, for messages ("recipe", "plan").
        max_bytes: largest file accepted.
    """
    path = Path(path)
    name = f"{what} {path}"
    from edgetl.data.files import NotAFileError, open_regular  # a FIFO is never waited on

    try:
        with open_regular(path) as f:
            data = f.read(max_bytes + 1)
    except NotAFileError as exc:
        raise ConfigError(f"cannot read {name}: it is {exc}; allowed: a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {name}: {(exc.strerror or str(exc)).lower()}") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{name} is larger than {max_bytes} bytes; allowed: at most {max_bytes} bytes "
                          f"({max_bytes / 2**20:g} MiB)")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{name} is a binary file (NUL byte at offset {nul}); allowed: YAML text in UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                          "allowed: YAML text in UTF-8") from None
    value = yaml_loads(text, name)
    if value is None:
        raise ConfigError(f"{name} is empty; allowed: a mapping of keys to values")
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: the top level must be a mapping of keys to values, "
                          f"got {type(value).__name__} {_short(value)}")
    return value
