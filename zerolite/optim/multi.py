"""`MultiOptimizer`: several user optimizers over disjoint parameters, seen as one.

``zerolite.shard(model, [muon, adamw], config)`` wraps the list in one `MultiOptimizer`
and shards that: everything downstream (re-pointing, the step, gradient clipping, state
dicts, checkpoints, the memory accounting) sees one optimizer whose ``param_groups`` are
the inner optimizers' groups, end to end (the *same* dicts, so each inner optimizer's LR
scheduler keeps working), and whose ``state`` is one dict shared with every inner
optimizer (their parameters are disjoint, so entries never collide). ``step`` steps each
inner optimizer in list order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerolite.optim.optimizer_hooks import init_optimizer_hooks

__all__ = ["MultiOptimizer", "class_name", "inner_optimizers"]


class MultiOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together.

    Built by `zerolite.shard` from a list; validation happens at construction, before any
    optimizer is changed. Its state is shared with the inner optimizers only from `bind`
    (called by `shard` once every check passed).

    Args:
        optimizers: at least one `torch.optim.Optimizer`, no parameter in two of them.
    Raises:
        TypeError: an element is not a `torch.optim.Optimizer` (or is a `MultiOptimizer`).
        ValueError: an empty list, the same optimizer twice, or a parameter held by two.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError("shard() got an empty list of optimizers; pass at least one")
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, MultiOptimizer):
                raise TypeError(
                    f"shard(): optimizers[{i}] is a {type(opt).__name__}; each element of the "
                    "list must be a torch.optim.Optimizer built on the model's parameters"
                )
        held: dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            if any(opt is other for other in optimizers[:i]):
                raise ValueError(f"shard(): optimizers[{i}] is listed twice")
            for group in opt.param_groups:
                for p in group["params"]:
                    j = held.setdefault(id(p), i)
                    if j != i:
                        raise ValueError(
                            f"shard(): a parameter of shape {tuple(p.shape)} is held by both "
                            f"optimizers[{j}] ({type(optimizers[j]).__name__}) and optimizers[{i}] "
                            f"({type(opt).__name__}); the optimizers must hold disjoint "
                            "parameter sets (e.g. Muon for hidden 2-D weights, AdamW for the rest)"
                        )
        init_optimizer_hooks(self)  # Optimizer.__init__ would rebuild the shared groups
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}
        self._state: defaultdict[Any, dict] | None = None

    def bind(self) -> None:
        """Share one state dict among the inner optimizers (their entries merged)."""
        shared: defaultdict[Any, dict] = defaultdict(dict)
        for opt in self.optimizers:
            shared.update(opt.state)
        for opt in self.optimizers:
            opt.state = shared
        self._state = shared

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizers' groups, in list order (the same dicts)."""
        return [group for opt in self.optimizers for group in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError("MultiOptimizer.param_groups are the inner optimizers' groups")

    @property
    def state(self) -> Any:  # type: ignore[override]
        if self._state is not None:
            return self._state
        merged: dict[Any, dict] = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("MultiOptimizer.state is the inner optimizers' shared state")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step every inner optimizer, in list order (no closure: zerolite runs it)."""
        for opt in self.optimizers:
            opt.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split ``state_dict`` (as `state_dict` wrote it) by group and load each inner one."""
        groups = state_dict["param_groups"]
        state = state_dict["state"]
        start = 0
        for opt in self.optimizers:
            count = len(opt.param_groups)
            mine = groups[start : start + count]
            ids = {i for g in mine for i in g["params"]}
            opt.load_state_dict({"state": {i: s for i, s in state.items() if i in ids},
                                 "param_groups": mine})
            start += count
        self.bind()

    def __repr__(self) -> str:
        return f"MultiOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The user's optimizers behind ``optimizer``: a `MultiOptimizer`'s list, or itself."""
    return list(optimizer.optimizers) if isinstance(optimizer, MultiOptimizer) else [optimizer]


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """``module.Class`` of ``optimizer``; ``[a.A, b.B]`` for a `MultiOptimizer` (checkpoints
    compare it at load)."""
    names = [f"{type(o).__module__}.{type(o).__qualname__}" for o in inner_optimizers(optimizer)]
    return names[0] if not isinstance(optimizer, MultiOptimizer) else f"[{', '.join(names)}]"
