"""``offload_params`` on a CUDA model (`make gpu-check`; without CUDA it skips): the
parameter and gradient shards leave the GPU between uses (through host memory, to a host
arena or a file) and come back for each gather and the step.

One rank on NCCL, stage 3, bf16, the tiny GPT: training with ``offload_params="host"`` and
``"disk"`` is bitwise the run without it (losses and every parameter), and after a step the
GPU holds less by at least the parameter and gradient shards' bytes.
"""

from __future__ import annotations

import pytest
import torch

import zerolite
from tests.support import parity
from zerolite import ZeroConfig
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

pytestmark = pytest.mark.cuda


def _train(where: str, tier: str | None) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    data = [(x.to(device), y.to(device)) for x, y in parity.batches(3)]
    config = ZeroConfig(stage=3, param_dtype=torch.bfloat16, bucket_size_mb=0.01,
                        offload_params=tier, offload_dir=where if tier == "disk" else None)
    model = parity.make_model().to(device)
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    losses = parity.train(model, opt, data, sliced=False)
    params_tier = state_of(model).params_tier
    if params_tier is not None:
        params_tier.drain()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(device)
    full = {k: v.cpu() for k, v in zerolite.full_state_dict(model, rank0_only=False).items()}
    parked = 0 if params_tier is None else params_tier.capacity
    return {"losses": losses, "full": full, "held": held, "parked": parked}


def _runs(where: str) -> dict:
    return {tier: _train(where, tier) for tier in (None, "host", "disk")}


def test_offload_params_on_cuda_is_bitwise_and_frees_the_gpu(tmp_path):
    runs = run_ranks(_runs, 1, str(tmp_path), backend="nccl", timeout=300)[0]
    plain = runs[None]
    for tier in ("host", "disk"):
        got = runs[tier]
        assert got["losses"] == plain["losses"], tier
        assert all(torch.equal(v, plain["full"][k]) for k, v in got["full"].items()), tier
        # The shards' bytes left the GPU (the allocator rounds each block up: "about").
        assert plain["held"] - got["held"] >= 0.9 * got["parked"], (tier, got, plain["held"])
