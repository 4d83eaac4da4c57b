# `make demo` and `make test` set everything up on a fresh machine (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.edgetl-installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
PYTEST_ARGS ?=
# tests run in one process per core, a test file per process at a time (pytest-xdist);
# JOBS=0 runs them all in one process
JOBS ?= auto

.PHONY: setup test test-slow demo clean data

setup: $(STAMP) data

# The packages go in with uv (pinned in constraints.txt, installed by pip): on a 2-core AVX2 EPYC
# it set up the venv in 40-59 s from an empty cache and 15-18 s from a full one, where pip took 128
# and 140 s (most of it unpacking torch's CUDA libraries). uv reads no pip.conf: a package index
# set in PIP_INDEX_URL / PIP_EXTRA_INDEX_URL is passed on; for one set in pip.conf, INSTALLER=pip.
# An offline set-up (PIP_NO_INDEX) or a trusted host (PIP_TRUSTED_HOST) is not passed on to uv,
# which would go to PyPI or refuse the host: where one is set, pip installs. (PIP_FIND_LINKS
# adds wheels beside the index, which uv uses; a PIP_CERT uv lacks fails loudly.)
ifneq ($(PIP_NO_INDEX)$(PIP_TRUSTED_HOST),)
INSTALLER ?= pip
endif
INSTALLER ?= uv
ifdef PIP_INDEX_URL
export UV_INDEX_URL ?= $(PIP_INDEX_URL)
endif
ifdef PIP_EXTRA_INDEX_URL
export UV_EXTRA_INDEX_URL ?= $(PIP_EXTRA_INDEX_URL)
endif

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(INSTALLER),pip)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[export,test]'
else ifeq ($(INSTALLER),uv)
	$(PY) -m pip install -q -c constraints.txt uv
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e '.[export,test]'
else
	@echo "INSTALLER=$(INSTALLER) is not allowed; allowed: uv, pip" >&2; exit 2
endif
	touch $(STAMP)

# Real offline data for tests and the demo (Debian package, needs root).
data:
	@if [ ! -f $(FMNIST) ]; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) >/dev/null; \
	  else \
	    echo "note: Fashion-MNIST not found; as root run: apt-get install dataset-fashion-mnist (tests that need it will skip)"; \
	  fi; \
	fi

# OpenMP threads wait passively: spinning threads make every step 10-30x slower while another
# process (a second pytest worker, the demo) shares the cores (issue #43; the edgetl program
# sets the same for itself, edgetl.cli.entry). A value set by the caller is kept.
export OMP_WAIT_POLICY ?= PASSIVE

test: setup
	$(PY) -m pytest -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# The whole pipeline on Fashion-MNIST (offline); a rerun reuses finished stages.
demo: setup
	$(VENV)/bin/edgetl demo -o runs/demo

clean:
	rm -rf $(VENV) build *.egg-info

# The CUDA check (issue #15). Here: `make gpu-wheels` downloads the torch-pruning wheel into
# .whl/ for a device call to carry; `make gpu-check DEVICE=cpu` runs the same driver at tiny
# scale. On a GPU machine: `bash scripts/gpu_check.sh --device cuda --out DIR` (docs/cuda.md).
DEVICE ?= cpu
GPU_OUT ?= gpu-results
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	bash scripts/gpu_wheels.sh

gpu-check: setup
	PYTHON=$(PY) bash scripts/gpu_check.sh --device $(DEVICE) --out $(GPU_OUT) $(if $(filter cpu,$(DEVICE)),--quick,)

# The emulated Jetson check (issue #28): Debian's arm64 CPython 3.11 under qemu user-mode
# emulation (no binfmt handler, host architectures untouched) with the pins of
# docker/requirements-jetson.txt, built into .jetson/ (downloads cached); results in
# jetson-check/summary.json. Short: the CI subset (7-15 min on 2 cores, rebuilding .jetson/ from
# its cached downloads included); full: 16 checks, 10-22 min (the machine's speed varies by day).
.PHONY: jetson-env jetson-check jetson-check-short
jetson-env:
	bash scripts/jetson_env.sh

jetson-check:
	$(PYTHON) scripts/jetson_check.py

jetson-check-short:
	$(PYTHON) scripts/jetson_check.py --short
