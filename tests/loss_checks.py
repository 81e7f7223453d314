"""Per-step loss comparisons that a truncated, padded or non-finite loss list cannot pass.

`loss_deviations` is the one place that turns two loss curves into per-step relative
deviations: lists of different lengths raise (``zip`` would compare the common prefix and
let a run that stopped early pass), and a step where either loss is not finite gives NaN,
which fails every ``<=`` bound (``abs(nan - b) / abs(b) <= tol`` is False, but ``max()``
over a list holding NaN returns NaN or a finite value depending on where the NaN sits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ddp_bounds", "loss_deviations", "within", "worst_deviation"]


def loss_deviations(losses: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per step ``|a - b| / |b|`` (``|a - b|`` where ``b == 0``); NaN where either loss is not
    finite.

    Raises:
        AssertionError: the lists differ in length, or are empty.
    """
    if len(losses) != len(reference) or not reference:
        raise AssertionError(
            f"{len(losses)} losses against {len(reference)} reference losses: a run that "
            "stopped early or logged extra steps cannot be compared step by step"
        )
    out = []
    for a, b in zip(losses, reference):
        if not (math.isfinite(a) and math.isfinite(b)):
            out.append(math.nan)
        else:
            out.append(abs(a - b) / abs(b) if b != 0 else abs(a - b))
    return out


def worst_deviation(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest of `loss_deviations`; NaN if any step's is NaN (so any bound fails)."""
    deviations = loss_deviations(losses, reference)
    if any(math.isnan(d) for d in deviations):
        return math.nan
    return max(deviations)


def within(losses: Sequence[float], reference: Sequence[float], bounds: Sequence[float]) -> bool:
    """Whether every step's deviation is ``<=`` its bound (one bound per step, or one for all)."""
    deviations = loss_deviations(losses, reference)
    if len(bounds) == 1:
        bounds = list(bounds) * len(deviations)
    if len(bounds) != len(deviations):
        raise AssertionError(f"{len(bounds)} bounds for {len(deviations)} steps")
    return all(d <= b for d, b in zip(deviations, bounds))  # NaN fails


def ddp_bounds(ddp_deviations: Sequence[float], floor: float = 1e-6) -> list[float]:
    """Per step: max(2 x the largest deviation DDP reached up to that step, ``floor``).

    DDP on the same ranks, against the same reference, measures how far data parallelism
    itself moves the loss on this CPU; the running largest, because rounding differences
    live on in the weights while one step's loss difference may cross zero by chance. The
    floor is a few fp32 roundings of a loss (eps 1.2e-7). A NaN in DDP's deviations makes
    that step's and every later bound NaN (nothing passes it).
    """
    bounds, worst = [], 0.0
    for d in ddp_deviations:
        worst = math.nan if math.isnan(d) or math.isnan(worst) else max(worst, d)
        bounds.append(math.nan if math.isnan(worst) else max(2 * worst, floor))
    return bounds
