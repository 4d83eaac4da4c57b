"""Shared CLI helpers: argument types that reject bad values in one line, and table printing."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

from edgetl.errors import ConfigError
from edgetl.io import PNG_SOFTWARE
from edgetl.units import MB, MIB
from edgetl.units import parse_bytes


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows an option's default only when it has one: not for options whose
    default is None (resolved later, e.g. from a recipe; their help says from where) and
    not for flags that are off."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def shown(text: str, limit: int = 40) -> str:
    """``repr(text)`` cut to ``limit`` characters, so an error naming it stays one short line."""
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def positive_int(text: str) -> int:
    if len(text.strip().lstrip("+-").lstrip("0")) > 18:  # past int64; keeps int() off its 4300-digit limit
        raise argparse.ArgumentTypeError(f"{shown(text)} is too large; allowed: an integer >= 1 of at most 18 digits")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed: an integer >= 1")
    return value


def torch_device(text: str) -> str:
    """A torch device that is here: cpu, cuda or cuda:N with N below the number of GPUs torch
    sees. Checked when the command line is read, so a missing GPU is one line before any
    work (torch would fail deep inside the first CUDA call)."""
    match = re.fullmatch(r"cpu|cuda(?::([0-9]{1,3}))?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a device; allowed: cpu, cuda, cuda:N")
    if text == "cpu":
        return text
    index = match.group(1)
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available here; allowed: cpu")
    if index and int(index) >= count:
        raise argparse.ArgumentTypeError(f"{text}: torch sees {count} CUDA device{'s' * (count > 1)}; "
                                         f"allowed: cpu, cuda, cuda:0..cuda:{count - 1}")
    return text


def budget_type(text: str) -> int:
    """A memory size with a unit (edgetl.units.parse_bytes), as an argparse type."""
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OverflowError:  # 400 digits read as a float are infinite
        raise argparse.ArgumentTypeError(f"size {shown(text)} is too large; allowed: a finite size, e.g. 256MB") from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number; allowed: a finite number > 0") from None
    if not (value > 0 and math.isfinite(value)):  # nan fails the comparison; inf is no rate or width
        raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed: a finite number > 0")
    return value


def keep_type(text: str) -> float:
    """A share of coefficients to keep: a number in (0, 1] (``edgetl.models.compress.check_fraction``)."""
    from edgetl.models.compress import check_fraction

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number; allowed: a fraction in (0, 1]") from None
    try:
        return check_fraction(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def given_path(text: str) -> Path:
    """An output path as typed (a run, backbone or demo folder, an export): an empty one is
    refused, as ``Path("")`` is the working folder, which the output would then land in."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; allowed: a path")
    return Path(text)


def writable_file(text: str) -> Path:
    """An output file path whose folder exists and is writable (checked before any work)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a file path")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    parent = path.parent
    if not parent.is_dir():
        there = "is a file, not a folder" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} {there}")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: folder {parent} is not writable")
    return path


# An output file replaces an existing file only if edgetl wrote it for the same purpose (issue #41:
# edgetl never overwrites a file it did not make; `plan -o` onto a user's notes or onto the
# backbone's own backbone.json is refused before any work). Each kind is recognised by what it
# holds, read whole up to this size (a larger file is no output of these kinds).
MAX_RECOGNISED_BYTES = 64 * 2**20


def _json_with(*keys: str):
    def recognise(data: bytes) -> bool:
        try:
            value = json.loads(data.decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError):
            return False
        return isinstance(value, dict) and all(k in value for k in keys)
    return recognise


def _plan_document(data: bytes) -> bool:
    import yaml

    try:
        value = yaml.safe_load(data.decode("utf-8-sig"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(value, dict) and str(value.get("format", "")).startswith("edgetl-plan/")


def _edgetl_png(data: bytes) -> bool:
    return data.startswith(b"\x89PNG\r\n\x1a\n") and b"Software\x00" + PNG_SOFTWARE.encode() in data[:4096]


def _csv_headed(first: str):
    return lambda data: data.split(b"\n", 1)[0].decode("utf-8", "replace").startswith(first)


OUTPUT_KINDS = {  # kind -> (what it is, in messages; how edgetl's own file of that kind is recognised)
    "plan": ("an edgetl plan", _plan_document),
    "profile-json": ("an edgetl profile report", _json_with("accounting", "mode", "blocks")),
    "bench-json": ("edgetl bench results", _json_with("reference", "rows", "resolution")),
    "bench-csv": ("edgetl bench rows", _csv_headed("method,label,")),
    "png": ("an edgetl chart", _edgetl_png),
}


def output_file(kind: str):
    """An argparse type for an output file of ``kind`` (``OUTPUT_KINDS``): ``writable_file``, and
    an existing file at the path is replaced only if it is edgetl's own file of that kind."""
    what, recognise = OUTPUT_KINDS[kind]

    def check(text: str) -> Path:
        path = writable_file(text)
        if not (path.exists() or path.is_symlink()):
            return path
        try:
            ours = path.is_file() and path.stat().st_size <= MAX_RECOGNISED_BYTES and recognise(path.read_bytes())
        except OSError:
            ours = False
        if not ours:
            raise argparse.ArgumentTypeError(f"{text} exists and is not {what}; edgetl replaces only files it wrote "
                                             f"of the same kind: give another path, or move that file away")
        return path

    check.__name__ = kind  # argparse names the type in some messages
    return check


def fmt_mb(n_bytes: float | None, unit: str = "MB") -> str:
    if n_bytes is None:
        return "-"
    return f"{n_bytes / (MIB if unit == 'MiB' else MB):.2f}"


def fmt_image_check(check) -> str:
    """"images: 72 files checked in 0.01 s (header and end of each)", plus what was left out."""
    text = f"images: {check.checked} files checked in {check.seconds:.2f} s (header and end of each)"
    if check.bad:
        text += f"; {len(check.bad)} unreadable, left out (data.on_bad_image: skip)"
    return text


def fmt_side_pools(lean: dict) -> str:
    """"pool 2 (stored per side module: 2 2 1 1 1 1)": the requested k and what each side conv stores."""
    pools = lean.get("side_pools") or []
    stored = f" (stored per side module: {' '.join(map(str, pools))})" if pools else ""
    return f"pool {lean['pool']}{stored}"


def print_table(headers: list[str], rows: list[list[str]], title: str | None = None) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
