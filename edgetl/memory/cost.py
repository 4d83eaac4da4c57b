"""Cost types of the runtime accounting (DESIGN 2b): what one layer call holds, in bytes.

Kept apart from the simulator (``edgetl.memory.runtime``) so that the layers which
declare their own costs (``edgetl.models.lean``, ``edgetl.models.lean_side``) and the
simulator that walks a step both import this module and never each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LayerCost:
    """What one leaf layer holds, for one call. Sizes in bytes; flags refer to storages.

    Attributes:
        saves_input: backward keeps a reference to the input's storage.
        saves_output: backward keeps a reference to the output's storage.
        saved_new_bytes: tensors allocated in forward and kept for backward (clone,
            mask, statistics, a pooled copy of the input).
        inplace: the output is the input's storage (no new allocation).
        forward_temp_bytes: allocated during the call and freed before it returns
            (e.g. batch statistics when no backward is needed).
        backward_temp_bytes: extra buffers while its backward runs, beyond grad_output,
            grad_input and param grads.
        grad_input: backward allocates a gradient of the input's size when the input
            requires grad (False for ops whose input grad is a view of grad_output).
    """

    saves_input: bool = False
    saves_output: bool = False
    saved_new_bytes: int = 0
    inplace: bool = False
    forward_temp_bytes: int = 0
    backward_temp_bytes: int = 0
    grad_input: bool = True


def numel(shape) -> int:
    """Elements of a tensor of this shape."""
    return math.prod(int(s) for s in shape)


def dtype_bytes(dtype) -> int:
    """Bytes a value of ``dtype`` takes, without making a tensor (a cost rule may be asked on
    a step's path, where a storage meter would count one)."""
    return dtype.itemsize


def over(phases, final: int) -> int:
    """Extra bytes of the largest phase over what the runtime model already counts."""
    return max(0, max(phases) - final)
