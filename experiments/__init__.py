"""Accuracy studies of edgetl, configurations in, results and tables out; run from the repository root.

Each study is a module run with ``python -m experiments.NAME --out DIR`` (``--help`` for its
options); ``experiments.harness`` holds what the studies share. This folder belongs to the
checkout and is not installed with edgetl.
"""
