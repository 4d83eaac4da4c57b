"""Device presets: a device name in, what it adds around the training tensors out (CUDA context,
allocator slack, the OS share)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgetl.errors import ConfigError
from edgetl.memory.cuda import JETSON_ORIN


@dataclass(frozen=True)
class DevicePreset:
    """What a device adds around the training tensors.

    Attributes:
        name: preset name.
        memory_bytes: device memory (shared by CPU and GPU on Jetson); None if unknown.
        cuda_context_bytes: CUDA context of a torch process (DESIGN 2c: ~300 MB on Jetson).
        allocator_slack: extra the caching allocator reserves beyond live tensors
            (segment rounding, fragmentation), as a fraction of the tensor peak; an assumption
            to replace by ``max_memory_reserved / max_memory_allocated`` measured on the device.
        os_share: share of the device memory the OS, desktop and page cache keep
            (edgetl.doctor keeps 25 % of MemAvailable free).
        capability: the GPU's compute capability where the device has one (finetune captures
            the step as CUDA graphs there, and a plan counts what they reserve); None: no GPU known.
    """

    name: str
    memory_bytes: int | None = None
    cuda_context_bytes: int = 0
    allocator_slack: float = 0.0
    os_share: float = 0.0
    capability: tuple[int, int] | None = None

    def overheads(self, tensor_bytes: int) -> dict[str, int]:
        """Process memory beyond ``tensor_bytes`` of live tensors, one line per cause."""
        lines = {}
        if self.cuda_context_bytes:
            lines["CUDA context"] = self.cuda_context_bytes
        if self.allocator_slack:
            lines[f"allocator slack ({self.allocator_slack:.0%} of tensors)"] = int(
                math.ceil(tensor_bytes * self.allocator_slack))
        return lines

    def process_limit_bytes(self) -> int | None:
        """What the device leaves for one process once the OS share is kept free."""
        if self.memory_bytes is None:
            return None
        return int(self.memory_bytes * (1 - self.os_share))

    def tensor_budget(self, process_bytes: int) -> int:
        """Largest tensor peak whose process total (tensors + overheads) is <= ``process_bytes``."""
        room = process_bytes - self.cuda_context_bytes
        return max(0, int(room / (1 + self.allocator_slack)))


def _doctor_constants() -> tuple[int, float]:
    from edgetl.doctor import BUDGET_HEADROOM, CUDA_CONTEXT_BYTES

    return CUDA_CONTEXT_BYTES, BUDGET_HEADROOM


_CTX, _HEADROOM = _doctor_constants()
DEVICES = {
    "none": DevicePreset("none"),
    "orin-nano-8gb": DevicePreset("orin-nano-8gb", 8 * 2**30, _CTX, 0.10, _HEADROOM, JETSON_ORIN),
    "orin-nano-4gb": DevicePreset("orin-nano-4gb", 4 * 2**30, _CTX, 0.10, _HEADROOM, JETSON_ORIN),
}


def device_preset(name: str) -> DevicePreset:
    if name not in DEVICES:
        raise ConfigError(f"unknown device {name!r}; allowed: {', '.join(DEVICES)}")
    return DEVICES[name]

