"""Every memory lever's fine-tuning accuracy cost, measured (issue #17 item 8): runs in, a table out.

The study of ``tests/test_finetune.py::test_finetune_learns_and_pooled_storage_costs_under_a_point``
widened to every lever of the lean runtime: Fashion-MNIST classes 5-9 fine-tuned (Rep-Net,
64 px) on a MobileNetV2 0.35 pretrained on classes 0-4 exactly as the ``pretrained_backbone``
fixture of ``tests/conftest.py`` builds it (no download: offline, from the Debian package
dataset-fashion-mnist). Each configuration trains through ``edgetl.finetune.finetune`` once per
seed; the best validation top-1 is recorded with the runtime accounting's predicted peak of
a training step, both at the recipe's batch and resolution (what trained) and at batch 8,
224 px (the paper's setting, same network).

Configurations: activations fp32/bf16/fp16 x frozen weights fp32/fp16/int8 (pool 1);
``model.pool`` 2 and 4; the paper's pruning (blocks 1-4 by 0.3/0.78/0.46/0.46, activation-L2
importance on Fashion-MNIST) without and with 3 epochs of retraining on the source task, and
a control that gives the unpruned backbone the same 3 extra epochs.

Writes ``OUT/levers_accuracy.json`` after every run (rerunning skips what it holds) and
``OUT/levers_accuracy.md``; work folders (backbones, run folders) go to ``OUT/work``.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/levers_accuracy.py --out /tmp/levers

The defaults are the accuracy test's scale (2000 images, 3 epochs, 1000 validation images);
benchmarks/levers_accuracy.* were run with ``--samples 1000`` (about 45 minutes on one CPU
thread: bf16 and fp16 convolutions run 3x slower than fp32 there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

SOURCE_CLASSES = [0, 1, 2, 3, 4]
PAPER_BLOCKS = [1, 2, 3, 4]
PAPER_RATIOS = [0.3, 0.78, 0.46, 0.46]
PAPER_BATCH, PAPER_RESOLUTION = 8, 224
BASELINE = "fp32/fp32/pool1"
# The source task is the fixture's at every scale of the study: the same backbone throughout.
SOURCE_SAMPLES, SOURCE_EPOCHS = 2000, 3


def _config(act: str, weights: str, pool: int = 1, backbone: str = "pretrained") -> dict:
    return {"precision": act, "frozen_weights": weights, "pool": pool, "backbone": backbone}


# Run order: the fast fp32-activation runs first, so a cut-short study has the most configs;
# the two pruning controls last.
CONFIGS: dict[str, dict] = {
    BASELINE: _config("fp32", "fp32"),
    "fp32/fp16/pool1": _config("fp32", "fp16"),
    "fp32/int8/pool1": _config("fp32", "int8"),
    "fp32/fp32/pool2": _config("fp32", "fp32", 2),
    "fp32/fp32/pool4": _config("fp32", "fp32", 4),
    "pruned+retrained": _config("fp32", "fp32", backbone="pruned_retrained"),
    "bf16/fp32/pool1": _config("bf16", "fp32"),
    "bf16/fp16/pool1": _config("bf16", "fp16"),
    "bf16/int8/pool1": _config("bf16", "int8"),
    "fp16/fp32/pool1": _config("fp16", "fp32"),
    "fp16/fp16/pool1": _config("fp16", "fp16"),
    "fp16/int8/pool1": _config("fp16", "int8"),
    "pruned (not retrained)": _config("fp32", "fp32", backbone="pruned"),
    "control: unpruned+retrained": _config("fp32", "fp32", backbone="control_retrained"),
}
# Table order: the 3 x 3 dtype grid, then pooling, then pruning beside its control.
TABLE_ORDER = [f"{a}/{w}/pool1" for a in ("fp32", "bf16", "fp16") for w in ("fp32", "fp16", "int8")] + [
    "fp32/fp32/pool2", "fp32/fp32/pool4", "pruned+retrained", "pruned (not retrained)", "control: unpruned+retrained"]


def source_recipe(samples: int, epochs: int, backbone: str | None = None):
    """The pretrained_backbone fixture's source-task recipe (classes 0-4, full fine-tuning)."""
    from edgetl.recipe import load_recipe

    values = {"data.classes": SOURCE_CLASSES, "data.max_samples": samples, "data.max_val_samples": 200,
              "model.mode": "full", "optim.lr_head": 3e-3, "optim.lr_side": None, "train.epochs": epochs}
    if backbone is not None:
        values["model.backbone"] = backbone
    return load_recipe("fashion_mnist", values)


