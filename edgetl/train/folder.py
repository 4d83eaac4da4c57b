"""The run folder: a path in; checked (disk space, an existing run), made, locked and claimed
before the loop, its recipe.yaml and metrics files written; cleaned up or explained after a failure."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
from pathlib import Path

from torch import nn

from edgetl.errors import ConfigError, DataError, DivergedError, EdgetlError, ResourceError
from edgetl.io import MB, atomic_write_text, existing_folder, free_bytes
from edgetl.recipe import Recipe
from edgetl.runfolder import MANIFEST, Manifest, check_output_folder, run_lock
from edgetl.train.checkpoint import BEST, LAST, checkpoint_bytes
from edgetl.train.distributed import is_main_process

# The package's logger name, as log lines read before the split (the CLI prints %(name)s).
log = logging.getLogger("edgetl.train")

RECIPE_FILE = "recipe.yaml"
METRICS_CSV, METRICS_JSONL = "metrics.csv", "metrics.jsonl"
METADATA_BYTES = 256 * 1024  # recipe.yaml, metrics.csv/jsonl


def disk_need(out_dir: str | Path, files: dict[str, int]) -> tuple[int, int]:
    """(bytes a run still needs on disk, bytes free there) for a run folder writing ``files``.

    ``files`` maps file name to its size bound; the first two are last.pt and best.pt,
    rewritten through a temporary copy while the old one still exists, the rest (the
    stage's final artifacts) written once after them. Files already there (a resumed run)
    count as written.
    """
    out_dir = Path(out_dir)
    sizes = list(files.values())
    peak = sum(sizes[:2]) + max([*sizes[:2], sum(sizes[2:])]) + METADATA_BYTES
    present = sum((out_dir / name).stat().st_size for name in files if (out_dir / name).is_file())
    return max(0, peak - present), free_bytes(out_dir)


def check_disk(out_dir: str | Path, files: dict[str, int]) -> int:
    """Refuse (ResourceError, one line) a run whose files would not fit the free disk space."""
    need, free = disk_need(out_dir, files)
    if need > free:
        parts = ", ".join(f"{name} {size / MB:.1f}" for name, size in files.items())
        raise ResourceError(
            f"not enough disk space for run folder {out_dir}: it needs up to {need / MB:.1f} MB ({parts} MB, "
            f"and a checkpoint is written beside the old one before replacing it), "
            f"{free / MB:.1f} MB free in {existing_folder(out_dir)}"
        )
    log.info("disk: the run needs up to %.1f MB, %.1f MB free in %s", need / MB, free / MB, existing_folder(out_dir))
    return need


def _write_metrics(out_dir: Path, history: list[dict]) -> None:
    """Rewrite metrics.jsonl and metrics.csv (one row an epoch), atomically."""
    atomic_write_text(out_dir / METRICS_JSONL, "".join(json.dumps(r) + "\n" for r in history))
    if not history:
        return
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(history[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    atomic_write_text(out_dir / METRICS_CSV, buf.getvalue())


def read_metrics(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / METRICS_JSONL
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_run_folder(out_dir: str | Path, resume: bool) -> None:
    """Before any work: the folder can be made and written; a resumed run needs ``last.pt``,
    a new one must not find one."""
    out_dir = Path(out_dir)
    if is_main_process():
        check_output_folder(out_dir, "run folder")
    _check_run_folder(out_dir, resume)


def _check_run_folder(out_dir: Path, resume: bool) -> None:
    """A resumed run needs ``last.pt``; a new one must not find one."""
    last_path = out_dir / LAST
    if resume and not last_path.is_file():
        raise DataError(f"nothing to resume: {last_path} does not exist")
    if not resume and last_path.is_file():
        raise ConfigError(f"{out_dir} already holds a run ({LAST}); resume it or choose another folder")


def _start_run_folder(out_dir: Path, recipe: Recipe, model: nn.Module, optimizer, world: int,
                      final_files: dict[str, int] | None, resume: bool, stack: contextlib.ExitStack,
                      created: list[Path]) -> None:
    """Check the disk, make the folder, lock it for the run (``stack`` holds the lock), claim
    the files the run writes (``edgetl.runfolder``) and write recipe.yaml (rank 0); what it
    created is appended to ``created``."""
    if not is_main_process():
        return
    check_disk(out_dir, {LAST: checkpoint_bytes(model, optimizer, world),
                         BEST: checkpoint_bytes(model, None), **(final_files or {})})
    if not out_dir.exists():
        created.append(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stack.enter_context(run_lock(out_dir))
    _check_run_folder(out_dir, resume)  # again, under the lock: a run started meanwhile has its last.pt
    manifest = Manifest(out_dir)
    names = [RECIPE_FILE, METRICS_CSV, METRICS_JSONL, LAST, BEST, *(final_files or {})]
    fresh = [out_dir / n for n in (MANIFEST, RECIPE_FILE, METRICS_CSV, METRICS_JSONL, BEST) if not (out_dir / n).exists()]
    manifest.claim(names)
    created += fresh
    atomic_write_text(out_dir / RECIPE_FILE, recipe.to_yaml())


def _after_failure(exc: BaseException, out_dir: Path, created: list[Path], saved: tuple[int, int] | None):
    """Clean up or explain after the loop failed; returns the exception to raise.

    Before the first last.pt (``saved`` None) the files and folder this run made are removed:
    nothing of it could be resumed. Later the folder stays and an EdgetlError's message says
    from where ``--resume`` continues.
    """
    from edgetl.data import worker_error

    exc = worker_error(exc) or exc
    if not is_main_process():
        return exc
    if saved is None:
        for path in created:
            if path != out_dir:
                path.unlink(missing_ok=True)
        for name in (RECIPE_FILE, METRICS_CSV, METRICS_JSONL, LAST, BEST, MANIFEST):
            for tmp in out_dir.glob(f".{name}.*.tmp"):
                tmp.unlink(missing_ok=True)
        if out_dir in created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        return exc
    epoch, step = saved
    where = f"after epoch {epoch}" if step == 0 else f"at epoch {epoch + 1} step {step}"
    note = f"{out_dir} keeps {LAST} ({where}): add --resume to continue once that is fixed"
    if isinstance(exc, DivergedError):  # resuming the same recipe would diverge again
        note = f"{out_dir} keeps {LAST} ({where}), its last finite weights"
    if isinstance(exc, EdgetlError):
        exc.args = (f"{exc}; {note}",)
    else:
        log.warning(note)
    return exc
