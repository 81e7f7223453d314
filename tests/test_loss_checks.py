"""`tests.loss_checks` refuses what a bare ``zip`` and ``max`` let pass."""

from __future__ import annotations

import math

import pytest

from tests.loss_checks import ddp_bounds, loss_deviations, within, worst_deviation


def test_a_truncated_or_empty_list_is_refused():
    with pytest.raises(AssertionError, match="2 losses against 3 reference losses"):
        loss_deviations([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(AssertionError, match="0 losses against 0"):
        loss_deviations([], [])
    with pytest.raises(AssertionError):
        within([1.0, 2.0, 3.0], [1.0, 2.0], [1e-5])


@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_non_finite_loss_fails_wherever_it_is(where):
    losses = [1.0, 2.0, 3.0]
    for bad in (math.nan, math.inf):
        broken = [*losses[:where], bad, *losses[where + 1:]]
        assert math.isnan(worst_deviation(broken, losses))  # max() alone depends on position
        assert not within(broken, losses, [1.0])
        assert not within(losses, broken, [1.0])


def test_deviations_and_ddp_bounds():
    assert loss_deviations([1.1, 0.5], [1.0, 0.0]) == pytest.approx([0.1, 0.5])
    assert within([1.0, 2.0], [1.0, 2.002], [1e-3])
    assert not within([1.0, 2.0], [1.0, 2.01], [1e-3])
    # max(2 x the running largest DDP deviation, floor); a NaN poisons every later step.
    assert ddp_bounds([1e-7, 3e-6, 1e-6]) == pytest.approx([1e-6, 6e-6, 6e-6])
    bounds = ddp_bounds([1e-7, math.nan, 1e-7])
    assert bounds[0] == 1e-6 and math.isnan(bounds[1]) and math.isnan(bounds[2])
