"""The sidecar JSON beside each exported artifact (``model.onnx.json``, ``model.engine.json``):
its format name, and the checksum that ties an engine to the ONNX file it was built from."""

from __future__ import annotations

import hashlib
from pathlib import Path

SIDECAR_FORMAT = "edgetl-export/1"


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
