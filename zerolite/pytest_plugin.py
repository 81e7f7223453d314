"""A pytest plugin for memory-footprint regression tests (opt in with
``pytest_plugins = ["zerolite.pytest_plugin"]`` in your ``conftest.py``).

Fixtures:

- ``zerolite_footprint``: `zerolite.testing.assert_footprint`, to call on a sharded
  optimizer inside a test (or inside a rank function launched with
  `zerolite.testing.run_ranks`): ``zerolite_footprint(opt)`` fails, naming each category
  and the excess bytes, when the measured model states differ from zerolite's estimate.
- ``zerolite_peak``: `zerolite.testing.assert_peak`: ``zerolite_peak(opt, predicted,
  tolerance)`` fails when the peak of live tensor bytes measured in ``opt``'s latest
  ``zerolite.memory.track`` block moved away from ``predicted`` (a
  `zerolite.memory.predict_peak` result, or bytes recorded as a baseline).
- ``zerolite_ranks``: `zerolite.testing.run_ranks`, for tests on real process groups.

The functions behind the fixtures are `zerolite.testing.assert_footprint` and
`zerolite.testing.assert_peak`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from zerolite.memory.assertions import assert_footprint, assert_peak
from zerolite.testing import run_ranks


@pytest.fixture
def zerolite_footprint() -> Callable:
    """`zerolite.testing.assert_footprint`: ``zerolite_footprint(opt)`` raises
    `zerolite.testing.FootprintMismatch` naming each category and its excess bytes."""
    return assert_footprint


__all__ = ["zerolite_footprint", "zerolite_peak", "zerolite_ranks"]


@pytest.fixture
def zerolite_peak() -> Callable:
    """`zerolite.testing.assert_peak`: ``zerolite_peak(opt, predicted, tolerance=0.05)``
    raises `zerolite.testing.PeakMismatch` with the measured and expected peak."""
    return assert_peak


@pytest.fixture
def zerolite_ranks() -> Callable:
    """`zerolite.testing.run_ranks`: ``zerolite_ranks(fn, world_size, *args)`` runs ``fn`` on
    a real process group of ``world_size`` ranks and returns each rank's result."""
    return run_ranks
