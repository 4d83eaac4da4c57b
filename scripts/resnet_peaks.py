"""The seeds' ResNet-18 measurements on edgetl's runtime, and ResNet-50 Rep-Net at 224 px: the
measured peak of one training step beside the runtime accounting's prediction (issue #42 item 3).

    python scripts/resnet_peaks.py    # CPU, about 10 minutes; writes benchmarks/resnet_peaks_224.json

Barley & Froening (seed 000) pool each conv's stored input 2x2 / 4x4 and report, for
ResNet-18 at batch 32, a 29 % / 36 % lower overall peak; Vu et al. (seed 001) store conv inputs
as wavelet (Haar, Daubechies-3) / DCT coefficients or thresholded, and measure allocated
memory on ResNet-18. Here the same levers run on edgetl's lean full fine-tuning of torchvision's
ResNet-18 (random weights, 102 classes, Adam), 224 px, batch 32, each measured
(``measure_training_peak``: live tensor bytes over 2 real steps) and predicted
(``runtime_report`` of the same network, its schedule fitted as ``finetune`` fits it). "stored" is what the step keeps for backward at the end of the forward; "peak_block" the
block the predicted peak falls in. "every
lever" adds, to pool4 storage, fused Adam and the update inside backward (lean full
fine-tuning takes the float batch: its stem conv trains on it).
ResNet-50 Rep-Net rows are at batch 8, lean and stock. Then ``edgetl plan --verify`` for a
budget (PLANS): the planner's pick, its predicted peak and the peak of 3 real steps of it.
docs/resnet.md renders the JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from edgetl.io import atomic_text_json
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step

ROOT = Path(__file__).resolve().parents[1]
RESOLUTION, CLASSES = 224, 102
# table, arch, row label, mode, batch, lean options (None: stock modules), step changes
CONFIGS = [
    ("full", "resnet18", "stock modules (BN training)", "full", 32, None, {}),
    ("full", "resnet18", "lean, exact", "full", 32, dict(storage="exact"), {}),
    ("full", "resnet18", "lean, conv inputs pooled 2x2 (Barley & Froening)", "full", 32, dict(storage="pool2"), {}),
    ("full", "resnet18", "lean, conv inputs pooled 4x4 (Barley & Froening)", "full", 32, dict(storage="pool4"), {}),
    *(("full", "resnet18", f"lean, {label}, 10 % kept (Vu et al.)", "full", 32, dict(storage=c, keep=0.1), {})
      for c, label in (("haar", "Haar wavelet"), ("db3", "Daubechies-3 wavelet"), ("dct", "8x8 block DCT"),
                       ("threshold", "thresholding"))),
    ("full", "resnet18", "lean, every lever: pool4, fused Adam, update inside backward", "full", 32,
     dict(storage="pool4"), dict(fused=True, step_in_backward=True)),
    ("repnet", "resnet50", "Rep-Net, stock modules", "repnet", 8, None, {}),
    ("repnet", "resnet50", "Rep-Net, lean", "repnet", 8, dict(pool=1), {}),
    ("repnet", "resnet50", "Rep-Net, lean, bf16 + int8 frozen weights, streamed by 1, uint8 batch", "repnet", 8,
     dict(pool=2, precision="bf16", frozen_weights="int8", stream=1, uint8_input=True), {}),
]

# arch, budget (MB = 10^6 B), batch: edgetl plan --backbone ARCH --budget BUDGET --batch-size BATCH --verify
PLANS = [("resnet18", 64, 8), ("resnet50", 256, 8)]


def plan_rows() -> list[dict]:
    from edgetl.plan import plan, verify_plan

    rows = []
    for arch, budget_mb, batch in PLANS:
        start = time.perf_counter()
        torch.manual_seed(0)
        result = plan(budget_bytes=budget_mb * 10**6, batch_size=batch, resolution=RESOLUTION, num_classes=CLASSES,
                      backbone=BackboneSpec(arch=arch, num_classes=CLASSES))
        measured = verify_plan(result, steps=3)
        rows.append({"arch": arch, "budget_bytes": budget_mb * 10**6, "tensor_budget_bytes": result.tensor_budget_bytes,
                     "batch_size": batch, "chosen": result.chosen.describe(), "kept": result.chosen.kept,
                     "predicted_bytes": result.predicted_bytes, "measured_bytes": measured})
        print(f"plan {arch} {budget_mb} MB batch {batch}: {result.chosen.describe()}; predicted "
              f"{result.predicted_bytes:,} B, measured {measured:,} B ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "resnet_peaks_224.json")
    p.add_argument("--only", help="comma-separated row numbers to run (a quick look; the file is not written)")
    a = p.parse_args()
    only = None if a.only is None else {int(i) for i in a.only.split(",")}
    rows = []
    for i, (table, arch, row, mode, batch, lean, changes) in enumerate(CONFIGS):
        if only is not None and i not in only:
            continue
        start = time.perf_counter()
        torch.manual_seed(0)
        net = build_network(BackboneSpec(arch=arch, num_classes=CLASSES), mode,
                            lean=None if lean is None else LeanOptions(**lean))
        step = Step.plain("adam", **changes)
        prepare_step(net, resolution=RESOLUTION, batch_size=batch, step=step)
        report = runtime_report(net, mode=mode, resolution=RESOLUTION, batch_size=batch, step=step)
        measured = measure_training_peak(net, resolution=RESOLUTION, batch_size=batch, steps=2, step=step)
        top = max(report.blocks, key=lambda b: b.peak_bytes)
        rows.append({"table": table, "arch": arch, "row": row, "mode": mode, "batch_size": batch, "lean": lean,
                     "step": changes, "predicted_bytes": report.total_bytes, "measured_bytes": measured,
                     "stored_bytes": report.blocks[-1].cugrd_bytes * batch, "peak_block": top.name,
                     "breakdown": report.breakdown})
        print(f"{i}. {arch} {row}: predicted {report.total_bytes:,} B, measured {measured:,} B "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    if only is None:
        atomic_text_json(a.out, {"resolution": RESOLUTION, "num_classes": CLASSES, "optimizer": "adam",
                                 "torch": torch.__version__, "rows": rows, "plans": plan_rows()})
        print(f"saved {a.out}")


if __name__ == "__main__":
    main()
