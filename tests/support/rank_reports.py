"""Multi-rank oracle checks that ranks measure and the parent asserts.

A rank function builds a report (`new_report`), records parity failures in it instead of
raising (`record_parity`), and returns it; `guarded` turns a Python error into a report
entry. The pytest process then asserts on every rank's report (`check_reports`) and on
the numbers. Ranks never raise on a failed check, so a failing check cannot leave the
ranks out of step and hang the launch.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from torch import nn

from tests.support import parity

__all__ = ["SMALL_BUCKETS_MB", "TIMEOUT", "WORLD_SIZES", "check_reports", "guarded",
           "new_report", "record_parity"]

# One launch per world size; run_ranks' timeout for one launch.
WORLD_SIZES = [2, 4]
TIMEOUT = 90.0
# ZeroConfig.bucket_size_mb that cuts parity.TINY into >= 4 flat buffers (14 at the time of
# writing), so that per-bucket behaviour (launch order, overlap, padding) is exercised.
SMALL_BUCKETS_MB = 0.01


def new_report() -> dict:
    """An empty report: ``failures`` (messages) and ``worst`` (label -> worst rel error)."""
    return {"failures": [], "worst": {}}


def record_parity(label: str, model: nn.Module, losses: list[float], ref: nn.Module,
                  ref_losses: list[float], ddp: parity.DdpDeviation, report: dict) -> None:
    """`parity.check_parity`, recorded in ``report`` instead of raised (the parent asserts)."""
    try:
        report["worst"][label] = parity.check_parity(
            label, model, losses, ref, ref_losses, ddp)
    except AssertionError as exc:
        report["failures"].append(str(exc))


def guarded(fn: Callable[..., dict], *args: Any) -> dict:
    """Run one case; a Python error that every rank hits symmetrically is reported, not raised."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported to the parent with its traceback
        return {"error": traceback.format_exc()}


def check_reports(reports: list[dict]) -> None:
    """Assert that no rank hit an error or recorded a failure."""
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        assert not rep["failures"], f"rank {r}: " + "\n".join(rep["failures"])
