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

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.levers_accuracy --out /tmp/levers

The defaults are the accuracy test's scale (2000 images, 3 epochs, 1000 validation images);
benchmarks/levers_accuracy.* were run with ``--samples 1000`` (about 45 minutes on one CPU
thread: bf16 and fp16 convolutions run 3x slower than fp32 there).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments import harness
from experiments.harness import (
    BATCH_SIZE,
    PAPER_BATCH,
    PAPER_BLOCKS,
    PAPER_RATIOS,
    PAPER_RESOLUTION,
    RESOLUTION,
    SOURCE_EPOCHS,
)

STUDY = "levers_accuracy"
BASELINE = "fp32/fp32/pool1"


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


def target_recipe(backbone: Path, config: dict, *, seed: int, samples: int, epochs: int, val_samples: int):
    """The harness's target recipe with this configuration's levers."""
    return harness.target_recipe(backbone, pool=config["pool"], precision=config["precision"],
                                 frozen_weights=config["frozen_weights"], seed=seed, samples=samples,
                                 epochs=epochs, val_samples=val_samples)


def peak_bytes(backbone: Path, config: dict, *, resolution: int, batch_size: int) -> int:
    """Runtime accounting's predicted peak of one training step (meta tensors: no compute)."""
    from edgetl.recipe import apply_overrides

    recipe = apply_overrides(target_recipe(backbone, config, seed=0, samples=8, epochs=1, val_samples=8),
                             {"data.resolution": resolution, "train.batch_size": batch_size})
    return harness.predicted_peak(recipe)


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
    from edgetl.models.lean import FrozenConvBNAct
    from edgetl.train import seed_everything

    grads, flow = {}, {}
    for act, scale in (("fp32", 1), ("bf16", 1), ("fp16", 1), ("fp16", 1024)):
        label = act if scale == 1 else f"{act}, loss x{scale}"
        recipe = target_recipe(backbone, _config(act, "fp32"), seed=0, samples=samples, epochs=1,
                               val_samples=val_samples)
        splits = datasets_from_recipe(recipe, check=False)
        net = harness.lean_network(recipe, splits.num_classes, trained)
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
        seeds, accs, seconds = harness.seed_results(runs)
        mean = statistics.mean(accs)
        peak = peaks.get(name, {})
        saved = {k: peaks[BASELINE][k] - v for k, v in peak.items()} if BASELINE in peaks else {}
        delta = None if base_mean is None else mean - base_mean
        saved_mb = saved.get("paper", 0) / 1e6
        # same seed, same classifier init and data order: the paired difference is less noisy
        paired = [runs[s]["best_acc1"] - base[s]["best_acc1"] for s in seeds if s in base]
        rows.append({"config": name, "seeds": seeds, "acc": accs, "paired": paired,
                     "mean": mean, "min": min(accs),
                     "max": max(accs), "delta": delta, "peak": peak, "saved": saved,
                     "points_per_mb": (-delta / saved_mb) if delta is not None and saved_mb > 0 else None,
                     "seconds": seconds})
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
        f"`{meta['command']}` ({harness.threads_text(meta['threads'])}; {meta['note']})",
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
    lines += harness.not_measured(TABLE_ORDER, data)
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


def _slug(name: str) -> str:
    """A configuration's name as a run folder's (``fp32/fp32/pool1`` -> ``fp32_fp32_pool1``)."""
    return "".join(c if c.isalnum() else "_" for c in name)


def run_one(name: str, seed: int, *, folders: dict[str, Path], runs: Path, args) -> dict:
    """One fine-tuning run of configuration ``name`` at ``seed``, in ``runs/<slug>_s<seed>``."""
    config = CONFIGS[name]
    recipe = target_recipe(folders[config["backbone"]], config, seed=seed, samples=args.samples,
                           epochs=args.epochs, val_samples=args.val_samples)
    return harness.finetune_run(recipe, runs / f"{_slug(name)}_s{seed}")


def main(argv: list[str] | None = None) -> int:
    parser = harness.study_parser(__doc__, CONFIGS, grad_check="skip the fp16 gradient underflow check",
                                  note="free text kept in the JSON (e.g. which commit ran)")
    args = parser.parse_args(argv)
    results, seeds, names = harness.open_results(parser, args, study=STUDY, configs=CONFIGS, markdown=markdown)
    if args.table_only:
        results.close()
        return 0

    data, runs = results.data, results.work / "runs"
    # The baseline's peak always (every saving is against it) and, when it runs, its runs first.
    order = [BASELINE] + [n for n in names if n != BASELINE]
    folders = harness.make_backbones(results.work, names={CONFIGS[n]["backbone"] for n in order})
    harness.record_backbones(data, folders)
    for name in order:
        if name not in data["peaks"]:
            config = CONFIGS[name]
            backbone = folders[config["backbone"]]
            data["peaks"][name] = {
                "recipe": peak_bytes(backbone, config, resolution=RESOLUTION, batch_size=BATCH_SIZE),
                "paper": peak_bytes(backbone, config, resolution=PAPER_RESOLUTION, batch_size=PAPER_BATCH)}
    results.run_seeds([n for n in order if n in names], seeds,
                      lambda name, seed: run_one(name, seed, folders=folders, runs=runs, args=args))
    if not args.no_grad_check and "grad_check" not in data:
        base_run = runs / f"{_slug(BASELINE)}_s{seeds[0]}"
        data["grad_check"] = {"initialisation": grad_check(folders["pretrained"], samples=args.samples,
                                                            val_samples=args.val_samples, trained=None)}
        if (base_run / "model.pt").is_file():
            data["grad_check"]["after fine-tuning (baseline seed %d)" % seeds[0]] = grad_check(
                folders["pretrained"], samples=args.samples, val_samples=args.val_samples, trained=base_run)
    results.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
