"""The demo's training steps, two ways each, side by side in one run (interleaved, as the bench
times its rows), on this CPU: the choices that make ``make demo`` quicker, each against what
ran before it.

* pretrain / retrain (stock MobileNetV2 0.35, every weight trained, 64 px, batch 32): the
  network and its batch plain (NCHW) or channels-last (``EdgeNet.to_channels_last``, what
  ``edgetl.retrain`` runs on every device);
* the streamed fine-tune (unpruned Rep-Net, the plan's k=2, streamed by ``--stream``, the demo's
  ``edgetl.demo.STREAM`` unless given,
  uint8 batch, recompute where the schedule takes it): the masked frozen convs of every
  segment sample by sample, or a micro-batch at a time where the schedule lets a segment
  (``StreamedSegment.whole_micro_batch``), with the predicted peak of each;
* the unstreamed fine-tune of the same network, the reference the streamed one is compared to.

    python scripts/demo_steps.py --stream 4 --json benchmarks/demo_steps_64.json

(the committed file: the demo streamed by 4 then; it streams by 8 now, ``edgetl.demo.STREAM``).

One thread and OpenMP's passive waiting, as the edgetl program runs on a 2-core machine; run it
with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (the program's policy)

import torch  # noqa: E402

from edgetl.bench import _Trainer, cpu_name, interleaved_step_times  # noqa: E402
from edgetl.demo import SOURCE_CLASSES, STREAM, TARGET_CLASSES, DemoScale  # noqa: E402
from edgetl.heap import hold_freed_memory  # noqa: E402
from edgetl.io import atomic_text_json  # noqa: E402
from edgetl.memory.runtime import runtime_report  # noqa: E402
from edgetl.memory.schedule import Schedule, apply_schedule, prepare_step  # noqa: E402
from edgetl.models.backbone import BackboneSpec  # noqa: E402
from edgetl.models.side import build_network  # noqa: E402
from edgetl.options import LeanOptions  # noqa: E402

def row_labels(stream: int) -> dict[str, str]:
    return {
        "pretrain-plain": "pretrain / retrain: stock, every weight trained, plain (before)",
        "pretrain-channels-last": "pretrain / retrain: stock, every weight trained, channels-last (now)",
        "finetune": "fine-tune: lean Rep-Net, unstreamed",
        "streamed-per-sample": f"fine-tune streamed by {stream}: masked convs sample by sample (before)",
        "streamed-whole-micro-batch": (f"fine-tune streamed by {stream}: a micro-batch at a time where the peak "
                                       "allows (now)"),
    }


def without_whole_micro_batches(schedule: Schedule) -> Schedule:
    """``schedule`` with every streamed segment's masked convs left sample by sample."""
    settings = {}
    for name, by_shape in schedule.settings.items():
        kept = {shape: {k: v for k, v in chosen.items() if k != "convs"} for shape, chosen in by_shape.items()}
        kept = {shape: chosen for shape, chosen in kept.items() if chosen}
        if kept:
            settings[name] = kept
    return dataclasses.replace(schedule, settings=settings)


def trainers(scale: DemoScale, stream: int = STREAM) -> tuple[dict[str, _Trainer], dict[str, int], int]:
    """The rows' trainers, the lean rows' predicted peaks (bytes), and the segments that run a
    micro-batch at a time."""
    res, batch = scale.resolution, scale.batch_size

    def trainer(net):
        return _Trainer(net, resolution=res, batch_size=batch, num_classes=net.spec.num_classes,
                        device=torch.device("cpu"), lr=1e-3, seed=0)

    out, peaks = {}, {}
    source = BackboneSpec(width=scale.width, num_classes=len(SOURCE_CLASSES))
    for name, layout in (("pretrain-plain", False), ("pretrain-channels-last", True)):
        torch.manual_seed(0)
        net = build_network(source, "full")
        out[name] = trainer(net.to_channels_last() if layout else net)
    target = BackboneSpec(width=scale.width, num_classes=len(TARGET_CLASSES))
    torch.manual_seed(0)
    net = build_network(target, "repnet", lean=LeanOptions(pool=2))
    prepare_step(net, resolution=res, batch_size=batch)
    peaks["finetune"] = runtime_report(net, mode="repnet", resolution=res, batch_size=batch).total_bytes
    out["finetune"] = trainer(net)
    streamed = LeanOptions(pool=2, stream=stream, uint8_input=True, recompute=True)
    whole = 0
    for name in ("streamed-per-sample", "streamed-whole-micro-batch"):
        torch.manual_seed(0)
        net = build_network(target, "repnet", lean=streamed)
        schedule = prepare_step(net, resolution=res, batch_size=batch)
        if name == "streamed-per-sample":
            apply_schedule(net, without_whole_micro_batches(schedule))
        else:
            whole = sum(s.whole_micro_batch for s in net.streams.values())
        peaks[name] = runtime_report(net, mode="repnet", resolution=res, batch_size=batch).total_bytes
        out[name] = trainer(net)
    return out, peaks, whole


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each row (interleaved)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stream", type=int, default=STREAM, help="the streamed rows' micro-batch (default: the demo's)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    heap = hold_freed_memory()
    scale = DemoScale()
    rows, peaks, whole = trainers(scale, a.stream)
    labels = row_labels(a.stream)
    times = interleaved_step_times(rows, steps=a.steps, warmup=a.warmup)
    step = {name: statistics.median(t) for name, t in times.items()}
    data = {
        "cpu": cpu_name(), "machine": platform.machine(), "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "heap": heap, "torch": torch.__version__,
        "resolution": scale.resolution, "batch_size": scale.batch_size, "stream": a.stream,
        "steps": a.steps, "warmup": a.warmup, "segments_whole_micro_batch": whole,
        "rows": {name: {"label": labels[name], "step_s": step[name], "steps_s": times[name],
                        "predicted_peak_bytes": peaks.get(name)} for name in rows},
        "channels_last_speedup": step["pretrain-plain"] / step["pretrain-channels-last"],
        "whole_micro_batch_speedup": step["streamed-per-sample"] / step["streamed-whole-micro-batch"],
        "streamed_vs_unstreamed": {"before": step["streamed-per-sample"] / step["finetune"],
                                   "now": step["streamed-whole-micro-batch"] / step["finetune"]},
    }
    for name, r in data["rows"].items():
        peak = f", predicted peak {r['predicted_peak_bytes']:,} B" if r["predicted_peak_bytes"] else ""
        print(f"{r['label']}: {r['step_s'] * 1e3:.0f} ms{peak}")
    print(f"channels-last: {data['channels_last_speedup']:.2f}x; a micro-batch at a time "
          f"({whole} segments): {data['whole_micro_batch_speedup']:.2f}x; streamed / unstreamed step "
          f"{data['streamed_vs_unstreamed']['before']:.2f}x before, {data['streamed_vs_unstreamed']['now']:.2f}x now")
    print(f"{data['cpu']}; {data['threads']} thread(s), OMP_WAIT_POLICY={data['omp_wait_policy']}, "
          f"torch {data['torch']}; the median of {a.steps} interleaved steps after {a.warmup}")
    if a.json is not None:
        atomic_text_json(a.json, data)


if __name__ == "__main__":
    main()
