"""Barley & Fröning's Table 1, recomputed (docs/resnet.md's table is rendered from the JSON this
writes, scripts/render_docs.py).

    python scripts/barley_table1.py      # seconds; writes benchmarks/barley_table1_resnet18.json

"Less Memory Means smaller GPUs: Backpropagation with Compressed Activations", Table 1: for
ResNet-18 at batch 32, 224 px, fp32, each conv layer's weights W, its input activation X, and
that input average-pooled 2x2 and 4x4 (Z), in MiB. Here every row comes from
``torchvision.models.resnet18`` on the meta device (shapes only): a forward pre-hook on each
nn.Conv2d takes its input, ``F.avg_pool2d(x, k, k)`` pools it. W = the conv's parameters x 4
bytes, X and Z = elements x 4 bytes, 1 MiB = 2**20 bytes, shown to 2 decimals.

The pooling is torch's default, ceil_mode=False: a 7x7 map pools to 3x3 at k=2 and 1x1 at k=4,
a 14x14 map to 3x3 at k=4. That is what reproduces the paper's cells (layer4.0.conv2: 0.56 and
0.06 MiB; ceil_mode=True would give 1.00 and 0.25) and what the paper's code does
(``torch.nn.AvgPool2d((2, 2))`` in parameter_count.py, ``F.avg_pool2d(input, kernel_size)`` in
layers/convolution.py of github.com/danielbarley/cnn_mean_compression). edgetl's own pooled
storage keeps the partial edge cell instead (``pool_for_save``: ceil_mode=True); the JSON gives
both totals.

Every row sits beside the paper's own, transcribed from the paper's text; where the two differ,
the row says why. The paper's W column is not its rows' W: the authors' parameter_count.py
lists the parameters whose name holds "conv" (the 17 convs but not the three 1x1 downsample
convs, named ``layerN.0.downsample.0``) and its table code zips those beside the activation rows
of all 20 convs: zip stops at 17 rows, so the table lacks layer4.0.downsample.0, layer4.1.conv1
and layer4.1.conv2, and from the layer2.0.downsample.0 row on each W cell belongs to a later
conv. The script checks this reading cell by cell instead of assuming it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "barley_table1_resnet18.json"
COMMAND = "python scripts/barley_table1.py"
MIB = 2**20
BATCH_SIZE = 32
RESOLUTION = 224
POOLS = (2, 4)
COLUMNS = ("W", "X", "Z2", "Z4")

PAPER = {
    "title": "Less Memory Means smaller GPUs: Backpropagation with Compressed Activations",
    "authors": "Daniel Barley, Holger Fröning",
    "table": "Table 1",
    "caption": ("Memory consumption per convolutional layer with respect to parameters W, activations X, "
                "and compressed versions Z. To keep consistent with Figure 1 a mini-batch size of 32 is "
                "assumed here."),
    "code": "https://github.com/danielbarley/cnn_mean_compression",
}
# Table 1 as printed: layer, W, X, Z (2x2), Z (4x4), all MiB.
PAPER_ROWS = [
    ("conv1", 0.04, 18.38, 4.59, 1.15),
    ("layer1.0.conv1", 0.14, 24.50, 6.12, 1.53),
    ("layer1.0.conv2", 0.14, 24.50, 6.12, 1.53),
    ("layer1.1.conv1", 0.14, 24.50, 6.12, 1.53),
    ("layer1.1.conv2", 0.14, 24.50, 6.12, 1.53),
    ("layer2.0.conv1", 0.28, 24.50, 6.12, 1.53),
    ("layer2.0.conv2", 0.56, 12.25, 3.06, 0.77),
    ("layer2.0.downsample.0", 0.56, 24.50, 6.12, 1.53),
    ("layer2.1.conv1", 0.56, 12.25, 3.06, 0.77),
    ("layer2.1.conv2", 1.12, 12.25, 3.06, 0.77),
    ("layer3.0.conv1", 2.25, 12.25, 3.06, 0.77),
    ("layer3.0.conv2", 2.25, 6.12, 1.53, 0.28),
    ("layer3.0.downsample.0", 2.25, 12.25, 3.06, 0.77),
    ("layer3.1.conv1", 4.50, 6.12, 1.53, 0.28),
    ("layer3.1.conv2", 9.00, 6.12, 1.53, 0.28),
    ("layer4.0.conv1", 9.00, 6.12, 1.53, 0.28),
    ("layer4.0.conv2", 9.00, 3.06, 0.56, 0.06),
]
# The table's "Sum" row: W, X, Z (2x2) "(-75%)", Z (4x4) "(-94%)".
PAPER_SUM = {"W": 41.94, "X": 254.19, "Z2": 63.34, "Z4": 15.35}
PAPER_SUM_PERCENT = {"Z2": -75, "Z4": -94}
# Section 5.3: "pooling reduces the memory requirement by 3/4 and 15/16 respectively, which
# amounts to roughly 191 MiB and 239 MiB".
PAPER_SAVED_MIB = {"Z2": 191, "Z4": 239}


W_COLUMN = ("The paper's W column is not its rows' W. The authors' parameter_count.py keeps the parameters whose "
            "name holds 'conv' (17 convs; the three 1x1 downsample convs' are layerN.0.downsample.0.weight) and its "
            "table code zips them beside the inputs of all 20 convs in module order: zip stops at 17 rows, so the "
            "table lacks layer4.0.downsample.0, layer4.1.conv1 and layer4.1.conv2, and from the "
            "layer2.0.downsample.0 row on each W cell belongs to a later conv (paper_w_source); its W sum is "
            "that of the 17 convs named conv*.")


def mib(n_bytes: int) -> float:
    """Bytes as MiB to 2 decimals, as the paper prints them (Python rounds the binary value half
    to even, as the paper's 18.375 -> 18.38, 6.125 -> 6.12 and 1.125 -> 1.12 do)."""
    return float(f"{n_bytes / MIB:.2f}")


def conv_rows(batch_size: int = BATCH_SIZE, resolution: int = RESOLUTION, pools: tuple[int, ...] = POOLS,
              ceil_mode: bool = False) -> list[dict]:
    """Every nn.Conv2d of torchvision's ResNet-18 in module order: its input shape and the bytes of
    W, X and X average-pooled by each k (kernel = stride = k)."""
    from torchvision.models import resnet18

    with torch.device("meta"):
        model = resnet18()
    inputs: dict[str, torch.Tensor] = {}
    convs = {name: m for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: inputs.__setitem__(name, args[0]))
             for name, m in convs.items()]
    try:
        model(torch.empty(batch_size, 3, resolution, resolution, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for name, conv in convs.items():
        x = inputs[name]
        pooled = {k: F.avg_pool2d(x, k, k, ceil_mode=ceil_mode) for k in pools}
        rows.append({
            "layer": name,
            "kernel": list(conv.kernel_size),
            "stride": list(conv.stride),
            "input_shape": list(x.shape),
            "bytes": {"W": sum(p.numel() * p.element_size() for p in conv.parameters()),
                      "X": x.numel() * x.element_size(),
                      **{f"Z{k}": z.numel() * z.element_size() for k, z in pooled.items()}},
            "pooled_shape": {f"Z{k}": list(z.shape[2:]) for k, z in pooled.items()},
        })
    return rows


def paper_w_sources(names: list[str]) -> dict[str, str]:
    """Row label -> the conv whose W the paper's W cell holds, as the authors' script builds the
    table: the parameters whose name holds "conv", zipped beside the activation rows."""
    return dict(zip(names, [n for n in names if "conv" in n]))


def _row_difference(row: dict, paper: dict | None, w_source: str | None, by_name: dict[str, dict]) -> str | None:
    """Why edgetl's row differs from the paper's; None when every cell agrees."""
    if paper is None:
        return "not in the paper's table: its 17 rows stop at layer4.0.conv2 (the authors' zip stops at 17)"
    mine = {c: mib(row["bytes"][c]) for c in COLUMNS}
    off = [c for c in COLUMNS if mine[c] != paper[c]]
    if not off:
        return None
    reasons = []
    if "W" in off:
        source = mib(by_name[w_source]["bytes"]["W"]) if w_source else None
        if source != paper["W"]:
            raise ValueError(f"{row['layer']}: the paper's W {paper['W']} is no conv's W in the zip reading")
        reasons.append(f"W: the paper's {paper['W']:.2f} is {w_source}'s (its W column is shifted); this row's own "
                       f"is {mine['W']:.2f}")
    rest = [c for c in off if c != "W"]
    if rest:
        raise ValueError(f"{row['layer']}: unexplained difference in {rest}: edgetl {mine}, paper {paper}")
    return "; ".join(reasons)


def _note(row: dict, w_source: str | None, same_w: bool) -> str | None:
    """What a matching row still hides (no difference in the figures)."""
    notes = []
    if row["layer"] == "conv1":
        notes.append("the paper's experiments keep the stem conv1 uncompressed (Section 5), yet its Z cells and "
                     "sums count conv1 pooled")
    if w_source and w_source != row["layer"] and same_w:
        notes.append(f"the paper's W cell is {w_source}'s, equal in size to this row's own")
    h, w = row["input_shape"][2:]
    odd = [f"{h}x{w} at k={k} -> {'x'.join(map(str, row['pooled_shape'][f'Z{k}']))}" for k in POOLS if h % k or w % k]
    if odd:
        notes.append("floor pooling drops the edge rows and columns: " + ", ".join(odd))
    return "; ".join(notes) or None


def _total(rows: list[dict], column: str) -> int:
    return sum(r["bytes"][column] for r in rows)


def build() -> dict:
    """The whole JSON: rows beside the paper's, totals, the ceil_mode check."""
    rows = conv_rows()
    names = [r["layer"] for r in rows]
    by_name = {r["layer"]: r for r in rows}
    paper = {name: dict(zip(COLUMNS, cells)) for name, *cells in PAPER_ROWS}
    unknown = set(paper) - set(names)
    if unknown:
        raise ValueError(f"the paper's rows {sorted(unknown)} are no conv of torchvision's resnet18")
    sources = paper_w_sources(names)
    out_rows = []
    for r in rows:
        p = paper.get(r["layer"])
        source = sources.get(r["layer"]) if p else None
        out_rows.append({
            **r,
            "edgetl_mib": {c: mib(r["bytes"][c]) for c in COLUMNS},
            "paper_mib": p,
            "paper_w_source": source,
            "difference": _row_difference(r, p, source, by_name),
            "note": _note(r, source, bool(p) and p["W"] == mib(r["bytes"]["W"])),
        })
    listed = [r for r in rows if r["layer"] in paper]
    w_column = [by_name[sources[r["layer"]]] for r in listed]
    ceil_rows = conv_rows(ceil_mode=True)
    ceil_listed = [r for r in ceil_rows if r["layer"] in paper]
    printed = {c: round(sum(p[c] for p in paper.values()), 2) for c in COLUMNS}

    def total(label: str, selected: list[dict], w_rows: list[dict] | None = None) -> dict:
        b = {c: _total(w_rows if (c == "W" and w_rows is not None) else selected, c) for c in COLUMNS}
        return {"label": label, "rows": len(selected), "bytes": b, "mib": {c: mib(v) for c, v in b.items()},
                "percent_of_X": {f"Z{k}": round(100 * b[f"Z{k}"] / b["X"], 2) for k in POOLS}}

    as_printed = total("edgetl, the paper's 17 rows, W as its column prints it (the 17 convs named conv*)",
                       listed, w_column)
    own_w = total("edgetl, the paper's 17 rows, each row's own W", listed)
    every = total(f"edgetl, all {len(rows)} convs", rows)
    ceil17 = total("edgetl, the paper's 17 rows, ceil_mode=True (as edgetl's pool_for_save pools)", ceil_listed)
    ceil_all = total(f"edgetl, all {len(rows)} convs, ceil_mode=True", ceil_rows)
    matches = [c for c in COLUMNS if as_printed["mib"][c] == PAPER_SUM[c]]
    as_printed["difference"] = (None if matches == list(COLUMNS) else
                                f"differs in {[c for c in COLUMNS if c not in matches]}")
    own_w["difference"] = (f"W {own_w['mib']['W']:.2f}, not {PAPER_SUM['W']:.2f}: these rows hold two downsample convs "
                           f"and lack layer4.1.conv1/conv2, the paper's W column does the opposite")
    every["difference"] = (f"{len(rows) - len(listed)} convs more than the paper's table (layer4.0.downsample.0, "
                           f"layer4.1.conv1, layer4.1.conv2): X +{every['mib']['X'] - PAPER_SUM['X']:.2f} MiB")
    for t in (ceil17, ceil_all):
        t["difference"] = ("a 7x7 map pools to 4x4 at k=2 and 2x2 at k=4, a 14x14 map to 4x4 at k=4; the paper "
                           "floors (Z2 {:.2f}, Z4 {:.2f} over its rows)".format(PAPER_SUM["Z2"], PAPER_SUM["Z4"]))
    return {
        "command": COMMAND,
        "paper": PAPER,
        "model": "torchvision.models.resnet18 (meta device: shapes only)",
        "batch_size": BATCH_SIZE,
        "resolution": RESOLUTION,
        "dtype": "float32",
        "unit": "MiB = 2**20 bytes, 2 decimals, rounded half to even (as the paper's cells are)",
        "unit_check": (f"MiB, not MB: layer1.0.conv1's X is {by_name['layer1.0.conv1']['bytes']['X']:,} bytes = "
                       f"{by_name['layer1.0.conv1']['bytes']['X'] / MIB:.2f} MiB (the paper's 24.50) = "
                       f"{by_name['layer1.0.conv1']['bytes']['X'] / 1e6:.2f} MB"),
        "pooling": {"op": "torch.nn.functional.avg_pool2d(x, k, k)", "kernel_size": list(POOLS),
                    "stride": "= kernel_size", "ceil_mode": False,
                    "why": ("reproduces the paper's cells for odd maps (7x7 -> 3x3 at k=2, 1x1 at k=4; 14x14 -> 3x3 at "
                            "k=4) and is what the paper's code runs (nn.AvgPool2d((k, k)), F.avg_pool2d defaults)")},
        "w_column": W_COLUMN,
        "rows": out_rows,
        "paper_sum": {
            "label": "the paper's Sum row",
            "mib": PAPER_SUM, "percent_printed": PAPER_SUM_PERCENT, "saved_mib_in_text": PAPER_SAVED_MIB,
            "sum_of_printed_cells": printed,
            "how": (f"exact sums rounded: its printed cells add to X {printed['X']:.2f}, Z2 {printed['Z2']:.2f}, "
                    f"Z4 {printed['Z4']:.2f}, W {printed['W']:.2f}"),
        },
        "totals": [as_printed, own_w, every, ceil17, ceil_all],
    }


def main() -> None:
    from edgetl.io import atomic_text_json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    atomic_text_json(a.out, build())
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
