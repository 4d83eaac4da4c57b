"""The fine-tuning accuracy of each lean full fine-tuning storage, measured (issue #16 item 6): runs in, a table out.

``experiments.levers_accuracy``'s study (same source task, same backbone, same target task:
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

    nice -n 10 .venv/bin/python -m experiments.storage_accuracy --out /tmp/storage --threads 2
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from experiments import harness
from experiments.harness import PAPER_BATCH, PAPER_RESOLUTION, RESOLUTION, SOURCE_CLASSES

STUDY = "storage_accuracy"
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
    """The harness's target recipe (classes 5-9, fp32) with this study's mode, runtime and storage."""
    from edgetl.recipe import apply_overrides

    recipe = harness.target_recipe(backbone, pool=config["pool"], seed=seed, samples=samples, epochs=epochs,
                                   val_samples=val_samples)
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
    from edgetl.memory.runtime import runtime_report
    from edgetl.models.backbone import BackboneSpec
    from edgetl.models.side import build_network

    recipe = target_recipe(backbone, config, seed=0, samples=8, epochs=1, val_samples=8)
    at_recipe = harness.predicted_peak(recipe)
    net = build_network(BackboneSpec(width=1.0, num_classes=PAPER_CLASSES), config["mode"], device="meta",
                        lean=lean_of(config))
    paper = runtime_report(net, mode=config["mode"], resolution=PAPER_RESOLUTION, batch_size=PAPER_BATCH)
    return {"recipe": at_recipe, "paper": paper.total_bytes}


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
        net = harness.lean_network(recipe, len(SOURCE_CLASSES), trained)
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
        seeds, accs, seconds = harness.seed_results(data["results"].get(name, {}))
        c = cos.get(config["storage"]) if config["mode"] == "full" and config["runtime"] == "lean" else None
        rows.append({"config": name, "seeds": seeds, "acc": accs,
                     "mean": statistics.mean(accs) if accs else None,
                     "std": statistics.stdev(accs) if len(accs) > 1 else None,
                     "min": min(accs) if accs else None, "max": max(accs) if accs else None,
                     "peak": data["peaks"].get(name, {}), "cos": c,
                     "seconds": seconds})
    return rows


def markdown(data: dict) -> str:
    meta = data["meta"]
    rows = summarize(data)
    src = data.get("backbones", {}).get("pretrained", {}).get("source_val_acc1")
    lines = [
        "# Lean full fine-tuning: each storage's accuracy (issue #16 item 6)",
        "",
        f"Fashion-MNIST classes 5-9 fine-tuned from a MobileNetV2 0.35 pretrained on classes 0-4 "
        f"(`tests/conftest.py::pretrained_backbone`, as `experiments/levers_accuracy.py`"
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
        f"`{meta['command']}` ({harness.threads_text(meta['threads'])}, {meta['note']}; edgetl at "
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
        lines += ["", "Weight-gradient cosine to exact storage, every setting (`grad_cosine` in the JSON: per "
                  "layer, and the cosine / relative error of all conv weight gradients together):", "",
                  "| weights, images | storage | cosine mean | min (layer) | all convs together | rel. error |",
                  "|---|---|---|---|---|---|"]
        for key, per in gc.items():
            for storage, c in per["storages"].items():
                if storage == "exact":
                    continue
                lines.append(f"| {labels.get(key, key)} ({per['layers_compared']} of {per['conv_layers']} convs) "
                             f"| {storage} | {c['mean']:.4f} | {c['min']:.4f} ({c['min_layer']}) | "
                             f"{c['all_convs']:.4f} | {c['rel_error']:.3f} |")
    lines += harness.not_measured(CONFIGS, data)
    return "\n".join(lines) + "\n"


def grad_checks(results: harness.Results, backbone: Path, trained: Path, args) -> None:
    """The weight-gradient cosines not yet in the record whose weights exist (the fine-tuned ones
    once the reference run has finished), each written as soon as it is measured."""
    cosines = results.data.setdefault("grad_cosine", {})
    for key, start, resolution in (("init_64", None, RESOLUTION), ("init_224", None, PAPER_RESOLUTION),
                                   ("trained_64", trained, RESOLUTION), ("trained_224", trained, PAPER_RESOLUTION)):
        if key in cosines or (start is not None and not (start / "model.pt").is_file()):
            continue
        t0 = time.perf_counter()
        cosines[key] = grad_cosines(backbone, samples=args.samples, val_samples=args.val_samples,
                                    trained=start, resolution=resolution)
        cosines[key]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"grad cosine {key} ({cosines[key]['seconds']:.0f} s): " + ", ".join(
            f"{s} {c['mean']:.4f}/{c['min']:.4f}" for s, c in cosines[key]["storages"].items()), flush=True)
        results.write()


def run_one(name: str, seed: int, *, backbone: Path, runs: Path, args) -> dict:
    """One fine-tuning run of configuration ``name`` at ``seed``, in ``runs/<name>_s<seed>``."""
    recipe = target_recipe(backbone, CONFIGS[name], seed=seed, samples=args.samples, epochs=args.epochs,
                           val_samples=args.val_samples)
    return harness.finetune_run(recipe, runs / f"{name}_s{seed}")


def main(argv: list[str] | None = None) -> int:
    parser = harness.study_parser(__doc__, CONFIGS, grad_check="skip the weight-gradient cosines",
                                  note="free text kept in the JSON (e.g. how edgetl was pinned)")
    parser.add_argument("--commit", default=None,
                        help="the commit to record (default: git HEAD of the edgetl that is imported)")
    args = parser.parse_args(argv)

    import edgetl

    results, seeds, names = harness.open_results(
        parser, args, study=STUDY, configs=CONFIGS, markdown=markdown, scale={"full_lr": FULL_LR, "keep": KEEP},
        provenance={"git_commit": args.commit or harness.git_commit(), "edgetl": str(Path(edgetl.__file__).parent)})
    if args.table_only:
        results.close()
        return 0

    data, runs = results.data, results.work / "runs"
    backbone = harness.make_backbones(results.work, names={"pretrained"})["pretrained"]
    harness.record_backbones(data, {"pretrained": backbone})
    for name in CONFIGS:  # every configuration's peak, run or not
        if name not in data["peaks"]:
            data["peaks"][name] = peaks(backbone, CONFIGS[name])
    results.write()
    reference = runs / f"{REFERENCE}_s{seeds[0]}"
    if not args.no_grad_check:
        grad_checks(results, backbone, reference, args)
    results.run_seeds(names, seeds, lambda name, seed: run_one(name, seed, backbone=backbone, runs=runs, args=args))
    if not args.no_grad_check:  # the fine-tuned weights' cosines, now that the reference run exists
        grad_checks(results, backbone, reference, args)
    results.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
