"""`python -m edgetl` runs the command-line interface."""

from edgetl.cli import main

raise SystemExit(main())
