"""What the accuracy studies share: a study's configurations in, its fine-tuning runs and resumable record out.

Every study fine-tunes Fashion-MNIST classes 5-9 (the fashion_mnist recipe: Rep-Net, 64 px,
batch 32) from one MobileNetV2 0.35 pretrained on classes 0-4 exactly as the
``pretrained_backbone`` fixture of ``tests/conftest.py`` builds it (no download: offline,
from the Debian package dataset-fashion-mnist). Held here: that source task and the
backbones built from it (pretrained; pruned as the paper prunes; retrained on the source),
the target recipe, one fine-tuning run, the predicted peak of a training step, the
network a one-batch gradient check starts from, the record ``OUT/STUDY.json`` with its
table ``OUT/STUDY.md`` (both rewritten atomically after every run; a rerun skips what the
record holds), the command line every study shares, and the commit of the edgetl that ran.
A study module holds only its configurations, how it runs one, and how it summarises
them, and is run from the repository root:

    python -m experiments.levers_accuracy --out DIR
    python -m experiments.storage_accuracy --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from edgetl.models.backbone import PAPER_RATIOS as PAPER_PRUNING

SOURCE_CLASSES = [0, 1, 2, 3, 4]
PAPER_BLOCKS = list(PAPER_PRUNING)
PAPER_RATIOS = list(PAPER_PRUNING.values())
PAPER_BATCH, PAPER_RESOLUTION = 8, 224
RESOLUTION, BATCH_SIZE = 64, 32  # the fashion_mnist recipe's, which every study trains at
# The source task is the fixture's at every scale of a study: the same backbone throughout.
SOURCE_SAMPLES, SOURCE_EPOCHS = 2000, 3


def source_recipe(samples: int, epochs: int, backbone: str | None = None):
    """The pretrained_backbone fixture's source-task recipe (classes 0-4, full fine-tuning)."""
    from edgetl.recipe import load_recipe

    values = {"data.classes": SOURCE_CLASSES, "data.max_samples": samples, "data.max_val_samples": 200,
              "model.mode": "full", "optim.lr_head": 3e-3, "optim.lr_side": None, "train.epochs": epochs}
    if backbone is not None:
        values["model.backbone"] = backbone
    return load_recipe("fashion_mnist", values)


def target_recipe(backbone: Path, *, seed: int, samples: int, epochs: int, val_samples: int, pool: int = 1,
                  precision: str = "fp32", frozen_weights: str = "fp32"):
    """The pooled-storage accuracy test's recipe (classes 5-9, Rep-Net) with these levers set."""
    from edgetl.recipe import load_recipe

    return load_recipe("fashion_mnist", {
        "model.backbone": str(backbone), "model.pool": pool, "model.precision": precision,
        "model.frozen_weights": frozen_weights, "train.seed": seed, "train.epochs": epochs,
        "data.max_samples": samples, "data.max_val_samples": val_samples, "train.checkpoint_every": 100})


def make_backbones(work: Path, *, names: set[str], samples: int = SOURCE_SAMPLES,
                   epochs: int = SOURCE_EPOCHS) -> dict[str, Path]:
    """The backbone folders the configurations need, each built once (kept in ``work``).

    ``names``: of "pretrained" (always built), "pruned" (the paper's blocks and ratios),
    "pruned_retrained" and "control_retrained" (the pruned and the unpruned backbone given
    the same epochs of ``edgetl.retrain`` on the source task).
    """
    from edgetl.data import datasets_from_recipe, loaders_from_recipe
    from edgetl.models.backbone import BackboneSpec, build_backbone, load_backbone, save_backbone
    from edgetl.models.side import set_trainable
    from edgetl.prune import calibration_batches, prune, save_pruned
    from edgetl.retrain import retrain
    from edgetl.train import fit, seed_everything

    folders = {"pretrained": work / "pretrained", "pruned": work / "pruned",
               "pruned_retrained": work / "pruned_retrained", "control_retrained": work / "control_retrained"}
    pre = folders["pretrained"]
    if not (pre / "backbone.json").is_file():
        # tests/conftest.py::pretrained_backbone, step for step
        recipe = source_recipe(samples, epochs)
        seed_everything(0)
        splits = datasets_from_recipe(recipe)
        net = build_backbone(BackboneSpec(width=0.35, num_classes=5))
        set_trainable(net, "full")
        train_loader, val_loader = loaders_from_recipe(recipe, splits)
        shutil.rmtree(pre, ignore_errors=True)
        fit(model=net, train_loader=train_loader, val_loader=val_loader, recipe=recipe, out_dir=pre / "run")
        save_backbone(pre, net)
    if names & {"pruned", "pruned_retrained"} and not (folders["pruned"] / "backbone.json").is_file():
        batches = calibration_batches("fashion-mnist", resolution=64, batches=4)  # as edgetl demo prunes
        result = prune(net=load_backbone(pre), blocks=PAPER_BLOCKS, ratios=PAPER_RATIOS, importance="activation-l2",
                       calib_batches=batches, calibration="fashion-mnist", resolution=64)
        save_pruned(result, folders["pruned"])
    for name, start in (("pruned_retrained", folders["pruned"]), ("control_retrained", pre)):
        if name in names and not (folders[name] / "backbone.json").is_file():
            shutil.rmtree(folders[name], ignore_errors=True)
            seed_everything(0)
            retrain(recipe=source_recipe(samples, epochs, str(start)), out_dir=folders[name])
    return folders


