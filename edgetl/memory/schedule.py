"""The execution schedule of a lean training step: data chosen from the runtime simulation,
stored with a run, applied to a network before the step that profile, plan, the pre-flight
and finetune all predict, measure and run (issues #14, #17).

Today a schedule says which lean frozen convs run their masked backward on the whole batch
(``FrozenConvBNAct.whole_batch_shapes``): sample by sample (the default), a frozen conv's
masked grad_output exists for one sample at a time; on the whole batch it is faster (fewer,
larger kernels) but holds every sample's copy at once. A layer's backward temporaries live
only during its own backward, so each layer's choice moves only its own moment of the step:
a layer may switch when its moment, with the whole-batch temporaries, stays within the
peak. (The peak can even drop: the per-sample path allocates the whole grad_input up
front.) The choice is per output shape: a batch of another size (the last, smaller batch
of an epoch) runs sample by sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from edgetl.errors import ConfigError
from edgetl.memory.runtime import layer_cost, runtime_report, simulate
from edgetl.models.lean import FrozenConvBNAct, mask_backward_per_sample
from edgetl.step import Step, resolve_step


@dataclass(frozen=True)
class Schedule:
    """How a lean step executes.

    Attributes:
        batch_size, resolution: the step it was fitted for.
        whole_batch: frozen conv name -> output shape whose masked backward runs on the
            whole batch.
        sample_by_sample: the convs left sample by sample (whole batch would raise the peak).
    """

    batch_size: int
    resolution: int
    whole_batch: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sample_by_sample: tuple[str, ...] = ()

    @property
    def decisions(self) -> dict[str, bool]:
        """Every conv that could run either way -> whether it runs on the whole batch."""
        out = {name: True for name in self.whole_batch}
        out.update({name: False for name in self.sample_by_sample})
        return out

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "resolution": self.resolution,
                "whole_batch_backward": {k: list(v) for k, v in self.whole_batch.items()},
                "sample_by_sample_backward": list(self.sample_by_sample)}

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        return cls(int(data["batch_size"]), int(data["resolution"]),
                   {k: tuple(int(d) for d in v) for k, v in data.get("whole_batch_backward", {}).items()},
                   tuple(data.get("sample_by_sample_backward", ())))


def _frozen_convs(net: nn.Module) -> dict[str, FrozenConvBNAct]:
    return {n: m for n, m in net.named_modules() if isinstance(m, FrozenConvBNAct)}


def apply_schedule(net: nn.Module, schedule: Schedule) -> None:
    """Set every lean frozen conv of ``net`` as ``schedule`` says (others: sample by sample)."""
    convs = _frozen_convs(net)
    unknown = sorted(set(schedule.whole_batch) - set(convs))
    if unknown:
        raise ConfigError(f"the schedule names {unknown[0]}, which is not a lean frozen conv of this network")
    for name, conv in convs.items():
        shape = schedule.whole_batch.get(name)
        conv.whole_batch_shapes = frozenset({shape}) if shape is not None else frozenset()


def fit_schedule(net: nn.Module, *, resolution: int, batch_size: int, step: Step | None = None) -> Schedule:
    """The schedule for ``net``'s step: whole-batch backward wherever it does not raise the
    predicted peak (see the module docstring). ``net`` is left as it was."""
    step = resolve_step(step)
    convs = _frozen_convs(net)
    saved = {name: conv.whole_batch_shapes for name, conv in convs.items()}
    names = {m: n for n, m in convs.items()}
    try:
        for conv in convs.values():
            conv.whole_batch_shapes = frozenset()
        res = simulate(net, resolution=resolution, batch_size=batch_size, step=step)
        candidates: dict[tuple[FrozenConvBNAct, tuple], list[int]] = {}
        for i, (module, args) in res.layer_args.items():
            if isinstance(module, FrozenConvBNAct) and i in res.backward_moments:
                shape = tuple(int(d) for d in args["out_shape"])
                if mask_backward_per_sample(module, args["input_requires_grad"], shape):
                    candidates.setdefault((module, shape), []).append(i)

        def within_peak(i: int) -> bool:  # with the module's current whole_batch_shapes
            module, args = res.layer_args[i]
            moment, per_sample_temp = res.backward_moments[i]
            return moment - per_sample_temp + layer_cost(module, **args).backward_temp_bytes <= res.peak_bytes

        whole: dict[str, tuple[int, ...]] = {}
        kept: list[str] = []
        for (module, shape), calls in candidates.items():
            module.whole_batch_shapes = frozenset({shape})
            if all(within_peak(i) for i in calls):
                whole[names[module]] = shape
            else:
                kept.append(names[module])
            module.whole_batch_shapes = frozenset()
    finally:
        for name, conv in convs.items():
            conv.whole_batch_shapes = saved[name]
    return Schedule(batch_size, resolution, whole, tuple(kept))


def prepare_step(net: nn.Module, *, resolution: int, batch_size: int, step: Step | None = None) -> Schedule:
    """Fit the schedule of ``net``'s step and apply it: what every view of a step calls
    before predicting, measuring or running it. Stock networks get an empty schedule."""
    schedule = fit_schedule(net, resolution=resolution, batch_size=batch_size, step=step)
    apply_schedule(net, schedule)
    return schedule


def predict_step(net: nn.Module, *, mode: str, resolution: int, batch_size: int,
                 step: Step | None = None):
    """``prepare_step`` then the runtime accounting of that step (a MemoryReport)."""
    prepare_step(net, resolution=resolution, batch_size=batch_size, step=step)
    return runtime_report(net, mode=mode, resolution=resolution, batch_size=batch_size, step=step)
