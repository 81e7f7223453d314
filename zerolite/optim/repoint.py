"""Re-point the user's optimizer at this rank's fp32 master pieces, keeping its objects.

`shard()` keeps the optimizer the user built: the same ``param_groups`` dicts (a scheduler
that already holds them keeps working), with ``"params"`` replaced by the master pieces,
and any state it already has (Adagrad's sum, a resumed Adam's moments) sliced to the
pieces instead of dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zerolite.state.pieces import Piece

__all__ = ["repoint_optimizer"]

# 0-dim state that is never per-element, even for a 0-dim parameter.
_SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})


@torch.no_grad()
def repoint_optimizer(
    optimizer: torch.optim.Optimizer,
    pieces: Iterable[Piece],
    param_group_of: dict[int, int],
    frozen: Iterable[nn.Parameter],
) -> None:
    """Replace each group's ``"params"`` by this rank's master pieces; slice existing state.

    Args:
        optimizer: the user's optimizer, still holding the model's parameters.
        pieces: this rank's pieces (`zerolite.state.shard_state.pieces_of`), in layout order.
        param_group_of: ``id(param) -> index`` of the param group holding it.
        frozen: parameters the optimizer holds that are not trained (their state is dropped).
    """
    new_params: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    flats = {}
    for piece in pieces:
        param = piece.flat.params[piece.index]
        flats[id(piece.flat)] = piece.flat
        new_params[param_group_of[id(param)]].append(piece.master)
        old = optimizer.state.get(param)
        if old:
            optimizer.state[piece.master] = {
                key: _slice_state(key, value, param, piece)
                for key, value in old.items()
            }
    for flat in flats.values():
        for param in flat.params:
            optimizer.state.pop(param, None)
    for param in frozen:
        optimizer.state.pop(param, None)
    for param_group, params in zip(optimizer.param_groups, new_params):
        param_group["params"] = params


def _slice_state(key: str, value: object, param: torch.Tensor, piece: Piece) -> object:
    """A state entry for one piece: per-element tensors sliced in the master's shape (fp32),
    others (scalars, Adafactor's factored moments of a whole owned tensor) copied."""
    if isinstance(value, torch.Tensor):
        if value.shape == param.shape and key not in _SCALAR_STATE:
            flat = value.detach().reshape(-1)[piece.param_start : piece.param_end]
            out = flat.clone().view(piece.master.shape)
            return out.float() if out.is_floating_point() else out
        return value.detach().clone()
    return value
