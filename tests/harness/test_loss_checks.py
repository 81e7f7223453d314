"""`tests.support.loss_checks` refuses what a bare ``zip`` and ``max`` let pass."""

from __future__ import annotations

import math

import pytest

from tests.support.loss_checks import within, worst_deviation


def test_a_truncated_or_empty_list_is_refused():
    with pytest.raises(AssertionError, match="2 losses against 3 reference losses"):
        worst_deviation([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(AssertionError, match="no reference losses"):
        worst_deviation([], [])
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


def test_deviations_within_bounds():
    assert worst_deviation([1.1, 2.0], [1.0, 2.0]) == pytest.approx(0.1)
    assert within([1.0, 2.0], [1.0, 2.002], [1e-3])
    assert not within([1.0, 2.0], [1.0, 2.01], [1e-3])
    assert within([1.0, 2.0], [1.0, 2.01], [0.0, 1e-2])
