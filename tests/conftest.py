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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with a reason, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
