"""The fine-tuning accuracy of each lean full fine-tuning storage, measured (issue #16 item 6): runs in, a table out.

``scripts/levers_accuracy.py``'s study (same source task, same backbone, same target task:
Fashion-MNIST classes 5-9 at 64 px, fine-tuned from a MobileNetV2 0.35 pretrained on
classes 0-4 exactly as ``tests/conftest.py::pretrained_backbone`` builds it) for the storages
of lean full fine-tuning (``edgetl.models.lean_full``): ``--mode full`` with
``model.runtime: lean`` folds each BN into its conv, every conv trains, and each conv keeps
its input for the weight gradient by ``model.storage`` (exact; average-pooled by 2 or 4;
or the haar/db3/dct/threshold compressors keeping ``model.keep`` of each map's
coefficients). Beside them: stock full fine-tuning (BN in training mode, another method),
TinyTL-B (mode bias) and Rep-Net (mode repnet), both on the lean runtime at pool 1.

Each configuration trains through ``edgetl.finetune.finetune`` once per seed; the best
validation top-1 is recorded with the runtime accounting's predicted peak of a training
step at the recipe's batch and resolution (the network that trained) and in the paper's
setting (MobileNetV2 1.0, 102 classes, batch 8, 224 px, built on meta). Every full-*
configuration, stock and lean, trains at one learning rate (``FULL_LR``, all parameters:
``edgetl demo``'s target-task full fine-tuning rate); bias and repnet keep the recipe's.

Weight-gradient cosine: on the pretrained backbone (new classifier, as a run starts) and
on the fine-tuned full-exact seed-0 weights, the conv weight gradients of the recipe's loss
on one batch of real target-task images, with each storage against exact storage (same
weights, same batch, the same dropout mask): per storage the mean and min over conv
layers of the cosine (layers whose exact gradient is all zeros left out) and the cosine of
all conv weight gradients together; at 64 px and with the same images upsampled to 224 px.

Writes ``OUT/storage_accuracy.json`` after every run (rerunning skips what it holds) and
``OUT/storage_accuracy.md``; work folders (backbone, run folders) go to ``OUT/work``.

    nice -n 10 .venv/bin/python scripts/storage_accuracy.py --out /tmp/storage --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from levers_accuracy import (  # noqa: E402  (the scripts folder is on sys.path above)
    PAPER_BATCH,
    PAPER_RESOLUTION,
    SOURCE_CLASSES,
    _config,
    make_backbones,
    target_recipe as levers_target_recipe,
)

FULL_LR = 1e-3  # every full-* config, all parameters (edgetl demo's full fine-tuning rate on the target task)
KEEP = 0.1
PAPER_CLASSES = 102
GRAD_IMAGES = 32
REFERENCE = "full-exact"


def _full(runtime: str, storage: str = "exact") -> dict:
    return {"mode": "full", "runtime": runtime, "storage": storage, "pool": 1}


# Run order = table order: the full-fine-tuning pair that anchors the comparison first.
CONFIGS: dict[str, dict] = {
    "full-stock": _full("stock"),
    "full-exact": _full("lean"),
    "full-pool2": _full("lean", "pool2"),
    "full-pool4": _full("lean", "pool4"),
    "full-haar": _full("lean", "haar"),
    "full-db3": _full("lean", "db3"),
    "full-dct": _full("lean", "dct"),
    "full-threshold": _full("lean", "threshold"),
    "bias-lean": {"mode": "bias", "runtime": "lean", "storage": "exact", "pool": 1},
    "repnet": {"mode": "repnet", "runtime": "lean", "storage": "exact", "pool": 1},
}
LEAN_STORAGES = [c["storage"] for c in CONFIGS.values() if c["mode"] == "full" and c["runtime"] == "lean"]


def target_recipe(backbone: Path, config: dict, *, seed: int, samples: int, epochs: int, val_samples: int,
                  overrides: dict | None = None):
    """levers_accuracy's target recipe (classes 5-9) with this study's mode, runtime and storage."""
    from edgetl.recipe import apply_overrides

    recipe = levers_target_recipe(backbone, _config("fp32", "fp32", config["pool"]), seed=seed,
                                  samples=samples, epochs=epochs, val_samples=val_samples)
    values = {"model.mode": config["mode"], "model.runtime": config["runtime"],
              "model.storage": config["storage"], "model.keep": KEEP}
    if config["mode"] == "full":
        values.update({"optim.lr_head": FULL_LR, "optim.lr_side": None})
    values.update(overrides or {})
    return apply_overrides(recipe, values)


def lean_of(config: dict):
    from edgetl.models.side import LeanOptions

    if config["runtime"] == "stock":
        return None
    return LeanOptions(pool=config["pool"], storage=config["storage"], keep=KEEP)


def peaks(backbone: Path, config: dict) -> dict:
    """Predicted peak of a training step: the recipe's network at batch 32, 64 px (its own step:
    loss, Adam, fitted schedule), and the paper's setting by ``runtime_report`` on meta."""
    from edgetl.finetune import build_model, predict_peak
    from edgetl.memory.runtime import runtime_report
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import build_network

    recipe = target_recipe(backbone, config, seed=0, samples=8, epochs=1, val_samples=8)
    at_recipe = predict_peak(build_model(recipe, len(SOURCE_CLASSES)), recipe, recipe.train.batch_size).total_bytes
    net = build_network(BackboneSpec(width=1.0, num_classes=PAPER_CLASSES), config["mode"], device="meta",
                        lean=lean_of(config))
    paper = runtime_report(net, mode=config["mode"], resolution=PAPER_RESOLUTION, batch_size=PAPER_BATCH)
    return {"recipe": at_recipe, "paper": paper.total_bytes}


