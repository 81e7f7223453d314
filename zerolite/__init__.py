"""zerolite: ZeRO-style sharding for the PyTorch optimizer you already have.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))

See README.md and docs/ for the full picture, and docs/design.md for how it is built and what its
words mean (flat buffer, shard, chunk, piece, span, unit, bucket, slot: its "Words"). The
subpackages ``zerolite.memory``, ``zerolite.checkpoint``, ``zerolite.testing``,
``zerolite.accelerate`` and ``zerolite.hf`` are attributes of the package, imported on first
use (``import zerolite`` stays cheap and never imports transformers).
"""

import importlib
from typing import Any

from zerolite._version import __version__
from zerolite.config import ZeroConfig
from zerolite.errors import CollectiveTimeout, RankMismatchError
from zerolite.gathered import full_state_dict, gathered_parameters, iter_full_state_dict
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.sharding import shard

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

# Imported on first attribute access, so `zerolite.memory.footprint(...)` works after a bare
# `import zerolite` without paying for Accelerate or transformers up front.
_LAZY_SUBMODULES = ("accelerate", "checkpoint", "hf", "memory", "testing")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"zerolite.{name}")
    raise AttributeError(f"module 'zerolite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})
