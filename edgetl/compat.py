"""Which torch edgetl supports, in one place: the floor, and the release of the torch installed.

The floor is the oldest torch the project tests (the Jetson image's: NVIDIA's JetPack 6.1
wheel is torch 2.5.0a0; ``make jetson-check`` runs PyPI's 2.5.1 for aarch64 under
emulation). Behaviour that differs below a newer release is gated on ``torch_release``
where it is used (e.g. ``edgetl.models.stream``).
"""

from __future__ import annotations

import re
from importlib import metadata

from edgetl.errors import CapabilityError

TORCH_FLOOR = (2, 5)
TORCHVISION_FLOOR = (0, 20)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.5.0a0+872d972e41.nv24.08" -> (2, 5)."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if not found:
        raise ValueError(f"not a version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch installed, read without importing it."""
    return release(metadata.version("torch"))


def check_supported() -> None:
    """Refuse, in one line, a torch or torchvision older than the tested floor."""
    for name, floor in (("torch", TORCH_FLOOR), ("torchvision", TORCHVISION_FLOOR)):
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # the import that needs it says so
        if release(found) < floor:
            raise CapabilityError(f"{name} {found} is older than edgetl supports: it needs {name} >= "
                                  f"{'.'.join(map(str, floor))} (the Jetson image's torch 2.5 is the oldest tested)")