def run_one(recipe, run_dir: Path) -> dict:
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


def grad_cosines(backbone: Path, *, samples: int, val_samples: int, trained: Path | None,
                 resolution: int) -> dict:
    """Conv weight gradients of one batch with each lean storage against exact storage.

    ``trained``: a run folder whose model.pt (stock layout) to start from; None: the
    pretrained backbone with the new classifier as built for seed 0. ``resolution``: the
    batch's 64 px images, bilinearly upsampled when larger.
    """
    import torch
    import torch.nn.functional as F

    from edgetl.data import datasets_from_recipe, loaders_from_recipe
    from edgetl.finetune import build_model, lean_options
    from edgetl.models.side import make_lean
    from edgetl.train import seed_everything

    grads, losses = {}, {}
    images = labels = None
    for storage in LEAN_STORAGES:
        recipe = target_recipe(backbone, _full("lean", storage), seed=0, samples=samples, epochs=1,
                               val_samples=val_samples, overrides={"train.batch_size": GRAD_IMAGES})
        if images is None:
            splits = datasets_from_recipe(recipe, check=False)
            seed_everything(0)
            images, labels = next(iter(loaders_from_recipe(recipe, splits)[0]))
            if resolution != images.shape[-1]:
                images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False)
        seed_everything(0)
        net = build_model(recipe, len(SOURCE_CLASSES))
        if trained is not None:
            net.load_state_dict(torch.load(trained / "model.pt", weights_only=True)["model"])
        make_lean(net, lean_options(recipe))
        net.train()
        seed_everything(0)  # the same classifier dropout mask for every storage
        loss = F.cross_entropy(net(images).float(), labels, label_smoothing=recipe.optim.label_smoothing)
        loss.backward()
        losses[storage] = float(loss.detach())
        grads[storage] = {n: p.grad.detach().clone() for n, p in net.features.named_parameters()
                          if p.ndim == 4 and p.requires_grad and p.grad is not None}
    ref = grads["exact"]
    layers = [n for n, g in ref.items() if bool(g.any())]
    out = {"images": int(images.shape[0]), "resolution": resolution, "conv_layers": len(ref),
           "layers_compared": len(layers), "loss": losses, "storages": {}}
    for storage, g in grads.items():
        if set(g) != set(ref):
            raise RuntimeError(f"storage {storage}: conv weights {sorted(set(g) ^ set(ref))} differ from exact's")
        cos = [float(F.cosine_similarity(g[n].flatten().double(), ref[n].flatten().double(), dim=0))
               for n in layers]
        flat = torch.cat([g[n].flatten() for n in layers]).double()
        flat_ref = torch.cat([ref[n].flatten() for n in layers]).double()
        out["storages"][storage] = {
            "mean": statistics.mean(cos), "min": min(cos), "min_layer": layers[cos.index(min(cos))],
            "all_convs": float(F.cosine_similarity(flat, flat_ref, dim=0)),
            "rel_error": float((flat - flat_ref).norm() / flat_ref.norm()),
            "per_layer": dict(zip(layers, cos))}
    return out


