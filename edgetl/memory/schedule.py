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

The forward is fitted the same way (issue #17 item 6): a frozen conv packs its ReLU6 mask
``mask_chunk`` samples at a time (``FrozenConvBNAct.mask_chunks``); one sample at a time
is the least memory, and at batch 32, 224 px, the most kernel launches of the step. Each
conv gets the largest chunk whose byte-per-element comparisons, at its forward moment,
keep the step within the same peak. Both choices are checked against the peak of the
default (sample-by-sample) step, so the fitted schedule never predicts a higher one.

A 1x1 frozen conv whose converted weight would hold more than one chunk of it converts it
a chunk at a time by default (``FrozenConvBNAct.chunked``: less memory, one small matrix
product per sample and chunk). With both choices above in place, each such conv gets its whole
weight converted per call (``whole_weight``: one conv kernel, as before chunking) where its
forward and backward moments stay within the same peak. Streamed segments keep every conv
inside them chunked (the segment is accounted as one leaf).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from edgetl.errors import ConfigError
from edgetl.memory.rules import layer_cost
from edgetl.memory.runtime import runtime_report, simulate
from edgetl.memory.trace import meta_copy
from edgetl.models.lean import FrozenConvBNAct, mask_backward_per_sample, mask_forward_chunked
from edgetl.models.stream import apply_streams, segments_of
from edgetl.step import Step, resolve_step


@dataclass(frozen=True)
class Schedule:
    """How a lean step executes.

    Attributes:
        batch_size, resolution: the step it was fitted for.
        whole_batch: frozen conv name -> output shape whose masked backward runs on the
            whole batch.
        sample_by_sample: the convs left sample by sample (whole batch would raise the peak).
        mask_chunks: frozen conv name -> (output shape, samples per chunk) for the forward's
            mask packing, where more than one sample fits (others: one at a time).
        streams: first block -> (stop block, micro-batch) of each streamed frozen segment
            (``edgetl.models.stream``); the convs inside one are not scheduled one by one.
        recompute: the first blocks of the streamed segments that keep their input and run
            forward again in backward (``LeanOptions.recompute``; where that lowers the peak).
        whole_weight: the frozen convs that convert their stored weight whole per call
            (the others that could run chunk by chunk do).
    """

    batch_size: int
    resolution: int
    whole_batch: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sample_by_sample: tuple[str, ...] = ()
    mask_chunks: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    streams: dict[int, tuple[int, int]] = field(default_factory=dict)
    recompute: tuple[int, ...] = ()
    whole_weight: tuple[str, ...] = ()

    @property
    def decisions(self) -> dict[str, bool]:
        """Every conv that could run either way -> whether it runs on the whole batch."""
        out = {name: True for name in self.whole_batch}
        out.update({name: False for name in self.sample_by_sample})
        return out

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "resolution": self.resolution,
                "whole_batch_backward": {k: list(v) for k, v in self.whole_batch.items()},
                "sample_by_sample_backward": list(self.sample_by_sample),
                "forward_mask_chunks": {k: {"shape": list(shape), "chunk": chunk}
                                        for k, (shape, chunk) in self.mask_chunks.items()},
                "streamed_segments": [{"blocks": [a, b], "micro_batch": m, "recompute": a in self.recompute}
                                      for a, (b, m) in sorted(self.streams.items())],
                "whole_weight_convs": list(self.whole_weight)}

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        """The inverse of ``to_dict``; a schedule stored before forward chunks packs one sample
        at a time, one stored before streaming streams nothing, one stored before chunked
        weights converts every chunkable weight chunk by chunk (the default, accounted as it
        runs)."""
        chunks = {k: (tuple(int(d) for d in v["shape"]), int(v["chunk"]))
                  for k, v in data.get("forward_mask_chunks", {}).items()}
        streams = {int(s["blocks"][0]): (int(s["blocks"][1]), int(s["micro_batch"]))
                   for s in data.get("streamed_segments", ())}
        again = tuple(int(s["blocks"][0]) for s in data.get("streamed_segments", ()) if s.get("recompute"))
        return cls(int(data["batch_size"]), int(data["resolution"]),
                   {k: tuple(int(d) for d in v) for k, v in data.get("whole_batch_backward", {}).items()},
                   tuple(data.get("sample_by_sample_backward", ())), chunks, streams, again,
                   tuple(data.get("whole_weight_convs", ())))


