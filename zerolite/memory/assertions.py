"""`assert_footprint` and `assert_peak`: memory regression checks for users' tests."""

from __future__ import annotations

import dataclasses

from zerolite.memory.estimate import estimate_sharded
from zerolite.memory.footprint import MemoryBreakdown, footprint
from zerolite.memory.peak_report import PeakPrediction
from zerolite.memory.track import latest_peaks, step_peak
from zerolite.optim.sharded_optimizer import ShardedOptimizer, require_sharded_optimizer

__all__ = ["FootprintMismatch", "PeakMismatch", "assert_footprint", "assert_peak"]

_MODEL_STATE_FIELDS = ("params", "grads", "master", "optimizer_state", "residual")


class FootprintMismatch(AssertionError):
    """Measured model states differ from the expected ones; ``differences`` maps each
    differing field to (measured, expected) bytes."""

    def __init__(self, message: str, differences: dict[str, tuple[int, int]]) -> None:
        super().__init__(message)
        self.differences = differences


def assert_footprint(
    opt: ShardedOptimizer, *, expected: MemoryBreakdown | None = None, rtol: float = 0.0
) -> MemoryBreakdown:
    """Check this rank's measured model states against ``expected``, field by field.

    Local (no communication). ``transient`` is not compared: it depends on the moment.

    Args:
        opt: the `ShardedOptimizer` under test.
        expected: the bytes to expect; default: zerolite's byte-exact estimate for
            ``opt``'s own layout (so an unexpected tensor anywhere shows up).
        rtol: allowed relative difference per field (0: exact).
    Returns:
        The measured `MemoryBreakdown`.
    Raises:
        FootprintMismatch: naming each field that differs and by how many bytes, e.g.
            ``optimizer_state: measured 224,112 B, expected 220,112 B (+4,000 B)``.
    """
    require_sharded_optimizer(opt, "assert_footprint()")
    expected = estimate_sharded(opt) if expected is None else expected
    measured = footprint(opt)
    differences = {}
    for field in _MODEL_STATE_FIELDS:
        got, want = getattr(measured, field), getattr(expected, field)
        if abs(got - want) > rtol * abs(want):
            differences[field] = (got, want)
    if differences:
        lines = [
            f"{f}: measured {g:,} B, expected {w:,} B ({g - w:+,} B)"
            for f, (g, w) in differences.items()
        ]
        raise FootprintMismatch(
            "memory footprint differs from expected (rtol=%g):\n  " % rtol + "\n  ".join(lines),
            differences,
        )
    return dataclasses.replace(measured)


class PeakMismatch(AssertionError):
    """The measured peak of a step moved away from the expected one; ``measured`` and
    ``expected`` are bytes."""

    def __init__(self, message: str, measured: int, expected: int) -> None:
        super().__init__(message)
        self.measured = measured
        self.expected = expected


def assert_peak(
    opt: ShardedOptimizer, predicted: PeakPrediction | int, tolerance: float = 0.05
) -> int:
    """Check the peak of live tensor bytes measured in ``opt``'s latest ``track()`` block
    against ``predicted``.

    Local (no communication); call it after a ``with zerolite.memory.track(opt):`` block
    around one training step (`zerolite.memory.measure_peak` runs one). Compare with a
    `predict_peak` result, or with bytes you recorded (a regression baseline).

    Args:
        opt: the `ShardedOptimizer` the block tracked.
        predicted: a `PeakPrediction` or a byte count.
        tolerance: allowed relative difference, either way (0.05: within 5 %).
    Returns:
        The measured peak, bytes.
    Raises:
        PeakMismatch: the measured peak is outside ``predicted * (1 +- tolerance)``; the
            message gives both, the difference and the phase of the measured peak.
        ValueError: ``opt`` was never tracked, the block measured no tensors
            (``track(opt, tensors=False)``) or no step, or ``tolerance`` < 0.
    """
    require_sharded_optimizer(opt, "assert_peak()")
    if not isinstance(tolerance, (int, float)) or tolerance < 0:
        raise ValueError(f"assert_peak(): tolerance must be a number >= 0, got {tolerance!r}")
    peaks = latest_peaks(opt)
    if peaks is None:
        raise ValueError(
            "assert_peak(): this optimizer was never tracked; run a training step inside "
            "`with zerolite.memory.track(opt):` first"
        )
    measured, phase = step_peak(peaks)
    if measured == 0:
        raise ValueError(
            "assert_peak(): the latest track() block measured no step's tensors; run "
            "forward, backward and step inside `track(opt)` (tensors=True, the default)"
        )
    expected = int(predicted)
    if abs(measured - expected) > tolerance * expected:
        raise PeakMismatch(
            f"peak of live tensor bytes moved: measured {measured:,} B in {phase}, expected "
            f"{expected:,} B ({measured - expected:+,} B, "
            f"{(measured - expected) / expected:+.1%}; tolerance {tolerance:.1%})",
            measured, expected,
        )
    return measured