def target_recipe(backbone: Path, config: dict, *, seed: int, samples: int, epochs: int, val_samples: int):
    """The pooled-storage accuracy test's recipe (classes 5-9, Rep-Net) with one lever set."""
    from edgetl.recipe import load_recipe

    return load_recipe("fashion_mnist", {
        "model.backbone": str(backbone), "model.pool": config["pool"], "model.precision": config["precision"],
        "model.frozen_weights": config["frozen_weights"], "train.seed": seed, "train.epochs": epochs,
        "data.max_samples": samples, "data.max_val_samples": val_samples, "train.checkpoint_every": 100})


def make_backbones(work: Path, *, names: set[str], samples: int = SOURCE_SAMPLES,
                   epochs: int = SOURCE_EPOCHS) -> dict[str, Path]:
    """The backbone folders the configurations need, each built once (kept in ``work``)."""
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


def peak_bytes(backbone: Path, config: dict, *, resolution: int, batch_size: int) -> int:
    """Runtime accounting's predicted peak of one training step (meta tensors: no compute)."""
    from edgetl.finetune import build_model, predict_peak
    from edgetl.recipe import apply_overrides

    recipe = apply_overrides(target_recipe(backbone, config, seed=0, samples=8, epochs=1, val_samples=8),
                             {"data.resolution": resolution, "train.batch_size": batch_size})
    return predict_peak(build_model(recipe, len(SOURCE_CLASSES)), recipe, batch_size).total_bytes


def run_one(backbone: Path, config: dict, run_dir: Path, *, seed: int, samples: int, epochs: int,
            val_samples: int) -> dict:
    from edgetl.finetune import finetune

    recipe = target_recipe(backbone, config, seed=seed, samples=samples, epochs=epochs, val_samples=val_samples)
    resume = (run_dir / "last.pt").is_file()
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = finetune(recipe=recipe, out_dir=run_dir, resume=resume, measure=False)
    return {"best_acc1": max(row["val_acc1"] for row in result.history),
            "val_acc1": [row["val_acc1"] for row in result.history],
            "final_train_loss": result.history[-1].get("train_loss"),
            "seconds": round(time.perf_counter() - t0, 1), "resumed": resume}


