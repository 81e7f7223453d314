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

import torch

from zerolite.checkpoint.format import CheckpointError

__all__ = [
    "check_hyperparameters", "check_param_groups", "piece_param_groups", "saved_param_groups",
]


def piece_param_groups(opt: Any) -> dict[str, int]:
    """``{parameter name: param group index}`` for the parameters with a piece on this rank."""
    param_group_of = {id(t): g for g, group in enumerate(opt.param_groups) for t in group["params"]}
    out: dict[str, int] = {}
    for piece in opt.shard_state.pieces():
        if id(piece.master) in param_group_of:
            out[piece.name] = param_group_of[id(piece.master)]
    return out


def saved_param_groups(index: dict[str, Any]) -> dict[str, int]:
    """The checkpoint's ``{name: group}``: from every file's record, and (older checkpoints)
    from the parameter table, where rank 0 of the save knew it."""
    out = {p["name"]: p["group"] for p in index.get("params", []) if p.get("group") is not None}
    for entry in index.get("files", []):
        out.update(entry.get("groups", {}))
    return out


def check_param_groups(saved: dict[str, int], current: dict[str, int], path: Any) -> None:
    """Raise unless every parameter is in the same group (by position) as at save.

    Args:
        saved: the checkpoint's grouping (`saved_param_groups`).
        current: the optimizer's grouping over all ranks (`piece_param_groups`, gathered).
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


def check_hyperparameters(
    saved: list[dict[str, Any]], current: list[dict[str, Any]], path: Any
) -> None:
    """Raise unless each saved hyperparameter has the kind of the optimizer's own value.

    The index is sealed, but a hand-edited, re-sealed one passes the schema with any JSON
    there (``betas: "oops"``); the optimizer would take it and fail (or compute nonsense)
    at its next step. Kinds: number (int, float, 0-dim tensor), bool, str, and sequences of
    the same length, element by element; None on either side matches anything (an option
    left unset).

    Args:
        saved: the decoded param groups of the index, by position.
        current: the optimizer's ``param_groups``, by position (same count: checked before).
    Raises:
        CheckpointError: naming the group, the key, the saved value and the kind expected.
    """
    for g, (old, new) in enumerate(zip(saved, current)):
        for key, value in old.items():
            if key != "params" and key in new and not _same_kind(value, new[key]):
                raise CheckpointError(
                    f"{path}: param group {g}'s {key!r} is {value!r} in the checkpoint, and "
                    f"this optimizer holds {new[key]!r} there: not the same kind of value. "
                    "The index was edited; restore it from a copy, or load another checkpoint"
                )


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return "number"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return type(value).__name__


def _same_kind(saved: Any, current: Any) -> bool:
    if saved is None or current is None:
        return True
    if _kind(saved) != _kind(current):
        return False
    if _kind(saved) == "sequence":
        return len(saved) == len(current) and all(map(_same_kind, saved, current))
    return True