def record_backbones(data: dict, folders: dict[str, Path]) -> None:
    """Each trained backbone's best source-task val top-1 into ``data["backbones"]``."""
    for key, folder in folders.items():
        # the pretrained backbone trained in run/ (the fixture's fit), retrained ones in their own folder
        log = folder / "run" / "metrics.jsonl" if (folder / "run").is_dir() else folder / "metrics.jsonl"
        if log.is_file():
            rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            data.setdefault("backbones", {})[key] = {"source_val_acc1": max(r["val_acc1"] for r in rows)}


def predicted_peak(recipe) -> int:
    """Runtime accounting's predicted peak of one training step of the recipe's network (meta tensors)."""
    from edgetl.finetune import build_model, predict_peak

    return predict_peak(build_model(recipe, len(SOURCE_CLASSES)), recipe, recipe.train.batch_size).total_bytes


def finetune_run(recipe, run_dir: Path) -> dict:
    """One fine-tuning run through ``edgetl.finetune.finetune``, resumed from its last checkpoint if any."""
    from edgetl.finetune import finetune

    resume = (run_dir / "last.pt").is_file()
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = finetune(recipe=recipe, out_dir=run_dir, resume=resume, measure=False)
    return {"best_acc1": max(row["val_acc1"] for row in result.history),
            "val_acc1": [row["val_acc1"] for row in result.history],
            "final_train_loss": result.history[-1].get("train_loss"),
            "seconds": round(time.perf_counter() - t0, 1), "resumed": resume}


def lean_network(recipe, num_classes: int, trained: Path | None):
    """The recipe's lean network in training mode, built after seeding 0 as a seed-0 run builds it.

    ``trained``: a run folder whose model.pt (stock layout) to load first; None: the
    backbone with its new classifier as built.
    """
    import torch

    from edgetl.finetune import build_model, lean_options
    from edgetl.models.side import make_lean
    from edgetl.train import seed_everything

    seed_everything(0)
    net = build_model(recipe, num_classes)
    if trained is not None:
        net.load_state_dict(torch.load(trained / "model.pt", weights_only=True)["model"])
    make_lean(net, lean_options(recipe))
    net.train()
    return net


def seed_results(runs: dict) -> tuple[list[str], list[float], float | None]:
    """A configuration's runs (seed -> run) as seeds in order, their best top-1, mean seconds per run."""
    seeds = sorted(runs, key=int)
    seconds = statistics.mean(runs[s]["seconds"] for s in seeds) if seeds else None
    return seeds, [runs[s]["best_acc1"] for s in seeds], seconds


