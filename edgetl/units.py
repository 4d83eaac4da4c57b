"""Byte sizes: text such as "256MB" or "1.5GiB" in, a whole number of bytes out (MB = 10^6)."""

from __future__ import annotations

import re

from edgetl.errors import ConfigError

MB = 10**6  # every report's unit (MiB where a report says so)
MIB = 2**20
UNITS = {
    "B": 1,
    "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_bytes(text: str) -> int:
    """Parse a size with a unit: B, kB/KB, MB, GB (powers of 10) or KiB, MiB, GiB (powers of 2).

    A bare number or an unknown unit is an error: "256" could mean MB or MiB.
    """
    match = _PATTERN.match(str(text))
    allowed = ", ".join(UNITS)
    if not match:
        if re.match(r"^\s*[0-9.]+\s*$", str(text)):
            raise ConfigError(f"size {text!r} has no unit; write e.g. {text.strip()}MB (units: {allowed})")
        raise ConfigError(f"size {text!r} is not a number with a unit, e.g. 256MB (units: {allowed})")
    number, unit = match.groups()
    if unit not in UNITS:
        hint = next((u for u in UNITS if u.lower() == unit.lower()), None)
        extra = f"; did you mean {hint}?" if hint else ""
        raise ConfigError(f"unknown unit {unit!r} in {text!r}; allowed: {allowed}{extra}")
    value = float(number) * UNITS[unit]
    if value < 1:
        raise ConfigError(f"size {text!r} is below one byte; give a positive size")
    return int(value)


def format_bytes(n_bytes: float, unit: str = "MB") -> str:
    return f"{n_bytes / UNITS[unit]:.2f} {unit}"


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-int(value) // multiple) * multiple
