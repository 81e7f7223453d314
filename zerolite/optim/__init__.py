"""The optimizer side of zerolite: fp32 masters, the sharded step, clipping, the allow-list."""

from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.optimizers import ELEMENTWISE_OPTIMIZERS

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer"]
