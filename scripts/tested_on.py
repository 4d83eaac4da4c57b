#!/usr/bin/env python3
"""Summaries of scripts/jetson_check.py in, a markdown "Tested on" section out (for the README).

    python3 scripts/tested_on.py benchmarks/jetson_check_summary.json [more summary.json ...]

One row a summary in the first table (platform, Python, library versions, how many checks
passed); the second has a row a check and a column a summary. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORMAT = "edgetl-jetson-check/1"
SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGKILL", "SIGFPE")


def platform_of(s: dict) -> str:
    runner = s.get("runner") or {}
    if runner.get("kind", "").startswith("qemu"):
        return f"{s['arch']} (qemu {runner.get('cpu', '')}, {s['host']['machine']} host)".replace("  ", " ")
    return f"{s['arch']} (native)"


def short_reason(check: dict) -> str:
    """A few words: the signal, the timeout, or the exit status."""
    reason = check.get("reason") or ""
    for sig in SIGNALS:
        if sig in reason:
            return sig
    if reason.startswith("timed out"):
        return "timeout"
    first = reason.splitlines()[0] if reason else ""
    return first if len(first) <= 40 else first[:37] + "..."


def cell(check: dict | None) -> str:
    if check is None:
        return "-"
    if check["status"] == "passed":
        return "pass"
    if check["status"] == "skipped":
        return "skip"
    return f"**fail** ({short_reason(check)})"


def render(summaries: list[dict]) -> str:
    lines = ["| Platform | Python | torch | torchvision | numpy | onnx / onnxruntime / onnxscript | torch-pruning "
             "| Checks passed | Mode, time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        ran = s["passed"] + s["failed"]
        failed = [c["name"] for c in s["checks"] if c["status"] == "failed"]
        passed = f"{s['passed']} of {ran}" + (f" (failed: {', '.join(failed)})" if failed else "")
        lines.append(f"| {platform_of(s)} | {s['python']} | {s['torch']} | {s['torchvision']} | {s['numpy']} "
                     f"| {s['onnx']} / {s['onnxruntime']} / {s['onnxscript']} | {s['torch_pruning']} "
                     f"| {passed} | {s['mode']}, {s['seconds'] / 60:.1f} min |")
    names: list[str] = []
    for s in summaries:
        names += [c["name"] for c in s["checks"] if c["name"] not in names]
    lines += ["", "| Check | " + " | ".join(f"{s['arch']} ({(s.get('runner') or {}).get('kind', '?').split()[0]}, "
                                           f"{s['mode']})" for s in summaries) + " |",
              "|---|" + "---|" * len(summaries)]
    for name in names:
        cells = []
        for s in summaries:
            check = next((c for c in s["checks"] if c["name"] == name), None)
            text = cell(check)
            if check is not None and check["status"] == "passed" and check.get("measured_bytes"):
                text += f", peak {check['measured_bytes'] / 1e6:.2f} MB"
            tests = (check or {}).get("tests") or {}
            if check is not None and check["status"] == "passed" and tests.get("passed"):
                text += f", {tests['passed']} tests"
            if check is not None and check["status"] != "skipped":
                text += f", {check['seconds']:.0f} s"
            cells.append(text)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += ["", "Peaks: measured peak of the training tensors (MB = 10^6 B), equal to edgetl's prediction "
              "where the check passed; shapes 64 px, batch 2, MobileNetV2 width 0.35 (the resnet18 rows: ResNet-18)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summaries", nargs="+", type=Path, help="summary.json files of scripts/jetson_check.py")
    args = p.parse_args(argv)
    loaded = []
    for path in args.summaries:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            print(f"tested_on: {path} is not a {FORMAT} summary", file=sys.stderr)
            return 2
        loaded.append(data)
    sys.stdout.write(render(loaded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
