"""The optimizers zerolite supports, each described once.

For every optimizer class `shard()` accepts, one row says what the rest of zerolite
needs to know about it:

- the class itself: the allow-list of `zerolite.optim.contract` (exact classes);
- the bytes of state torch keeps for one tensor, given the hyperparameters of its
  param group (per element, and 0-dim scalars such as Adam's ``step``), which
  `zerolite.memory.estimate` counts;
- the names under which `zerolite.memory.estimate` and ``zerolite estimate --optimizer``
  build it with default hyperparameters; `zerolite.memory.formula` counts the per-element
  state of those defaults (`STATE_BYTES_PER_PARAM`).

Adding an optimizer is one row of `SUPPORTED`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "NAMED",
    "STATE_BYTES_PER_PARAM",
    "SUPPORTED",
    "WHOLE_TENSOR",
    "OptimizerSpec",
    "build_named",
    "name_of",
    "spec_of",
]


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer zerolite can shard.

    Attributes:
        cls: the exact class allowed to step 1-D shards (subclasses are not).
        state_bytes: param group -> (bytes per element, bytes of 0-dim scalars) of the
            state torch keeps for one tensor of that group (fp32 state, fp32 ``step``).
        names: estimator name -> the constructor's keyword arguments besides the
            parameters; hyperparameters not named keep torch's defaults.
    """

    cls: type[torch.optim.Optimizer]
    state_bytes: Callable[[Mapping[str, Any]], tuple[int, int]]
    names: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)


def _adam(group: Mapping[str, Any]) -> tuple[int, int]:
    # exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad); step.
    return (12 if group.get("amsgrad") else 8), 4


def _sgd(group: Mapping[str, Any]) -> tuple[int, int]:
    # momentum_buffer only with momentum; no step.
    return (4 if group.get("momentum", 0) else 0), 0


def _rmsprop(group: Mapping[str, Any]) -> tuple[int, int]:
    # square_avg, momentum_buffer with momentum, grad_avg when centered; step.
    return 4 + (4 if group.get("momentum", 0) else 0) + (4 if group.get("centered") else 0), 4


SUPPORTED: tuple[OptimizerSpec, ...] = (
    OptimizerSpec(torch.optim.Adam, _adam, {"adam": {}}),
    OptimizerSpec(torch.optim.AdamW, _adam, {"adamw": {}}),
    OptimizerSpec(
        torch.optim.SGD, _sgd, {"sgd": {"lr": 0.1}, "sgd_momentum": {"lr": 0.1, "momentum": 0.9}}
    ),
    OptimizerSpec(torch.optim.Adagrad, lambda group: (4, 4), {"adagrad": {}}),  # sum; step
    OptimizerSpec(torch.optim.RMSprop, _rmsprop, {"rmsprop": {}}),
    OptimizerSpec(torch.optim.Adamax, lambda group: (8, 4)),  # exp_avg, exp_inf; step
    OptimizerSpec(torch.optim.NAdam, lambda group: (8, 8)),  # exp_avg, exp_avg_sq; step, mu_product
    OptimizerSpec(torch.optim.RAdam, lambda group: (8, 4)),  # exp_avg, exp_avg_sq; step
)

# The allow-list of `zerolite.optim.contract`.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(s.cls for s in SUPPORTED)

# Shape-aware optimizers whose state the estimator counts, sharded only with whole-tensor
# ownership (``ZeroConfig.partition="tensor"``), so not on the allow-list. (Adafactor's
# factored state depends on each tensor's shape, not on its element count: not estimated.)
WHOLE_TENSOR: tuple[OptimizerSpec, ...] = (
    OptimizerSpec(torch.optim.Muon, lambda group: (4, 0)),  # momentum_buffer; no step
)

# Estimator name -> (its optimizer, constructor keyword arguments).
NAMED: dict[str, tuple[OptimizerSpec, Mapping[str, Any]]] = {
    name: (spec, kwargs) for spec in SUPPORTED for name, kwargs in spec.names.items()
}

# Bytes of per-element optimizer state per parameter (fp32 state, as torch keeps it), for
# each estimator name. The keyword arguments stand for the whole group: the
# hyperparameters they leave at torch's defaults (amsgrad, centered...) add no state.
STATE_BYTES_PER_PARAM: dict[str, int] = {
    name: spec.state_bytes(kwargs)[0] for name, (spec, kwargs) in NAMED.items()
}
"""Optimizer state bytes per trained parameter of each named optimizer at its defaults
(``"adamw"``: 8, two fp32 moments), as `zerolite.memory.formula` counts them."""

_BY_CLASS_NAME: dict[str, OptimizerSpec] = {s.cls.__name__: s for s in (*SUPPORTED, *WHOLE_TENSOR)}


def spec_of(optimizer: torch.optim.Optimizer) -> OptimizerSpec | None:
    """The row for ``optimizer``'s class, by class name; None for one not in `SUPPORTED`."""
    return _BY_CLASS_NAME.get(type(optimizer).__name__)


def name_of(optimizer: torch.optim.Optimizer) -> str:
    """The estimator name ``optimizer`` would have: its lowercased class name, and
    ``"sgd_momentum"`` for an SGD with momentum in any group. It may not be in `NAMED`."""
    name = type(optimizer).__name__.lower()
    if name == "sgd" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        name = "sgd_momentum"
    return name


def build_named(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer estimator name ``name`` (a key of `NAMED`) stands for, over ``params``."""
    spec, kwargs = NAMED[name]
    return spec.cls(params, **kwargs)
