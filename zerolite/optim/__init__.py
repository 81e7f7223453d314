"""The optimizer side of zerolite: fp32 masters, the sharded step, clipping, the allow-list."""

from zerolite.optim.contract import ELEMENTWISE_OPTIMIZERS
from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer"]
