"""`assert_footprint`: memory-footprint regression checks for users' tests."""

from __future__ import annotations

import dataclasses

from zerolite.memory.estimate import estimate_sharded
from zerolite.memory.footprint import MemoryBreakdown, footprint
from zerolite.optim.sharded_optimizer import ShardedOptimizer, require_sharded_optimizer

__all__ = ["assert_footprint", "FootprintMismatch"]

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
