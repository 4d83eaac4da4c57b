"""Budget sizes: units are powers of 10 (MB) or of 2 (MiB); anything else is refused."""

import pytest

from edgetl.errors import ConfigError
from edgetl.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("256MB", 256_000_000), ("256 MB", 256_000_000), ("1GB", 10**9), ("1.5GiB", 3 * 2**29),
    ("512KiB", 524_288), ("10kB", 10_000), ("10KB", 10_000), ("100B", 100), ("64MiB", 67_108_864),
])
def test_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, needle", [
    ("256", "has no unit"), ("256Mb", "did you mean MB"), ("256 XB", "unknown unit"),
    ("MB", "not a number"), ("-5MB", "not a number"), ("0MB", "below one byte"), ("", "not a number"),
])
def test_bad_sizes(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_bytes(text)


def test_format():
    assert format_bytes(50_027_320) == "50.03 MB"
    assert format_bytes(2**20, "MiB") == "1.00 MiB"