def _frozen_convs(net: nn.Module) -> dict[str, FrozenConvBNAct]:
    return {n: m for n, m in net.named_modules() if isinstance(m, FrozenConvBNAct)}


def apply_schedule(net: nn.Module, schedule: Schedule) -> None:
    """Set every lean frozen conv of ``net`` as ``schedule`` says (others: sample by sample),
    and stream the segments it names (no others)."""
    if schedule.streams or net.streams is not None:
        apply_streams(net, schedule.streams, schedule.recompute)
    convs = _frozen_convs(net)
    unknown = sorted((set(schedule.whole_batch) | set(schedule.mask_chunks) | set(schedule.whole_weight))
                     - set(convs))
    if unknown:
        raise ConfigError(f"the schedule names {unknown[0]}, which is not a lean frozen conv of this network")
    _set_convs(convs, schedule.whole_batch, schedule.mask_chunks, schedule.whole_weight)


def _set_convs(convs: dict[str, FrozenConvBNAct], whole_batch: dict, mask_chunks: dict, whole_weight=()) -> None:
    """Each conv's execution options from the schedule's choices (absent: the defaults)."""
    for name, conv in convs.items():
        shape = whole_batch.get(name)
        conv.whole_batch_shapes = frozenset({shape}) if shape is not None else frozenset()
        conv.mask_chunks = dict([mask_chunks[name]]) if name in mask_chunks else {}
        conv.whole_weight = name in whole_weight


def fit_schedule(net: nn.Module, *, resolution: int, batch_size: int, step: Step | None = None) -> Schedule:
    """The schedule for ``net``'s step: whole-batch backward and the largest forward mask
    chunks wherever they do not raise the predicted peak (see the module docstring).
    ``net`` is not touched: the choices are tried on a meta copy of it."""
    step = resolve_step(step)
    work = meta_copy(net)  # the fitter's own: its convs and streams are set and reset freely
    convs = _frozen_convs(work)
    names = {m: n for n, m in convs.items()}
    streams = stream_segments(work, batch_size, step)
    if streams or work.streams is not None:
        apply_streams(work, streams)
    _set_convs(convs, {}, {})  # every conv at its defaults: the peak the choices must keep
    res = simulate(work, resolution=resolution, batch_size=batch_size, step=step)
    again: tuple[int, ...] = ()
    if streams and work.options.recompute:
        again, res = _fit_recompute(work, res, streams, resolution, batch_size, step)
    whole, kept = _fit_backward(res, names)
    chunks = _fit_forward(res, names)
    _set_convs(convs, whole, chunks)  # the weights are fitted with both choices in place
    weights = _fit_weights(res, names)
    return Schedule(batch_size, resolution, whole, tuple(kept), chunks, streams, again, weights)


def _fit_recompute(net, res, streams, resolution: int, batch_size: int, step: Step):
    """The streamed segments worth recomputing, and the simulation with them: those whose
    backward runs and whose saved bytes exceed the input they would keep instead (a uint8
    image is kept anyway), taken together when that lowers the predicted peak."""
    from edgetl.cost import numel
    from edgetl.models.stream import StreamedSegment

    again = []
    for module, args in res.layer_args.values():
        if not isinstance(module, StreamedSegment) or not args["output_requires_grad"]:
            continue
        saved = layer_cost(module, **args).saved_new_bytes
        kept = 0 if args["in_bytes"] == 1 else numel(args["in_shape"]) * args["in_bytes"]
        if saved > kept:
            again.append(module.start)
    if not again:
        return (), res
    apply_streams(net, streams, tuple(again))
    trial = simulate(net, resolution=resolution, batch_size=batch_size, step=step)
    if trial.peak_bytes < res.peak_bytes:
        return tuple(sorted(again)), trial
    apply_streams(net, streams)
    return (), res


