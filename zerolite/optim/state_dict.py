"""In-memory ``state_dict`` of a `ShardedOptimizer`: this rank's shard, and only it.

The dict is the wrapped optimizer's own ``state_dict()`` (state keyed by piece index,
param groups with their hyperparameters) plus a ``"zerolite"`` entry: the rank and
world size it belongs to, the stage, a digest of the layout, this rank's fp32 master
shards and the loss-scaler state. Loading checks that entry on every rank and agrees
across ranks before touching anything, so a dict from another rank (which would
silently load someone else's shard) or another layout is refused everywhere at once.

For files that survive a change of world size, use `zerolite.checkpoint`.
"""

from __future__ import annotations

from typing import Any

import torch

from zerolite.comm.consensus import agreed
from zerolite.optim.loss_scale import DynamicLossScaler
from zerolite.state.shard_state import ShardState

__all__ = ["sharded_state_dict", "load_sharded_state_dict"]

FORMAT = 1


def sharded_state_dict(
    state: ShardState, loss_scaler: DynamicLossScaler | None
) -> dict[str, Any]:
    """This rank's optimizer state (``state``'s, and the fp16 ``loss_scaler``'s); tensors are
    references, as torch's ``state_dict()``."""
    if state.offload is not None:
        raise RuntimeError(
            "state_dict() holds the whole state in memory, and this model offloads it "
            "(ZeroConfig.offload): save with zerolite.checkpoint.save, which reads the tier"
        )
    inner = state.inner.state_dict()
    inner["zerolite"] = {
        "format": FORMAT,
        "rank": state.group.rank,
        "world_size": state.group.size,
        "stage": state.config.stage,
        "layout": state.layout_digest,
        "masters": [master.data for master in state.masters],
        # ZeroConfig.quantize_reduce's error-feedback residuals (the layout digest pins them).
        "residuals": _residuals(state),
        "loss_scaler": None if loss_scaler is None else loss_scaler.state_dict(),
        "groups": _group_names(state),
    }
    return inner


def _residuals(state: ShardState) -> list[torch.Tensor]:
    """Every error-feedback residual: the shard group's, then (hybrid) the cross-node step's."""
    exchanges = [flat.exchange for flat in state.flats]
    within = [e.residual for e in exchanges if e.residual is not None]
    return within + [e.replica_residual for e in exchanges if e.replica_residual is not None]


def _group_names(state: ShardState) -> list[list[str]]:
    """Per param group, the names of the parameters with a piece on this rank, in order.

    The wrapped optimizer's ``load_state_dict`` matches groups by position; these names
    let a dict saved with the groups in another order be refused by name."""
    name_of = {id(piece.master): piece.name for piece in state.pieces()}
    return [
        [name_of[id(t)] for t in group["params"] if id(t) in name_of]
        for group in state.inner.param_groups
    ]


def _moved(saved: list[list[str]], current: list[list[str]]) -> list[str]:
    """Names in a group of another position than in ``saved`` (a layout change that only
    moves pieces between ranks is left to the layout check)."""
    was = {name: g for g, names in enumerate(saved) for name in names}
    return [name for g, names in enumerate(current) for name in names if was.get(name, g) != g]


def _describe(groups: list[list[str]]) -> str:
    parts = []
    for g, names in enumerate(groups):
        more = f", ... ({len(names)} params)" if len(names) > 3 else ""
        parts.append(f"group {g}: [{', '.join(names[:3])}{more}]")
    return "; ".join(parts)