def git_commit() -> str:
    """The commit of the edgetl that runs (its package folder's repository), '+dirty' if edgetl/ differs."""
    import edgetl

    root = Path(edgetl.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "edgetl"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (edgetl from %s, not a git checkout)" % root
    return head + ("+dirty" if dirty else "")


def threads_text(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def not_measured(names: Iterable[str], data: dict) -> list[str]:
    """The markdown lines naming each configuration's seeds that the record lacks (none: no lines)."""
    missing = [f"{n} (seeds {', '.join(map(str, s))})" for n in names
               if (s := [x for x in data["meta"]["seeds"] if str(x) not in data["results"].get(n, {})])]
    return ["", "Not measured: " + "; ".join(missing) + "."] if missing else []


class Results:
    """A study's record ``OUT/STUDY.json`` and its table ``OUT/STUDY.md``, rewritten together after every change."""

    def __init__(self, out: Path, study: str, data: dict, markdown: Callable[[dict], str]):
        self.out, self.study, self.data, self.markdown = out, study, data, markdown
        self.path = out / f"{study}.json"
        self.table = out / f"{study}.md"
        self.work = out / "work"  # backbones and run folders

    def write(self) -> None:
        from edgetl.io import atomic_text_json, atomic_write_text

        atomic_text_json(self.path, self.data)
        atomic_write_text(self.table, self.markdown(self.data))

    def run_seeds(self, names: Iterable[str], seeds: list[int], run: Callable[[str, int], dict]) -> None:
        """``run(name, seed)`` for every configuration and seed the record lacks, each written as it ends."""
        for name in names:
            done = self.data["results"].setdefault(name, {})
            for seed in seeds:
                if str(seed) in done:
                    continue
                done[str(seed)] = run(name, seed)
                print(f"{name} seed {seed}: best {done[str(seed)]['best_acc1']:.1f} % "
                      f"in {done[str(seed)]['seconds']:.0f} s", flush=True)
                self.write()

    def close(self) -> None:
        self.write()
        print(f"wrote {self.path} and {self.table}")


def study_parser(doc: str, configs: Iterable[str], *, grad_check: str, note: str) -> argparse.ArgumentParser:
    """The options every study takes (``grad_check``, ``note``: the help of --no-grad-check and --note)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON, the table and work/")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2)")
    parser.add_argument("--samples", type=int, default=2000, help="fine-tuning images (2000)")
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs (3)")
    parser.add_argument("--val-samples", type=int, default=1000, help="validation images (1000)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: this runs beside other work)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset, in run order (default all): {', '.join(configs)}")
    parser.add_argument("--no-grad-check", action="store_true", help=grad_check)
    parser.add_argument("--note", default="", help=note)
    parser.add_argument("--table-only", action="store_true", help="rewrite the markdown from the JSON and stop")
    return parser


def open_results(parser: argparse.ArgumentParser, args: argparse.Namespace, *, study: str, configs: Iterable[str],
                 markdown: Callable[[dict], str], scale: dict | None = None,
                 provenance: dict | None = None) -> tuple[Results, list[int], list[str]]:
    """The study's record in ``args.out`` (read back if there), this run's seeds and configurations.

    ``scale``: the study's own settings that a record must share to be extended (beside
    samples, epochs and val_samples); ``provenance``: what else the record notes of the run
    (after the note). With --table-only the record's own meta stays, but for merged seeds
    and note, whatever scale the command line names (nothing is run). An unknown
    configuration or a malformed --seeds is a usage error (exit 2) before anything is
    created. Sets torch's threads and EDGETL_OFFLINE (the backbone is trained here).
    """
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: comma-separated integers expected")
    configs = list(configs)
    names = configs if args.configs is None else [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in configs]
    if unknown:  # before anything is created or imported
        parser.error(f"unknown configs {unknown}; known: {', '.join(configs)}")

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("EDGETL_OFFLINE", "1")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{study}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    command = f"python -m experiments.{study} " + " ".join(
        f"--{k} {v}" for k, v in (("out", out), ("seeds", args.seeds), ("samples", args.samples),
                                  ("epochs", args.epochs), ("val-samples", args.val_samples),
                                  ("threads", args.threads)))
    meta = {"samples": args.samples, "epochs": args.epochs, "val_samples": args.val_samples, "seeds": seeds,
            "threads": args.threads, "resolution": RESOLUTION, "batch_size": BATCH_SIZE, **(scale or {}),
            "note": args.note, **(provenance or {}), "command": command}
    old = data.get("meta")
    keys = ("samples", "epochs", "val_samples", *(scale or {}))
    if old and not args.table_only and any(old.get(k) != meta[k] for k in keys):
        parser.error(f"{path} holds a study at another scale ({ {k: old.get(k) for k in keys} }); "
                     "choose another --out")
    if old:
        meta["seeds"] = sorted(set(old["seeds"]) | set(seeds))
        meta["note"] = args.note or old.get("note", "")
        if args.table_only:  # the study's own record (command, threads, commit) stays
            meta = {**old, "seeds": meta["seeds"], "note": meta["note"]}
    data["meta"] = meta
    data.setdefault("results", {})
    data.setdefault("peaks", {})
    return Results(out, study, data, markdown), seeds, names
