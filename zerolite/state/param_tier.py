"""The ``offload_params`` tier: where this rank's parameter and gradient shards are parked.

`reserve_param_tier` runs inside `shard()`'s agreement, before anything changes: it checks
the directory (created if its parent exists, as for ``offload``), reserves the exact bytes
`zerolite.plan.param_offload.param_tier_bytes` counts (disk: a file of its own under
``offload_dir``, unlinked at once; host: one host tensor) and returns the empty
`ShardTier` that stage 3's flat buffers and gradient buckets then park their shards in
(`attach_buckets`).
"""

from __future__ import annotations

from zerolite.config import ZeroConfig
from zerolite.grads.bucket import GradBucket
from zerolite.params.tiered_shard import ShardTier
from zerolite.state.arena import DiskArena, HostArena
from zerolite.state.offload import check_disk_room

__all__ = ["attach_buckets", "reserve_param_tier"]


def reserve_param_tier(config: ZeroConfig, nbytes: int, rank: int) -> ShardTier | None:
    """The tier of ``config.offload_params`` with ``nbytes`` reserved (None without it).

    Raises:
        ValueError: ``offload_dir`` cannot be created or written, or has less than
            ``nbytes`` free, or the reservation fails (a full or quota-limited disk).
    """
    tier = config.offload_params
    if tier is None:
        return None
    if tier == "disk":
        check_disk_room(config.offload_dir, nbytes, "this rank's parameter and gradient shards")
        arena: DiskArena | HostArena = DiskArena(str(config.offload_dir), nbytes, rank)
    else:
        arena = HostArena(nbytes)
    return ShardTier(arena, tier, nbytes)


def attach_buckets(tier: ShardTier, buckets: list[GradBucket]) -> None:
    """Park each bucket's gradient shard (zeros: nothing is written) on ``tier``."""
    for bucket in buckets:
        assert bucket.shard is not None  # stage 3 keeps the shard, not the full buffer
        bucket.tiered = tier.add(
            bucket.shard, f"the gradient shard of bucket {bucket.flat.index}", zeros=True
        )
