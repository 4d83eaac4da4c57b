"""Measured peak of one training step (forward, backward, Adam step) at 224 px, batch 8, 102
classes, on CPU, for the runtimes and storages of docs/lean-runtime.md, with the runtime
accounting's prediction beside each (the tables there are rendered from the JSON this writes,
scripts/render_docs.py).

    python scripts/step_peaks.py      # CPU, about 2 minutes; writes benchmarks/step_peaks_224.json

Measured: ``edgetl.memory.meter.measure_training_peak`` (live tensor bytes over 2 real steps,
random weights); predicted: ``edgetl.memory.runtime.runtime_report`` of the same network, its
schedule fitted as ``finetune`` fits it. "stored" is what the step keeps for backward at the
end of the forward (the head's cumulative gradient memory per image, times the batch).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from edgetl.bench import pruned_hidden
from edgetl.io import atomic_text_json
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.side import LeanOptions, build_network

ROOT = Path(__file__).resolve().parents[1]
HALF = dict(precision="bf16", frozen_weights="int8")
# table, row, column, mode, pruned, lean options (None: stock modules)
CONFIGS = [
    ("repnet", "Rep-Net", "stock modules", "repnet", False, None),
    ("repnet", "Rep-Net", "lean, fp32", "repnet", False, dict(pool=1)),
    ("repnet", "Rep-Net", "lean, bf16 activations + int8 frozen weights", "repnet", False, dict(pool=1, **HALF)),
    ("repnet", "pruned", "stock modules", "repnet", True, None),
    ("repnet", "pruned", "lean, fp32", "repnet", True, dict(pool=2)),
    ("repnet", "pruned", "lean, bf16 activations + int8 frozen weights", "repnet", True, dict(pool=2, **HALF)),
    ("full", "stock modules (BN training)", "", "full", False, None),
    ("full", "lean, `exact`", "", "full", False, dict(storage="exact")),
    ("full", "lean, `pool2`", "", "full", False, dict(storage="pool2")),
    ("full", "lean, `pool4`", "", "full", False, dict(storage="pool4")),
    *(("full", f"lean, `{c}`, keep 0.1", "", "full", False, dict(storage=c, keep=0.1))
      for c in ("haar", "db3", "dct", "threshold")),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "step_peaks_224.json")
    a = p.parse_args()
    resolution, batch, classes = 224, 8, 102
    rows = []
    for table, row, column, mode, pruned, lean in CONFIGS:
        start = time.perf_counter()
        spec = BackboneSpec(width=1.0, num_classes=classes, hidden=pruned_hidden(1.0, classes) if pruned else {})
        torch.manual_seed(0)
        net = build_network(spec, mode, lean=None if lean is None else LeanOptions(**lean))
        prepare_step(net, resolution=resolution, batch_size=batch)
        report = runtime_report(net, mode=mode, resolution=resolution, batch_size=batch)
        measured = measure_training_peak(net, resolution=resolution, batch_size=batch, steps=2)
        rows.append({"table": table, "row": row, "column": column, "mode": mode, "pruned": pruned, "lean": lean,
                     "predicted_bytes": report.total_bytes, "measured_bytes": measured,
                     "stored_bytes": report.blocks[-1].cugrd_bytes * batch})
        print(f"{table}: {row} {column}: predicted {report.total_bytes:,} B, measured {measured:,} B "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    atomic_text_json(a.out, {"resolution": resolution, "batch_size": batch, "num_classes": classes,
                             "torch": torch.__version__, "rows": rows})
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
