"""Per-step loss comparisons that a truncated, padded or non-finite loss list cannot pass.

Built on `tests.support.parity.loss_deviations` (lists of different lengths raise: ``zip`` would
compare the common prefix and let a run that stopped early pass; a step where either loss is
not finite gives NaN, which fails every ``<=`` bound), for comparisons that are not parity
against DDP: a quantized run against the unquantized one, a compiled one against eager, bf16
against fp32 training. ``max()`` over a list holding NaN returns NaN or a finite value
depending on where the NaN sits, so `worst_deviation` handles NaN itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tests.support.parity import loss_deviations

__all__ = ["loss_deviations", "within", "worst_deviation"]


def _deviations(losses: Sequence[float], reference: Sequence[float]) -> list[float]:
    if not reference:
        raise AssertionError("no reference losses: nothing was compared")
    return loss_deviations(list(losses), list(reference))


def worst_deviation(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest per-step ``|a - b| / |b|``; NaN if any step's is NaN (so any bound fails).

    Raises:
        AssertionError: the lists differ in length, or are empty.
    """
    deviations = _deviations(losses, reference)
    if any(math.isnan(d) for d in deviations):
        return math.nan
    return max(deviations)


def within(losses: Sequence[float], reference: Sequence[float], bounds: Sequence[float]) -> bool:
    """Whether every step's deviation is ``<=`` its bound (one bound per step, or one for all).

    Raises:
        AssertionError: the lists differ in length, or are empty.
    """
    deviations = _deviations(losses, reference)
    if len(bounds) == 1:
        bounds = list(bounds) * len(deviations)
    if len(bounds) != len(deviations):
        raise AssertionError(f"{len(bounds)} bounds for {len(deviations)} steps")
    return all(d <= b for d, b in zip(deviations, bounds))  # NaN fails
