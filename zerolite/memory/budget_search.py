"""How `zerolite.memory.plan` finds each combination's entry: the largest micro-batch
that fits, and which combinations need a prediction at all ([Note: pruned search] in
`zerolite.memory.budget`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from zerolite.memory.budget_bounds import StateBound
from zerolite.memory.budget_entry import PlanEntry, tier_order
from zerolite.memory.peak_report import PeakPrediction, human_bytes

__all__ = ["Candidate", "SKIPPED", "larger_after_fit", "pruned", "search"]

# (ZeroConfig keyword arguments, micro-batch, accumulation, checkpointing, stop_above) ->
# prediction (`predict_peak`'s ``stop_above``: None for a whole one)
Predict = Callable[[dict[str, Any], int, int, bool, int | None], PeakPrediction]
# Requests (`Predict`'s arguments) `plan` will probably make, in the order it would
# make them ([Note: predictions ahead] in `zerolite.memory.prediction_pool`).
Ahead = Callable[[list[tuple]], None]
SKIPPED = "skipped"
_AT_FLOOR = "needs at least"
Candidate = tuple[dict[str, Any], bool]  # ZeroConfig keyword arguments, checkpointing
Floor = tuple[int, str]  # a lower bound of a peak, bytes; what it is made of


def _micro_batches(batch: int) -> list[int]:
    """``batch``, then halves of it while they divide it evenly, down to 1."""
    out = [batch]
    while out[-1] % 2 == 0:
        out.append(out[-1] // 2)
    if out[-1] != 1:
        out.append(1)
    return out


def larger_after_fit(request: tuple, prediction: PeakPrediction) -> list[tuple]:
    """The requests `search` makes once micro-batch 1 of a combination fits: its larger
    micro-batches (the same ``stop_above``); none for another request or answer. (The
    `plan`'s prediction pool asks them ahead as soon as a worker answers.)"""
    kwargs, micro, batch, ckpt, stop_above = request
    if micro != 1 or not prediction.complete or (
            stop_above is not None and prediction.peak > stop_above):
        return []
    return [(kwargs, m, batch // m, ckpt, stop_above) for m in _micro_batches(batch)[:-1]]


def search(
    memory: int, batch: int, kwargs: dict[str, Any], ckpt: bool, predict: Predict,
    *, pruned: bool = False, floor: Callable[[int], Floor | None] = lambda micro: None,
    stop_above: int | None = None,
) -> PlanEntry:
    """The largest micro-batch of one combination that fits, or the rejection.

    Exhaustive: the whole batch first, then a micro-batch of 1 (if that is over, nothing
    smaller is left: one prediction rejects), then the halves in between, largest first.
    ``pruned``: 1 first (most combinations searched are rejected, by that one
    prediction), then the whole batch, then bisection; a micro-batch whose ``floor`` (a
    lower bound of its peak and what it is made of, or None) is over the budget is over
    without a prediction. ``stop_above``: each simulation stops once the rank holds more
    than this (at least ``memory``; [Note: stopped simulation] in
    `zerolite.memory.predict`)."""
    sizes = _micro_batches(batch)
    tried: dict[int, PeakPrediction] = {}
    floors: dict[int, Floor] = {}
    asked: list[int] = []

    def over(i: int) -> bool:
        micro = sizes[i]
        least = floor(micro)
        if least is not None and least[0] > memory:
            floors[micro] = least
            return True
        asked.append(micro)
        tried[micro] = predict(kwargs, micro, batch // micro, ckpt, stop_above)
        return tried[micro].peak > memory

    try:
        best = _largest_fitting(len(sizes), over, pruned)
    except ValueError as exc:  # a combination zerolite refuses (e.g. offload here)
        return PlanEntry(kwargs, asked[-1], batch // asked[-1], ckpt, 0, False, 0,
                         f"zerolite refuses it: {exc}")
    if best is not None:
        return _entry(kwargs, tried[sizes[best]], True, None)
    if sizes[-1] in floors:
        return _over_at_floor(kwargs, ckpt, floors[sizes[-1]], memory, batch)
    smallest = tried[sizes[-1]]
    over_by = smallest.peak - memory
    if not smallest.complete:
        return _entry(kwargs, smallest, False, (
            f"{_AT_FLOOR} {human_bytes(smallest.peak)} at micro-batch "
            f"{smallest.micro_batch}, over the budget ({human_bytes(memory)}): its "
            f"simulation stopped there, most of it {_largest(smallest)} (not predicted "
            "further)"
        ))
    return _entry(kwargs, smallest, False, (
        f"needs {human_bytes(smallest.peak)} at micro-batch {smallest.micro_batch}, "
        f"{human_bytes(over_by)} over the budget ({human_bytes(memory)}); most of it "
        f"{_largest(smallest)}"
    ))


def _largest_fitting(n: int, over: Callable[[int], bool], pruned: bool) -> int | None:
    """The index of the largest of ``n`` micro-batches (descending) that fits, or None,
    asking ``over(i)`` in `search`'s order."""
    last = n - 1  # micro-batch 1
    if pruned:
        if over(last):
            return None
        if last == 0 or not over(0):
            return 0
    else:
        if not over(0):
            return 0
        if last == 0 or over(last):
            return None
    if not pruned:
        return next((i for i in range(1, last) if not over(i)), last)
    above, fitting = 0, last  # sizes[above] is over the budget, sizes[fitting] fits
    while fitting - above > 1:
        middle = (above + fitting) // 2
        above, fitting = (middle, fitting) if over(middle) else (above, middle)
    return fitting


def _largest(prediction: PeakPrediction) -> str:
    name, n = max(prediction.breakdown.items(), key=lambda kv: kv[1])
    return f"{name} ({human_bytes(n)}) in {prediction.phase}"


def _entry(kwargs: dict[str, Any], p: PeakPrediction, fits: bool, reason: str | None) -> PlanEntry:
    return PlanEntry(dict(kwargs), p.micro_batch, p.accumulation, p.activation_checkpointing,
                     p.peak, fits, p.communication_bytes, reason, p.offloaded)


def pruned(
    memory: int, batch: int, candidates: list[Candidate], bounds: list[StateBound | None],
    predict: Predict, ahead: Ahead = lambda requests: None,
) -> list[PlanEntry]:
    """[Note: pruned search]: the entries of ``candidates``, in their order. Each traced
    one's micro-batch 1 is asked for ``ahead`` at once."""
    entries: list[PlanEntry | None] = [None] * len(candidates)
    traced = []
    for i, ((kwargs, ckpt), bound) in enumerate(zip(candidates, bounds)):
        if bound is not None and bound.resident > memory:
            entries[i] = _over_in_states(kwargs, ckpt, bound, memory, batch)
        else:
            traced.append(i)
    unknown = {candidates[i][0].get("offload") for i in traced if bounds[i] is None}

    def group(i: int) -> tuple:
        (kwargs, ckpt), bound = candidates[i], bounds[i]
        tier = kwargs.get("offload")
        if tier is not None and tier in unknown:  # no bytes to order by: the whole tier
            return (*tier_order(kwargs), 0, False)
        return (*tier_order(kwargs), 0 if bound is None else bound.offloaded, ckpt)

    floors = _ActivationFloors(predict)
    fitting: PlanEntry | None = None
    order = sorted(traced, key=group)
    ahead([(candidates[i][0], 1, batch, candidates[i][1], memory) for i in order])
    for _, members in itertools.groupby(order, key=group):
        for i in members:
            kwargs, ckpt = candidates[i]
            bound = bounds[i]
            entry = (
                search(memory, batch, kwargs, ckpt, floors.predict, pruned=True,
                       floor=floors.floor(kwargs, ckpt, bound), stop_above=memory)
                if fitting is None else _skipped(kwargs, ckpt, batch, fitting)
            )
            if bound is not None and (entry.reason or "").startswith(_AT_FLOOR):
                entry = dataclasses.replace(entry, offloaded_bytes=bound.offloaded)
            entries[i] = entry
        fits = [e for i, e in enumerate(entries) if i in traced and e is not None and e.fits]
        if fitting is None and fits and _ordered_as_bounded(entries, bounds, traced):
            fitting = min(fits, key=PlanEntry.cost)
    assert all(e is not None for e in entries)
    if not any(e.fits for e in entries if e is not None):
        _predict_least_over(entries, candidates, memory, batch, floors.predict)
    return entries  # type: ignore[return-value]


def _predict_least_over(
    entries: list[PlanEntry | None], candidates: list[Candidate], memory: int, batch: int,
    predict: Predict,
) -> None:
    """Nothing fits: the first entry `plan` lists is the least over the budget, so it must
    be a prediction, not a bound. While the least is a bound (a lower bound of its peak:
    its model states, its floor, or a stopped simulation), predict that one (in place),
    stopped above the least peak predicted so far (a stopped one is not the least), and
    look again. Each is predicted once: its bound then is at least that peak, which only
    falls."""
    while True:
        least = min(range(len(entries)), key=lambda i: entries[i].peak_bytes)  # type: ignore[union-attr]
        if not _is_bound(entries[least]):  # type: ignore[arg-type]
            return
        known = [e.peak_bytes for e in entries if e is not None and not _is_bound(e)]
        kwargs, ckpt = candidates[least]
        entries[least] = search(memory, batch, kwargs, ckpt, predict, pruned=True,
                                stop_above=min(known, default=None))


def _is_bound(entry: PlanEntry) -> bool:
    """Whether the entry's peak is a lower bound, not a prediction."""
    return "(not predicted" in (entry.reason or "")


class _ActivationFloors:
    """[Note: activation floor] Each prediction's `PeakPrediction.activations_peak`, kept
    per (``param_dtype``, checkpointing, micro-batch): the model's own forward tensors,
    which no stage, offload tier or shard group changes. Another configuration of the
    same three holds them at some moment of its step, on top of what it holds at every
    moment (`StateBound.persistent`: parameters, masters, optimizer state, a resident
    arena), so that sum is a lower bound of its peak, and of its peak at any larger
    micro-batch. A stopped simulation ([Note: stopped simulation] in
    `zerolite.memory.predict`) saw a part of them, a lower bound too: it is used where no
    whole prediction of the three is known.

    [Note: step floor] Each prediction's peak of the ``"step"`` phase is kept too, per
    configuration (its `ZeroConfig` keyword arguments) and micro-batch. That phase is
    ``opt.step()`` and ``zero_grad()`` on what the rank holds once the last backward is
    done -- parameters, gradient buffers, masters, optimizer state and the 0-dim loss,
    the autograd graph gone -- and the next step's first batch, made in it: the same
    storages and the same code at every checkpointing setting and micro-batch but for
    that batch, which grows with the micro-batch. So the same configuration's step phase
    reaches that peak at least, with checkpointing on or off, at that micro-batch and
    every larger one: a lower bound of its peak there."""

    def __init__(self, predict: Predict) -> None:
        self._predict = predict
        self._seen: dict[tuple, int] = {}
        self._partial: dict[tuple, int] = {}  # from stopped simulations
        self._steps: dict[tuple, int] = {}  # (configuration, micro-batch) -> step peak

    def predict(self, kwargs: dict[str, Any], micro: int, accumulation: int,
                ckpt: bool, stop_above: int | None) -> PeakPrediction:
        p = self._predict(kwargs, micro, accumulation, ckpt, stop_above)
        key = (kwargs["param_dtype"], ckpt, micro)
        if p.complete:
            self._seen[key] = min(self._seen.get(key, p.activations_peak), p.activations_peak)
        else:  # a stopped simulation saw part of them: a lower bound of them
            self._partial[key] = max(self._partial.get(key, 0), p.activations_peak)
        if "step" in p.by_phase:
            self._steps[(_frozen(kwargs), micro)] = p.by_phase["step"]
        return p

    def floor(self, kwargs: dict[str, Any], ckpt: bool,
              bound: StateBound | None) -> Callable[[int], Floor | None]:
        config = _frozen(kwargs)

        def at(micro: int) -> Floor | None:
            seen = [n for (dtype, c, m), n in {**self._partial, **self._seen}.items()
                    if dtype == kwargs["param_dtype"] and c == ckpt and m <= micro]
            steps = [(n, m) for (k, m), n in self._steps.items() if k == config and m <= micro]
            floors = [(max(steps)[0], _STEP_FLOOR.format(micro=max(steps)[1]))] if steps else []
            if bound is not None and seen:
                floors.append((bound.persistent + max(seen), _ACTIVATION_FLOOR))
            return max(floors, default=None)
        return at


def _frozen(kwargs: dict[str, Any]) -> tuple:
    return tuple(sorted(kwargs.items()))


def _ordered_as_bounded(entries: list[PlanEntry | None], bounds: list[StateBound | None],
                        traced: list[int]) -> bool:
    """Whether every prediction so far offloads the bytes its bound said (the groups'
    order then is [Note: plan cost]'s; if not, nothing is skipped)."""
    return all(
        e.offloaded_bytes == b.offloaded
        for i, (e, b) in enumerate(zip(entries, bounds))
        if i in traced and e is not None and b is not None and e.peak_bytes
    )


def _over_in_states(kwargs: dict[str, Any], ckpt: bool, bound: StateBound, memory: int,
                    batch: int) -> PlanEntry:
    name, n = max(bound.parts.items(), key=lambda kv: kv[1])
    return PlanEntry(
        dict(kwargs), 1, batch, ckpt, bound.resident, False, 0,
        f"model states alone need {human_bytes(bound.resident)}, "
        f"{human_bytes(bound.resident - memory)} over the budget ({human_bytes(memory)}); "
        f"most of it {name} ({human_bytes(n)}) (not predicted: no micro-batch can fit)",
        bound.offloaded,
    )


_ACTIVATION_FLOOR = ("the model states it always holds and the activations of the same "
                     "model at micro-batch 1")
_STEP_FLOOR = ("its optimizer step, the same with checkpointing on or off, as predicted "
               "at micro-batch {micro}")


def _over_at_floor(kwargs: dict[str, Any], ckpt: bool, least: Floor, memory: int,
                   batch: int) -> PlanEntry:
    n, what = least
    return PlanEntry(
        dict(kwargs), 1, batch, ckpt, n, False, 0,
        f"{_AT_FLOOR} {human_bytes(n)} at micro-batch 1, "
        f"{human_bytes(n - memory)} over the budget ({human_bytes(memory)}): {what} "
        "(not predicted)",
    )


def _skipped(kwargs: dict[str, Any], ckpt: bool, batch: int, fitting: PlanEntry) -> PlanEntry:
    return PlanEntry(
        dict(kwargs), batch, 1, ckpt, 0, False, 0,
        f"{SKIPPED}: costs more than one that fits ({fitting.zero_config_line()}, "
        f"activation checkpointing {'on' if fitting.activation_checkpointing else 'off'})",
    )
