#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks into .whl/ (ignored by git), to be
# carried by a device call (carry: [".whl"]). The GPU image has torch, torchvision, onnx,
# onnxruntime, pyyaml, tqdm, matplotlib and pytest; only torch-pruning is missing. It is
# pure Python (py3-none-any), pinned to the version in constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
spec=$(grep -i '^torch-pruning==' constraints.txt)
mkdir -p .whl
rm -f .whl/torch_pruning-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "$spec"
ls -l .whl
