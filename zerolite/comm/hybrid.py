"""Hybrid sharding: shard within groups of k ranks, replicate across the groups.

``ZeroConfig.shard_group_size = k`` splits the N data-parallel ranks into R = N / k
*shard groups* of consecutive ranks (``[0..k-1], [k..2k-1], ...``; with ``"node"``,
k = ``LOCAL_WORLD_SIZE``: one group per machine) and k *replica groups* (``[j, j+k,
j+2k, ...]``: the ranks holding shard j in every shard group). A 2-D ``DeviceMesh``
(replicate x shard) names the same two families of groups.

Everything that is sharded -- flat buffers, masters, optimizer state, gradient shards --
is sharded within the shard group, exactly as the flat stages shard over N ranks, so
`zerolite.plan.layout` and the stages see a group of size k and need nothing new. Two things
change:

- Gradients: each bucket is reduce-scattered within the shard group (the average over
  its k ranks), then every shard is all-reduced across its replica group and divided by
  R (`average_across_replicas`): the average over all N ranks, as DDP. Only Ψ/k
  elements per rank cross the slow link, 2 (R-1)/R Ψ/k per step. With
  ``quantize_reduce`` that step is a two-phase quantized mean instead
  (`zerolite.comm.quantized_replicas`): int8 blocks, bitwise-equal results on every replica.
- Agreement: whatever all N ranks must agree on (the plan at `shard()`, the step's
  gradient flags and lockstep counters, checkpoints, rank 0's initial values) runs over
  ``group.world``. A flat `Group` is its own world.

All-gathers, the gradient norm and the fp16 overflow check stay within the shard group:
after the replica all-reduce every replica holds identical shards, so a shard group
sees every element exactly once.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zerolite.comm.collectives import (
    Group,
    Pending,
    all_gather_inplace,
    all_reduce,
    chunk_of,
    reduce_scatter_avg,
)
from zerolite.config import ZeroConfig

__all__ = [
    "LinkedGroup",
    "data_parallel_group",
    "average_across_replicas",
    "shard_group_size",
    "sharding_group",
]


class LinkedGroup(Group):
    """A subgroup of a hybrid layout (a shard group or a replica group) of ``world``.

    Its step and forward counters are the world's (one optimizer step is one step on
    every group), and its errors name the world rank as well as the rank within it.
    ``replicas`` (shard groups only) is the replica group of this rank.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        world: Group,
        role: str,
        *,
        collectives: str,
        timeout_s: float,
    ) -> None:
        self._world = world  # first: Group.__init__ sets the counters, which live there
        self.role = role
        super().__init__(
            process_group, collectives=collectives, timeout_s=timeout_s,
            device=world.buffer_device,
        )

    @property
    def world(self) -> Group:
        return self._world

    @property
    def step(self) -> int:  # type: ignore[override]
        return self._world.step

    @step.setter
    def step(self, value: int) -> None:
        self._world.step = value

    @property
    def forwards(self) -> int:  # type: ignore[override]
        return self._world.forwards

    @forwards.setter
    def forwards(self, value: int) -> None:
        self._world.forwards = value

    def prefix(self) -> str:
        return f"[rank {self._world.rank}/{self._world.size}, {self.role} {self.rank}/{self.size}]"


def data_parallel_group(config: ZeroConfig) -> dist.ProcessGroup | None:
    """The process group of every data-parallel rank: ``config.process_group``, or for a
    `DeviceMesh` a group over all of its ranks (``None`` where that is the default group).
    Every rank of the mesh must call (a new group is created once per mesh)."""
    pg = config.process_group
    if not isinstance(pg, DeviceMesh):
        return pg
    ranks = sorted(int(r) for r in pg.mesh.flatten().tolist())
    if dist.is_initialized() and ranks == list(range(dist.get_world_size())):
        return None
    return _cached(("mesh", tuple(ranks)), lambda: _new_group(ranks))


def shard_group_size(config: ZeroConfig, world_size: int) -> int | None:
    """The resolved k for ``config`` over ``world_size`` ranks (None: shard over all).

    Local and cheap; `zerolite.shard` runs it inside its agreement, so a rank with another
    k, or a bad k, raises on every rank before any group is created.

    Raises:
        ValueError: ``"node"`` without ``LOCAL_WORLD_SIZE``; k larger than the world size,
            or not dividing it. The message names the value.
    """
    k = config.shard_group_size
    if isinstance(config.process_group, DeviceMesh):
        k = config.process_group.shape[1]
    elif k == "node":
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        if raw is None or not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(
                f"ZeroConfig.shard_group_size='node' needs LOCAL_WORLD_SIZE (ranks per machine, "
                f"set by torchrun and accelerate), got {raw!r}; set it or give k as an int"
            )
        k = int(raw)
    if k is None:
        return None
    n = world_size
    if k > n:
        raise ValueError(
            f"ZeroConfig.shard_group_size: got {k}, larger than the world size {n}; use a k "
            f"that divides {n} (e.g. the ranks per machine)"
        )
    if n % k:
        raise ValueError(
            f"ZeroConfig.shard_group_size: got {k}, which does not divide the world size {n}; "
            f"use a divisor of {n} (e.g. the ranks per machine)"
        )
    return None if k == n else k


