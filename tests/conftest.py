import os
import sys
from pathlib import Path

import pytest

# This machine (and CI) has no internet: without these, transformers waits on the hub.
# Rank processes started by run_ranks inherit the environment.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# examples/ holds the GPT the tests train; rank processes inherit this path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# A module whose assertions compare floating-point results that another CPU's kernels (oneDNN,
# MKL and ATen pick AVX2, AVX-512 or AMX code at run time) compute with other rounding marks
# itself ``pytestmark = pytest.mark.numerics``: `make test-kernels` runs those under each
# kernel family (tests/README.md, "Markers").


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with a reason, where torch sees no CUDA device; tests
    marked ``slow`` skip unless ``-m`` names ``slow`` (`make test-matrix`)."""
    import torch

    skip = None
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (`make gpu-check` on a GPU machine)")
    skip_slow = None
    if "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="slow: `make test-matrix` runs it")
    for item in items:
        if skip is not None and "cuda" in item.keywords:
            item.add_marker(skip)
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)
