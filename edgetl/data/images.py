"""Image files: a path in, whether the file looks whole (else what is wrong, in a few words) out.

A header and end-of-file check cheap enough to run on every file before training, and the
one-line ``BadImageError`` a file that fails to decode raises, even from a DataLoader worker.
"""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from edgetl.data.files import open_regular
from edgetl.errors import DataError


class BadImageError(DataError):
    """An image file that cannot be read or decoded; the message names the file and the fault.

    A DataLoader worker's exception comes back to the main process rebuilt as
    ``type(text)``, where text is "Caught ... Original Traceback ..." ending in this
    class's own line; the constructor keeps only that line, so the user sees one line.
    """

    def __init__(self, message: str):
        marker = f"{__name__}.{type(self).__qualname__}: "
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


def bad_image_error(path, fault: str) -> BadImageError:
    exc = BadImageError(f"cannot read image {path}: {fault}; fix or remove it, or set data.on_bad_image: skip")
    exc.path, exc.fault = str(path), fault
    return exc


def image_fault(exc: BaseException) -> str:
    """What is wrong with a file, in a few words, from the exception reading it raised."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image file Pillow can read"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, OSError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
# bytes per pixel of raw-coded rows (PPM/PGM/TGA...) when the format does not give a stride
_RAW_BYTES = {"L": 1, "P": 1, "LA": 2, "I;16": 2, "I;16B": 2, "RGB": 3, "BGR": 3, "RGBA": 4, "RGBX": 4, "CMYK": 4}


def _end_looks_whole(f, img: Image.Image, size: int) -> bool:
    """Whether the file's last bytes are what its format ends with (a cheap truncation test).

    JPEG ends with the EOI marker, PNG with its IEND chunk, WebP is as long as its RIFF
    header says, a raw-coded image (BMP, PPM, ...) holds its rows. Other formats: True
    (their header was read). False is a suspicion only: the caller decodes to confirm.
    """
    fmt = img.format
    if fmt == "JPEG":
        f.seek(max(0, size - 64))
        return f.read().rstrip(b"\x00\r\n\t ").endswith(b"\xff\xd9")
    if fmt == "PNG":
        f.seek(max(0, size - len(_PNG_END)))
        return f.read() == _PNG_END
    if fmt == "WEBP":
        f.seek(4)
        return int.from_bytes(f.read(4), "little") + 8 <= size
    tile = getattr(img, "tile", None) or []
    if len(tile) == 1 and tile[0][0] == "raw":
        _, (x0, y0, x1, y1), offset, args = tile[0]
        rawmode, stride = (args, 0) if isinstance(args, str) else (args[0], args[1] if len(args) > 1 else 0)
        if not stride:
            if rawmode == "1":
                stride = -(-(x1 - x0) // 8)
            elif rawmode in _RAW_BYTES:
                stride = (x1 - x0) * _RAW_BYTES[rawmode]
        if stride > 0:
            return offset + stride * (y1 - y0) <= size
    return True


def check_image_file(path: str | Path) -> str | None:
    """None if the image file looks whole, else what is wrong with it.

    Reads the header (format, size) and the end of the file (``_end_looks_whole``); only a
    file whose end looks wrong is decoded in full, so a good file costs one open and two
    small reads. An entry that is not a file (a dangling symlink, a FIFO) is named, not
    opened (``open_regular``).
    """
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return "the file is empty"
            with Image.open(f) as img:
                width, height = img.size
                if width < 1 or height < 1:
                    return f"its header says {width}x{height} pixels"
                if _end_looks_whole(f, img, size):
                    return None
        with open_regular(path) as f, Image.open(f) as img:
            img.load()
        return None
    except MemoryError:
        raise
    except Exception as exc:  # Pillow raises many types for damaged files
        return image_fault(exc)
