"""The measurement scripts that write committed benchmark files still run against today's library
(a script that only runs when someone regenerates its figures breaks unseen: busy_cores.py built
the bench's setting without the architecture field for a while)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_busy_cores_child_times_both_methods():
    """The timed process of scripts/busy_cores.py, at tiny scale: one step of each method."""
    argv = [sys.executable, str(SCRIPTS / "busy_cores.py"), "--child", "--steps", "2", "--warmup", "0",
            "--resolution", "64", "--batch-size", "2", "--width", "0.35", "--num-classes", "3"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["seconds"]) == {"repnet-lean", "repnet-lean-stream"}
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())
