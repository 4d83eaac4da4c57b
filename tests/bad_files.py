"""Real damaged image files, made the way they happen: a copy cut short, a flipped bit, a foreign file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def image_bytes(fmt: str, size: int = 32, seed: int = 0) -> bytes:
    """A noisy RGB image encoded as ``fmt`` (JPEG, PNG, BMP, WEBP, PPM)."""
    px = np.random.default_rng(seed).integers(0, 256, (size, size, 3)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format=fmt)
    return buf.getvalue()


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut the file short, as an interrupted copy or download leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_png_data(path: Path) -> None:
    """Flip one byte inside the first IDAT chunk: header and end stay intact, the data is broken.

    Such a file passes the header-and-end check and fails only when decoded (in a loader
    worker, during training).
    """
    data = bytearray(path.read_bytes())
    i = data.index(b"IDAT")
    data[i + 40] ^= 0xFF
    path.write_bytes(bytes(data))
