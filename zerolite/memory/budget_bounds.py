"""What `plan` knows of a configuration before predicting its step: the model-state bytes
`estimate` counts, which the peak can never be under, and the bytes it offloads.

[Note: plan bounds] At the end of the second step's backward a rank holds its
parameters, its gradients, its fp32 masters and its optimizer state at once (and a host
tier's arena, on a CPU model), so `estimate`'s model states are a lower bound of the
peak `predict_peak` finds: a configuration whose model states alone are over the budget
needs no trace. `estimate` plans the layout, padding and offload exactly as ``shard()``
does, so its ``offloaded`` is the tier's arena, the second key of [Note: plan cost]. The
model is built once, on the meta device; `estimate` then only does arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerolite.config import ZeroConfig
from zerolite.memory.estimate import estimate
from zerolite.memory.loop import OptimizerChoice

__all__ = ["StateBound", "state_bounds"]

_PARTS = ("params", "grads", "master", "optimizer_state", "residual")


@dataclasses.dataclass(frozen=True)
class StateBound:
    """One configuration's model states, as `estimate` counts them.

    Attributes:
        resident: bytes the rank holds at every step's end of backward (model states,
            and a host tier's arena when the model is on the CPU): the peak is at least
            this.
        offloaded: bytes on the offload tier (0: none), as `PeakPrediction.offloaded`.
        parts: ``resident`` by category, for the rejection's reason.
    """

    resident: int
    offloaded: int
    parts: dict[str, int]

    @property
    def persistent(self) -> int:
        """What the rank holds from the first step's end to the run's end, at every
        moment of a step: ``resident`` but the gradients (freed by ``zero_grad``)."""
        return self.resident - self.parts.get("grads", 0)


def state_bounds(
    model_fn: Callable[[], nn.Module], configs: Sequence[ZeroConfig | None], world_size: int,
    optimizer: OptimizerChoice, device: str,
) -> list[StateBound | None]:
    """Per configuration, its `StateBound`, or None where `estimate` cannot tell (a model
    that cannot be built on the meta device, an optimizer that is not one
    ``torch.optim.Optimizer``, a configuration zerolite refuses, given as None): those are
    traced."""
    try:
        with torch.device("meta"):
            model = model_fn()
        opt: Any = optimizer if isinstance(optimizer, str) else optimizer(model)
    except Exception:  # noqa: BLE001 - no bound: the trace reports any real error
        return [None] * len(configs)
    if not isinstance(opt, (str, torch.optim.Optimizer)):
        return [None] * len(configs)
    return [None if config is None else _bound(model, config, world_size, opt, device)
            for config in configs]


def _bound(
    model: nn.Module, config: ZeroConfig, world_size: int,
    optimizer: str | torch.optim.Optimizer, device: str,
) -> StateBound | None:
    try:
        counted = estimate(model, world_size=world_size, config=config, optimizer=optimizer)
    except Exception:  # noqa: BLE001 - e.g. a refused configuration: the trace says why
        return None
    parts = {name: getattr(counted, name) for name in _PARTS if getattr(counted, name)}
    if config.offload == "host" and device == "cpu" and counted.offloaded:
        parts["offload"] = counted.offloaded  # the arena is this device's memory
    return StateBound(sum(parts.values()), counted.offloaded, parts)
