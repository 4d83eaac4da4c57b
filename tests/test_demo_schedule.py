"""The demo's stages side by side (``edgetl.demo_jobs.run_side_by_side``), with stage functions of
this module run in real spawned processes: each stage starts once the stages it needs are done,
sees only their results, independent stages overlap in time, a failure ends the stages beside
it, and a rerun reads every stage back."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import pytest

from edgetl.demo import QUICK, DemoReport, _claim_folder, _Context
from edgetl.demo_jobs import Stage, run_side_by_side
from edgetl.errors import DataError, ResourceError


@dataclass(frozen=True)
class Ran:
    work: str
    seen: list[str]  # (a list: a stage's mark is JSON)
    start: float
    end: float
    pid: int
    parent: int  # the pid of the process that started this stage's


def _sleep(ctx, work, seconds: float = 2.0) -> Ran:
    start = time.time()
    work.mkdir()
    (work / "half.json").write_text("{")
    time.sleep(seconds)
    return Ran(str(work), sorted(ctx.done), start, time.time(), os.getpid(), os.getppid())


def _sleep_long(ctx, work) -> Ran:
    return _sleep(ctx, work, 60.0)


def _wait_for(path, seconds: float = 60.0) -> None:
    """Until ``path`` exists (a spawned stage imports torch first: seconds on a busy machine)."""
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _meet(ctx, work) -> Ran:
    """A stage of the diamond's middle: started, it waits until the other one has started too,
    so the two overlap however long each process takes to start."""
    start = time.time()
    work.mkdir()
    (work / "half.json").write_text("{")
    for other in ("profile", "plan"):
        _wait_for(work.parent / other / "half.json")
    time.sleep(0.5)
    return Ran(str(work), sorted(ctx.done), start, time.time(), os.getpid(), os.getppid())


def _fail(ctx, work) -> Ran:
    _wait_for(work.parent / "profile" / "half.json")  # the stage beside it is under way
    raise DataError("an image of the stage's data could not be read")


class _Unpicklable(Exception):
    """An error that does not pickle (a lambda among its attributes), as a library's may not."""

    def __init__(self, message: str):
        super().__init__(message)
        self.hook = lambda: None


def _fail_unpicklable(ctx, work) -> Ran:
    _wait_for(work.parent / "profile" / "half.json")
    raise _Unpicklable("the stage's own words")


def _chatter(ctx, work) -> Ran:
    """A stage that sends progress every 50 ms for 60 s."""
    start = time.time()
    work.mkdir()
    (work / "half.json").write_text("{")
    while time.time() < start + 60:
        ctx.on_step({"epoch": 1})
        time.sleep(0.05)
    return Ran(str(work), sorted(ctx.done), start, time.time(), os.getpid(), os.getppid())


def _killed(ctx, work) -> Ran:
    _wait_for(work.parent / "profile" / "half.json")
    os._exit(3)  # as a kill does: nothing said, nothing cleaned up


def _ctx(tmp_path, on_step=None) -> _Context:
    return _Context(QUICK, "cpu", str(tmp_path), on_step, {}, "mobilenet_v2")


def _run(stages, out, jobs=2, on_step=None):
    events = []
    report = DemoReport(out)
    run_side_by_side(stages, _ctx(out, on_step), _claim_folder(out), report, lambda *e: events.append(e[:2]), jobs)
    return report, events


DIAMOND = (Stage("pretrain", "a", _sleep, Ran), Stage("profile", "b", _meet, Ran, ("pretrain",)),
           Stage("plan", "c", _meet, Ran, ("pretrain",)), Stage("prune", "d", _sleep, Ran, ("plan", "profile")))
# the same, its middle two apart (one job runs them one after the other)
CHAIN = tuple(Stage(s.name, s.title, _sleep, Ran, s.needs) for s in DIAMOND)


def test_stages_run_side_by_side_once_their_needs_are_done_and_see_only_those(tmp_path):
    out = tmp_path / "demo"
    report, events = _run(DIAMOND, out)
    a, b, c, d = (report.stages[n] for n in ("pretrain", "profile", "plan", "prune"))
    assert [a.seen, b.seen, c.seen, d.seen] == [[], ["pretrain"], ["pretrain"], ["plan", "profile"]]
    assert a.pid == d.pid == os.getpid()  # alone: run here
    assert len({b.pid, c.pid, os.getpid()}) == 3  # beside each other: a process each
    if sys.platform.startswith("linux"):  # forked from a server that imported the demo
        assert b.parent == c.parent != os.getpid()
    assert b.start < c.end and c.start < b.end  # side by side
    assert a.end <= min(b.start, c.start) and max(b.end, c.end) <= d.start
    assert list(report.to_dict()) == ["pretrain", "profile", "plan", "prune"]  # table order, whatever finished first
    assert {e for e in events if e[1] == "done"} == {(n, "done") for n in report.stages}
    # the wall time is the stage's own, measured where it ran
    assert all(abs(report.wall_s[n] - (s.end - s.start)) < 0.5 for n, s in report.stages.items())

    again, events = _run(DIAMOND, out)
    assert events == [(n, "reused") for n in ("pretrain", "profile", "plan", "prune")]
    assert again.stages == report.stages and again.wall_s == report.wall_s


