"""`PlanEntry`: one configuration `zerolite.memory.plan` considered, and its cost."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["OFFLOAD_ORDER", "PlanEntry", "tier_order"]

OFFLOAD_ORDER = {None: 0, "host": 1, "disk": 2}


def tier_order(config: dict[str, Any]) -> tuple[int, int]:
    """The first keys of [Note: plan cost] for `ZeroConfig` keyword arguments ``config``:
    the parameter tier (``offload_params``: every gather and the step read the shards
    back), then the optimizer's (``offload``), each none, then host, then disk."""
    return OFFLOAD_ORDER[config.get("offload_params")], OFFLOAD_ORDER[config.get("offload")]


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One configuration `plan` considered.

    Attributes:
        config: the `ZeroConfig` keyword arguments (``param_dtype`` a ``torch.dtype``).
        micro_batch: samples per forward; ``accumulation`` forwards make the step.
        accumulation: micro-steps per optimizer step.
        activation_checkpointing: whether `checkpoint_blocks` is applied.
        peak_bytes: the predicted peak on one rank (at the smallest micro-batch when
            nothing fits).
        fits: whether ``peak_bytes`` is within the budget.
        communication_bytes: what the rank sends per optimizer step.
        reason: why it does not fit (None when it does).
        offloaded_bytes: bytes on the offload tier, streamed once per step (0: none).
    """

    config: dict[str, Any]
    micro_batch: int
    accumulation: int
    activation_checkpointing: bool
    peak_bytes: int
    fits: bool
    communication_bytes: int
    reason: str | None = None
    offloaded_bytes: int = 0

    def zero_config_line(self) -> str:
        """The one line of Python that makes this configuration's `ZeroConfig`."""
        args = ", ".join(
            f"{k}=torch.{str(v).removeprefix('torch.')}" if isinstance(v, torch.dtype)
            else f"{k}={v!r}"
            for k, v in self.config.items()
        )
        return f"zerolite.ZeroConfig({args})"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``param_dtype`` as its name, e.g. ``"bfloat16"``)."""
        config = {
            k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
            for k, v in self.config.items()
        }
        return {**dataclasses.asdict(self), "config": config}

    def cost(self) -> tuple:
        """Smaller is cheaper ([Note: plan cost] in `zerolite.memory.budget`)."""
        return (*tier_order(self.config), self.offloaded_bytes,
                self.activation_checkpointing, self.communication_bytes, self.accumulation,
                self.config["stage"])
