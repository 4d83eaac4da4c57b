"""Memory report: the data object every accounting returns, printable and saved as JSON.

Per-block figures are for one image (as the paper's Figure 1); totals are for the batch.
All sizes are bytes; MB = 10^6 bytes, MiB = 2^20 bytes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from edgetl.io import atomic_write_text
from edgetl.units import MB, MIB


@dataclass
class BlockMemory:
    """One block: temporary, cumulative gradient (stored) and peak memory, one image."""

    index: int
    name: str
    tmp_bytes: int
    cugrd_bytes: int
    peak_bytes: int


@dataclass
class MemoryReport:
    accounting: str
    mode: str
    resolution: int
    batch_size: int
    num_classes: int
    blocks: list[BlockMemory]
    peak_activation_bytes: int
    param_bytes: int
    total_bytes: int
    sensitive_blocks: list[int]
    breakdown: dict[str, int] = field(default_factory=dict)
    backbone: dict = field(default_factory=dict)
    runtime: str = "stock"
    lean: dict | None = None
    measured_peak_bytes: int | None = None
    # runtime accounting of a lean network: the step's schedule (``Schedule.to_dict``) and
    # the aten ops one step dispatches ({"forward", "backward", "optimizer"}: GPU launches)
    schedule: dict | None = None
    step_ops: dict | None = None

    @property
    def stored_bytes(self) -> int:
        """Cumulative gradient memory at the end of the network (one image)."""
        return self.blocks[-1].cugrd_bytes if self.blocks else 0

    def block(self, index: int) -> BlockMemory:
        for b in self.blocks:
            if b.index == index:
                return b
        raise KeyError(f"no block {index} in the report")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for optional in ("measured_peak_bytes", "schedule", "step_ops"):
            if data[optional] is None:
                data.pop(optional)
        return data

    def save_json(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryReport":
        data = dict(data)
        data["blocks"] = [BlockMemory(**b) for b in data["blocks"]]
        return cls(**data)