def stream_segments(net: nn.Module, batch_size: int, step: Step) -> dict[int, tuple[int, int]]:
    """The streamed segments of ``net``'s step: every segment of its frozen backbone with the
    micro-batch the network asks for (``LeanOptions.stream``), where that is below the batch."""
    m = net.options.stream if net.options is not None else 0
    if not m or m >= batch_size:
        return {}
    if step.bn != "fold":
        raise ConfigError(f"streaming (micro-batch {m}) needs bn fold; the step uses bn {step.bn}")
    taps = tuple(net.side.taps) if net.side is not None else ()
    return {a: (b, m) for a, b in segments_of(len(net.features), taps)}


def _calls(res, moments: dict, chosen) -> dict[tuple[FrozenConvBNAct, tuple], list[int]]:
    """(frozen conv, output shape) -> the simulated ops where ``chosen(module, args, shape)``."""
    out: dict[tuple[FrozenConvBNAct, tuple], list[int]] = {}
    for i, (module, args) in res.layer_args.items():
        if isinstance(module, FrozenConvBNAct) and i in moments:
            shape = tuple(int(d) for d in args["out_shape"])
            if chosen(module, args, shape):
                out.setdefault((module, shape), []).append(i)
    return out


def _within_peak(res, i: int, moments: dict, temp: str) -> bool:
    """Op ``i``'s moment with its module's current settings stays within the default peak."""
    module, args = res.layer_args[i]
    moment, default_temp = moments[i]
    return moment - default_temp + getattr(layer_cost(module, **args), temp) <= res.peak_bytes


def _fit_backward(res, names) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    candidates = _calls(res, res.backward_moments,
                        lambda m, args, shape: mask_backward_per_sample(m, args["input_requires_grad"], shape))
    whole: dict[str, tuple[int, ...]] = {}
    kept: list[str] = []
    for (module, shape), calls in candidates.items():
        module.whole_batch_shapes = frozenset({shape})
        if all(_within_peak(res, i, res.backward_moments, "backward_temp_bytes") for i in calls):
            whole[names[module]] = shape
        else:
            kept.append(names[module])
        module.whole_batch_shapes = frozenset()
    return whole, kept


def _fit_forward(res, names) -> dict[str, tuple[tuple[int, ...], int]]:
    candidates = _calls(res, res.forward_moments,
                        lambda m, args, shape: mask_forward_chunked(m, args["output_requires_grad"], shape))
    chunks: dict[str, tuple[tuple[int, ...], int]] = {}
    for (module, shape), calls in candidates.items():
        def fits(chunk: int) -> bool:
            module.mask_chunks = {shape: chunk}
            return all(_within_peak(res, i, res.forward_moments, "forward_temp_bytes") for i in calls)

        lo, hi = 1, shape[0]  # the temporaries grow with the chunk: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        module.mask_chunks = {}
        if lo > 1:
            chunks[names[module]] = (shape, lo)
    return chunks


def _fit_weights(res, names) -> tuple[str, ...]:
    """The chunkable frozen convs whose forward and backward moments, with the whole weight
    converted per call, stay within the default peak."""
    moments = (res.forward_moments, "forward_temp_bytes"), (res.backward_moments, "backward_temp_bytes")
    calls = [(_calls(res, m, lambda module, args, shape: module.chunkable), m, temp) for m, temp in moments]
    whole = []
    for module in {module for found, _, _ in calls for module, _ in found}:
        module.whole_weight = True
        if all(_within_peak(res, i, m, temp) for found, m, temp in calls
               for (other, _), ops in found.items() if other is module for i in ops):
            whole.append(names[module])
        module.whole_weight = False
    return tuple(sorted(whole))


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
