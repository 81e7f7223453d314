"""Which optimizers can step 1-D shards exactly.

Sharding cuts every parameter into flat pieces and steps each piece on the rank that
owns it. That is exact only for an *elementwise* update: element ``i``'s new value
depends on element ``i``'s gradient and state alone. Adafactor (factored second
moments of 2-D weights), Muon (orthogonalises whole matrices), LBFGS (global line
search) and SparseAdam (sparse gradients) are not. A deny-list would let the next
non-elementwise optimizer, or a user subclass that overrides ``step``, run silently
wrong, so the check is an allow-list of exact classes (`zerolite.optim.registry`),
extendable by the user.
"""

from __future__ import annotations

import torch

from zerolite.optim.registry import ELEMENTWISE_OPTIMIZERS

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_optimizer"]

_WHY_NOT: dict[str, str] = {
    "Adafactor": "it keeps factored row/column second moments of each 2-D weight, which a 1-D "
    "shard does not have (it would step silently with unfactored state)",
    "Muon": "it orthogonalises each whole weight matrix, which no single rank holds",
    "LBFGS": "its line search and curvature history span all parameters at once",
    "SparseAdam": "it needs sparse gradients, and sharded gradients are dense",
}


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
        raise TypeError(
            f"{name} cannot be sharded: {reason}. Sharding supports elementwise optimizers: "
            f"{allowed}."
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
        f"ZeroConfig(elementwise_optimizers=({cls.__name__},))."
    )
