"""Cost types of the runtime accounting (DESIGN 2b): what one layer call holds, in bytes,
and the execution settings a layer offers the step's schedule.

Kept apart from the simulator (``edgetl.memory.runtime``) so that the layers, whose loops
over samples go through ``repeated`` (``edgetl.models.lean``, ``edgetl.models.compress``) and
which declare their settings (``Tunable``), and the accounting that measures and schedules
them both import this module and never each other.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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

    def keeps_input(self, i: int) -> bool:
        """Whether backward keeps a reference to the storage of tensor input ``i`` (a layer: its
        first)."""
        return self.saves_input and i == 0

    def passes_grad(self, i: int) -> bool:
        """Whether tensor input ``i``'s gradient is grad_output itself (no new buffer)."""
        return not self.grad_input


@dataclass
class FunctionCost(LayerCost):
    """What one call of a function between leaves holds (an add, a view, a cast, an
    interpolation: ``edgetl.memory.leaf.function_cost``), per tensor input where a function
    of several tensors differs from a layer.

    Attributes:
        inputs_kept: per tensor input: backward keeps a reference to its storage.
        inputs_passed: per tensor input: its gradient is grad_output itself.
    """

    inputs_kept: tuple[bool, ...] = ()
    inputs_passed: tuple[bool, ...] = ()

    def keeps_input(self, i: int) -> bool:
        return self.inputs_kept[i]

    def passes_grad(self, i: int) -> bool:
        return self.inputs_passed[i]


def numel(shape) -> int:
    """Elements of a tensor of this shape."""
    return math.prod(int(s) for s in shape)


def dtype_bytes(dtype) -> int:
    """Bytes a value of ``dtype`` takes, without making a tensor (a cost rule may be asked on
    a step's path, where a storage meter would count one)."""
    return dtype.itemsize


class Passes:
    """While a leaf is measured (``edgetl.memory.leaf``): how many passes of each repeated
    loop run (None: all), and whether a loop was cut short."""

    limit: int | None = None
    cut = False


def repeated(passes: range) -> range:
    """The passes of a loop whose every pass allocates and frees the same or less than the
    first ones, nothing carried from one pass to the next (one sample, one chunk, one part
    of a batch; a last, shorter chunk). A layer loops ``for i in repeated(range(...))``.

    Run for real, it is ``passes``. While a leaf's cost is measured on meta
    (``edgetl.memory.leaf``), only the first few passes run: the peak and what the call keeps
    are the same after 2 passes as after all of them, so the measurement of a batch of
    hundreds of samples takes as long as one of two (the measurement checks that with 3 passes
    once per layer and input layout)."""
    if Passes.limit is None or len(passes) <= Passes.limit:
        return passes
    Passes.cut = True
    return passes[:Passes.limit]


def over(phases, final: int) -> int:
    """Extra bytes of the largest phase over what the runtime model already counts."""
    return max(0, max(phases) - final)


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class CallShape:
    """One call of a leaf in the simulated step: what its settings may depend on."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    input_requires_grad: bool
    output_requires_grad: bool


@dataclass(frozen=True)
class Setting:
    """One way a leaf can run a call, and its candidates (``Tunable.settings``).

    Attributes:
        name: the key in the layer's ``execution`` ("backward", "mask_chunk", "weight").
        candidates: least memory first; ``candidates[0]`` is the default, the one a layer
            with no choice runs.
        moment: whose temporaries it moves: "forward", "backward" or "both".
        bisect: memory grows along the candidates (a chunk size 1..n), so the last one that
            fits is found by bisection; otherwise they are tried from the last down.
        every_shape: the choice holds for every call of the layer (keyed ``None`` in its
            ``execution``), not only calls of the output shape it was fitted at.
    """

    name: str
    candidates: tuple[Hashable, ...]
    moment: str
    bisect: bool = False
    every_shape: bool = False

    def __post_init__(self) -> None:
        if self.moment not in ("forward", "backward", "both"):
            raise ValueError(f"a setting's moment is forward, backward or both, not {self.moment!r}")
        if not self.candidates:
            raise ValueError(f"setting {self.name!r} has no candidates")

    @property
    def default(self) -> Hashable:
        return self.candidates[0]

    @property
    def moments(self) -> tuple[str, ...]:
        return ("forward", "backward") if self.moment == "both" else (self.moment,)


# out shape (None: every call) -> setting name -> chosen candidate; an absent one is its default
Execution = Mapping[tuple[int, ...] | None, Mapping[str, Hashable]]


@runtime_checkable
class Tunable(Protocol):
    """A leaf layer whose execution the step's schedule chooses (``edgetl.memory.schedule``):
    it declares its settings per call, runs as its ``execution`` says, and makes configured
    copies for the fitter to measure (it never changes itself to be measured)."""

    execution: Execution

    def settings(self, call: CallShape) -> tuple[Setting, ...]:
        """The settings this call can run with, in the order the fitter scores them."""

    def configured(self, choice: Execution) -> "Tunable":
        """A copy of this layer whose ``execution`` is ``choice``."""


def configured_copy(layer, choice: Execution):
    """What ``Tunable.configured`` returns: a shallow copy of ``layer`` (its tensors and the
    modules it holds shared) whose ``execution`` is ``choice``."""
    twin = copy.copy(layer)
    twin.execution = {shape: dict(c) for shape, c in choice.items()}
    return twin
