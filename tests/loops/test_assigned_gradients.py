"""Gradients assigned to ``param.grad`` by hand, without a backward, are reduced like autograd's.

The hooks never see such a gradient: the step boundary brings it into its bucket (stage 1:
into the ``param.grad`` view; stage 2: `GradReducer.add_unhooked_grad`), and the ranks'
agreement at ``step()`` reduces it. Oracle: torch's SGD stepping the mean over ranks of the
assigned gradients, where a rank that assigned none for a parameter contributes zeros
(``DistributedDataParallel(find_unused_parameters=True)`` semantics). World size 2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
from zerolite import ZeroConfig
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 2


def _rank_gradients(model: nn.Module, rank: int, step: int) -> list[torch.Tensor | None]:
    """Rank ``rank``'s gradients at ``step``: distinct per rank, step and parameter; rank 1
    assigns none to the last parameter."""
    grads: list[torch.Tensor | None] = []
    for i, p in enumerate(model.parameters()):
        ramp = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.01
        grads.append(ramp + (rank + 1) * (i + step + 1))
    if rank == 1:
        grads[-1] = None
    return grads


def _assigned_rank() -> dict[int, float]:
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        ref = copy.deepcopy(model)
        opt = zerolite.shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ZeroConfig(stage=stage))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(STEPS):
            for p, g in zip(model.parameters(), _rank_gradients(model, rank, step)):
                p.grad = g
            opt.step()
            opt.zero_grad()
            per_rank = [_rank_gradients(ref, r, step) for r in range(n)]
            for i, p in enumerate(ref.parameters()):
                p.grad = sum(g[i] if g[i] is not None else torch.zeros_like(p)
                             for g in per_rank) / n
            ref_opt.step()
            ref_opt.zero_grad()
        errors[stage] = max((a - b).abs().max().item()
                            for a, b in zip(model.parameters(), ref.parameters()))
    return errors


def test_assigned_gradients_are_reduced_like_autograds():
    for rank, errors in enumerate(run_ranks(_assigned_rank, 2, timeout=120)):
        for stage, error in errors.items():
            # A gradient lost or left unreduced moves parameters by >= 0.01.
            assert error <= 1e-5, f"rank {rank} stage {stage}: max abs error {error:.3e}"