def sharding_group(world: Group, k: int | None, config: ZeroConfig) -> Group:
    """The group that shards: ``world`` itself (k None), else this rank's shard group, a
    `LinkedGroup` whose ``replicas`` is this rank's replica group.

    Every rank of ``world`` must call with the same ``k`` (agreed beforehand). The
    process groups are created once per (world, k) and reused by later `shard()` calls.
    """
    if k is None:
        return world
    mesh = config.process_group if isinstance(config.process_group, DeviceMesh) else None
    if mesh is not None:
        shard_pg, replica_pg = mesh.get_group(1), mesh.get_group(0)
    else:
        shard_pg, replica_pg = _subgroups(world, k)
    kw = {"collectives": config.collectives, "timeout_s": config.timeout_s}
    group = LinkedGroup(shard_pg, world, "shard", **kw)
    group.replicas = LinkedGroup(replica_pg, world, "replica", **kw)
    return group


def average_across_replicas(
    inner: Pending, out: torch.Tensor, group: Group, *, key: int, what: str
) -> Pending:
    """Hybrid: once ``inner`` (this shard group's reduction into ``out``, the average over
    its ranks) completes, the mean of ``out`` across ``group.replicas``: ``out`` is then the
    average over every data-parallel rank. Returns ``inner`` itself when ``group`` is flat.

    Every rank of the replica group must call, in the same order relative to zerolite's
    other exchanges; ``key`` tags its messages (`zerolite.comm.collectives.tag_of`). What
    crosses the slow link is in ``out``'s dtype (``ZeroConfig.grad_dtype``), when the
    returned handle is waited on. Point-to-point groups reduce-scatter ``R`` parts of
    ``out`` and all-gather them (a ring's bytes), summing each element in replica order
    whatever its position ([Note: rank order] in `zerolite.comm.collectives`); native groups
    all-reduce.
    """
    replicas = group.replicas
    if replicas is None or replicas.size == 1:
        return inner
    label = f"{what} (across replica groups)"

    def finish() -> None:
        inner.wait()
        if not replicas.point_to_point:
            all_reduce(out, replicas, dist.ReduceOp.SUM, what=label)
            out.div_(replicas.size)
            return
        n = replicas.size
        part = -(-out.numel() // n)
        padded = part * n != out.numel()
        full = out  # in place; a padded copy only when R does not divide the shard
        if padded:
            full = torch.zeros(part * n, dtype=out.dtype, device=out.device)
            full[: out.numel()] = out
        mine = chunk_of(full, replicas.rank, part)
        reduced = torch.empty_like(mine)
        reduce_scatter_avg(full, reduced, replicas, key=key, what=label).wait()
        mine.copy_(reduced)
        all_gather_inplace(full, replicas, key=key, what=label).wait()
        if padded:
            out.copy_(full[: out.numel()])

    return Pending(finish=finish, group=group, what=what)


# (kind, ranks...) -> process groups, kept for the life of the default group: creating a
# group is a rendezvous of its ranks, too slow to repeat at every shard().
_GROUPS: dict[tuple, tuple[object, object]] = {}


def _cached(key: tuple, make):  # noqa: ANN001, ANN202 - (key, () -> value)
    world = dist.group.WORLD  # a new default group (after destroy/init) invalidates all
    hit = _GROUPS.get(key)
    if hit is None or hit[0] is not world:
        hit = _GROUPS[key] = (world, make())
    return hit[1]


def _subgroups(world: Group, k: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (shard group, replica group) of consecutive blocks of k world ranks."""
    ranks = [world.global_rank(r) for r in range(world.size)]
    shards = [ranks[i : i + k] for i in range(0, len(ranks), k)]
    replicas = [ranks[j::k] for j in range(k)]
    mine = world.global_rank(world.rank)

    def make() -> tuple[dict, dict]:
        # Every rank of the default group must create every group (torch's rule) unless only
        # a subgroup shards; then each rank creates its own, synchronising only with members.
        everyone = world.size == dist.get_world_size()
        made_shards, made_replicas = {}, {}
        for family, made in ((shards, made_shards), (replicas, made_replicas)):
            for members in family:
                if everyone:
                    made[tuple(members)] = _new_group(members, local=False)
                elif mine in members:
                    made[tuple(members)] = _new_group(members)
        return made_shards, made_replicas

    made_shards, made_replicas = _cached(("blocks", tuple(ranks), k), make)
    shard = next(m for m in made_shards if mine in m)
    replica = next(m for m in made_replicas if mine in m)
    return made_shards[shard], made_replicas[replica]


def _new_group(ranks: list[int], *, local: bool = True) -> dist.ProcessGroup:
    return dist.new_group(ranks, use_local_synchronization=local)