def summarize(data: dict) -> list[dict]:
    rows = []
    cos = data.get("grad_cosine", {}).get("init_64", {}).get("storages", {})
    for name, config in CONFIGS.items():
        runs = data["results"].get(name, {})
        seeds = sorted(runs, key=int)
        accs = [runs[s]["best_acc1"] for s in seeds]
        c = cos.get(config["storage"]) if config["mode"] == "full" and config["runtime"] == "lean" else None
        rows.append({"config": name, "seeds": seeds, "acc": accs,
                     "mean": statistics.mean(accs) if accs else None,
                     "std": statistics.stdev(accs) if len(accs) > 1 else None,
                     "min": min(accs) if accs else None, "max": max(accs) if accs else None,
                     "peak": data["peaks"].get(name, {}), "cos": c,
                     "seconds": statistics.mean(runs[s]["seconds"] for s in seeds) if seeds else None})
    return rows


def markdown(data: dict) -> str:
    meta = data["meta"]
    rows = summarize(data)
    src = data.get("backbones", {}).get("pretrained", {}).get("source_val_acc1")
    lines = [
        "# Lean full fine-tuning: each storage's accuracy (issue #16 item 6)",
        "",
        f"Fashion-MNIST classes 5-9 fine-tuned from a MobileNetV2 0.35 pretrained on classes 0-4 "
        f"(`tests/conftest.py::pretrained_backbone`, as `scripts/levers_accuracy.py`"
        f"{f'; {src:.1f} % source val top-1' if src is not None else ''}), {meta['resolution']} px, batch "
        f"{meta['batch_size']}, {meta['samples']} training images, {meta['epochs']} epochs, {meta['val_samples']} "
        f"validation images; best val top-1 per seed (seeds {', '.join(map(str, meta['seeds']))}), mean ± std "
        f"(min-max). full-stock: mode full on stock modules (BN in training mode, gammas train); full-<storage>: "
        f"mode full on the lean runtime (BN folded into every conv, which trains; each conv's input kept for its "
        f"weight gradient by the storage; compressors keep {KEEP:g} of each map's coefficients). All full-* runs: "
        f"Adam, lr {meta['full_lr']:g} for every parameter (optim.lr_head, no lr_side), cosine schedule, label "
        f"smoothing 0.1. bias-lean (TinyTL-B) and repnet: lean runtime, pool 1, the recipe's rates (lr_head 3e-3, "
        f"lr_side 1e-2). Peak = the runtime accounting's predicted peak of one training step (MB = 10^6 B): at "
        f"{PAPER_BATCH}/{PAPER_RESOLUTION} = MobileNetV2 1.0, {PAPER_CLASSES} classes, batch {PAPER_BATCH}, "
        f"{PAPER_RESOLUTION} px (`runtime_report` on meta, Adam); at b{meta['batch_size']}/{meta['resolution']} = the "
        f"network that trained, with its recipe's step. Weight-grad cosine: conv weight gradients of one batch of "
        f"{GRAD_IMAGES} real target images (the recipe's loss, same weights, same dropout mask) against exact "
        f"storage, on the pretrained backbone with the new seed-0 classifier at 64 px; mean / min over the conv "
        f"layers (layers whose exact gradient is all zeros left out).",
        "",
        f"`{meta['command']}` ({meta['threads']} thread{'s' if meta['threads'] != 1 else ''}, {meta['note']}; edgetl at "
        f"commit {meta['git_commit'][:10]})",
        "",
        f"| configuration | predicted MB, b{PAPER_BATCH}/{PAPER_RESOLUTION} px | predicted MB, "
        f"b{meta['batch_size']}/{meta['resolution']} px | top-1 per seed (%) | mean ± std (min-max) | "
        f"weight-grad cosine mean / min | s/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        accs = " / ".join(f"{a:.1f}" for a in r["acc"]) or "—"
        if r["mean"] is None:
            summary = "not run"
        else:
            std = f" ± {r['std']:.2f}" if r["std"] is not None else ""
            summary = f"{r['mean']:.2f}{std} ({r['min']:.1f}-{r['max']:.1f})"
        cos = "—" if r["cos"] is None else f"{r['cos']['mean']:.4f} / {r['cos']['min']:.4f}"
        peak = r["peak"]
        paper = f"{peak['paper'] / 1e6:.2f}" if peak else "?"
        at_recipe = f"{peak['recipe'] / 1e6:.2f}" if peak else "?"
        seconds = "—" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {r['config']} | {paper} | {at_recipe} | {accs} | {summary} | {cos} | {seconds} |")
    ref = next((r for r in rows if r["config"] == REFERENCE and r["mean"] is not None), None)
    if ref:
        deltas = [f"{r['config']} {r['mean'] - ref['mean']:+.2f}" for r in rows
                  if r["mean"] is not None and r["config"] != REFERENCE]
        lines += ["", f"Mean top-1 against {REFERENCE} (points): " + ", ".join(deltas) + "."]
    gc = data.get("grad_cosine", {})
    if gc:
        labels = {"init_64": "pretrained + new classifier, 64 px", "init_224": "pretrained + new classifier, "
                  "same images upsampled to 224 px", "trained_64": f"{REFERENCE} seed 0 fine-tuned weights, 64 px",
                  "trained_224": f"{REFERENCE} seed 0 fine-tuned weights, 224 px"}
        lines += ["", f"Weight-gradient cosine to exact storage, every setting (`grad_cosine` in the JSON: per "
                  f"layer, and the cosine / relative error of all conv weight gradients together):", "",
                  "| weights, images | storage | cosine mean | min (layer) | all convs together | rel. error |",
                  "|---|---|---|---|---|---|"]
        for key, per in gc.items():
            for storage, c in per["storages"].items():
                if storage == "exact":
                    continue
                lines.append(f"| {labels.get(key, key)} ({per['layers_compared']} of {per['conv_layers']} convs) "
                             f"| {storage} | {c['mean']:.4f} | {c['min']:.4f} ({c['min_layer']}) | "
                             f"{c['all_convs']:.4f} | {c['rel_error']:.3f} |")
    missing = [f"{n} (seeds {', '.join(map(str, s))})" for n in CONFIGS
               if (s := [x for x in meta["seeds"] if str(x) not in data["results"].get(n, {})])]
    if missing:
        lines += ["", "Not measured: " + "; ".join(missing) + "."]
    return "\n".join(lines) + "\n"


def write(out: Path, data: dict) -> None:
    from edgetl.io import atomic_text_json

    atomic_text_json(out / "storage_accuracy.json", data)
    (out / "storage_accuracy.md.tmp").write_text(markdown(data))
    os.replace(out / "storage_accuracy.md.tmp", out / "storage_accuracy.md")


def grad_checks(data: dict, out: Path, backbone: Path, trained: Path, args) -> None:
    """The weight-gradient cosines not yet in ``data`` whose weights exist (the fine-tuned ones
    once the reference run has finished), each written as soon as it is measured."""
    cosines = data.setdefault("grad_cosine", {})
    for key, start, resolution in (("init_64", None, 64), ("init_224", None, PAPER_RESOLUTION),
                                   ("trained_64", trained, 64), ("trained_224", trained, PAPER_RESOLUTION)):
        if key in cosines or (start is not None and not (start / "model.pt").is_file()):
            continue
        t0 = time.perf_counter()
        cosines[key] = grad_cosines(backbone, samples=args.samples, val_samples=args.val_samples,
                                    trained=start, resolution=resolution)
        cosines[key]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"grad cosine {key} ({cosines[key]['seconds']:.0f} s): " + ", ".join(
            f"{s} {c['mean']:.4f}/{c['min']:.4f}" for s, c in cosines[key]["storages"].items()), flush=True)
        write(out, data)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON, the table and work/")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2)")
    parser.add_argument("--samples", type=int, default=2000, help="fine-tuning images (2000)")
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs (3)")
    parser.add_argument("--val-samples", type=int, default=1000, help="validation images (1000)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: this runs beside other work)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset, in run order (default all): {', '.join(CONFIGS)}")
    parser.add_argument("--no-grad-check", action="store_true", help="skip the weight-gradient cosines")
    parser.add_argument("--commit", default=None,
                        help="the commit to record (default: git HEAD of the edgetl that is imported)")
    parser.add_argument("--note", default="", help="free text kept in the JSON (e.g. how edgetl was pinned)")
    parser.add_argument("--table-only", action="store_true", help="rewrite the markdown from the JSON and stop")
    args = parser.parse_args(argv)

    import torch

    import edgetl

    torch.set_num_threads(args.threads)
    os.environ.setdefault("EDGETL_OFFLINE", "1")  # nothing is downloaded: the backbone is trained here
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / "storage_accuracy.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    seeds = [int(s) for s in args.seeds.split(",")]
    names = list(CONFIGS) if args.configs is None else [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    meta = {"samples": args.samples, "epochs": args.epochs, "val_samples": args.val_samples, "seeds": seeds,
            "threads": args.threads, "resolution": 64, "batch_size": 32, "full_lr": FULL_LR, "keep": KEEP,
            "note": args.note, "git_commit": args.commit or git_commit(), "edgetl": str(Path(edgetl.__file__).parent),
            "command": "python scripts/storage_accuracy.py " + " ".join(
                f"--{k} {v}" for k, v in (("out", out), ("seeds", args.seeds), ("samples", args.samples),
                                          ("epochs", args.epochs), ("val-samples", args.val_samples),
                                          ("threads", args.threads)))}
    old = data.get("meta")
    scale = ("samples", "epochs", "val_samples", "full_lr", "keep")
    if old and any(old.get(k) != meta[k] for k in scale):
        parser.error(f"{path} holds a study at another scale ({ {k: old.get(k) for k in scale} }); "
                     "choose another --out")
    if old:
        meta["seeds"] = sorted(set(old["seeds"]) | set(seeds))
        meta["note"] = args.note or old.get("note", "")
        if args.table_only:  # the study's own record (commit, command, threads, notes) stays
            meta = {**old, "seeds": meta["seeds"], "note": meta["note"]}
    data["meta"] = meta
    data.setdefault("results", {})
    data.setdefault("peaks", {})
    if args.table_only:
        write(out, data)
        return 0

    work = out / "work"
    folders = make_backbones(work, names={"pretrained"})
    backbone = folders["pretrained"]
    log = backbone / "run" / "metrics.jsonl"
    if log.is_file():
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        data["backbones"] = {"pretrained": {"source_val_acc1": max(r["val_acc1"] for r in rows)}}
    for name in CONFIGS:
        if name not in data["peaks"]:
            data["peaks"][name] = peaks(backbone, CONFIGS[name])
    write(out, data)
    if not args.no_grad_check:
        grad_checks(data, out, backbone, work / "runs" / f"{REFERENCE}_s{seeds[0]}", args)
    for name in names:
        config = CONFIGS[name]
        for seed in seeds:
            done = data["results"].setdefault(name, {})
            if str(seed) in done:
                continue
            recipe = target_recipe(backbone, config, seed=seed, samples=args.samples, epochs=args.epochs,
                                   val_samples=args.val_samples)
            done[str(seed)] = run_one(recipe, work / "runs" / f"{name}_s{seed}")
            print(f"{name} seed {seed}: best {done[str(seed)]['best_acc1']:.1f} % "
                  f"in {done[str(seed)]['seconds']:.0f} s", flush=True)
            write(out, data)
    if not args.no_grad_check:  # the fine-tuned weights' cosines, now that the reference run exists
        grad_checks(data, out, backbone, work / "runs" / f"{REFERENCE}_s{seeds[0]}", args)
    write(out, data)
    print(f"wrote {path} and {out / 'storage_accuracy.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
