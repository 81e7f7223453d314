# Two entry points, each creating (or reusing) the virtual environment it needs:
#   make example   - train a small GPT with Accelerate + zerolite on 2 CPU processes
#   make test      - ruff check, then the test suite (what .ci/run runs)
# TORCH_SPEC is installed before the package so that pip never resolves torch itself:
# on a CPU-only machine `torch==2.13.0` is the local CPU wheel; with a CUDA build
# already wanted, run e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
STAGE ?= 2

STAMP := $(VENV)/.zerolite-installed

.PHONY: test example env

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

example: $(STAMP)
	ACCELERATE_USE_CPU=1 $(VENV)/bin/accelerate launch --config_file examples/accelerate/cpu_2proc.yaml \
	  --num_processes $(NPROC) examples/train_gpt.py --stage $(STAGE)
