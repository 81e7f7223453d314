"""`full_state_dict`: the unsharded ``model.state_dict()``, gathered unit by unit.

In stage 3 no rank holds full parameters between uses, so ``model.state_dict()`` is
refused. This gathers one unit at a time, copies its tensors out (to CPU by default)
and frees it again, so the device never holds more than one extra unit.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.unit_scheduler import UnitScheduler
from zerolite.zero import UNITS_ATTR

__all__ = ["full_state_dict"]


def _copy(t: torch.Tensor, to_cpu: bool) -> torch.Tensor:
    t = t.detach()
    return t.to("cpu", copy=True) if to_cpu else t.clone()


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = True, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The model's full state dict (names and shapes of the unsharded ``model.state_dict()``).

    Every rank must call it (stage 3 all-gathers each unit). Tied parameters appear
    under each of their names, sharing one tensor, as in ``model.state_dict()``.

    Args:
        model: a model sharded by `zerolite.shard` (any stage), or a plain model.
        rank0_only: only rank 0 receives the tensors; other ranks get ``{}`` (they
            still take part in the gathers).
        to_cpu: copy tensors to CPU (else clones on the model's device).
    Returns:
        ``name -> tensor`` copies, in ``model.state_dict()`` order.
    """
    scheduler: UnitScheduler | None = getattr(model, UNITS_ATTR, None)
    keep = not rank0_only or scheduler is None and _rank() == 0 or scheduler is not None and scheduler.group.rank == 0
    if scheduler is None:
        if not keep:
            return {}
        shared: dict[int, torch.Tensor] = {}  # tied names share one copy, as in state_dict()
        out = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) not in shared:
                shared[id(tensor)] = _copy(tensor, to_cpu)
            out[name] = shared[id(tensor)]
        return out
    scheduler.allow_state_dict = True
    try:
        entries = model.state_dict(keep_vars=True)
    finally:
        scheduler.allow_state_dict = False
    copies: dict[int, torch.Tensor] = {}  # id(original) -> copy, so tied names share one copy
    for i, flat in enumerate(scheduler.flats):
        if flat is None:
            continue
        was_gathered = flat.unsharded
        scheduler.unshard(i)
        if keep:
            for p in flat.params:
                copies[id(p)] = _copy(p, to_cpu)
        if not was_gathered:
            scheduler.reshard(i)
    if not keep:
        return {}
    return {name: copies[id(t)] if id(t) in copies else _copy(t, to_cpu) for name, t in entries.items()}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
