"""The execution schedule of a lean training step: data chosen from the runtime simulation,
stored with a run, applied to a network before the step that profile, plan, the pre-flight
and finetune all predict, measure and run (issues #14, #17).

A lean layer that can run a call more than one way declares how (``edgetl.cost.Tunable``):
per call, its settings (``edgetl.cost.Setting``: candidates, least memory first, the first
its default) and the moment of the step whose temporaries each moves; it runs as its
``execution`` says, which ``apply_schedule`` sets. ``fit_schedule`` simulates the step with
every layer at its defaults, then scores each setting's candidates on a configured copy of
the layer (``configured``, measured as any leaf is: ``edgetl.memory.leaf``), never by
changing it. A layer's temporaries live only during its own forward or backward, so each
choice moves only its own moments: a layer takes the last candidate whose moments stay
within the default step's peak, so the fitted schedule never predicts a higher one. A
layer's settings are scored in the order it declares them, its earlier choices in place.

The lean frozen conv (``FrozenConvBNAct``) declares three:

* "backward": sample by sample (the default), its masked grad_output exists for one sample
  at a time; on the whole batch it is faster (fewer, larger kernels) but holds every
  sample's copy at once. (The peak can even drop: the per-sample path allocates the whole
  grad_input up front.) The choice is per output shape: a batch of another size (the last,
  smaller batch of an epoch) runs sample by sample.
* "mask_chunk" (issue #17 item 6): the forward packs its ReLU6 mask that many samples at a
  time; one is the least memory, and at batch 32, 224 px, the most kernel launches of the
  step. Each conv gets the largest chunk whose byte-per-element comparisons, at its forward
  moment, keep the step within the peak (the memory grows with the chunk: bisected).
* "weight": a 1x1 frozen conv whose converted weight would hold more than one chunk of it
  converts it a chunk at a time by default (``FrozenConvBNAct.chunked``: less memory, one
  small matrix product per sample and chunk); with both choices above in place, it gets its
  whole weight converted per call (one conv kernel, as before chunking) where its forward
  and backward moments stay within the peak. For every call of the conv.

Streamed segments are accounted as one leaf each, so their convs are not scored one call at a
time. Which of them recompute is fitted first, and the settings are scored on the step with
it: the fewest segments found that keep the peak of recomputing every one whose masks
outweigh its input (``_fit_recompute``). Then each chunkable conv inside a streamed segment
gets its whole weight where the whole step, simulated with it (and the ones taken before it),
keeps the default peak (``_fit_segment_weights``): one conv kernel per micro-batch instead of
a matrix product per chunk and sample (streamed paper configuration at 224 px, batch 8: all
eight, the peak unchanged, 24,654 -> 22,022 ops a step, 3 % faster on a CPU).

A streamed segment whose convs convert their whole stored weight per call (int8, or a float
dtype other than the activations') is a tunable leaf too (``StreamedSegment.settings``):
"weights", converted per micro-batch (the default) or once per pass and held across its
micro-batches, scored with the settings above on the segment's forward and backward moments,
after the whole weights are chosen (a conv given its whole weight converts it per call, so it
is held too; only the convs still chunked are not) (the paper configuration in bf16 + int8 at
224 px, batch 8: 8 of 12 segments, 22,534 -> 17,476 ops a step, the peak unchanged).

A streamed segment of micro-batches of two or more samples has a second setting, "convs":
its masked frozen convs pack their masks and run their masked backward sample by sample (the
default) or a micro-batch at a time (``StreamedSegment.whole_micro_batch``), scored on the
segment's moments as any setting. A micro-batch at a time holds its samples' masked copies
at once, so the segments on the largest maps keep the default where those set the peak (the
demo's streamed fine-tune, 64 px, batch 32 by 4: 9 of 12 segments, the peak unchanged, the
step 1.5x as fast on a CPU, benchmarks/demo_steps_64.json).

A ``Schedule`` stores the frozen convs' choices as it always has (``whole_batch_backward``,
``forward_mask_chunks``, ``whole_weight_convs``, the last now with convs inside segments) and
a segment's in ``settings``, so schedules stored with runs load.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import nn

from edgetl.cost import CallShape, Setting, Tunable
from edgetl.errors import ConfigError
from edgetl.memory.flow import trace_flow
from edgetl.memory.rules import layer_cost
from edgetl.memory.runtime import runtime_report, simulate
from edgetl.memory.search import largest_fitting
from edgetl.memory.step_cost import optimizer_cost
from edgetl.twin import meta_copy
from edgetl.models.stream import apply_streams, segments_of
from edgetl.step import Step, resolve_step

# layer name -> output shape (None: every call) -> setting -> choice
Choices = dict[str, dict[tuple[int, ...] | None, dict[str, Hashable]]]


@dataclass(frozen=True)
class Schedule:
    """How a lean step executes.

    The settings of the lean frozen convs (``FrozenConvBNAct.settings``) keep the fields
    that stored schedules have always had; any other tunable layer's choices are in
    ``settings``.

    Attributes:
        batch_size, resolution: the step it was fitted for.
        whole_batch: frozen conv name -> output shape whose masked backward runs on the
            whole batch (setting "backward": "whole_batch").
        sample_by_sample: the convs left sample by sample (whole batch would raise the peak).
        mask_chunks: frozen conv name -> (output shape, samples per chunk) for the forward's
            mask packing, where more than one sample fits (setting "mask_chunk"; others: one
            at a time).
        streams: first block -> (stop block, micro-batch) of each streamed frozen segment
            (``edgetl.models.stream``); the convs inside one are not scheduled one by one.
        recompute: the first blocks of the streamed segments that keep their input and run
            forward again in backward (``LeanOptions.recompute``; where that lowers the peak).
        whole_weight: the frozen convs that convert their stored weight whole per call
            (setting "weight": "whole"; the others that could run chunk by chunk do).
        settings: the other settings' choices that are not their defaults (``Choices``).
    """

    batch_size: int
    resolution: int
    whole_batch: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sample_by_sample: tuple[str, ...] = ()
    mask_chunks: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    streams: dict[int, tuple[int, int]] = field(default_factory=dict)
    recompute: tuple[int, ...] = ()
    whole_weight: tuple[str, ...] = ()
    settings: Choices = field(default_factory=dict)

    @property
    def decisions(self) -> dict[str, bool]:
        """Every conv that could run either way -> whether it runs on the whole batch."""
        out = {name: True for name in self.whole_batch}
        out.update({name: False for name in self.sample_by_sample})
        return out

    def choices(self) -> Choices:
        """Layer name -> its ``execution`` (``edgetl.cost.Tunable``): what ``apply_schedule`` sets."""
        out: Choices = {}

        def put(name: str, shape, setting: str, value) -> None:
            out.setdefault(name, {}).setdefault(shape, {})[setting] = value

        for name, shape in self.whole_batch.items():
            put(name, shape, "backward", "whole_batch")
        for name, (shape, chunk) in self.mask_chunks.items():
            put(name, shape, "mask_chunk", chunk)
        for name in self.whole_weight:
            put(name, None, "weight", "whole")
        for name, by_shape in self.settings.items():
            for shape, chosen in by_shape.items():
                for setting, value in chosen.items():
                    put(name, shape, setting, value)
        return out

    def to_dict(self) -> dict:
        out = {"batch_size": self.batch_size, "resolution": self.resolution,
               "whole_batch_backward": {k: list(v) for k, v in self.whole_batch.items()},
               "sample_by_sample_backward": list(self.sample_by_sample),
               "forward_mask_chunks": {k: {"shape": list(shape), "chunk": chunk}
                                       for k, (shape, chunk) in self.mask_chunks.items()},
               "streamed_segments": [{"blocks": [a, b], "micro_batch": m, "recompute": a in self.recompute}
                                     for a, (b, m) in sorted(self.streams.items())],
               "whole_weight_convs": list(self.whole_weight)}
        if self.settings:
            out["settings"] = {name: [{"shape": None if shape is None else list(shape), "choices": dict(chosen)}
                                      for shape, chosen in by_shape.items()]
                               for name, by_shape in self.settings.items()}
        return out

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
        settings = {name: {None if e["shape"] is None else tuple(int(d) for d in e["shape"]): dict(e["choices"])
                           for e in entries}
                    for name, entries in data.get("settings", {}).items()}
        return cls(int(data["batch_size"]), int(data["resolution"]),
                   {k: tuple(int(d) for d in v) for k, v in data.get("whole_batch_backward", {}).items()},
                   tuple(data.get("sample_by_sample_backward", ())), chunks, streams, again,
                   tuple(data.get("whole_weight_convs", ())), settings)


def _tunables(net: nn.Module) -> dict[str, Tunable]:
    return {n: m for n, m in net.named_modules() if isinstance(m, Tunable)}


def apply_schedule(net: nn.Module, schedule: Schedule) -> None:
    """Set every tunable layer of ``net`` (``edgetl.cost.Tunable``) as ``schedule`` says
    (others: their defaults), and stream the segments it names (no others)."""
    if schedule.streams or net.streams is not None:
        apply_streams(net, schedule.streams, schedule.recompute)
    layers = _tunables(net)
    choices = schedule.choices()
    unknown = sorted(set(choices) - set(layers))
    if unknown:
        raise ConfigError(f"the schedule names {unknown[0]}, which is not a tunable lean layer of this network")
    for name, layer in layers.items():
        layer.execution = {shape: dict(chosen) for shape, chosen in choices.get(name, {}).items()}


def fit_schedule(net: nn.Module, *, resolution: int, batch_size: int, step: Step | None = None) -> Schedule:
    """The schedule for ``net``'s step: each tunable layer's settings (whole-batch backward,
    the largest forward mask chunks, whole weights, streamed segments' held weights) wherever
    they do not raise the predicted peak (see the module docstring). ``net`` is not touched:
    the step is simulated on a meta copy of it, and each choice is measured on a configured
    copy of its layer."""
    step = resolve_step(step)
    work = meta_copy(net)  # the fitter's own: its streams are set and reset freely
    streams = stream_segments(work, batch_size, step)
    if streams or work.streams is not None:
        apply_streams(work, streams)
    for layer in _tunables(work).values():
        layer.execution = {}  # every layer at its defaults: the peak the choices must keep
    res = simulate(work, resolution=resolution, batch_size=batch_size, step=step)
    again: tuple[int, ...] = ()
    if streams and work.options.recompute:
        again, res = _fit_recompute(work, res, streams, resolution, batch_size, step)
    names = {id(m): n for n, m in work.named_modules()}
    whole, kept, chunks, weights, settings = {}, [], {}, [], {}
    if streams:
        weights += _fit_segment_weights(work, res, names, resolution, batch_size, step)
    for (module, setting, shape), value in _fit_settings(res).items():
        name = names[id(module)]
        if setting.name == "backward":
            if value == "whole_batch":
                whole[name] = shape
            else:
                kept.append(name)
        elif setting.name == "mask_chunk":
            if value != setting.default:
                chunks[name] = (shape, value)
        elif setting.name == "weight":
            if value == "whole":
                weights.append(name)
        elif value != setting.default:
            settings.setdefault(name, {}).setdefault(shape, {})[setting.name] = value
    return Schedule(batch_size, resolution, whole, tuple(kept), chunks, streams, again, tuple(sorted(weights)),
                    settings)


def _fit_recompute(net, res, streams, resolution: int, batch_size: int, step: Step):
    """The streamed segments worth recomputing, and the simulation with them.

    The candidates are the segments whose backward runs and whose saved bytes exceed the
    input they would keep instead (a uint8 image is kept anyway); all together they must
    lower the predicted peak, or none recomputes. Then the set shrinks, one simulation per
    candidate: each leaves, the one whose recompute frees the fewest bytes first, where the
    peak stays at the whole set's. A recompute runs the segment's forward a second time, and
    the peak is often set where one or two segments' savings suffice (the paper configuration
    in bf16 + int8 at 224 px, batch 8: blocks 8-10 alone give the peak of all four
    candidates, and the step ran 1.1x as fast on one CPU thread). The segments that free the
    most leave last, as they are the ones that can hold the peak down alone: tried by forward
    time instead, the most expensive first, two segments stayed there (5-6 and 12-13), about
    1.7x the forward time of blocks 8-10. The peak never rises above the whole set's; the
    set is fitted for this batch only (at another, other segments may be needed)."""
    from edgetl.cost import numel
    from edgetl.models.stream import StreamedSegment

    freed = {}  # first block -> bytes its recompute takes off every moment from its forward to its backward
    for module, args in res.layer_args.values():
        if not isinstance(module, StreamedSegment) or not args["output_requires_grad"]:
            continue
        saved = layer_cost(module, **args).saved_new_bytes
        kept = 0 if args["in_bytes"] == 1 else numel(args["in_shape"]) * args["in_bytes"]
        if saved > kept:
            freed[module.start] = saved - kept
    if not freed:
        return (), res
    # the segments each returned simulation ran (a tunable segment's choices are named by the
    # simulation's own modules: they are put back, not built again)
    original = net.streams
    again = sorted(freed)
    apply_streams(net, streams, tuple(again))
    best = simulate(net, resolution=resolution, batch_size=batch_size, step=step)
    if best.peak_bytes >= res.peak_bytes:
        net.streams = original
        return (), res
    ran = net.streams
    for start in sorted(freed, key=lambda a: (freed[a], a)):
        if len(again) == 1:
            break  # none at all was tried above
        fewer = [a for a in again if a != start]
        apply_streams(net, streams, tuple(fewer))
        trial = simulate(net, resolution=resolution, batch_size=batch_size, step=step)
        if trial.peak_bytes <= best.peak_bytes:
            again, best, ran = fewer, trial, net.streams
    net.streams = ran
    return tuple(again), best


def _fit_segment_weights(net, res, names: dict[int, str], resolution: int, batch_size: int,
                         step: Step) -> list[str]:
    """The chunkable convs inside ``net``'s streamed segments (convs the simulation ``res`` never
    scored: the segment is its leaf) that convert their weight whole, greedily in order: each
    where the whole step, simulated with it and the ones taken before, keeps ``res``'s peak.

    A whole weight only adds to its conv's moments (the converted weight where a chunk of it
    was), so the peak never falls as convs are taken. The greedy pass then takes the longest
    run of the next convs that keeps the peak, and leaves the one after it: the run is found by
    the one search (``largest_fitting``, trying all of them first), not one simulation per conv.
    Every simulation shares one trace (``simulate``: only the segments' insides change). The
    paper configuration at 224 px, batch 8: 1 simulation for 8 convs, all taken; ``edgetl plan
    --budget 14MB``'s evaluations mostly keep all but the last one or three."""
    scored = {id(module) for module, _ in res.layer_args.values()}
    rest = [module for module in net.modules() if id(module) not in scored
            and getattr(module, "chunkable", False) and isinstance(module, Tunable)]
    flow, opt = trace_flow(net, resolution, batch_size), optimizer_cost(net, step)
    taken: list[str] = []
    while rest:
        before = [module.execution for module in rest]

        def run(n: int, rest=rest, before=before) -> None:
            """The first ``n`` of ``rest`` whole, the others as they were."""
            for i, module in enumerate(rest):
                module.execution = {None: {"weight": "whole"}} if i < n else before[i]

        def peak_with(n: int) -> int:
            run(n)
            return simulate(net, resolution=resolution, batch_size=batch_size, step=step, opt=opt,
                            flow=flow).peak_bytes

        n = largest_fitting(peak_with, res.peak_bytes, 0, len(rest) + 1, guess=len(rest))
        run(n)  # and the one after them, which raised the peak, as it was
        taken += [names[id(module)] for module in rest[:n]]
        rest = rest[n + 1:]
    return taken


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


def _fit_settings(res) -> dict[tuple[nn.Module, Setting, tuple[int, ...] | None], Hashable]:
    """Each setting of each tunable leaf of the simulated step -> its choice, in the order the
    leaves' calls ran (a layer's settings in its declaration order).

    A setting is chosen per layer and output shape (``Setting.every_shape``: per layer), over
    all its calls there: the last candidate whose calls' moments (``Setting.moment``), with
    that candidate and the layer's earlier choices in place, stay within the default peak.
    Each is measured on ``module.configured(...)``, never by changing the layer."""
    groups: dict[tuple[int, str, tuple | None], tuple[nn.Module, Setting, list[int]]] = {}
    order: dict[tuple[int, str, tuple | None], tuple[int, int, int]] = {}
    rank: dict[int, int] = {}
    for i, (module, args) in res.layer_args.items():
        if not isinstance(module, Tunable):
            continue
        out_shape = tuple(int(d) for d in args["out_shape"])
        call = CallShape(tuple(int(d) for d in args["in_shape"]), out_shape,
                         bool(args["input_requires_grad"]), bool(args["output_requires_grad"]))
        for k, setting in enumerate(module.settings(call)):
            if not any(i in _moments(res, m) for m in setting.moments):
                continue
            key = (id(module), setting.name, None if setting.every_shape else out_shape)
            if key not in groups:
                groups[key] = (module, setting, [])
                order[key] = (rank.setdefault(id(module), len(rank)), k, len(order))
            groups[key][2].append(i)
    chosen: dict[int, dict[tuple | None, dict[str, Hashable]]] = {}  # id(module) -> its choices so far
    out = {}
    for key in sorted(groups, key=order.__getitem__):
        module, setting, calls = groups[key]
        shape = key[2]
        done = chosen.setdefault(id(module), {})

        def fits(value) -> bool:
            trial = {s: dict(c) for s, c in done.items()}
            trial.setdefault(shape, {})[setting.name] = value
            layer = module.configured(trial)
            return all(_within_peak(res, i, layer, m) for i in calls for m in setting.moments
                       if i in _moments(res, m))

        out[key] = value = _last_fitting(setting, fits)
        done.setdefault(shape, {})[setting.name] = value
    return {(groups[key][0], groups[key][1], key[2]): out[key] for key in groups}


def _last_fitting(setting: Setting, fits) -> Hashable:
    """The last of ``setting``'s candidates that ``fits`` (the first, the default, always does)."""
    candidates = setting.candidates
    if setting.bisect:  # the memory grows along the candidates: the last that fits
        lo, hi = 0, len(candidates) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid - 1)
        return candidates[lo]
    return next((c for c in reversed(candidates[1:]) if fits(c)), candidates[0])


def _moments(res, moment: str) -> dict[int, tuple[int, int]]:
    return res.forward_moments if moment == "forward" else res.backward_moments


def _within_peak(res, i: int, layer: nn.Module, moment: str) -> bool:
    """Op ``i``'s moment (forward or backward), run by ``layer`` in place of its module,
    stays within the default peak."""
    _, args = res.layer_args[i]
    total, default_temp = _moments(res, moment)[i]
    return total - default_temp + getattr(layer_cost(layer, **args), f"{moment}_temp_bytes") <= res.peak_bytes


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
