"""Running the demo's stages (``edgetl.demo``): a stage's folder claimed, its result and wall
time recorded in the report and in its mark (``DIR/stages/NAME.json``, read back by a rerun),
and the stages side by side (``edgetl demo --jobs N``, ``run_side_by_side``): each as soon as
the stages it needs are done, a stage beside another in a process of its own that
sends its progress, result or error back on a queue."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from edgetl.errors import ResourceError
from edgetl.io import atomic_text_json, read_json

log = logging.getLogger("edgetl.demo")


@dataclass(frozen=True)
class Stage:
    """One row of the demo: its name (and folder), what it does, the type of its result, and
    the stages whose results it reads (``needs``: the only ones its context holds)."""

    name: str
    title: str
    run: Callable[[Any, Path], Any]  # (the demo's context, its folder) -> its result
    result: type
    needs: tuple[str, ...] = ()


def _read_mark(mark: Path, result: type):
    """A finished stage's (result, wall time) from its mark; None where there is none, or
    where an older edgetl wrote other fields (the stage then runs again). A field added since
    with a default reads as that default, which says what the stage did then (a Rep-Net
    fine-tune recorded before ``FineTuned.channels_last`` ran plain)."""
    if not mark.is_file():
        return None
    info = read_json(mark)
    try:
        wall_s = info.pop("wall_s")
        return result(**info), wall_s
    except (KeyError, TypeError, AttributeError):
        log.warning("%s was written by another version of the demo; running the stage again", mark)
        return None


def _stage_context(ctx, stage: Stage, report, on_step):
    """``ctx`` for ``stage``: the results of the stages it needs, nothing else."""
    return dataclasses.replace(ctx, done={name: report.stages[name] for name in stage.needs}, on_step=on_step)


def _claim_work(stage: Stage, manifest, report) -> Path:
    """The stage's folder, claimed for edgetl (a folder of the user's by that name is refused);
    a folder of this demo's left by a stage killed part-way is removed, to start again."""
    work = report.out_dir / stage.name
    manifest.claim([stage.name])
    if work.exists():
        shutil.rmtree(work)
    return work


def _record(stage: Stage, result, wall_s: float, report, on_stage) -> None:
    report.stages[stage.name], report.wall_s[stage.name] = result, wall_s
    info = report.to_dict()[stage.name]
    atomic_text_json(report.out_dir / "stages" / f"{stage.name}.json", info)
    on_stage(stage.name, "done", info)


def _reuse(stage: Stage, report, on_stage) -> bool:
    """Read a finished stage back from its mark; False where there is none to read."""
    done = _read_mark(report.out_dir / "stages" / f"{stage.name}.json", stage.result)
    if done is None:
        return False
    report.stages[stage.name], report.wall_s[stage.name] = done
    on_stage(stage.name, "reused", report.to_dict()[stage.name])
    return True


def _run_stage(stage: Stage, ctx: Any, manifest, report,
               on_stage: Callable[[str, str, dict], None], *, reuse: bool = True) -> None:
    """Run ``stage`` here into ``report`` (its result and wall time), or reuse its mark
    (``reuse``: its mark not read yet)."""
    if reuse and _reuse(stage, report, on_stage):
        return
    work = _claim_work(stage, manifest, report)
    on_stage(stage.name, "start", {})
    start = time.perf_counter()
    on_step = None if ctx is None or ctx.on_step is None else _Progress(stage.name, ctx.on_step)
    result = stage.run(None if ctx is None else _stage_context(ctx, stage, report, on_step), work)
    _record(stage, result, round(time.perf_counter() - start, 1), report, on_stage)


@dataclass(frozen=True)
class _Progress:
    """A stage's progress callback: the training loop's dict with the stage's name added,
    handed to ``forward`` (the caller's callback, or a queue's ``put`` in a stage's process)."""

    stage: str
    forward: Callable

    def __call__(self, info: dict) -> None:
        self.forward({**info, "stage": self.stage})


