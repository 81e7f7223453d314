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


# Modules whose assertions compare floating-point results that another CPU's kernels (oneDNN,
# MKL and ATen pick AVX2, AVX-512 or AMX code at run time) compute with other rounding:
# `make test-kernels` runs them under each kernel family.
NUMERICS = {
    "test_accelerate", "test_accumulation", "test_activation_checkpointing",
    "test_assigned_gradients", "test_bf16", "test_checkpoint", "test_clip_value", "test_clipping",
    "test_combination_matrix",
    "test_compile", "test_edge_parameters", "test_error_feedback", "test_feature_combinations",
    "test_fp16_loss_scaling", "test_grad_norm_accuracy", "test_hf_trainer", "test_hybrid",
    "test_lr_scheduler",
    "test_meta_init", "test_more_optimizers", "test_offload", "test_parity", "test_quantize",
    "test_quantized_collectives", "test_quantized_hybrid", "test_read_after_step",
    "test_same_arithmetic",
    "test_stage3", "test_stage3_hf", "test_stage3_loops", "test_tensor_checkpoint",
    "test_tensor_ownership", "test_transformers_matrix", "test_trl", "test_unused_parameters",
    "test_user_loops",
}



def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the `NUMERICS` modules' tests ``numerics``; tests marked ``cuda`` skip, with a
    reason, where torch sees no CUDA device; tests marked ``slow`` skip unless ``-m`` names
    ``slow`` (`make test-matrix`)."""
    import torch

    skip = None
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (`make gpu-check` on a GPU machine)")
    skip_slow = None
    if "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="slow: `make test-matrix` runs it")
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in NUMERICS:
            item.add_marker(pytest.mark.numerics)
        if skip is not None and "cuda" in item.keywords:
            item.add_marker(skip)
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)