def _check(
    state: ShardState, state_dict: dict[str, Any], loss_scaler: DynamicLossScaler | None
) -> None:
    meta = state_dict.get("zerolite") if isinstance(state_dict, dict) else None
    if meta is None:
        raise ValueError(
            "not a ShardedOptimizer state dict (no 'zerolite' entry): load a dict saved from a "
            "ShardedOptimizer, or use zerolite.checkpoint to load across topologies"
        )
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"state dict format {meta.get('format')!r} is not supported (expected {FORMAT})"
        )
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    missing += [
        f"zerolite.{k}"
        for k in ("rank", "world_size", "stage", "layout", "masters", "loss_scaler")
        if k not in meta
    ]
    if missing:
        raise ValueError(
            f"this ShardedOptimizer state dict lacks {missing}; load the dict that "
            "ShardedOptimizer.state_dict() returned, unchanged"
        )
    here = (state.group.rank, state.group.size)
    saved = (meta["rank"], meta["world_size"])
    if saved != here:
        raise ValueError(
            f"this state dict holds rank {saved[0]}/{saved[1]}'s shard but is being loaded on rank "
            f"{here[0]}/{here[1]}: each rank must load the dict its own rank saved (an in-memory "
            "state dict does not reshard; zerolite.checkpoint does)"
        )
    saved_groups = meta.get("groups")  # absent from dicts of older versions
    if saved_groups is not None and _moved(saved_groups, _group_names(state)):
        raise ValueError(
            "this state dict's param groups hold other parameters than this optimizer's (groups "
            "are matched by position): state dict "
            f"{_describe(saved_groups)}; this optimizer {_describe(_group_names(state))}. Build "
            "the optimizer with the groups in the order they had when the state dict was saved"
        )
    if meta["stage"] != state.config.stage or meta["layout"] != state.layout_digest:
        raise ValueError(
            f"this state dict was saved with stage {meta['stage']} and another parameter layout "
            "(model, optimizer groups or bucket_size_mb differ); load it into the same setup, or "
            "use zerolite.checkpoint"
        )
    if len(meta["masters"]) != len(state.masters):
        raise ValueError(
            f"state dict has {len(meta['masters'])} master shards, expected {len(state.masters)}"
        )
    for i, (master, saved) in enumerate(zip(state.masters, meta["masters"])):
        if not isinstance(saved, torch.Tensor) or saved.shape != master.data.shape:
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(
                f"master shard {i} of this state dict is {shape}, expected "
                f"{tuple(master.data.shape)}; load the dict this rank saved with the same setup"
            )
    residuals = meta.get("residuals")  # absent from dicts of older versions: restart at zero
    if residuals is not None and [tuple(r.shape) for r in residuals] != [
        tuple(r.shape) for r in _residuals(state)
    ]:
        raise ValueError(
            "this state dict's error-feedback residuals do not match this optimizer's "
            "(ZeroConfig.quantize_reduce / error_feedback differ); load it into the same setup"
        )
    if (meta["loss_scaler"] is None) != (loss_scaler is None):
        raise ValueError("state dict and optimizer disagree on fp16 loss scaling")


@torch.no_grad()
def load_sharded_state_dict(
    state: ShardState, state_dict: dict[str, Any], loss_scaler: DynamicLossScaler | None
) -> None:
    """Load this rank's dict into ``state`` and the fp16 ``loss_scaler`` (every rank must
    call, each with its own rank's dict)."""
    with agreed("ShardedOptimizer.load_state_dict()", state.group.world, [state.layout_digest]):
        if state.offload is not None:
            raise RuntimeError(
                "load_state_dict() is for in-memory state, and this model offloads it "
                "(ZeroConfig.offload): load with zerolite.checkpoint.load"
            )
        _check(state, state_dict, loss_scaler)
    meta = state_dict["zerolite"]
    state.inner.load_state_dict({k: v for k, v in state_dict.items() if k != "zerolite"})
    for master, saved in zip(state.masters, meta["masters"]):
        master.data.copy_(saved)
    saved_residuals = meta.get("residuals")
    for residual, saved in zip(_residuals(state), saved_residuals or []):
        residual.copy_(saved)
    if saved_residuals is None:
        for residual in _residuals(state):
            residual.zero_()
    state.publish()
    if loss_scaler is not None:
        loss_scaler.load_state_dict(meta["loss_scaler"])
