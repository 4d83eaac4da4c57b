"""Lean against stock on CPU, several runs: ``edgetl bench`` run ``--runs`` times alone and as many
times beside one competing process (``python3 -c 'while True: pass'``, one core kept busy), each
run's table kept whole in one file, with each row's ratio to stock Rep-Net summarised per setting.

    python scripts/cpu_speed.py --json benchmarks/cpu_speed_224_heap.json
    python scripts/cpu_speed.py --methods repnet-stock,repnet-stock-cl,repnet-lean,repnet-lean-cl,... --json F

The ``edgetl`` program's own policies hold in every run (its thread policy, its heap policy:
``edgetl.heap``); run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

METHODS = ("repnet-stock,repnet-lean,repnet-pruned-pool2,repnet-pruned-pool2-bf16-int8,bias-lean,bias-lean-stream,"
           "repnet-lean-stream,repnet-pruned-pool2-bf16-int8-stream")


def bench_args(methods: str) -> list[str]:
    """The ``edgetl bench`` arguments of every run (before ``--json``)."""
    return ["--methods", methods, "--steps", "10", "--warmup", "2", "--largest-steps", "0"]


def bench_once(out: Path, competing: bool, methods: str = METHODS) -> dict:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if competing else None
    try:
        subprocess.run([sys.executable, "-m", "edgetl", "bench", *bench_args(methods), "--json", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return json.loads(out.read_text())


def summary(runs: list[dict]) -> dict[str, dict]:
    """Per row: its throughput ratio to stock Rep-Net in each run, their median, and its ratio to
    its unstreamed twin where it has one."""
    out: dict[str, dict] = {}
    for run in runs:
        for row in run["rows"]:
            entry = out.setdefault(row["method"], {"images_per_s": [], "vs_stock": [], "vs_twin": []})
            entry["images_per_s"].append(row["images_per_s"])
            entry["vs_stock"].append(row["throughput_ratio"])
            if row.get("unstreamed_throughput_ratio") is not None:
                entry["vs_twin"].append(row["unstreamed_throughput_ratio"])
    for entry in out.values():
        for key in ("vs_stock", "vs_twin"):
            entry[f"{key}_median"] = statistics.median(entry[key]) if entry[key] else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs alone, and as many beside a competing process")
    p.add_argument("--methods", default=METHODS, metavar="A,B,...",
                   help="the bench's methods, comma-separated (edgetl bench --methods; stock Rep-Net, the "
                        "reference, among them); default: %(default)s")
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args()
    from edgetl.io import atomic_text_json

    runs: dict[str, list[dict]] = {"alone": [], "competing": []}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in runs:
            for i in range(a.runs):
                runs[setting].append(bench_once(Path(tmp) / f"{setting}{i}.json", setting == "competing", a.methods))
                print(f"{setting} run {i + 1}/{a.runs} done", file=sys.stderr, flush=True)
    data = {"what": f"edgetl bench at 224 px, batch 8, run {a.runs} times alone and {a.runs} times beside one "
                    "competing process (python3 -c 'while True: pass', one core busy); the edgetl program's own "
                    "thread and heap policies",
            "command": "edgetl bench " + " ".join(bench_args(a.methods)) + " --json RUN.json",
            "script": "python scripts/cpu_speed.py " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "summary": {setting: summary(r) for setting, r in runs.items()}, "runs": runs}
    for setting, rows in data["summary"].items():
        for name, entry in rows.items():
            twin = "" if entry["vs_twin_median"] is None else f", {entry['vs_twin_median']:.2f}x its twin"
            print(f"{setting:9} {name:40} {entry['vs_stock_median']:.2f}x stock (median){twin}")
    atomic_text_json(a.json, data)


if __name__ == "__main__":
    main()
