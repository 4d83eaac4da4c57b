"""`python -m edgetl` runs the command-line interface."""

from edgetl.cli import entry

raise SystemExit(entry())