def test_one_job_runs_every_stage_here_in_table_order(tmp_path):
    report, events = _run(CHAIN, tmp_path / "demo", jobs=1)
    assert {s.pid for s in report.stages.values()} == {os.getpid()}
    starts = [n for n, e in events if e == "start"]
    assert starts == ["pretrain", "profile", "plan", "prune"]


def test_a_failing_stage_ends_the_stage_beside_it_and_raises_its_error_here(tmp_path):
    out = tmp_path / "demo"
    stages = (Stage("pretrain", "a", _sleep, Ran), Stage("profile", "b", _sleep_long, Ran, ("pretrain",)),
              Stage("plan", "c", _fail, Ran, ("pretrain",)))
    start = time.time()
    with pytest.raises(DataError, match="^an image of the stage's data could not be read$"):
        _run(stages, out)
    assert time.time() - start < 30  # the 60-s stage beside it was ended, not waited for
    assert not (out / "stages" / "profile.json").exists() and (out / "profile" / "half.json").exists()
    # the next run reuses what finished and starts the ended stage again in a clean folder
    report, events = _run((stages[0], Stage("profile", "b", _sleep, Ran, ("pretrain",)), CHAIN[2]), out)
    assert events[0] == ("pretrain", "reused") and ("profile", "done") in events
    assert sorted(os.listdir(out / "profile")) == ["half.json"] and report.stages["profile"].seen == ["pretrain"]


def test_a_stage_killed_beside_one_that_sends_progress_ends_the_demo_within_seconds(tmp_path):
    """A stage's process that dies without a word (out of memory, a signal) is seen while the
    stage beside it keeps the queue busy with progress, not when that stage ends."""
    stages = (Stage("pretrain", "a", _sleep, Ran), Stage("profile", "b", _chatter, Ran, ("pretrain",)),
              Stage("plan", "c", _killed, Ran, ("pretrain",)))
    steps = []
    start = time.time()
    with pytest.raises(ResourceError, match="^demo stage plan ended with exit code 3 before it finished"):
        _run(stages, tmp_path / "demo", on_step=steps.append)
    assert time.time() - start < 30  # the 60-s stage beside it was ended, not waited for
    assert steps and {s["stage"] for s in steps} == {"profile"}  # its progress came through, named


def test_a_failing_stage_error_is_raised_from_its_own_traceback(tmp_path):
    stages = (Stage("pretrain", "a", _sleep, Ran), Stage("profile", "b", _sleep_long, Ran, ("pretrain",)),
              Stage("plan", "c", _fail, Ran, ("pretrain",)))
    with pytest.raises(DataError) as caught:
        _run(stages, tmp_path / "demo")
    trace = str(caught.value.__cause__)
    assert "in _fail" in trace and "raise DataError(" in trace  # where it failed, in its process


def test_a_mark_of_another_version_is_said_once_while_its_stage_waits_for_a_slot(tmp_path, caplog):
    """Three stages ready for two slots: the third's mark, written by another version, is read
    (and said) once, not again at each pass while it waits; the stage then runs again."""
    out = tmp_path / "demo"
    stages = (Stage("pretrain", "a", _sleep, Ran),
              *(Stage(name, name, _sleep, Ran, ("pretrain",)) for name in ("profile", "plan", "prune")))
    _run(stages, out)
    (out / "stages" / "profile.json").unlink()  # redo these two: they take both slots
    (out / "stages" / "plan.json").unlink()
    mark = out / "stages" / "prune.json"
    mark.write_text(mark.read_text().replace('"work"', '"folder"'))  # a field this version lacks
    with caplog.at_level("WARNING", logger="edgetl"):
        report, events = _run(stages, out)
    said = [r for r in caplog.records if "written by another version" in r.getMessage()]
    assert len(said) == 1 and str(mark) in said[0].getMessage()
    assert events[0] == ("pretrain", "reused") and ("prune", "done") in events
    assert report.stages["prune"].start >= min(report.stages["profile"].end, report.stages["plan"].end)


def test_an_error_that_does_not_pickle_comes_through_as_a_line_naming_its_stage(tmp_path):
    stages = (Stage("pretrain", "a", _sleep, Ran), Stage("profile", "b", _sleep_long, Ran, ("pretrain",)),
              Stage("plan", "c", _fail_unpicklable, Ran, ("pretrain",)))
    start = time.time()
    with pytest.raises(RuntimeError, match="^demo stage plan failed: _Unpicklable: the stage's own words$") as caught:
        _run(stages, tmp_path / "demo")
    assert time.time() - start < 30  # the stage beside it was ended
    assert "in _fail_unpicklable" in str(caught.value.__cause__)  # its traceback there, all the same
