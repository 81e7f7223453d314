"""LR-scheduler state in a checkpoint: exact, typed, and checked before anything changes.

`save` stores one entry per scheduler in the index: its class (with the classes of the
schedulers it wraps, for ``SequentialLR`` and ``ChainedScheduler``) and its
``state_dict()`` in the lossless encoding of `zerolite.checkpoint.json_codec` -- so
``MultiStepLR``'s ``Counter`` of milestones comes back with int keys and resumes decaying
at the right step. `load` checks the number and classes of the schedulers it is given
against the checkpoint and decodes every state before the model, the optimizer or any
scheduler changes (`plan_schedulers`), then loads them with a backup it can restore
(`apply_schedulers`) if a peer rank fails later in the load.

Functions and lambdas (``LambdaLR``, ``MultiplicativeLR``, ``CyclicLR``'s ``scale_fn``)
are not saved (torch's own ``state_dict()`` leaves them out): the schedulers given to
`load` must be built with the same functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from zerolite.checkpoint.format import CheckpointError
from zerolite.checkpoint.json_codec import decode, encode

__all__ = ["apply_schedulers", "plan_schedulers", "restore_schedulers", "scheduler_entries"]


def _kind(scheduler: Any) -> str:
    """``module.Class``, with the wrapped schedulers' kinds in brackets (SequentialLR)."""
    cls = type(scheduler)
    name = f"{cls.__module__}.{cls.__qualname__}"
    children = getattr(scheduler, "_schedulers", None)
    if isinstance(children, (list, tuple)):
        name += "[" + ", ".join(_kind(c) for c in children) + "]"
    return name


def _check_sequence(schedulers: Any, caller: str) -> list[Any]:
    if hasattr(schedulers, "state_dict") or not isinstance(schedulers, Sequence):
        raise TypeError(
            f"{caller}: schedulers must be a list of LR schedulers, got "
            f"{type(schedulers).__name__}; pass schedulers=[scheduler]"
        )
    for i, s in enumerate(schedulers):
        if not (
            callable(getattr(s, "state_dict", None))
            and callable(getattr(s, "load_state_dict", None))
        ):
            raise TypeError(
                f"{caller}: schedulers[{i}] is a {type(s).__name__}, which has no state_dict() / "
                "load_state_dict(); pass LR schedulers (torch.optim.lr_scheduler)"
            )
    return list(schedulers)


def scheduler_entries(schedulers: Sequence[Any]) -> list[dict[str, Any]]:
    """The index's ``"schedulers"`` entry: ``{"class": kind, "state": encoded}`` per scheduler.

    Raises:
        TypeError: ``schedulers`` is not a sequence of schedulers.
        ValueError: a state value cannot round-trip through the index, naming it.
    """
    entries = []
    for i, s in enumerate(_check_sequence(schedulers, "checkpoint.save()")):
        kind = _kind(s)
        short = type(s).__qualname__
        entries.append(
            {"class": kind, "state": encode(s.state_dict(), f"scheduler {i} ({short}) state")}
        )
    return entries


def plan_schedulers(
    index: dict[str, Any], schedulers: Sequence[Any], path: Any
) -> list[tuple[Any, Any]]:
    """(scheduler, decoded state) pairs for `load`, after checking them all. Changes nothing.

    Raises:
        TypeError: ``schedulers`` is not a sequence of schedulers.
        CheckpointError: the checkpoint holds another number of schedulers, one of another
            class, or a state this version cannot decode -- naming the scheduler.
    """
    given = _check_sequence(schedulers, "checkpoint.load()")
    saved = index.get("schedulers") or []
    kinds = [e.get("class") if isinstance(e, dict) else None for e in saved]
    if not given and all(k is None for k in kinds):
        return []  # an older index's untyped states may be skipped, never loaded
    if len(given) != len(saved):
        raise CheckpointError(
            f"{path}: the checkpoint holds {len(saved)} LR scheduler state(s) {_names(kinds)}, "
            f"load() got {len(given)} {_names([_kind(s) for s in given])}: pass the same "
            "schedulers, in the same order, as to save() (a scheduler the checkpoint lacks "
            "would silently restart at epoch 0)"
        )
    plan = []
    for i, (s, entry, kind) in enumerate(zip(given, saved, kinds)):
        if not isinstance(entry, dict) or kind is None or "state" not in entry:
            raise CheckpointError(
                f"{path}: scheduler {i}'s state was saved by an older zerolite, whose index lost "
                "its types (e.g. MultiStepLR's milestones); load with schedulers=() and set the "
                "scheduler's last_epoch yourself"
            )
        if kind != _kind(s):
            raise CheckpointError(
                f"{path}: scheduler {i} was saved as {kind}, load() got {_kind(s)}; pass a "
                "scheduler of the saved class (schedulers=[...] in the order given to save())"
            )
        try:
            plan.append((s, decode(entry["state"], f"scheduler {i} state")))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    return plan


def apply_schedulers(plan: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Load each planned state; returns (scheduler, previous state) for `restore_schedulers`.

    A failure restores the schedulers loaded so far, then re-raises.
    """
    backups: list[tuple[Any, Any]] = []
    try:
        for scheduler, state in plan:
            backups.append((scheduler, scheduler.state_dict()))  # first: a failed load is undone
            scheduler.load_state_dict(state)
    except Exception:
        restore_schedulers(backups)
        raise
    return backups


def restore_schedulers(backups: list[tuple[Any, Any]]) -> None:
    """Undo `apply_schedulers` (torch's ``load_state_dict`` rebinds attributes, so a
    ``state_dict()`` taken before holds the previous values)."""
    for scheduler, backup in reversed(backups):
        scheduler.load_state_dict(backup)


def _names(kinds: list[Any]) -> str:
    """Kinds without module paths: ``[SequentialLR[LinearLR, MultiStepLR]]``."""
    return "[" + ", ".join(re.sub(r"[\w.]*\.(\w+)", r"\1", k) if k else "?" for k in kinds) + "]"