def run_side_by_side(stages, ctx, manifest, report, on_stage, jobs: int) -> None:
    """Every stage of ``stages``, up to ``jobs`` at once, each as soon as the stages it needs
    are done (in table order among those ready). A stage that is the only one that can run
    (every stage, with one job) runs here; the others each in a process of their own
    (``_process_context``; a stage pickles: module-level functions), with this process's
    threads shared out and its heap policy, which sends its progress and result back on a
    queue. A stage that fails stops the demo: the stages beside it are ended (each starts
    again on the next run) and its error is raised here, from its traceback there."""
    import torch

    from edgetl.heap import DEFAULT, heap_policy

    context = _process_context()
    events = context.Queue() if jobs > 1 else None  # (a queue starts multiprocessing's resource tracker)
    threads = max(1, torch.get_num_threads() // jobs)
    level = logging.getLogger("edgetl").getEffectiveLevel()
    hold = not heap_policy().startswith(DEFAULT)
    waiting, running = list(stages), {}
    read: set[str] = set()  # stages whose marks were read (once each: a mark left by another
    # version is said once, not at every pass while the stage waits for a slot)
    try:
        while waiting or running:
            ready = [s for s in waiting if all(n in report.stages for n in s.needs)]
            if not ready and not running:
                raise RuntimeError(f"demo stages {[s.name for s in waiting]} need stages that never run")
            unread = [s for s in ready if s.name not in read]
            read.update(s.name for s in unread)
            reused = [s for s in unread if _reuse(s, report, on_stage)]
            if reused:
                waiting = [s for s in waiting if s not in reused]
                continue
            if ready and not running and (len(ready) == 1 or jobs == 1):
                waiting.remove(ready[0])
                _run_stage(ready[0], ctx, manifest, report, on_stage, reuse=False)
                continue
            for stage in ready[:jobs - len(running)]:
                waiting.remove(stage)
                work = _claim_work(stage, manifest, report)
                on_stage(stage.name, "start", {})
                child = _stage_context(ctx, stage, report, None)
                process = context.Process(target=_stage_process, name=f"edgetl demo {stage.name}",
                                        args=(stage, child, work, events, threads, level, hold,
                                              ctx.on_step is not None))
                process.start()
                running[stage.name] = stage, process
            _wait_for_a_stage(events, running, report, on_stage, ctx.on_step)
    finally:
        for _, process in running.values():  # a failure, or an interrupt: end the stages beside it
            process.terminate()
        for _, process in running.values():
            process.join()


def _process_context():
    """How a stage's process starts: from a fork server that imported the demo (torch and
    torchvision among it) once, on Linux; elsewhere spawned, each importing them
    again (seconds each on a busy 2-core machine). Either way it starts from a process that
    has run nothing: no torch threads, no CUDA context."""
    import multiprocessing
    import sys

    # macOS has a fork server too, but forking a process that loaded Apple's frameworks is unsafe
    if not sys.platform.startswith("linux"):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["edgetl.demo"])
    return context


def _wait_for_a_stage(events, running: dict, report, on_stage, on_step) -> None:
    """Pass progress on until a running stage ends; record its result, or raise its error. A
    stage's process that ended without saying so (killed: out of memory, a signal) is seen
    within seconds, while the stage beside it still sends progress."""
    import queue

    said_by = None  # when a process seen ended must have said why (what it sent may be on its way)
    while True:
        try:
            kind, name, payload = events.get(timeout=1.0)
        except queue.Empty:
            kind = None
        if kind == "step":
            if on_step is not None:
                on_step(payload)
        elif kind is not None:
            stage, process = running.pop(name)
            process.join()
            if kind == "error":
                error, trace = payload
                raise error from _StageTraceback(trace)
            result, wall_s = payload
            _record(stage, result, wall_s, report, on_stage)
            return
        ended = [name for name, (_, process) in running.items() if process.exitcode is not None]
        if not ended:
            said_by = None
        elif said_by is None:
            said_by = time.monotonic() + 5.0
        elif time.monotonic() > said_by:
            name = ended[0]
            code = running.pop(name)[1].exitcode
            raise ResourceError(f"demo stage {name} ended with exit code {code} before it finished; "
                                f"run the demo again to start it again")


class _StageTraceback(Exception):
    """The traceback of a stage that failed in a process of its own: the error raised here is
    raised from it (as ``concurrent.futures`` does), so the failing line is shown; its one
    argument, the formatted traceback, is what it prints."""


def _stage_process(stage: Stage, ctx, work: Path, events, threads: int, level: int, hold: bool,
                   progress: bool) -> None:
    """A stage's own process: the stage run with ``threads`` torch threads (freed memory held
    where ``hold``, ``edgetl.heap``), its progress, result and wall time, or its error, sent
    back on ``events``."""
    import torch

    from edgetl.heap import hold_freed_memory

    torch.set_num_threads(threads)
    if hold:
        hold_freed_memory()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    name = stage.name
    on_step = _Progress(name, lambda info: events.put(("step", name, info))) if progress else None
    try:
        start = time.perf_counter()
        result = stage.run(dataclasses.replace(ctx, on_step=on_step), work)
        events.put(("done", name, (result, round(time.perf_counter() - start, 1))))
    except BaseException as exc:  # sent whole where it pickles, else as a line naming the stage
        trace = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"demo stage {name} failed: {type(exc).__name__}: {exc}")
        events.put(("error", name, (exc, trace)))
