"""What `plan` knows of a configuration before predicting its step: the model-state bytes
`estimate` counts, which the peak can never be under, and the bytes it offloads.

[Note: plan bounds] At the end of the second step's backward a rank holds its
parameters, its gradients, its fp32 masters and its optimizer state at once (and a host
tier's arena, on a CPU model), so `estimate`'s model states are a lower bound of the
peak `predict_peak` finds: a configuration whose model states alone are over the budget
needs no trace. `estimate` plans the layout, padding and offload exactly as ``shard()``
does, so its ``offloaded`` is the tier's arena, the second key of [Note: plan cost]. The
model is built once, on the meta device; `estimate` then only does arithmetic.

[Note: shared fractions] ``offload_fraction`` is read only where the offload plan is
made (which pieces go to the tier): two configurations that differ only in it and get
the same plan run the very same step, so one prediction serves both
(`shared_fractions`). The plan is `estimate`'s, which is ``shard()``'s on rank 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerolite.config import ZeroConfig
from zerolite.memory.estimate import estimate_planned
from zerolite.memory.loop import OptimizerChoice
from zerolite.memory.peak_report import PeakPrediction
from zerolite.plan.offload import OffloadPlan

__all__ = ["StateBound", "shared_fractions", "state_bounds"]

# (ZeroConfig keyword arguments, micro-batch, accumulation, checkpointing, stop_above) ->
# prediction
_Predict = Callable[[dict[str, Any], int, int, bool, int | None], PeakPrediction]

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
        offload_plan: the offload plan of rank 0 (None: no offload).
    """

    resident: int
    offloaded: int
    parts: dict[str, int]
    offload_plan: OffloadPlan | None = None

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
        counted, offload = estimate_planned(model, world_size=world_size, config=config,
                                            optimizer=optimizer)
    except Exception:  # noqa: BLE001 - e.g. a refused configuration: the trace says why
        return None
    parts = {name: getattr(counted, name) for name in _PARTS if getattr(counted, name)}
    if config.offload == "host" and device == "cpu" and counted.offloaded:
        parts["offload"] = counted.offloaded  # the arena is this device's memory
    return StateBound(sum(parts.values()), counted.offloaded, parts, offload)


def shared_fractions(predict: _Predict, kwargs: Sequence[dict[str, Any]],
                     bounds: Sequence[StateBound | None]) -> _Predict:
    """``predict``, asked once for configurations among ``kwargs`` that differ only in
    ``offload_fraction`` and whose bounds have the same offload plan ([Note: shared
    fractions]); the others, and those without a plan, are predicted each time."""
    plans = {_without_fraction(kw): b.offload_plan for kw, b in zip(kwargs, bounds)
             if b is not None and b.offload_plan is not None}
    seen: dict[tuple, PeakPrediction] = {}

    def shared(kw: dict[str, Any], micro: int, accumulation: int, ckpt: bool,
               stop_above: int | None) -> PeakPrediction:
        key = _without_fraction(kw)
        plan = plans.get(key)
        if plan is None:
            return predict(kw, micro, accumulation, ckpt, stop_above)
        key = (key[1], plan, micro, accumulation, ckpt)
        # A whole prediction (None) answers every question; a stopped one, its limit's.
        for limit in (None, stop_above):
            if (key, limit) in seen:
                return seen[(key, limit)]
        p = predict(kw, micro, accumulation, ckpt, stop_above)
        seen[(key, None if p.complete else stop_above)] = p
        return p
    return shared


def _without_fraction(kwargs: dict[str, Any]) -> tuple:
    """``kwargs`` as a key: all of it, and all of it but ``offload_fraction``."""
    rest = tuple(sorted((k, v) for k, v in kwargs.items() if k != "offload_fraction"))
    return (tuple(sorted(kwargs.items())), rest)