def grad_check(backbone: Path, *, samples: int, val_samples: int, trained: Path | None) -> dict:
    """Does fp16 need loss scaling? Gradients of one batch at fp32, bf16 and fp16 activations.

    For each activation dtype: the fraction of exactly-zero gradient elements in the side
    network's and classifier's parameters, and their cosine to the fp32 gradients. On the
    fp32 run: the fraction of the nonzero gradients flowing through the frozen backbone
    (each lean conv's output gradient) that fp16 would flush to zero (< 2^-24) or hold as
    a subnormal (< 2^-14). ``trained``: a fine-tuned run folder whose model.pt to start
    from (gradients shrink as the loss falls); None: the network at initialisation.
    """
    import torch
    import torch.nn.functional as F

    from edgetl.data import datasets_from_recipe, loaders_from_recipe
    from edgetl.finetune import build_model, lean_options
    from edgetl.models.lean import FrozenConvBNAct
    from edgetl.models.side import make_lean
    from edgetl.train import seed_everything

    grads, flow = {}, {}
    for act, scale in (("fp32", 1), ("bf16", 1), ("fp16", 1), ("fp16", 1024)):
        label = act if scale == 1 else f"{act}, loss x{scale}"
        recipe = target_recipe(backbone, _config(act, "fp32"), seed=0, samples=samples, epochs=1,
                               val_samples=val_samples)
        splits = datasets_from_recipe(recipe, check=False)
        seed_everything(0)
        net = build_model(recipe, splits.num_classes)
        if trained is not None:
            net.load_state_dict(torch.load(trained / "model.pt", weights_only=True)["model"])
        make_lean(net, lean_options(recipe))
        net.train()
        images, labels = next(iter(loaders_from_recipe(recipe, splits)[0]))
        seed_everything(0)  # the same dropout mask in every dtype
        stats = {"n": 0, "zero": 0, "below_2^-24": 0, "below_2^-14": 0}

        def count(grad, stats=stats):
            g = grad.detach().float().abs()
            stats["n"] += g.numel()
            stats["zero"] += int((g == 0).sum())
            stats["below_2^-24"] += int(((g > 0) & (g < 2.0**-24)).sum())
            stats["below_2^-14"] += int(((g > 0) & (g < 2.0**-14)).sum())

        def hook(module, inputs, output):
            if output.requires_grad:  # frozen layers before the first side branch get no gradient
                output.register_hook(count)

        hooks = [m.register_forward_hook(hook)
                 for m in net.features.modules() if isinstance(m, FrozenConvBNAct)]
        loss = F.cross_entropy(net(images).float(), labels, label_smoothing=recipe.optim.label_smoothing)
        (loss * scale).backward()
        for h in hooks:
            h.remove()
        grads[label] = {n: p.grad.detach().float() / scale for n, p in net.named_parameters()
                      if p.requires_grad and p.grad is not None and n.startswith(("side.", "classifier."))}
        nonzero = max(stats["n"] - stats["zero"], 1)
        flow[label] = {"backbone_grad_elements": stats["n"], "zero_fraction": stats["zero"] / max(stats["n"], 1),
                     "nonzero_below_2^-24": stats["below_2^-24"] / nonzero,
                     "nonzero_below_2^-14": stats["below_2^-14"] / nonzero, "loss": float(loss.detach())}
    out = {}
    for act, g in grads.items():
        side = [v for n, v in g.items() if n.startswith("side.")]
        flat = torch.cat([v.flatten() for v in side])
        ref = torch.cat([grads["fp32"][n].flatten() for n in g if n.startswith("side.")])
        out[act] = {"side_zero_fraction": float((flat == 0).float().mean()),
                    "side_cosine_to_fp32": float(F.cosine_similarity(flat, ref, dim=0)),
                    "side_rel_error_to_fp32": float((flat - ref).norm() / ref.norm()),
                    "backbone_flow": flow[act]}
    return out


def summarize(results: dict, peaks: dict) -> list[dict]:
    base = results.get(BASELINE, {})
    base_mean = statistics.mean(r["best_acc1"] for r in base.values()) if base else None
    rows = []
    for name in TABLE_ORDER:
        runs = results.get(name, {})
        if not runs:
            continue
        accs = [runs[s]["best_acc1"] for s in sorted(runs, key=int)]
        mean = statistics.mean(accs)
        peak = peaks.get(name, {})
        saved = {k: peaks[BASELINE][k] - v for k, v in peak.items()} if BASELINE in peaks else {}
        delta = None if base_mean is None else mean - base_mean
        saved_mb = saved.get("paper", 0) / 1e6
        # same seed, same classifier init and data order: the paired difference is less noisy
        paired = [runs[s]["best_acc1"] - base[s]["best_acc1"] for s in sorted(runs, key=int) if s in base]
        rows.append({"config": name, "seeds": sorted(runs, key=int), "acc": accs, "paired": paired,
                     "mean": mean, "min": min(accs),
                     "max": max(accs), "delta": delta, "peak": peak, "saved": saved,
                     "points_per_mb": (-delta / saved_mb) if delta is not None and saved_mb > 0 else None,
                     "seconds": statistics.mean(runs[s]["seconds"] for s in runs)})
    return rows


