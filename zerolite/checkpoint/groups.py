"""Which optimizer param group each parameter belongs to, at save and at load.

Hyperparameters are restored group by group, and LR schedulers hold per-group lists
(``base_lrs``, ``min_lrs``, ...) by position. A checkpoint applied to groups listed in
another order would silently move weight decay onto biases and swap learning rates, so
`load` compares the grouping by parameter name and refuses any difference, naming both
groupings, before anything changes. (Remapping a permutation is not offered: scheduler
state and user code index groups by position, and cannot be remapped faithfully.)

Each rank knows the group only of the parameters it holds a piece of, so `save` records
this rank's ``{name: group}`` in its file's record (the index then covers every
parameter with elements), and `load` gathers the current ranks' maps the same way.
"""

from __future__ import annotations

from typing import Any

from zerolite.checkpoint.format import CheckpointError

__all__ = ["check_groups", "piece_groups", "saved_groups"]


def piece_groups(opt: Any) -> dict[str, int]:
    """``{parameter name: param group index}`` for the parameters with a piece on this rank."""
    group_of = {id(t): g for g, group in enumerate(opt.param_groups) for t in group["params"]}
    out: dict[str, int] = {}
    for piece in opt.shard_state.pieces():
        if id(piece.master) in group_of:
            out[piece.name] = group_of[id(piece.master)]
    return out


def saved_groups(index: dict[str, Any]) -> dict[str, int]:
    """The checkpoint's ``{name: group}``: from every file's record, and (older checkpoints)
    from the parameter table, where rank 0 of the save knew it."""
    out = {p["name"]: p["group"] for p in index.get("params", []) if p.get("group") is not None}
    for entry in index.get("files", []):
        out.update(entry.get("groups", {}))
    return out


def check_groups(saved: dict[str, int], current: dict[str, int], path: Any) -> None:
    """Raise unless every parameter is in the same group (by position) as at save.

    Args:
        saved: the checkpoint's grouping (`saved_groups`).
        current: the optimizer's grouping over all ranks (`piece_groups`, gathered).
    Raises:
        CheckpointError: naming the moved parameters and both groupings.
    """
    moved = sorted(n for n, g in current.items() if n in saved and saved[n] != g)
    if not moved:
        return
    raise CheckpointError(
        f"{path}: the optimizer's param groups differ from the checkpoint's: {len(moved)} "
        f"parameter(s) are in another group, e.g. {moved[0]!r} is in group {current[moved[0]]} "
        f"here and in group {saved[moved[0]]} in the checkpoint. Checkpoint: {_describe(saved)}; "
        f"this optimizer: {_describe(current)}. Build the optimizer with the groups in the order "
        "they had at save (hyperparameters and scheduler state are per group position)"
    )


def _describe(groups: dict[str, int]) -> str:
    by_group: dict[int, list[str]] = {}
    for name, g in sorted(groups.items()):
        by_group.setdefault(g, []).append(name)
    parts = []
    for g, names in sorted(by_group.items()):
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} params)" if len(names) > 3 else "")
        parts.append(f"group {g}: [{shown}]")
    return "; ".join(parts)
