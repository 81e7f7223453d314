"""Whole-tensor ownership (``ZeroConfig.partition="tensor"``): who steps which parameter.

A flat partition cuts every flat buffer into equal 1-D shards, which is exact only for
elementwise optimizers. Muon orthogonalises a whole matrix, Adafactor factors its second
moment by rows and columns: their step needs the whole tensor. Under ``"tensor"`` each
trained parameter lies whole in one *owner* rank's shard of its flat buffer (the buffer's
parameters are ordered by owner, see `zerolite.plan.layout.FlatLayout`'s ``owners``), so:

- gradients of a bucket are reduced to their owners (`zerolite.comm.owned`),
  still one exchange per bucket, launched as the bucket completes in backward;
- the owner steps its parameters' fp32 masters in their own shapes with the user's
  optimizer;
- updated parameters are sent out from their owners (the bucket's all-gather, uneven).

At stage 3 a buffer is a unit's (`zerolite.plan.units`), ordered by owner the same way:
rank ``r``'s shard of a unit is the unit's tensors it owns (uneven, possibly empty), which
is all it holds of them between uses. The unit's gather collects each chunk from its owner
and its gradients are reduced to the owners, with the stage-3 machinery unchanged (the
exchange is the buffer's `zerolite.comm.exchange.OwnedExchange`).

Ownership is balanced greedily by element count over the whole model (largest first,
each to the least-loaded rank, ties to the lower rank): a pure function of the plan, so
every rank computes the same owners without communicating. Over the whole model, not per
buffer or unit: what an owner holds (master, gradient shard, optimizer state) and the
optimizer work it does add up over all buffers, so this is the balance that evens out
memory and step time; a per-unit balance would not shrink a stage-3 gather (every rank
receives the whole unit either way). Which rank owns a tensor does not change the
arithmetic (each gradient element is summed in rank order on any owner), so stages 1-3
train bit for bit alike under ``"tensor"``. Whole tensors cannot be split,
so ranks may hold unequal amounts: `imbalance` (max/min of owned elements over ranks)
says how unequal; `zerolite.memory.footprint` and ``estimate`` report it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerolite.plan.shard_plan import ShardPlan

__all__ = ["assign_owners", "balance", "imbalance"]


def balance(numels: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each of ``numels``: largest first, each to the least-loaded rank.

    Deterministic (ties go to the earlier tensor and the lower rank), so every rank computes
    the same owners from the same sizes.
    """
    loads = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += numels[i]
    return owners


def assign_owners(plan: ShardPlan, world_size: int) -> ShardPlan:
    """``plan`` with every trained parameter given an owner among ``world_size`` ranks.

    Returns a new plan (``plan`` is left as it was): each buffer's parameters sorted by
    owner, stably (the order within one owner is kept), and ``owners`` holding, per buffer,
    its parameters' owners in that order (the ``owners`` of its
    `zerolite.plan.layout.FlatLayout`).
    """
    flat = [p for params in plan.flat_params for _, p in params]
    owner_of = dict(zip((id(p) for p in flat), balance([p.numel() for p in flat], world_size)))
    ordered = [
        sorted(params, key=lambda item: owner_of[id(item[1])]) for params in plan.flat_params
    ]
    owners = [tuple(owner_of[id(p)] for _, p in params) for params in ordered]
    return dataclasses.replace(plan, flat_params=ordered, owners=owners)


def imbalance(chunk_sizes: Sequence[Sequence[int]], world_size: int) -> float:
    """max / min over ranks of the elements each owns, summed over buffers.

    Args:
        chunk_sizes: per flat buffer, the elements of each rank's shard.
    Returns:
        1.0 for a perfect balance, ``inf`` when some rank owns nothing.
    """
    totals = [sum(sizes[r] for sizes in chunk_sizes) for r in range(world_size)]
    return max(totals) / min(totals) if min(totals) else float("inf")
