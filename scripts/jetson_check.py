#!/usr/bin/env python3
"""The emulated Jetson check (issue #28): edgetl's commands, tiny, on aarch64 under qemu in, jetson-check/summary.json out.

Runs on the host with its own python3 (standard library only) and drives the aarch64
interpreter that scripts/jetson_env.sh builds (.jetson/python, qemu user-mode emulation of
Debian's arm64 CPython 3.11 with the pins of docker/requirements-jetson.txt). Every check is
a child process; a child that crashes (a segfault included) is a failed check and the next
one runs. Shapes are tiny (64 px, MobileNetV2 width 0.35, batch 2): the whole check runs
about 3.6x slower emulated than natively on this host (bf16 arithmetic far more).

    python3 scripts/jetson_check.py            # full: about 12 min on 2 cores
    python3 scripts/jetson_check.py --short    # CI: about 5 min, env rebuilt from its cache included
    python3 scripts/jetson_check.py --python .venv/bin/python --no-env --out jetson-check-host
                                               # the same checks natively on the host

Summary: versions read inside the checked interpreter, and per check its name, status
(passed / failed / skipped) with a reason, seconds, the command, the predicted and
measured peak bytes where the command reports them, and its log (jetson-check/logs/).
Exit code 0 when no check failed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
FORMAT = "edgetl-jetson-check/1"
RESOLUTION, WIDTH, BATCH = 64, 0.35, 2
# The preflight table prints MB = 10^6 B with 2 decimals: equal within that rounding.
MB_ROUNDING = 5_000
PEAK_TOLERANCE = 0.01  # predicted vs measured peak, relative (edgetl claims exact on CPU)
TAIL_LINES = 15
LOADER_WORKERS_EMULATED = 0  # finetune's DataLoader workers under qemu (see Checker.finetune_argv)
CROSS_CXX = "aarch64-linux-gnu-g++"  # builds the fused kernels for the emulated interpreter (c_fused_kernels)

VERSIONS = r"""
import importlib.metadata as md, json, platform
out = {"arch": platform.machine(), "python": platform.python_version()}
for key, dist in (("torch", "torch"), ("torchvision", "torchvision"), ("numpy", "numpy"), ("onnx", "onnx"),
                  ("onnxruntime", "onnxruntime"), ("onnxscript", "onnxscript"), ("torch_pruning", "torch-pruning")):
    try:
        out[key] = md.version(dist)
    except md.PackageNotFoundError:
        out[key] = None
import torch
out["torch"] = torch.__version__
out["torch_threads"] = torch.get_num_threads()
print(json.dumps(out))
"""

SETUP = r"""
import sys
from pathlib import Path

import torch

from edgetl.models.backbone import BackboneSpec, build_backbone, save_backbone
from tests.conftest import make_color_folder

make_color_folder(Path("data"), n_train=4, n_val=2, size=32)  # 3 classes: 12 train, 6 val images
torch.manual_seed(0)
Path("base").mkdir()
save_backbone(Path("base"), build_backbone(BackboneSpec(width=float(sys.argv[1]), num_classes=3)).eval())
print("data: 3 classes, 12 train + 6 val PNG files; backbone: MobileNetV2 width", sys.argv[1], "random init")
"""

SAME_WEIGHTS = r"""
import sys
import torch
a = torch.load(sys.argv[1], weights_only=True)["model"]
b = torch.load(sys.argv[2], weights_only=True)["model"]
diff = [k for k in a if k not in b or not torch.equal(a[k], b[k])] + [k for k in b if k not in a]
print(f"{len(a)} tensors, {len(diff)} differ" + (f": {', '.join(diff[:5])}" if diff else ""))
sys.exit(1 if diff else 0)
"""


@dataclass
class Result:
    name: str
    status: str = "skipped"
    reason: str = ""
    seconds: float = 0.0
    command: str = ""
    log: str | None = None
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"name": self.name, "status": self.status, "reason": self.reason, "seconds": round(self.seconds, 1),
               "command": self.command, "predicted_bytes": self.predicted_bytes,
               "measured_bytes": self.measured_bytes, "log": self.log}
        out.update(self.details)
        return out


@dataclass
class Run:
    """What a child process did: exit status, its output (carriage-return progress folded)."""

    returncode: int
    output: str
    seconds: float
    timed_out: bool = False

    def failure(self) -> str | None:
        """A one-line reason when the child failed, None when it exited 0."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        if self.returncode == 0:
            return None
        sig = None
        if self.returncode < 0:
            sig = -self.returncode
        elif self.returncode > 128 and re.search(r"uncaught target signal|Segmentation fault|core dumped", self.output):
            sig = self.returncode - 128
        if sig is not None:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"killed by {name} (exit status {self.returncode})"
        return f"exit status {self.returncode}"


