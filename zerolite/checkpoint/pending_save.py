"""`PendingSave`: an asynchronous checkpoint save in flight on this rank.

At most one save is in flight per process: `zerolite.checkpoint.save` calls
`finish_in_flight` before anything else, so a new save waits for the previous one, and an
error of the previous one that nobody has seen yet (no ``wait()`` raised it) is raised
there, on every rank (``save`` agrees on it). An error is reported once: by ``wait()``, or
else by the next ``save``.

At normal interpreter exit (``atexit``) a save in flight is completed; its thread is a
daemon only so that a crash of the main thread is not held up by it. SIGKILL or
``os._exit`` end it wherever it is: the atomic protocol of
`zerolite.checkpoint.commit` then leaves the previous checkpoint as ``latest``.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from zerolite.checkpoint.format import CheckpointError
from zerolite.comm.collectives import Group
from zerolite.comm.consensus import agreed

__all__ = ["PendingSave", "finish_in_flight", "finish_in_flight_everywhere", "in_flight"]

logger = logging.getLogger(__name__)


class PendingSave:
    """A checkpoint being written by a background thread of this rank.

    Returned by ``zerolite.checkpoint.save(..., blocking=False)`` on every rank. The state
    it writes is the state at that call. Its methods are local to the rank (no
    communication); any rank may call them, any number of times.

    Attributes:
        path: the checkpoint directory being written.
    """

    def __init__(self, path: Path, work: Callable[[], None], rank: int, world_size: int) -> None:
        self.path = path
        self._where = f"[rank {rank}/{world_size}]"
        self._work: Callable[[], None] | None = work
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(
            target=self._run, name=f"zerolite-save-{path.name}", daemon=True
        )

    def _run(self) -> None:
        try:
            if self._work is not None:
                self._work()
        except BaseException as exc:  # noqa: BLE001 - kept for wait() and the next save
            self._error = exc
        finally:
            self._work = None  # drop the staged state: the staging area lives with its optimizer

    def done(self) -> bool:
        """True once the background write has ended, committed or failed."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the save has ended; on every rank this means rank 0 has committed it
        and ``latest`` names it (or the save failed).

        Returns:
            ``path``.
        Raises:
            zerolite.checkpoint.CheckpointError: the save failed, naming the rank and the
                file; the previous checkpoint and ``latest`` are untouched.
        """
        self._thread.join()
        if self._error is not None:
            self._reported = True
            raise CheckpointError(
                f"{self._where} asynchronous save of {self.path} failed: {self._error}"
            ) from self._error
        return self.path

    def _start(self) -> None:
        self._thread.start()

    def _unreported_error(self) -> CheckpointError | None:
        self._thread.join()
        if self._error is None or self._reported:
            return None
        self._reported = True
        return CheckpointError(
            f"{self._where} the previous asynchronous save, of {self.path}, failed: "
            f"{self._error}"
        )


_lock = threading.Lock()
_in_flight: PendingSave | None = None


def in_flight() -> PendingSave | None:
    """This process's asynchronous save, if one was started and not yet finished through
    `finish_in_flight` (it may have ended already: see ``done()``)."""
    return _in_flight


def start(pending: PendingSave) -> PendingSave:
    """Make ``pending`` the save in flight and start its thread (after `finish_in_flight`)."""
    global _in_flight
    with _lock:
        if _in_flight is not None:
            raise RuntimeError(f"{pending._where} a save is already in flight")
        _in_flight = pending
    pending._start()
    return pending


def finish_in_flight() -> None:
    """Wait for this process's save in flight, if any, and forget it.

    Raises:
        zerolite.checkpoint.CheckpointError: it failed and no ``wait()`` reported it.
    """
    global _in_flight
    with _lock:
        pending, _in_flight = _in_flight, None
    if pending is not None:
        error = pending._unreported_error()
        if error is not None:
            raise error


def finish_in_flight_everywhere(group: Group) -> None:
    """`finish_in_flight` on every rank of ``group`` (all must call): an error raised on
    one rank is raised on all, so none goes on into a collective alone."""
    with agreed("waiting for the asynchronous checkpoint save in flight", group):
        finish_in_flight()


@atexit.register
def _complete_at_exit() -> None:
    pending = _in_flight
    if pending is None:
        return
    pending._thread.join()
    if pending._error is not None and not pending._reported:
        logger.error("%s asynchronous save of %s failed at exit: %s",
                     pending._where, pending.path, pending._error)
