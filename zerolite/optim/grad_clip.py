"""The true global gradient norm over all ranks' shards, and clipping by it.

Each rank holds only its shard of the reduced gradients, so a local norm (what
``torch.nn.utils.clip_grad_norm_(model.parameters())`` computes) is wrong under
sharding. Every element lives in exactly one rank's shard (tied parameters are stored
once, padding is zero), so summing ``|g|^p`` locally and all-reducing gives the norm
of the full gradient with one small collective.
"""

from __future__ import annotations

import math

import torch

from zerolite.comm.collectives import Group
from zerolite.comm.small_exchange import exchange_small

__all__ = ["global_grad_norm", "clip_coefficient"]


def global_grad_norm(shards: list[torch.Tensor], norm_type: float, group: Group) -> torch.Tensor:
    """The ``norm_type``-norm of the concatenation of every rank's ``shards``.

    Args:
        shards: this rank's reduced gradient shards (1-D, any float dtype).
        norm_type: p > 0, or ``math.inf``.
        group: the data-parallel group; every rank must call.
    Returns:
        0-dim fp32 tensor on the CPU, the same on every rank.
    """
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    device = shards[0].device if shards else torch.device("cpu")
    if math.isinf(p):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for s in shards:
            local = torch.maximum(local, s.detach().abs().max().float())
        return exchange_small(
            local, group, "max", what="clip_grad_norm_'s all-reduce of the global norm"
        )
    local = torch.zeros((), dtype=torch.float32, device=device)
    for s in shards:
        local += torch.linalg.vector_norm(s.detach(), p, dtype=torch.float32) ** p
    total = exchange_small(
        local, group, "sum", what="clip_grad_norm_'s all-reduce of the global norm"
    )
    return total ** (1.0 / p)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
