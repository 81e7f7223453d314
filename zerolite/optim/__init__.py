"""The step: `ShardedOptimizer` (reduce, step this rank's masters, all-gather), several user
optimizers as one, re-pointing, clipping, fp16 loss scaling, the streamed step of an offload
tier, and per-rank state dicts. ``ELEMENTWISE_OPTIMIZERS`` is `zerolite.plan.optimizers`'
allow-list, named here too.
Its place among the layers (what it may import): docs/design.md, "Layers"."""

from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.optimizers import ELEMENTWISE_OPTIMIZERS

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer"]