def markdown(data: dict) -> str:
    meta = data["meta"]
    rows = summarize(data["results"], data["peaks"])
    lines = [
        "# Every lever's accuracy cost (issue #17 item 8)",
        "",
        f"Fashion-MNIST classes 5-9, Rep-Net fine-tuning of a MobileNetV2 0.35 pretrained on classes 0-4 "
        f"(`tests/conftest.py::pretrained_backbone`), {meta['resolution']} px, batch {meta['batch_size']}, "
        f"{meta['samples']} training images, {meta['epochs']} epochs, {meta['val_samples']} validation images; "
        f"best val top-1 per seed (seeds {', '.join(map(str, meta['seeds']))}). Config = activations / frozen "
        f"weights / pool. Peak = the runtime accounting's predicted peak of one training step (MB = 10^6 B) "
        f"at the recipe's batch and resolution, and at batch {PAPER_BATCH}, {PAPER_RESOLUTION} px (same "
        f"network, 5 classes); saved and points per MB are at {PAPER_BATCH}/{PAPER_RESOLUTION}. "
        f"Points per MB = (baseline mean - mean) / MB saved: lower is cheaper, negative = no measured loss. "
        f"Pruning: blocks {','.join(map(str, PAPER_BLOCKS))} by {','.join(map(str, PAPER_RATIOS))} (edgetl.prune, "
        f"activation-L2 on Fashion-MNIST), then {SOURCE_EPOCHS} epochs of `edgetl.retrain` on the source task; the "
        f"control gives the unpruned backbone the same {SOURCE_EPOCHS} epochs, so pruning's own cost is "
        f"pruned+retrained against the control. Pooling: at 64 px `effective_pool` stores the side convs' "
        f"inputs pooled 2 2 1 1 1 1 for pool 2 and pool 4 alike (the same run), and the step's peak is a "
        f"forward temporary, not stored side inputs, so the peak does not move.",
        "",
        f"`{meta['command']}` ({meta['threads']} thread{'s' if meta['threads'] != 1 else ''}; {meta['note']})",
        "",
        "| config | top-1 per seed (%) | mean | min | max | Δ mean (points) | Δ per seed | peak MB, b"
        f"{meta['batch_size']}/{meta['resolution']} px | peak MB, b{PAPER_BATCH}/{PAPER_RESOLUTION} px | "
        "saved MB | points lost per MB saved | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = "—" if r["config"] == BASELINE else (f"{r['delta']:+.2f}" if r["delta"] is not None else "?")
        paired = "—" if r["config"] == BASELINE else " / ".join(f"{d:+.1f}" for d in r["paired"])
        per_mb = "—" if r["points_per_mb"] is None else f"{r['points_per_mb']:+.3f}"
        lines.append(
            f"| {r['config']} | {' / '.join(f'{a:.1f}' for a in r['acc'])} | {r['mean']:.2f} | {r['min']:.1f} | "
            f"{r['max']:.1f} | {delta} | {paired} | {r['peak'].get('recipe', 0) / 1e6:.2f} | "
            f"{r['peak'].get('paper', 0) / 1e6:.2f} | {r['saved'].get('paper', 0) / 1e6:.2f} | {per_mb} | "
            f"{r['seconds']:.0f} |")
    missing = [f"{n} (seeds {', '.join(map(str, s))})" for n in TABLE_ORDER
               if (s := [x for x in meta["seeds"] if str(x) not in data["results"].get(n, {})])]
    if missing:
        lines += ["", "Not measured: " + "; ".join(missing) + "."]
    base = next((r for r in rows if r["config"] == BASELINE), None)
    if base and len(base["acc"]) > 1:
        lines += ["", f"Noise: the baseline's seeds span {base['max'] - base['min']:.1f} points; a Δ mean "
                  "within about that is not resolved by these seeds, and its points per MB only ranks by "
                  "bytes saved."]
    ranked = sorted((r for r in rows if r["points_per_mb"] is not None), key=lambda r: r["points_per_mb"])
    if ranked:
        lines += ["", "By measured cost per MB saved (cheapest first): "
                  + ", ".join(f"{r['config']} ({r['points_per_mb']:+.3f})" for r in ranked) + "."]
    if data.get("grad_check"):
        lines += ["", "Gradients of one batch (32 images) against fp32 activations (`grad_check` in the JSON; "
                  "the last two columns count the gradients flowing through the frozen backbone in that run: "
                  "in the fp32 row, what fp16 would flush to zero or hold as a subnormal):", "",
                  "| start | activations | side grad zero fraction | side grad cosine to fp32 | "
                  "backbone grads' nonzero elements < 2^-24 | < 2^-14 |", "|---|---|---|---|---|---|"]
        for start, per in data["grad_check"].items():
            for act, g in per.items():
                f = g["backbone_flow"]
                lines.append(f"| {start} | {act} | {g['side_zero_fraction']:.4f} | {g['side_cosine_to_fp32']:.5f} | "
                             f"{f['nonzero_below_2^-24']:.2e} | {f['nonzero_below_2^-14']:.2e} |")
    return "\n".join(lines) + "\n"


def write(out: Path, data: dict) -> None:
    from edgetl.io import atomic_text_json

    atomic_text_json(out / "levers_accuracy.json", data)
    (out / "levers_accuracy.md.tmp").write_text(markdown(data))
    os.replace(out / "levers_accuracy.md.tmp", out / "levers_accuracy.md")


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
    parser.add_argument("--no-grad-check", action="store_true", help="skip the fp16 gradient underflow check")
    parser.add_argument("--note", default="", help="free text kept in the JSON (e.g. which commit ran)")
    parser.add_argument("--table-only", action="store_true", help="rewrite the markdown from the JSON and stop")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("EDGETL_OFFLINE", "1")  # nothing is downloaded: the backbone is trained here
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / "levers_accuracy.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    seeds = [int(s) for s in args.seeds.split(",")]
    names = list(CONFIGS) if args.configs is None else [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    meta = {"samples": args.samples, "epochs": args.epochs, "val_samples": args.val_samples, "seeds": seeds,
            "threads": args.threads, "resolution": 64, "batch_size": 32, "note": args.note,
            "command": "python scripts/levers_accuracy.py " + " ".join(
                f"--{k} {v}" for k, v in (("out", out), ("seeds", args.seeds), ("samples", args.samples),
                                          ("epochs", args.epochs), ("threads", args.threads)))}
    old = data.get("meta")
    scale = ("samples", "epochs", "val_samples")
    if old and any(old[k] != meta[k] for k in scale):
        parser.error(f"{path} holds a study at another scale ({ {k: old[k] for k in scale} }); choose another --out")
    if old:
        meta["seeds"] = sorted(set(old["seeds"]) | set(seeds))
        meta["note"] = args.note or old.get("note", "")
    data["meta"] = meta
    data.setdefault("results", {})
    data.setdefault("peaks", {})
    if args.table_only:
        write(out, data)
        return 0

    work = out / "work"
    folders = make_backbones(work, names={CONFIGS[n]["backbone"] for n in names} | {"pretrained"})
    data["backbones"] = {}
    for key, folder in folders.items():
        if (folder / "run" / "metrics.jsonl").is_file() or (folder / "metrics.jsonl").is_file():
            log = folder / "run" / "metrics.jsonl" if (folder / "run").is_dir() else folder / "metrics.jsonl"
            rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            data["backbones"][key] = {"source_val_acc1": max(r["val_acc1"] for r in rows)}
    for name in [BASELINE] + [n for n in names if n != BASELINE]:
        config = CONFIGS[name]
        backbone = folders[config["backbone"]]
        if name not in data["peaks"]:
            data["peaks"][name] = {
                "recipe": peak_bytes(backbone, config, resolution=64, batch_size=32),
                "paper": peak_bytes(backbone, config, resolution=PAPER_RESOLUTION, batch_size=PAPER_BATCH)}
        if name not in names:
            continue
        for seed in seeds:
            done = data["results"].setdefault(name, {})
            if str(seed) in done:
                continue
            slug = "".join(c if c.isalnum() else "_" for c in name)
            done[str(seed)] = run_one(backbone, config, work / "runs" / f"{slug}_s{seed}", seed=seed,
                                      samples=args.samples, epochs=args.epochs, val_samples=args.val_samples)
            print(f"{name} seed {seed}: best {done[str(seed)]['best_acc1']:.1f} % "
                  f"in {done[str(seed)]['seconds']:.0f} s", flush=True)
            write(out, data)
    if not args.no_grad_check and "grad_check" not in data:
        base_run = work / "runs" / f"fp32_fp32_pool1_s{seeds[0]}"
        data["grad_check"] = {"initialisation": grad_check(folders["pretrained"], samples=args.samples,
                                                            val_samples=args.val_samples, trained=None)}
        if (base_run / "model.pt").is_file():
            data["grad_check"]["after fine-tuning (baseline seed %d)" % seeds[0]] = grad_check(
                folders["pretrained"], samples=args.samples, val_samples=args.val_samples, trained=base_run)
    write(out, data)
    print(f"wrote {path} and {out / 'levers_accuracy.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
