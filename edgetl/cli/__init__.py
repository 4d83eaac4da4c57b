"""Command line: ``edgetl STAGE ...`` parses flags and calls the same function a Python user calls.

Each stage lives in its own module here with ``add_parser(subparsers)`` and
``run(args) -> int``. Only this package prints. User errors (EdgetlError, bad flags)
end in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from edgetl import __version__
from edgetl.compat import check_supported
from edgetl.errors import EdgetlError

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


def main(argv: list[str] | None = None) -> int:
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
    try:
        check_supported()
        return int(args.run(args) or 0)
    except EdgetlError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("edgetl: interrupted", file=sys.stderr)
        return 130
