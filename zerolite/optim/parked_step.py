"""The step with ``offload_params``: one bucket's parked shards in memory at a time.

`ShardedOptimizer` steps bucket by bucket when the parameter and gradient shards are
parked (`zerolite.params.tiered_shard`): `fetch_bucket` brings bucket ``b``'s gradient
shard and parameter shard in (and starts reading bucket ``b + 1``'s, so the read overlaps
this bucket's update), the optimizer steps its pieces (the offloaded ones through
`zerolite.optim.streamed_step`), and `park_bucket` writes the new parameter shard back.
"""

from __future__ import annotations

from typing import Any

import torch

from zerolite.grads.bucket import GradBucket

__all__ = ["copy_tensors", "fetch_bucket", "park_bucket"]


def fetch_bucket(buckets: list[GradBucket], b: int) -> torch.Tensor:
    """Bucket ``b``'s gradient shard and parameter shard resident (bucket ``b + 1``'s are
    read ahead); returns the gradient shard (1-D, ``grad_dtype``, the shard's numel)."""
    if b + 1 < len(buckets):
        after = buckets[b + 1]
        for ahead in (after.tiered, after.flat.tiered):
            if ahead is not None:
                ahead.read_ahead()
    bucket = buckets[b]
    if bucket.flat.tiered is not None:
        bucket.flat.tiered.fetch()
    return bucket.fetch_shard()


def park_bucket(bucket: GradBucket, *, grad_changed: bool) -> None:
    """After the bucket stepped: its new parameter shard goes back to the tier; its
    gradient shard is freed, rewritten only if ``grad_changed`` (scaled in place)."""
    if bucket.flat.tiered is not None:
        bucket.flat.tiered.park(dirty=True)
    bucket.park_shard(changed=grad_changed)


def copy_tensors(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) cloned: a state dict
    that stays valid after the shards it viewed are parked again."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: copy_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tensors(v) for v in value)
    return value
