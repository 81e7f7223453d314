"""Where loaded optimizer state goes: torch's own rule, so resumed runs do not sync.

``torch.optim.Optimizer.load_state_dict`` moves every state tensor to its parameter's
device, except ``step``: a 0-dim counter that stays on the CPU unless the group is
``fused`` or ``capturable`` (whose kernels read it on the device). A ``step`` moved to a
CUDA device costs a host sync per parameter piece at every step (the optimizer reads it on
the host to compute the bias correction). zerolite's loads (`zerolite.checkpoint.load`,
through `zerolite.state.shard_state.Piece.write`) follow the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["loaded_state", "state_device"]


def state_device(
    key: str, value: torch.Tensor, device: torch.device, group: Mapping[str, Any] | None
) -> torch.device:
    """The device torch's ``load_state_dict`` gives state ``key`` of a parameter on ``device``.

    Args:
        key: the state's name (``"step"``, ``"exp_avg"``, ...).
        value: the loaded tensor.
        device: the parameter's (here: the fp32 master's) device.
        group: the parameter's param group (its ``fused`` / ``capturable`` flags); None
            when unknown (treated as neither).
    """
    if key == "step":
        on_device = group is not None and bool(group.get("fused") or group.get("capturable"))
        return device if on_device else value.device
    return device


def loaded_state(
    state: Mapping[str, Any], device: torch.device, group: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``state`` with each tensor moved where `state_device` says (others unchanged)."""
    return {
        k: v.to(state_device(k, v, device, group)) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }
