"""Dynamic loss scaling for fp16 gradients, agreed across ranks.

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by
``scale`` before backward, and the reduced gradient shards are divided by it before
clipping and the step. If any element on *any* rank is inf or nan, the step is skipped
on every rank (one all-reduce of a flag: a rank that skipped alone would diverge) and
the scale is multiplied by ``backoff_factor``; after ``growth_interval`` consecutive good
steps it is multiplied by ``growth_factor``. Same policy as ``torch.amp.GradScaler``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerolite.comm.collectives import Group
from zerolite.comm.small_collectives import small_collective

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Loss scale state and the overflow decision.

    Args:
        init_scale: the first scale (2**16, as GradScaler).
        growth_factor, backoff_factor: multipliers after ``growth_interval`` good steps,
            and after an overflow.
        growth_interval: consecutive non-overflowing steps before growing.
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def found_overflow(self, shards: Sequence[torch.Tensor], group: Group) -> bool:
        """True on every rank if any rank's ``shards`` hold an inf or nan.

        One host sync per call, not one per shard: the per-shard checks stay on the
        shards' device and only the combined flag is read (`small_collective`)."""
        flag = torch.zeros(1, dtype=torch.float32)
        if shards:
            bad = torch.stack([(~torch.isfinite(shard)).any() for shard in shards]).any()
            flag = bad.to(torch.float32).reshape(1)
        flag = small_collective(flag, group, "max", what="step()'s fp16 overflow check")
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` good steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "good_steps": self.good_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.good_steps = int(state["good_steps"])
