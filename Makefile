# Entry points, each creating (or reusing) the virtual environment it needs:
#   make example       - train a small GPT with Accelerate + zerolite on 2 CPU processes
#   make test          - ruff check, the docs build (mkdocs build --strict: a warning fails it),
#                        then the test suite, which runs every Python block of the docs
#                        (tests/docs/test_docs.py) (what .ci/run runs)
#   make docs-serve    - preview the docs site (docs/, mkdocs.yml) at http://127.0.0.1:8000
#   make test-matrix   - every accepted combination of features (slow; tests/support/combination_matrix.py)
#   make test-kernels  - the numerics tests under other CPUs' kernel families (README, Tests)
#   make test-compat   - the whole suite under each pinned version set in .ci/compat/ (oldest.txt:
#                        the floors pyproject.toml names; gpu-image.txt: the GPU image's versions),
#                        each in a fresh venv .venv-compat-<set> (git-ignored) built from the pins
#                        file with zerolite installed --no-deps; COMPAT=oldest picks one set.
#                        Not part of make test (it downloads several GB of CUDA torch wheels).
#   make gpu-check     - everything one GPU can check (tests/gpu/gpu_check.py: the cuda-marked tests,
#                        world size 1 on NCCL and 2 on gloo over CUDA tensors, the step-time and
#                        checkpoint benchmarks on the GPU) as one pass/fail table, written with the
#                        logs and benchmark tables to OUT (default gpu-check-results/, git-ignored).
#                        It creates no venv and installs nothing: it runs GPU_PYTHON (below) on
#                        this tree through PYTHONPATH, and names any package that does not
#                        import. Without a GPU it says so and succeeds. Under 10 minutes.
# TORCH_SPEC is installed before the package so that pip never resolves torch itself:
# on a CPU-only machine `torch==2.13.0` is the local CPU wheel. On a machine with internet and a
# GPU, a CUDA build of the same torch comes from PyTorch's wheel index for that CUDA version:
#   make test TORCH_SPEC=torch==2.13.0 PIP_INDEX=https://download.pytorch.org/whl/cu130
#   make gpu-check GPU_PYTHON=.venv/bin/python
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# An extra index for the torch wheel only (empty: pip's configured indexes).
PIP_INDEX ?=
# The Python with a CUDA torch: this tree's venv where there is one, else python3 (the lent GPU
# machine's own: the venv, git-ignored, does not travel there).
GPU_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
OUT ?= gpu-check-results
NPROC ?= 2
STAGE ?= 2
# pytest-xdist workers for make test. Each test file runs whole in one worker (--dist loadfile),
# so a module's rank processes and fixtures are shared as in a serial run; most tests spend
# their time waiting on rank processes, so 2 workers keep 2 cores busy (on 2 idle cores, 0.6 of the serial time).
TEST_WORKERS ?= 2

STAMP := $(VENV)/.zerolite-installed
# Material for MkDocs prints a banner about its successor on every build; keep the output short.
export NO_MKDOCS_2_WARNING := 1

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

.PHONY: test test-matrix test-kernels test-compat example env gpu-check docs docs-serve

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q $(if $(PIP_INDEX),--extra-index-url $(PIP_INDEX)) "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The site goes to site/ (git-ignored). --strict turns every warning into a failure: a broken
# link or anchor, a page missing from the nav, a public name the API reference leaves out.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

# Every accepted combination of features (tests/support/combination_matrix.py), not only the pairwise
# set that `make test` runs: long.
test-matrix: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow tests/combinations/test_combination_matrix.py tests/checkpoint/test_resume_matrix.py

test-kernels: $(STAMP)
	@set -e; $(foreach family,$(KERNEL_FAMILIES),\
	  echo "== kernel family $(family): $(or $(KERNELS_$(family)),as this CPU picks)"; \
	  env $(KERNELS_$(family)) $(VENV)/bin/python -m pytest -q -m numerics;)

example: $(STAMP)
	ACCELERATE_USE_CPU=1 $(VENV)/bin/accelerate launch --config_file examples/accelerate/cpu_2proc.yaml \
	  --num_processes $(NPROC) examples/train_gpt.py --stage $(STAGE)

# The version sets that test-compat runs: one per pins file in .ci/compat/ (COMPAT=oldest: one).
COMPAT ?= $(sort $(basename $(notdir $(wildcard .ci/compat/*.txt))))

# A venv per set, built afresh whenever its pins file or pyproject.toml changes. The pins file
# alone decides the versions: zerolite goes in editable and --no-deps, so pip resolves nothing for it.
.venv-compat-%/.zerolite-installed: .ci/compat/%.txt pyproject.toml
	rm -rf .venv-compat-$*
	$(PYTHON) -m venv .venv-compat-$*
	.venv-compat-$*/bin/python -m pip install -q -r $<
	.venv-compat-$*/bin/python -m pip install -q --no-deps -e .
	.venv-compat-$*/bin/python -m pip check
	touch $@

# One set after the other (never in parallel: each takes both cores), HF_HUB_OFFLINE=1 as in
# make test (tests/conftest.py); every set runs, and the target fails if any set failed.
test-compat: $(foreach set,$(COMPAT),.venv-compat-$(set)/.zerolite-installed)
	@failed=; for set in $(COMPAT); do \
	  echo "== compat set $$set: $$(grep -v '^#' .ci/compat/$$set.txt | tr '\n' ' ')"; \
	  HF_HUB_OFFLINE=1 .venv-compat-$$set/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	    || failed="$$failed $$set"; \
	done; test -z "$$failed" || { echo "test-compat failed under:$$failed"; exit 1; }

# No $(STAMP): the GPU machine has no package index, so nothing may be installed there.
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) tests/gpu/gpu_check.py --out "$(OUT)"
