"""`full_state_dict`: the unsharded ``model.state_dict()``, gathered unit by unit.

In stage 3 no rank holds full parameters between uses, so ``model.state_dict()`` is
refused. This gathers one unit at a time, copies its tensors out (to CPU by default)
and frees it again, so the device never holds more than one extra unit.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.checkpoint.save import state_dict_names
from zerolite.gathered import iter_full_state_dict
from zerolite.state.shard_state import state_of

__all__ = ["full_state_dict"]


@torch.no_grad()
def full_state_dict(
    model: nn.Module, rank0_only: bool = True, to_cpu: bool = True
) -> dict[str, torch.Tensor]:
    """The model's full state dict (names and shapes of the unsharded ``model.state_dict()``).

    Every rank must call it (stage 3 all-gathers each unit in turn, so the device holds
    at most one extra unit). Tied parameters appear under each of their names, sharing
    one tensor, as in ``model.state_dict()``.

    Args:
        model: a model sharded by `zerolite.shard` (any stage), or a plain model.
        rank0_only: only rank 0 keeps the tensors; other ranks get ``{}`` (they still
            take part in the gathers).
        to_cpu: copy tensors to CPU (else clones on the model's device).
    Returns:
        ``name -> tensor`` copies, in ``model.state_dict()`` order.
    """
    state = state_of(model)
    scheduler = None if state is None else state.scheduler
    rank = scheduler.group.world.rank if scheduler is not None else _rank()
    keep = not rank0_only or rank == 0
    items = {}
    for name, tensor in iter_full_state_dict(model, to_cpu=to_cpu):
        if keep:  # other ranks only take part in the gathers
            items[name] = tensor
    if not keep:
        return {}
    return {name: items[name] for name in state_dict_names(model)}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
