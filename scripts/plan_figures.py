"""`edgetl plan --verify` at 224 px, 102 classes: each budget's plan and the peak its network
measures in real training steps (the table of docs/planner.md, rendered from the JSON this
writes by scripts/render_docs.py).

    python scripts/plan_figures.py                 # CPU, about 5 minutes
    python scripts/plan_figures.py --out FILE      # default benchmarks/plan_verify_224.json

Each row runs the command it records, in this process (``edgetl.cli.main``), with ``--json``
into a temporary folder. The paper-pruned backbone (blocks 1-4 pruned 0.3/0.78/0.46/0.46 as
``edgetl prune`` would, random weights: the planner reads only its shape) is written to a
temporary backbone folder first and given as ``--backbone``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from edgetl.bench import pruned_hidden
from edgetl.cli import main as edgetl
from edgetl.io import atomic_text_json
from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
from edgetl.plan.document import load_plan

ROOT = Path(__file__).resolve().parents[1]
PRUNED = "paper-pruned"
# backbone, budget, batch
ROWS = [
    (PRUNED, "15MB", "8"),
    *(("MobileNetV2", budget, "8") for budget in ("32MB", "64MB", "128MB", "256MB", "1GB")),
    *(("MobileNetV2", budget, "auto") for budget in ("32MB", "64MB", "128MB", "256MB", "1GB")),
]


def _pruned_folder(parent: Path) -> Path:
    """The paper-pruned MobileNetV2 as a backbone folder (random weights)."""
    folder = parent / PRUNED
    folder.mkdir()
    torch.manual_seed(0)
    spec = BackboneSpec(width=1.0, num_classes=102, hidden=pruned_hidden(1.0, 102))
    save_backbone(folder, build_backbone(spec), {"pruned": "0.3,0.78,0.46,0.46 (random weights)"})
    return folder


def run(row: tuple[str, str, str], work: Path, pruned: Path) -> dict:
    backbone, budget, batch = row
    args = ["plan", "--budget", budget, "--batch-size", batch, "--num-classes", "102", "--verify"]
    if backbone == PRUNED:
        args += ["--backbone", PRUNED]
    out = work / f"{backbone}-{budget}-{batch}.json"
    start = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = edgetl([a if a != PRUNED else str(pruned) for a in args] + ["--json", str(out)])
    seconds = time.perf_counter() - start
    if code != 0:
        sys.exit(f"edgetl {' '.join(args)} exited {code}:\n{printed.getvalue()}")
    plan = load_plan(out)
    data = json.loads(out.read_text())
    return {"command": "edgetl " + " ".join(args), "backbone": backbone, "budget": budget, "batch": batch,
            "chosen": plan.chosen.describe(), "batch_size": plan.chosen.batch_size,
            "predicted_bytes": plan.predicted_bytes, "measured_bytes": plan.measured_bytes,
            "verify_steps": plan.verify_steps, "evaluations": data["search"]["evaluations"],
            "search_seconds": data["search"]["seconds"], "seconds": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "plan_verify_224.json")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pruned = _pruned_folder(Path(tmp))
        for row in ROWS:
            r = run(row, Path(tmp), pruned)
            rows.append(r)
            print(f"{r['command']}: {r['chosen']}; predicted {r['predicted_bytes']:,} B, measured "
                  f"{r['measured_bytes']:,} B ({r['seconds']:.0f} s)", flush=True)
    atomic_text_json(a.out, {"torch": torch.__version__, "rows": rows})
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
