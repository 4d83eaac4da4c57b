#!/usr/bin/env bash
# The GPU check on a bare machine (issue #15): no virtual environment, no network.
# Installs the carried torch-pruning wheel (.whl/, made here by scripts/gpu_wheels.sh) into
# /tmp/site, puts the repository and /tmp/site on PYTHONPATH and runs scripts/gpu_check.py
# with the machine's python3. Usage: scripts/gpu_check.sh --device cuda --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${EDGETL_SITE:-/tmp/site}
if ! "$PY" -c 'import torch_pruning' 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  else
    echo "note: torch_pruning is missing and no wheel was carried in .whl/ (run scripts/gpu_wheels.sh here first)" >&2
  fi
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"