def fold_progress(text: str) -> str:
    """tqdm redraws a line with carriage returns: keep what each line shows last."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.splitlines())


def tail(text: str, n: int = TAIL_LINES) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def crash_tail(text: str, frames: int = 6) -> str | None:
    """Python's faulthandler report of a fatal signal, cut to its innermost frames (the
    outer ones are pytest's and runpy's), or None where there is none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    if start is None:
        return None
    kept = [lines[start][lines[start].index("Fatal Python error"):]]
    for line in lines[start + 1:]:
        if line.strip().startswith("File "):
            kept.append(line)
            if len(kept) > frames:
                break
        elif line.strip() and len(kept) > 1:
            break
        elif line.strip():
            kept.append(line)
    return "\n".join(kept)


class Checker:
    def __init__(self, args):
        self.args = args
        self.out = args.out.resolve()
        self.work = self.out / "work"
        self.logs = self.out / "logs"
        self.python = [str(args.python)]
        self.emulated = "python" in Path(self.python[0]).name and Path(self.python[0]).parent.name == ".jetson"
        self.results: dict[str, Result] = {}
        self.env = dict(os.environ)
        # the repository checked comes first on the emulated sys.path (the wrapper adds its site)
        self.env["PYTHONPATH"] = str(args.repo)
        self.env["EDGETL_OFFLINE"] = "1"  # no weights downloads: tiny random backbones only
        self.env["TORCH_HOME"] = str(self.work / "torch_home")
        self.env["MPLBACKEND"] = "Agg"
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.setdefault("TQDM_MININTERVAL", "5")
        self.count = 0

    # -- running children --------------------------------------------------------------
    def run(self, argv: list[str], log_name: str, cwd: Path | None = None, timeout: float = 900,
            env: dict[str, str] | None = None) -> Run:
        """``argv`` in its own session, its output logged; ``env``: variables set for it alone."""
        t0 = time.perf_counter()
        log = self.logs / f"{log_name}.log"
        # own session: a timed-out check's whole group (DataLoader workers too) is killed
        proc = subprocess.Popen(argv, cwd=cwd or self.work, env={**self.env, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            raw, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            raw, _ = proc.communicate()
        text = fold_progress(raw.decode("utf-8", "replace"))
        seconds = time.perf_counter() - t0
        log.write_text(f"$ {shlex.join(argv)}\n(cwd {cwd or self.work})\n{text}\n"
                       f"[exit status {proc.returncode}, {seconds:.1f} s]\n")
        return Run(proc.returncode, text, seconds, timed_out)

    def edgetl(self, *args: str) -> list[str]:
        return [*self.python, "-m", "edgetl", *args]

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.out))
        except ValueError:
            return str(path)

    # -- one check ---------------------------------------------------------------------
    def check(self, name: str, body: Callable[[Result], None], needs: tuple[str, ...] = ()) -> Result:
        result = Result(name)
        self.results[name] = result
        self.count += 1
        missing = [n for n in needs if self.results.get(n) is None or self.results[n].status != "passed"]
        if missing:
            result.reason = f"needs {', '.join(missing)}, which did not pass"
            print(f"[{self.count:2d}] {name:<24} skipped: {result.reason}", flush=True)
            return result
        tty = sys.stdout.isatty()
        if tty:
            print(f"[{self.count:2d}] {name:<24} ...", end="", flush=True)
        t0 = time.perf_counter()
        try:
            body(result)
            if result.status == "skipped" and not result.reason:
                result.status = "passed"
        except CheckFailed as exc:
            result.status, result.reason = "failed", str(exc)
        result.seconds = time.perf_counter() - t0
        print(f"{chr(13) if tty else ''}[{self.count:2d}] {name:<24} {result.status} ({result.seconds:.0f} s)"
              + (f": {result.reason.splitlines()[0]}" if result.reason else ""), flush=True)
        return result

    def expect(self, result: Result, run: Run, argv: list[str], log_name: str) -> None:
        """Record the command and its log; raise CheckFailed with the output's tail if it failed."""
        result.command = shlex.join(self.display(argv))
        result.log = self.rel(self.logs / f"{log_name}.log")
        why = run.failure()
        if why is not None:
            result.details["error_tail"] = crash_tail(run.output) or tail(run.output)
            raise CheckFailed(why)

    def display(self, argv: list[str]) -> list[str]:
        """The command as a user would type it: `edgetl ...` / `python ...`, paths relative to work/."""
        shown = []
        for i, a in enumerate(argv):
            if i == 0 and a in self.python:
                shown.append("python")
                continue
            shown.append(a.replace(str(self.work) + "/", "").replace(str(self.args.repo) + "/", ""))
        if shown[:3] == ["python", "-m", "edgetl"]:
            shown = ["edgetl", *shown[3:]]
        return shown

    def peaks(self, result: Result, predicted: int | None, measured: int | None, slack: int = 0) -> None:
        result.predicted_bytes, result.measured_bytes = predicted, measured
        if predicted is None or measured is None:
            raise CheckFailed("the command printed no predicted and measured peak")
        off = abs(predicted - measured)
        if off > slack and off > PEAK_TOLERANCE * measured:
            raise CheckFailed(f"predicted {predicted} B vs measured {measured} B: off by {predicted / measured - 1:+.2%}")

    # -- the checks --------------------------------------------------------------------
    def c_help(self, r: Result) -> None:
        argv = self.edgetl("--help")
        run = self.run(argv, "help", timeout=300)
        self.expect(r, run, argv, "help")
        missing = [c for c in ("profile", "plan", "prune", "finetune", "export", "doctor") if c not in run.output]
        if missing:
            raise CheckFailed(f"--help does not list {', '.join(missing)}")

    def c_doctor(self, r: Result) -> None:
        argv = self.edgetl("doctor", "--json")
        run = self.run(argv, "doctor", timeout=300)
        self.expect(r, run, argv, "doctor")
        facts = json.loads(run.output[run.output.index("{"):])
        r.details["doctor"] = {k: facts.get(k) for k in ("machine", "python", "is_jetson", "torch", "cuda_available",
                                                         "onnx", "onnxruntime", "suggested_budget_bytes")}
        if not str(facts.get("machine", "")).startswith(self.versions["arch"]):
            raise CheckFailed(f"doctor reports machine {facts.get('machine')!r}, python says {self.versions['arch']}")
        if facts.get("torch") != self.versions["torch"]:
            raise CheckFailed(f"doctor reports torch {facts.get('torch')}, import says {self.versions['torch']}")

    def c_setup(self, r: Result) -> None:
        for sub in ("data", "base"):
            shutil.rmtree(self.work / sub, ignore_errors=True)
        argv = [*self.python, "-c", SETUP, str(WIDTH)]
        run = self.run(argv, "setup", cwd=self.work, timeout=600)
        # tests.conftest is imported from the repository, found through PYTHONPATH
        self.expect(r, run, argv, "setup")
        r.command = "python -c SETUP (tests.conftest.make_color_folder + edgetl.models.backbone.save_backbone)"

    def c_profile(self, r: Result) -> None:
        out = self.work / "profile.json"
        argv = self.edgetl("profile", "--accounting", "runtime", "--measure", "--resolution", str(RESOLUTION),
                           "--width", str(WIDTH), "--batch-size", str(BATCH), "--num-classes", "3",
                           "--json", str(out))
        run = self.run(argv, "profile-measure", timeout=900)
        self.expect(r, run, argv, "profile-measure")
        report = json.loads(out.read_text())
        self.peaks(r, report.get("total_bytes"), report.get("measured_peak_bytes"))

    def c_plan(self, r: Result) -> None:
        out = self.work / "plan.json"
        argv = self.edgetl("plan", "--budget", "5MB", "--stream", "0", "--resolution", str(RESOLUTION),
                           "--width", str(WIDTH), "--num-classes", "3", "--batch-size", str(BATCH), "--verify",
                           "--json", str(out), "-o", str(self.work / "plan.yaml"))
        run = self.run(argv, "plan-verify", timeout=900)
        self.expect(r, run, argv, "plan-verify")
        plan = json.loads(out.read_text())
        self.peaks(r, plan["predicted"]["total_bytes"], (plan.get("verify") or {}).get("measured_bytes"))

    def c_prune(self, r: Result) -> None:
        out = self.work / "pruned"
        shutil.rmtree(out, ignore_errors=True)
        argv = self.edgetl("prune", "--checkpoint", str(self.work / "base"), "--blocks", "1,2,3",
                           "--ratios", "0.3,0.5,0.5", "--resolution", str(RESOLUTION),
                           "--calib-data", str(self.work / "data"), "--calib-batches", "1", "-o", str(out))
        run = self.run(argv, "prune", timeout=900)
        self.expect(r, run, argv, "prune")
        spec = json.loads((out / "backbone.json").read_text())["spec"]
        r.details["hidden_channels"] = spec.get("hidden")
        if not spec.get("hidden"):
            raise CheckFailed("backbone.json records no pruned channels")

    def backbone(self) -> Path:
        pruned = self.results.get("prune")
        return self.work / ("pruned" if pruned is not None and pruned.status == "passed" else "base")

    def finetune_argv(self, run_dir: Path, *extra: str, backbone: str | None = None, budget: str = "50MB") -> list[str]:
        # Emulated, the loader reads in the finetune process itself: qemu-user (7.2) forking the
        # multi-threaded interpreter for DataLoader workers deadlocks now and then inside qemu
        # (the forked worker's only guest thread waits forever on a futex in qemu's own memory),
        # a hang of the emulator that a Jetson does not have; natively the recipe's workers stand.
        workers = ("--set", f"train.workers={LOADER_WORKERS_EMULATED}") if self.emulated else ()
        return self.edgetl("finetune", "--recipe", "imagefolder", "--backbone", backbone or str(self.backbone()),
                           "--data", str(self.work / "data"), "--set", f"data.resolution={RESOLUTION}",
                           "--batch-size", str(BATCH), "--budget", budget, *workers, *extra, "-o", str(run_dir))

    def finetuned(self, r: Result, run: Run, run_dir: Path) -> None:
        """Peaks from the pre-flight table; the run folder holds what export reads."""
        def mb(label: str) -> int | None:
            m = re.search(rf"^\s*{re.escape(label)}\s+([\d.]+)\s*$", run.output, re.M)
            return None if m is None else round(float(m.group(1)) * 1e6)

        r.details["bytes_from"] = "pre-flight table on stdout (MB with 2 decimals)"
        r.details["backbone"] = self.rel(self.backbone())
        best = re.search(r"best val top-1: ([\d.]+)%", run.output)
        r.details["best_val_top1"] = None if best is None else float(best.group(1))
        missing = [f for f in ("model.json", "model.pt", "last.pt", "metrics.jsonl") if not (run_dir / f).is_file()]
        if missing:
            raise CheckFailed(f"{self.rel(run_dir)} lacks {', '.join(missing)}")
        self.peaks(r, mb("predicted peak"), mb("measured peak (one real step)"), slack=MB_ROUNDING)

    def finetune(self, r: Result, name: str, *extra: str, **backbone) -> None:
        run_dir = self.work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = self.finetune_argv(run_dir, *extra, **backbone)
        run = self.run(argv, r.name, timeout=1200)
        self.expect(r, run, argv, r.name)
        self.finetuned(r, run, run_dir)

    def fp32_args(self) -> tuple[str, ...]:
        # full mode: 2 epochs of 6 steps, last.pt every 2 steps: the reference of the resume check
        epochs = "1" if self.args.short else "2"
        return ("--precision", "fp32", "--frozen-weights", "fp32", "--epochs", epochs,
                "--set", "train.checkpoint_every=2")

    def c_finetune_fp32(self, r: Result) -> None:
        self.finetune(r, "fp32", *self.fp32_args())

    def c_finetune_bf16(self, r: Result) -> None:
        self.finetune(r, "bf16-int8", "--precision", "bf16", "--frozen-weights", "int8", "--epochs", "1",
                      "--set", "data.max_samples=4")

    def c_finetune_stream(self, r: Result) -> None:
        self.finetune(r, "stream-uint8", "--stream", "1", "--uint8-input", "--precision", "fp32",
                      "--frozen-weights", "fp32", "--epochs", "1", "--set", "data.max_samples=4")

    def c_finetune_resnet18(self, r: Result) -> None:
        """ResNet-18 (issue #42): the lean Rep-Net streamed by 1 with the uint8 batch, from
        torchvision's architecture at random init (no weights are downloaded here)."""
        self.finetune(r, "resnet18-stream", "--stream", "1", "--uint8-input", "--precision", "fp32",
                      "--frozen-weights", "fp32", "--epochs", "1", "--set", "data.max_samples=4",
                      backbone="resnet18:random", budget="100MB")

    def c_export_resnet18(self, r: Result) -> None:
        self.export(r, self.work / "runs" / "resnet18-stream", "export-resnet18")

    def c_finetune_resume(self, r: Result) -> None:
        """Kill the fp32 run (SIGKILL, its whole process group) once its first last.pt is
        written, resume it, and compare its model.pt with the uninterrupted run's."""
        run_dir = self.work / "runs" / "resumed"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = self.finetune_argv(run_dir, *self.fp32_args())
        log = self.logs / "finetune-resume-killed.log"
        t0 = time.perf_counter()
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            killed_at = None
            while proc.poll() is None and time.perf_counter() - t0 < 1200:
                if (run_dir / "last.pt").is_file() and not (run_dir / "model.json").exists():
                    time.sleep(0.5)  # written atomically (rename): complete once it is there
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_at = time.perf_counter() - t0
                    break
                time.sleep(0.2)
            proc.wait()
        r.details["first_run"] = (f"killed (SIGKILL) {killed_at:.0f} s in, after its first last.pt"
                                  if killed_at is not None else f"not killed: it ended first (exit status {proc.returncode})")
        if killed_at is None and proc.returncode != 0:
            r.log = self.rel(log)
            r.details["error_tail"] = tail(fold_progress(log.read_text(errors="replace")))
            raise CheckFailed(f"the run to interrupt failed: {Run(proc.returncode, log.read_text(errors='replace'), 0).failure()}")
        argv = self.finetune_argv(run_dir, *self.fp32_args(), "--resume")
        run = self.run(argv, "finetune-resume", timeout=1200)
        self.expect(r, run, argv, "finetune-resume")
        self.finetuned(r, run, run_dir)
        reference = self.results.get("finetune-fp32")
        if reference is None or reference.status != "passed":
            r.details["same_weights_as_uninterrupted"] = None
            return
        cmp_argv = [*self.python, "-c", SAME_WEIGHTS, str(self.work / "runs" / "fp32" / "model.pt"),
                    str(run_dir / "model.pt")]
        same = self.run(cmp_argv, "finetune-resume-compare", timeout=600)
        r.details["same_weights_as_uninterrupted"] = same.returncode == 0
        r.details["compare"] = tail(same.output, 1)
        if same.returncode != 0:
            raise CheckFailed(f"resumed weights differ from the uninterrupted run's: {tail(same.output, 1)}")

    def exported_run(self) -> Path:
        return self.work / "runs" / "fp32"

    def c_export(self, r: Result) -> None:
        self.export(r, self.exported_run(), "export-onnx")

    def export(self, r: Result, run_dir: Path, log: str) -> None:
        """The default export of a run folder: the dynamo exporter, onnxruntime parity."""
        shutil.rmtree(run_dir / "export", ignore_errors=True)
        argv = self.edgetl("export", "--run", str(run_dir))
        run = self.run(argv, log, timeout=1200)
        self.expect(r, run, argv, log)
        sidecar = json.loads((run_dir / "export" / "model.onnx.json").read_text())
        r.details["exporter"] = sidecar.get("exporter")
        r.details["opset"] = sidecar.get("opset")
        r.details["parity_max_abs_diff"] = sidecar.get("parity", {}).get("max_abs_diff")
        if sidecar.get("exporter") != "dynamo":
            raise CheckFailed(f"the default exporter is {sidecar.get('exporter')!r}, not dynamo")

    def c_classify(self, r: Result) -> None:
        model = self.exported_run() / "export" / "model.onnx"
        images = sorted(str(p.relative_to(self.work)) for p in (self.work / "data" / "val").glob("*/*.png"))
        argv = [*self.python, str(self.args.repo / "deploy" / "classify.py"), "--model", str(model), "--json", *images]
        run = self.run(argv, "deploy-classify", timeout=600)
        self.expect(r, run, argv, "deploy-classify")
        rows = [json.loads(line) for line in run.output.splitlines() if line.startswith("{")]
        labels = set(json.loads(Path(str(model) + ".json").read_text())["labels"])
        bad = [row for row in rows if not row.get("top") or row["top"][0]["label"] not in labels]
        r.details["images"] = len(rows)
        if len(rows) != len(images) or bad:
            raise CheckFailed(f"{len(rows)} results for {len(images)} images, {len(bad)} without a known label")

    def pytest(self, r: Result, name: str, env: dict[str, str] | None = None) -> None:
        """One test file (a crash loses only its own later tests), a selection of it; ``env``:
        variables set for it alone."""
        file = f"tests/test_{name}.py"
        if self.args.short:
            select = [f"{file}::{t}" for t in PYTEST_SHORT[name]]
        else:
            select = [file, "-k", "not (" + " or ".join(PYTEST_FULL_SKIP[name]) + ")"]
        argv = [*self.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=5", *select]
        log = r.name
        run = self.run(argv, log, cwd=self.args.repo, timeout=1500, env=env)
        last = tail(run.output, 1)
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", last)}
        r.details["tests"] = counts
        if (run.failure() or "").startswith("killed"):
            # pytest -v names a test before running it: the crash follows the last name
            crashed = re.search(r"^(tests/\S+::\S+) (?!PASSED|FAILED|SKIPPED|ERROR)[^\n]*Fatal Python error",
                                run.output, re.M)
            r.details["crashed_in"] = crashed.group(1) if crashed else None
            r.details["tests"] = {f"{word.lower()} before the crash": len(re.findall(rf" {word}\b", run.output))
                                  for word in ("PASSED", "FAILED", "SKIPPED")}
        self.expect(r, run, argv, log)
        if not counts.get("passed"):
            raise CheckFailed("no test passed")

    def c_pytest_accounting(self, r: Result) -> None:
        self.pytest(r, "runtime_accounting")

    def c_pytest_stream(self, r: Result) -> None:
        self.pytest(r, "stream")

    def c_pytest_uint8(self, r: Result) -> None:
        self.pytest(r, "uint8_input")

    def c_pytest_metaop(self, r: Result) -> None:
        self.pytest(r, "metaop")

    def c_pytest_channels_last(self, r: Result) -> None:
        self.pytest(r, "channels_last")

    def c_fused_kernels(self, r: Result) -> None:
        """edgetl's fused mask kernels built against the checked torch for its CPU (on aarch64 the
        portable loop a Jetson's Arm cores run) and tested there against torch's ops. Under
        emulation the build runs natively, with the host's aarch64 cross compiler (the emulated
        interpreter starts host programs as they are: ninja, the compiler); on a real aarch64
        machine with its own compiler."""
        env = {"TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions")}
        if self.emulated:
            cross = shutil.which(CROSS_CXX)
            if cross is None:
                r.reason = (f"no aarch64 cross compiler on the host to build the kernels with ({CROSS_CXX}: "
                            "apt-get install g++-aarch64-linux-gnu, which scripts/jetson_env.sh does as root)")
                return
            env["CXX"] = cross
        if shutil.which("ninja") is None:
            r.reason = "no ninja on the host to build the kernels with (apt-get install ninja-build)"
            return
        self.pytest(r, "fused_masks", env)

    # -- the whole check ---------------------------------------------------------------
    def probe_versions(self) -> dict:
        run = self.run([*self.python, "-c", VERSIONS], "versions", timeout=600)
        if run.failure():
            raise SystemExit(f"jetson_check: cannot run {self.python[0]}: {run.failure()}\n{tail(run.output)}")
        return json.loads(run.output.strip().splitlines()[-1])

    def main(self) -> int:
        t0 = time.perf_counter()
        if self.out.exists():
            if any(self.out.iterdir()) and not (self.out / "logs").is_dir():
                raise SystemExit(f"jetson_check: {self.out} is not empty and holds no earlier check; choose another --out")
            shutil.rmtree(self.out)
        self.work.mkdir(parents=True)
        self.logs.mkdir()
        (self.work / "torch_home").mkdir()
        env_seconds = None
        if self.args.env:
            print("building the environment: scripts/jetson_env.sh", flush=True)
            t_env = time.perf_counter()
            built = subprocess.run(["bash", str(REPO / "scripts" / "jetson_env.sh")], cwd=REPO)
            env_seconds = round(time.perf_counter() - t_env, 1)
            if built.returncode != 0:
                print("jetson_check: scripts/jetson_env.sh failed", file=sys.stderr)
                return 2
        self.versions = self.probe_versions()
        print(f"checking edgetl ({self.args.repo}) on {self.versions['arch']} Python {self.versions['python']}, "
              f"torch {self.versions['torch']} ({'short' if self.args.short else 'full'} mode)", flush=True)
        plan = [
            ("help", self.c_help, (), True),
            ("doctor", self.c_doctor, (), True),
            ("setup", self.c_setup, (), True),
            ("profile-measure", self.c_profile, (), True),
            ("plan-verify", self.c_plan, (), True),
            ("prune", self.c_prune, ("setup",), False),
            ("finetune-fp32", self.c_finetune_fp32, ("setup",), True),
            ("finetune-bf16-int8", self.c_finetune_bf16, ("setup",), False),
            ("finetune-stream-uint8", self.c_finetune_stream, ("setup",), True),
            ("finetune-resume", self.c_finetune_resume, ("setup",), False),
            ("export-onnx", self.c_export, ("finetune-fp32",), True),
            ("deploy-classify", self.c_classify, ("export-onnx",), True),
            ("finetune-resnet18-stream", self.c_finetune_resnet18, ("setup",), True),
            ("export-resnet18", self.c_export_resnet18, ("finetune-resnet18-stream",), True),
            ("pytest-accounting", self.c_pytest_accounting, (), True),
            ("pytest-stream", self.c_pytest_stream, (), True),
            ("pytest-uint8", self.c_pytest_uint8, (), True),
            ("pytest-metaop", self.c_pytest_metaop, (), True),
            ("pytest-channels-last", self.c_pytest_channels_last, (), True),
            ("fused-kernels", self.c_fused_kernels, (), True),
        ]
        only = set(self.args.only.split(",")) if self.args.only else None
        if only:
            unknown = only - {name for name, *_ in plan}
            if unknown:
                raise SystemExit(f"jetson_check: unknown check {', '.join(sorted(unknown))}; "
                                 f"allowed: {', '.join(name for name, *_ in plan)}")
            for name, _, needs, _ in reversed(plan):  # what a chosen check needs runs too
                if name in only:
                    only.update(needs)
        for name, body, needs, in_short in plan:
            if only is not None and name not in only:
                continue
            if self.args.short and not in_short and only is None:
                r = Result(name, reason="not in --short")
                self.results[name] = r
                continue
            self.check(name, body, needs)
        summary = self.summary(time.perf_counter() - t0, env_seconds)
        path = self.out / "summary.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(path)
        print(f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped "
              f"in {summary['seconds']:.0f} s; summary: {path}")
        return 1 if summary["failed"] else 0

    def summary(self, seconds: float, env_seconds: float | None) -> dict:
        reqs = REPO / "docker" / "requirements-jetson.txt"
        qemu = None
        if self.emulated:
            first = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout
            qemu = first.splitlines()[0] if first else "qemu-aarch64-static"
        checks = [r.to_dict() for r in self.results.values()]
        return {
            "format": FORMAT,
            "mode": "short" if self.args.short else "full",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **{k: self.versions.get(k) for k in ("arch", "python", "torch", "torchvision", "numpy", "onnx",
                                                  "onnxruntime", "onnxscript", "torch_pruning")},
            "runner": ({"kind": "qemu user-mode emulation", "qemu": qemu, "cpu": os.environ.get("QEMU_CPU", "cortex-a76"),
                        "sysroot": "Debian bookworm arm64 (python3.11); the Jetson image: Ubuntu 22.04, Python 3.10",
                        "finetune_loader_workers": LOADER_WORKERS_EMULATED}
                       if qemu else {"kind": "native", "interpreter": self.python[0]}),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "system": platform.platform(terse=True)},
            "torch_threads": self.versions.get("torch_threads"),
            "requirements": {"file": "docker/requirements-jetson.txt",
                             "sha256": hashlib.sha256(reqs.read_bytes()).hexdigest() if reqs.is_file() else None},
            "shapes": {"resolution": RESOLUTION, "width": WIDTH, "batch_size": BATCH, "classes": 3},
            "env_seconds": env_seconds,
            "seconds": round(seconds, 1),
            "passed": sum(c["status"] == "passed" for c in checks),
            "failed": sum(c["status"] == "failed" for c in checks),
            "skipped": sum(c["status"] == "skipped" for c in checks),
            "checks": checks,
        }


