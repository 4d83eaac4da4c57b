"""Command line: ``edgetl STAGE ...`` parses flags and calls the same function a Python user calls.

Each stage lives in its own module here with ``add_parser(subparsers)`` and
``run(args) -> int``. Only this package prints. User errors (EdgetlError, bad flags)
end in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

from edgetl import __version__
from edgetl.compat import check_supported
from edgetl.errors import EdgetlError
from edgetl.heap import hold_freed_memory

# Stage modules in pipeline order (each is edgetl/cli/<name>.py) and their one-line help.
# The listing (`edgetl --help`) is built from this table alone, so it imports no stage and
# no torch; a command imports only its own stage.
COMMANDS = {
    "profile": "per-block temporary / cumulative-gradient memory of a fine-tuning configuration",
    "plan": "choose pruning, pooling, precision and batch size to fit a memory budget",
    "prune": "prune hidden channels of the memory-sensitive blocks (the FMEC 2023 method)",
    "retrain": "retrain a pruned backbone on ImageNet (or pretrain one); torchrun for many GPUs",
    "finetune": "fine-tune the side network (frozen, lean backbone) on your data within a memory budget",
    "export": "export a fine-tuned run to ONNX or a TensorRT engine",
    "bench": "the paper's Table I, measured: memory and speed of every fine-tuning method",
    "doctor": "platform facts: Jetson / L4T, torch, CUDA, cuDNN, TensorRT, memory, a suggested budget",
    "demo": "the whole pipeline on real offline data (Fashion-MNIST), with a final report",
}

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``edgetl NAME: error: ...``) with exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``edgetl`` parser; ``only`` (a name in COMMANDS) registers just that stage, so
    a command imports its own module and not every stage's (torch-pruning, onnx, ...);
    without one, the stages are listed by name and help, and none is imported."""
    parser = OneLineParser(
        prog="edgetl",
        description="Fine-tune a pretrained vision model on an NVIDIA Jetson inside a hard memory budget.",
    )
    parser.add_argument("--version", action="version", version=f"edgetl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    if only in COMMANDS:
        importlib.import_module(f"edgetl.cli.{only}").add_parser(sub)
    else:  # the listing: names and help only
        for name, text in COMMANDS.items():
            sub.add_parser(name, help=text, add_help=False)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The stage named on the command line: its first argument that is not an option
    (the global options take no value), if it names a stage."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def fail(message: str) -> int:
    """Print a one-line user error and return the usage exit code."""
    print(f"edgetl: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def thread_policy(cores: int) -> dict[str, str]:
    """The OpenMP settings of the edgetl program on a machine with ``cores`` usable cores.

    torch's OpenMP threads spin while they wait: when another process shares the cores (a
    Jetson's camera pipeline, a second test worker) a spinning thread holds the core its
    partner needs and a step can take 10-200x longer, in some runs and not others (issue #43;
    benchmarks/busy_cores_*.json, docs/bench.md). So threads wait passively, and one core is
    left to the rest of the machine: on 2 cores that is one thread, which measured fastest
    alone at 64 px and shared at both sizes. OpenMP reads these once, when torch loads.
    """
    return {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(max(1, cores - 1))}


def entry() -> int:
    """The ``edgetl`` program (console script and ``python -m edgetl``): the threading policy,
    set before torch loads, and the heap policy (``edgetl.heap``: freed memory kept for the next
    step); never at the library's import, and a value the user set is kept. Then ``main``."""
    try:
        os.getcwd()
    except FileNotFoundError:  # torch's libraries fail to load there, with a fatal error of their own
        return fail("the working folder no longer exists (deleted or unmounted); cd to a folder that exists")
    if "torch" not in sys.modules:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        for name, value in thread_policy(cores).items():
            os.environ.setdefault(name, value)
    hold_freed_memory()
    return main()


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. A torchrun worker that joined its process group ends here,
    without the interpreter's shutdown (``edgetl.train.distributed.exit_worker``: why)."""
    code = _run(argv)
    worker = sys.modules.get("edgetl.train.distributed")  # loaded only by a command that trains
    if worker is not None and worker.joined_group:
        worker.exit_worker(code)
    return code


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command_of(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    stdout, sys.stdout = sys.stdout, _StandardOutput(sys.stdout)
    try:
        check_supported()
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed or full standard output fails here, inside the try
        return code
    except EdgetlError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("edgetl: interrupted", file=sys.stderr)
        return 130
    except OutputError as exc:
        # nothing more can be shown there; the interpreter's own flush at exit must not fail again
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream without a descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return fail(str(exc))
    except OSError as exc:  # the environment: a full or read-only destination, a vanished file
        where = f" {exc.filename}" if exc.filename else ""
        return fail(f"cannot use{where}: {(exc.strerror or type(exc).__name__).lower()}")
    finally:
        sys.stdout = stdout


class OutputError(OSError):
    """Standard output could not be written: a closed pipe (``edgetl plan | head -1``) or a
    full device behind ``>``."""


class _StandardOutput:
    """sys.stdout while a command runs: a failed write is named as standard output's, so the
    one line can say what failed (an OSError from a print carries no file name)."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise OutputError("standard output was closed before edgetl finished writing (a closed pipe)") from None
        except OSError as exc:
            raise OutputError(f"cannot write standard output: {(exc.strerror or str(exc)).lower()}") from None

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)
