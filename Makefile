# Entry points, each creating (or reusing) the virtual environment it needs:
#   make example       - train a small GPT with Accelerate + zerolite on 2 CPU processes
#   make test          - ruff check, then the test suite (what .ci/run runs)
#   make test-kernels  - the numerics tests under other CPUs' kernel families (README, Tests)
#   make gpu-check     - the CUDA-marked tests (tests/test_cuda.py); without a CUDA device it
#                        says so and succeeds. Use a CUDA torch: make gpu-check TORCH_SPEC=torch
# TORCH_SPEC is installed before the package so that pip never resolves torch itself:
# on a CPU-only machine `torch==2.13.0` is the local CPU wheel; with a CUDA build
# already wanted, run e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
STAGE ?= 2

STAMP := $(VENV)/.zerolite-installed

# How another CPU computes, emulated on this one: oneDNN (bf16 matmuls), MKL (fp32 GEMM) and
# ATen's own vector kernels (elementwise ops, reductions) each pick their code at run time.
# "native" is this machine as it is.
KERNELS_native :=
KERNELS_avx2 := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
KERNELS_avx512 := ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512 \
  ATEN_CPU_CAPABILITY=avx512
KERNELS_avx512_bf16 := ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MKL_ENABLE_INSTRUCTIONS=AVX512 \
  ATEN_CPU_CAPABILITY=avx512
KERNEL_FAMILIES ?= native avx2 avx512

.PHONY: test test-kernels example env gpu-check

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

test-kernels: $(STAMP)
	@set -e; $(foreach family,$(KERNEL_FAMILIES),\
	  echo "== kernel family $(family): $(or $(KERNELS_$(family)),as this CPU picks)"; \
	  env $(KERNELS_$(family)) $(VENV)/bin/python -m pytest -q -m numerics;)

example: $(STAMP)
	ACCELERATE_USE_CPU=1 $(VENV)/bin/accelerate launch --config_file examples/accelerate/cpu_2proc.yaml \
	  --num_processes $(NPROC) examples/train_gpt.py --stage $(STAGE)

gpu-check: $(STAMP)
	@if $(VENV)/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	  $(VENV)/bin/python -m pytest -q -s -rs -m cuda tests; \
	else \
	  echo "gpu-check: skipped, torch sees no CUDA device here (torch.cuda.is_available() is False)"; \
	fi
