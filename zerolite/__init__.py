"""zerolite: ZeRO-style sharding for the PyTorch optimizer you already have.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))

See README.md for the full picture.
"""

from zerolite._version import __version__
from zerolite.config import ZeroConfig
from zerolite.errors import CollectiveTimeout, RankMismatchError
from zerolite.full_state_dict import full_state_dict
from zerolite.gathered import gathered_parameters, iter_full_state_dict
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.zero import shard

__all__ = [
    "__version__",
    "CollectiveTimeout",
    "RankMismatchError",
    "ShardedOptimizer",
    "ZeroConfig",
    "full_state_dict",
    "gathered_parameters",
    "iter_full_state_dict",
    "shard",
]
