"""Which optimizers can step 1-D shards exactly.

Sharding cuts every parameter into flat pieces and steps each piece on the rank that
owns it. That is exact only for an *elementwise* update: element ``i``'s new value
depends on element ``i``'s gradient and state alone. Adafactor (factored second
moments of 2-D weights), Muon (orthogonalises whole matrices), LBFGS (global line
search) and SparseAdam (sparse gradients) are not. A deny-list would let the next
non-elementwise optimizer, or a user subclass that overrides ``step``, run silently
wrong, so the check is an allow-list of exact classes (`zerolite.plan.optimizers`),
extendable by the user.

With ``ZeroConfig.partition="tensor"`` each parameter is stepped whole, in its own shape,
on one rank (`zerolite.plan.owners`): any optimizer whose step treats each parameter
tensor on its own is then exact (Muon, Adafactor, a user's subclass). Only optimizers that
couple parameters stay refused there (`check_tensor_optimizer`).
"""

from __future__ import annotations

import torch

from zerolite.plan.optimizers import ELEMENTWISE_OPTIMIZERS

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_optimizer", "check_tensor_optimizer", "is_elementwise"]

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
