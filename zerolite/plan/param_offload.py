"""What ``ZeroConfig(offload_params=...)`` will park on this rank, decided from sizes alone.

At stage 3 each flat buffer's parameter shard (``param_dtype``, trained and frozen buffers)
and each trained buffer's gradient shard (``grad_dtype``) lives on the tier between uses
(`zerolite.params.tiered_shard`); the arena holds all of them, each 64-byte aligned.
`zerolite.state.param_tier` reserves it; `zerolite.memory.estimate` counts the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerolite.config import ZeroConfig
from zerolite.plan.owners import assign_owners

if TYPE_CHECKING:
    from zerolite.plan.shard_plan import ShardPlan

__all__ = ["ALIGN", "aligned", "arena_bytes", "parked_shards", "param_tier_bytes"]

ALIGN = 64  # bytes: where each parked shard starts in the arena


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to `ALIGN`: a shard's room in the arena."""
    return -(-nbytes // ALIGN) * ALIGN


def parked_shards(
    plan: ShardPlan, config: ZeroConfig, *, rank: int, world_size: int
) -> list[tuple[int, torch.dtype]]:
    """``(numel, dtype)`` of every shard rank ``rank`` of ``world_size`` parks: each flat
    buffer's parameter shard (`ShardPlan.all_flat_params` order), then each trained
    buffer's gradient shard. Empty without ``config.offload_params``."""
    if config.offload_params is None:
        return []
    if plan.partition == "tensor":  # the owners `shard()` assigns, from sizes alone
        plan = assign_owners(plan, world_size)
    assert config.param_dtype is not None and config.grad_dtype is not None
    sizes = [plan.layout(i, world_size).shard_size(rank) for i in range(len(plan.all_flat_params))]
    trained = sizes[: len(plan.flat_params)]
    return [(n, config.param_dtype) for n in sizes] + [(n, config.grad_dtype) for n in trained]


def param_tier_bytes(plan: ShardPlan, config: ZeroConfig, *, rank: int, world_size: int) -> int:
    """Bytes the ``offload_params`` arena of rank ``rank`` needs (0 without it)."""
    return arena_bytes(parked_shards(plan, config, rank=rank, world_size=world_size))


def arena_bytes(shards: list[tuple[int, torch.dtype]]) -> int:
    """Bytes an arena holding shards of these ``(numel, dtype)`` needs, each aligned."""
    return sum(aligned(numel * dtype.itemsize) for numel, dtype in shards)
