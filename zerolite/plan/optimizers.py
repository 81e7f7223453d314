"""The optimizers zerolite can shard, and how: one table, and the checks `shard()` runs.

**The table.** For every optimizer class `shard()` accepts on flat shards, one row
(`OptimizerSpec`) says what the rest of zerolite needs to know about it: the class itself
(the allow-list), the bytes of state torch keeps for one tensor given its param group's
hyperparameters (per element, and 0-dim scalars such as Adam's ``step``, which
`zerolite.memory.estimate` counts), and the names under which ``estimate`` and ``zerolite
estimate --optimizer`` build it with default hyperparameters (`zerolite.memory.formula`
counts the per-element state of those defaults: `STATE_BYTES_PER_PARAM`). Adding an
optimizer is one row of `SUPPORTED`.

**The checks.** Sharding cuts every parameter into flat pieces and steps each piece on the
rank that owns it. That is exact only for an *elementwise* update: element ``i``'s new value
depends on element ``i``'s gradient and state alone. Adafactor (factored second moments of
2-D weights), Muon (orthogonalises whole matrices), LBFGS (global line search) and
SparseAdam (sparse gradients) are not. A deny-list would let the next non-elementwise
optimizer, or a user subclass that overrides ``step``, run silently wrong, so
`check_optimizer` is an allow-list of exact classes, extendable by the user
(``ZeroConfig.elementwise_optimizers``).

With ``ZeroConfig.partition="tensor"`` each parameter is stepped whole, in its own shape,
on one rank (`zerolite.plan.owners`): any optimizer whose step treats each parameter tensor
on its own is then exact (Muon, Adafactor, a user's subclass). Only optimizers that couple
parameters stay refused there (`check_tensor_optimizer`). `resolve_partition` picks the
partition ``"auto"`` means for the optimizers given.

Everything here reads optimizer classes and hyperparameters only: the plan and the memory
estimator use it before anything is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zerolite.config import ZeroConfig

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "NAMED",
    "STATE_BYTES_PER_PARAM",
    "SUPPORTED",
    "WHOLE_TENSOR",
    "OptimizerSpec",
    "build_named",
    "check_optimizer",
    "check_tensor_optimizer",
    "is_elementwise",
    "name_of",
    "resolve_partition",
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

# The allow-list of `check_optimizer`.
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


# -- which optimizers step shards exactly ----------------------------------------

_WHY_NOT: dict[str, str] = {
    "Adafactor": "it keeps factored row/column second moments of each 2-D weight, which a 1-D "
    "shard does not have (it would step silently with unfactored state)",
    "Muon": "it orthogonalises each whole weight matrix, which no single rank holds under a flat "
    "partition",
    "LBFGS": "its line search and curvature history span all parameters at once",
    "SparseAdam": "it needs sparse gradients, and sharded gradients are dense",
}


# Refused under any partition: their step couples parameters, or cannot run on masters.
_COUPLED: dict[str, str] = {
    "LBFGS": "its step needs a closure that re-evaluates the model, and its line search and "
    "curvature history span all parameters at once (global state no single owner holds)",
    "SparseAdam": "it needs sparse gradients, and zerolite reduces dense gradients",
}
_WHOLE_TENSOR_FIX = (
    " It steps each parameter tensor on its own: use ZeroConfig(partition='tensor') (or "
    "'auto'), which gives each parameter whole to one rank."
)


def is_elementwise(
    optimizer: torch.optim.Optimizer, declared: tuple[type[torch.optim.Optimizer], ...] = ()
) -> bool:
    """Whether ``optimizer``'s exact class is allowed to step 1-D shards."""
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS or type(optimizer) in declared


def check_tensor_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` can step whole parameters, one tensor at a time.

    Raises:
        TypeError: not a `torch.optim.Optimizer`, or a class known to couple parameters
            (LBFGS, SparseAdam), naming the reason.
    """
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard() needs a torch.optim.Optimizer, got {name}")
    for known in cls.__mro__:
        if known.__name__ in _COUPLED and known.__module__.startswith("torch.optim"):
            raise TypeError(
                f"{name} cannot be sharded, even with whole-tensor ownership "
                f"(partition='tensor'): {_COUPLED[known.__name__]}. Use DDP for it, or an "
                "optimizer that steps each parameter on its own (AdamW, Muon, Adafactor, ...)."
            )


def check_optimizer(
    optimizer: torch.optim.Optimizer,
    declared: tuple[type[torch.optim.Optimizer], ...] = (),
) -> None:
    """Raise unless ``type(optimizer)`` is allowed to step shards.

    Args:
        optimizer: the user's optimizer, before sharding.
        declared: classes the user declares elementwise (``ZeroConfig.elementwise_optimizers``).

    Raises:
        TypeError: naming the class, why it is refused and how to proceed.
    """
    cls = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"shard() needs a torch.optim.Optimizer, got {cls.__module__}.{cls.__qualname__}"
        )
    if cls in ELEMENTWISE_OPTIMIZERS or cls in declared:
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    if cls.__name__ in _WHY_NOT and cls.__module__.startswith("torch.optim"):
        reason = _WHY_NOT[cls.__name__]
        fix = "" if cls.__name__ in _COUPLED else _WHOLE_TENSOR_FIX
        raise TypeError(
            f"{name} cannot be sharded with partition='flat': {reason}. The flat partition "
            f"supports elementwise optimizers: {allowed}.{fix}"
        )
    parents = [c.__name__ for c in cls.__mro__[1:] if c in ELEMENTWISE_OPTIMIZERS]
    detail = (
        f"it subclasses {parents[0]}, but a subclass may change the update, so it is not trusted"
        if parents
        else "it is not on zerolite's list of elementwise optimizers"
    )
    raise TypeError(
        f"{name} cannot be sharded: {detail}. Supported: {allowed}. If its update of each "
        f"element depends only on that element's gradient and state, declare it with "
        f"ZeroConfig(elementwise_optimizers=({cls.__name__},)); if it steps each parameter "
        "tensor on its own, use ZeroConfig(partition='tensor')."
    )


def resolve_partition(config: ZeroConfig, optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """``"flat"`` or ``"tensor"``: ``config.partition``, with ``"auto"`` resolved.

    ``"auto"`` keeps the flat partition whenever it is exact (every optimizer elementwise:
    zerolite's allow-list or ``config.elementwise_optimizers``), so existing setups are laid
    out exactly as before, and owns whole tensors otherwise.
    """
    if config.partition != "auto":
        return config.partition
    flat = all(is_elementwise(o, config.elementwise_optimizers) for o in optimizers)
    return "flat" if flat else "tensor"