class CheckFailed(Exception):
    pass


# pytest at small shapes (the tests' own: 48-64 px, width 0.25-0.35): the accounting,
# streaming and uint8-batch tests (all of these three files take about 40 min emulated), the
# meta-op memo and the channels-last runtime. --short runs a few cases of each and the full
# check leaves out the slowest (each over 4 s natively: large batches, recompute searches, the
# 224 px figure, CLI round trips; bf16 and ResNet-18, slow under qemu).
PYTEST_SHORT = {
    "runtime_accounting": [
        *(f"test_each_rule_against_hand_count_and_meter[{rule}]" for rule in
          ("frozen_conv", "relu6", "relu6_inplace", "avgpool", "bn", "dropout", "flatten_free", "resize",
           "relu_inplace")),
        "test_tiny_backbone_prediction_matches_measured[repnet]",
    ],
    "stream": [
        "test_streamed_gradients_equal_the_unstreamed_network[1-unpruned]",
        "test_streamed_gradients_equal_the_unstreamed_network[2-pruned]",
        "test_a_streamed_step_is_predicted_exactly[repnet-4-1]",
        "test_streaming_needs_folded_bn",
        "test_a_kept_edge_owns_its_node_after_the_output_is_dropped[older torch]",
        "test_a_kept_edge_owns_its_node_after_the_output_is_dropped[torch>=2.9]",
    ],
    "uint8_input": [
        "test_the_network_normalises_to_the_loaders_values_bit_for_bit",
        "test_a_uint8_batch_trains_as_the_float_batch[1-fp32-repnet]",
        "test_a_uint8_step_is_predicted_exactly[False-repnet-4-0-fp32]",
        "test_uint8_saves_the_batch_bytes_it_promises",
    ],
    # the remembered meta results against this torch's own meta kernels (its registry differs)
    "metaop": [
        *(f"test_a_remembered_result_has_the_layout_torch_gives[{name}]" for name in
          ("add_broadcast", "batch_norm", "cat", "channels_last_mul", "clamp", "conv", "conv_backward_mask",
           "empty_strided", "gt", "mul_int_by_float", "to_bf16")),
        "test_an_in_place_op_returns_its_argument_and_a_view_is_never_remembered",
        "test_an_op_that_rebinds_its_argument_always_runs",
        "test_an_in_place_op_that_changes_its_arguments_layout_always_runs",
        "test_torchs_meta_kernel_runs_once_per_layout",
        "test_a_factory_op_follows_the_default_dtype",
        "test_a_leaf_measures_the_same_with_torchs_meta_kernels_every_time[frozen_depthwise_int8]",
        "test_a_metered_step_on_meta_counts_the_same_bytes_and_ops",
    ],
    # the channels-last lean runtime on this torch: one plain-against-channels-last step, a
    # streamed one, the mask order, the accounting's layouts and the layout helpers
    "channels_last": [
        "test_channels_last_step_is_the_plain_step[k1-fp32]",
        "test_channels_last_step_is_the_plain_step[stream1]",
        "test_masks_are_packed_and_read_in_memory_order[1-shape1]",
        "test_masks_are_packed_and_read_in_memory_order[8-shape0]",
        "test_the_accounting_measures_each_leaf_laid_out_as_it_runs",
        "test_layout_helpers",
    ],
    # edgetl's fused mask kernels as an Arm CPU runs them (the portable loop), against torch's
    # ops: each op on whole and partial bytes, both layouts, ReLU6 and ReLU; whole steps bit for
    # bit; the accounting's prediction against the meter with them
    "fused_masks": [
        *(f"test_clamp_pack_gives_the_aten_path_s_values_and_mask[{upper}-{shape}-{layout}-dtype{d}]"
          for upper, shape, layout, d in (("6.0", "shape0", "False", 0), ("None", "shape2", "True", 0),
                                           ("6.0", "shape2", "True", 1), ("6.0", "shape1", "False", 2))),
        *(f"test_mask_mul_gives_the_aten_path_s_gradient_and_layout[{shape}-{grad}-{layout}-dtype{d}]"
          for shape, grad, layout, d in (("shape0", "same", "False", 0), ("shape1", "other", "True", 0),
                                          ("shape1", "same", "True", 1))),
        "test_the_meta_kernels_give_the_aten_path_s_layouts",
        "test_many_threads_and_a_partial_last_byte_give_the_same_bytes",
        "test_a_fused_step_trains_the_same_weights_bit_for_bit[repnet-channels-last]",
        "test_a_fused_step_is_predicted_as_measured_and_holds_no_more_than_the_aten_step[repnet-channels-last]",
    ],
}
PYTEST_FULL_SKIP = {
    "runtime_accounting": ["test_full_size_repnet_matches_design_figure", "test_cli_runtime_measure",
                           "test_profile_runtime_prediction_is_exact"],
    "stream": ["test_a_big_batch_is_measured_at_two_small_ones_and_still_exact",
               "test_recompute_is_chosen_where_it_lowers_the_peak_and_predicted_exactly",
               "test_a_segment_cost_is_not_shared_by_networks_of_other_channels",
               "test_profile_prints_the_streamed_segments", "test_streaming_as_on_older_torch_is_exact_too",
               "test_a_segment_whose_temporaries_settle_after_three_periods_is_extrapolated_exactly",
               "test_a_segment_whose_temporaries_decline_is_measured_whole_once_per_layout",
               "bias-5-3", "bias-4-1"],
    # bf16 arithmetic is slow under qemu (no bf16 instructions emulated natively): one bf16 case
    "uint8_input": ["test_a_uint8_step_is_predicted_exactly", "test_a_copy_of_a_uint8_network_keeps_its_normalisation",
                    "bf16-bias", "1-bf16-repnet", "3-bf16-repnet"],
    "metaop": ["bf16"],
    "channels_last": ["bf16", "resnet18", "finetune"],
    # the portable build is this build on aarch64; the CLI round trips and the bench's rows are the
    # host suite's (they spawn interpreters and time rows); the GPU tests skip without one
    "fused_masks": ["portable_loop", "without_a_compiler", "bench_leaves", "finetune_refuses", "cuda",
                    "on_the_gpu"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the CI subset (streaming finetune and default export included)")
    p.add_argument("--out", type=Path, default=REPO / "jetson-check", help="output folder (replaced)")
    p.add_argument("--python", type=Path, default=REPO / ".jetson" / "python",
                   help="interpreter to check (default: the emulated aarch64 one)")
    p.add_argument("--repo", type=Path, default=REPO, help="the edgetl checkout to check")
    p.add_argument("--no-env", dest="env", action="store_false", help="do not run scripts/jetson_env.sh first")
    p.add_argument("--only", metavar="NAME,...", help="run these checks (and what they need)")
    args = p.parse_args(argv)
    args.repo = args.repo.resolve()
    args.python = Path(os.path.abspath(args.python))  # not resolve(): a venv's python is a symlink
    if args.env and args.python != REPO / ".jetson" / "python":
        args.env = False  # another interpreter needs no emulated environment
    if not args.env and not (args.python.is_file() and os.access(args.python, os.X_OK)):
        raise SystemExit(f"jetson_check: {args.python} is not an executable (run scripts/jetson_env.sh)")
    return Checker(args).main()


if __name__ == "__main__":
    sys.exit(main())
