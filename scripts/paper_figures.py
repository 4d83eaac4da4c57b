"""The paper memory model's figures at 224 px (docs/memory.md's table and docs/pipeline.md's
pruning table are rendered from the JSON this writes, scripts/render_docs.py).

    python scripts/paper_figures.py      # seconds; writes benchmarks/paper_figures_224.json

Runs, in this process (``edgetl.cli.main``): ``edgetl prune --ratios 0.3,0.78,0.46,0.46`` of a
MobileNetV2 backbone folder (1000 classes, random weights, weight-L2 importance: which channels
go depends on the weights, how many and what that saves does not) and keeps its
``backbone.json`` record of before and after (hidden channels, params, MACs, Rep-Net's paper
accounting at 102 classes, batch 8); and ``edgetl profile --mode full --accounting paper`` for
full fine-tuning.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

from edgetl.cli import main as edgetl
from edgetl.io import atomic_text_json
from edgetl.models.backbone import PAPER_RATIOS, BackboneSpec, build_backbone, save_backbone

ROOT = Path(__file__).resolve().parents[1]
PRUNE = ["prune", "--ratios", ",".join(map(str, PAPER_RATIOS.values())), "--importance", "weight-l2"]
FULL = ["profile", "--mode", "full", "--accounting", "paper", "--num-classes", "102"]


def _run(args: list[str]) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = edgetl(args)
    if code != 0:
        sys.exit(f"edgetl {' '.join(args)} exited {code}:\n{printed.getvalue()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "paper_figures_224.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, pruned, full = Path(tmp) / "mobilenet_v2", Path(tmp) / "pruned", Path(tmp) / "full.json"
        base.mkdir()
        torch.manual_seed(0)
        save_backbone(base, build_backbone(BackboneSpec(width=1.0, num_classes=1000)))
        _run([*PRUNE, "--checkpoint", str(base), "-o", str(pruned)])
        record = json.loads((pruned / "backbone.json").read_text())
        _run([*FULL, "--json", str(full)])
        profile = json.loads(full.read_text())
    pruning = {k: v for k, v in record["pruning"].items() if k != "history"}
    atomic_text_json(a.out, {
        "torch": torch.__version__,
        "prune": {"command": "edgetl " + " ".join(PRUNE) + " --checkpoint MOBILENET_V2 -o OUT",
                  "pruning": pruning, "before": record["before"], "after": record["after"]},
        "full": {"command": "edgetl " + " ".join(FULL), **{k: profile[k] for k in (
            "resolution", "batch_size", "num_classes", "peak_activation_bytes", "total_bytes")}},
    })
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
