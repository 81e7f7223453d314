"""`Group`: the communicator of one sharded model, as every exchange sees it.

A process group with its rank, size and backends looked up once (`zerolite.comm.devices`),
where the model's flat buffers live and where its small collectives run, how reduce-scatters
and all-gathers travel (native kernels or point-to-point), how long a wait may take, and
the lockstep counters of [Note: lockstep] in `zerolite.comm.collectives`.

[Note: abort] An exchange that does not complete leaves the group unusable: the ranks are
out of step, and an abandoned gloo collective keeps the group's worker thread busy, so a
process exiting after the error would wait at exit for the group's own timeout (30 minutes
by default) while its destructor joins that thread. So:

- every launch of a zerolite exchange (`Group.launching`) hands gloo the group's bound as
  the operation's own timeout (gloo reads the backend's default timeout when a work is
  created; torch 2.13's gloo has no working ``abort()``): an abandoned collective ends
  within the bound, and the process can exit;
- the first failed wait (`Group.abort`) marks the group aborted -- every later zerolite
  exchange on it, or on any group of the same sharded model, raises at once -- and calls
  the process group's ``abort()`` (NCCL aborts its communicators; gloo's is a no-op);
- the error says so: the process group cannot be used again, by zerolite or the user.

The bound is ``ZeroConfig.timeout_s``, or the process group's own timeout
(``init_process_group(timeout=...)``) where that is shorter: gloo ends a wait there anyway,
and the error names whichever bound applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zerolite.comm.devices import backends_of, communication_device
from zerolite.errors import CollectiveTimeout

__all__ = ["Group"]


class Group:
    """The communicator of one sharded model: a process group with its rank, size and
    backends looked up once, where its tensors live, how exchanges travel, how long they
    may wait, and the sequence numbers of [Note: lockstep].

    Args:
        process_group: the group, or ``None`` for the default group; when
            torch.distributed is not initialised this is a group of one.
        collectives: ``"auto"``, ``"native"`` or ``"point_to_point"`` (`ZeroConfig`).
        timeout_s: the bound on every gloo wait, in seconds ([Note: waits]).
        device: where the model's flat buffers live (`zerolite.comm.devices.buffer_device`);
            ``None``: the CPU.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        collectives: str = "auto",
        timeout_s: float = 600.0,
        device: torch.device | None = None,
    ) -> None:
        self.pg = process_group
        # Device type -> backend (`zerolite.comm.devices`); {} without torch.distributed.
        self.backends = backends_of(process_group)
        if self.backends:
            self.rank = dist.get_rank(process_group)
            self.size = dist.get_world_size(process_group)
            self._global_ranks = [
                r if process_group is None else dist.get_global_rank(process_group, r)
                for r in range(self.size)
            ]
        else:
            self.rank, self.size, self._global_ranks = 0, 1, [0]
        # Where the flat buffers live, and the backend that carries them ("none": no group).
        self.buffer_device = torch.device("cpu") if device is None else device
        self.backend = self.backends.get(self.buffer_device.type, "none")
        # True where reduce-scatter and all-gather are built from isend/irecv.
        self.point_to_point = collectives == "point_to_point" or (
            collectives == "auto" and self.backend == "gloo"
        )
        self.timeout = timedelta(seconds=timeout_s)
        # False on NCCL: waits leave the bound to the process group ([Note: waits]).
        self.bounded_waits = self.backend != "nccl"
        # gloo: the backend whose default timeout bounds each launch ([Note: abort]), and
        # the bound itself: timeout_s, or the process group's own timeout when shorter.
        self._gloo = _gloo_backend(process_group) if self.backend == "gloo" else None
        pg_timeout = None if self._gloo is None else self._gloo.options._timeout
        self.pg_bound = pg_timeout is not None and pg_timeout < self.timeout
        self.wait_bound = pg_timeout if self.pg_bound else self.timeout
        # Why this group was aborted (the first exchange that failed); None while usable.
        self._aborted: str | None = None
        # Lockstep counters, equal on every rank that runs the same loop, compared at each
        # step (`zerolite.grads.reducer`): exchanges issued so far on this group, optimizer
        # steps completed (named in errors), and forwards started with gradients enabled
        # (a rank that raised in a forward and skipped the iteration issues the same
        # exchanges as its peers, one batch late: only this count tells).
        self.sequence = 0
        self.step = 0
        self.forwards = 0

    # Hybrid sharding (`zerolite.comm.hybrid`): this shard group's replica group; None when flat.
    replicas: Group | None = None

    @property
    def world(self) -> Group:
        """Every data-parallel rank: the group itself unless hybrid (`zerolite.comm.hybrid`)."""
        return self

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence

    def global_rank(self, rank: int) -> int:
        return self._global_ranks[rank]

    @property
    def device(self) -> torch.device:
        """Where small collectives (flags, counters, norms, bytes) run: the communication
        device of `zerolite.comm.devices` (the buffers' CUDA device on NCCL, else the CPU)."""
        return communication_device(self.buffer_device, self.backends)

    def prefix(self) -> str:
        """``[rank r/N]``, for internal error messages."""
        return f"[rank {self.rank}/{self.size}]"

    @contextlib.contextmanager
    def launching(self, label: str, what: str) -> Iterator[None]:
        """Around the launch of one zerolite exchange on this group: refused at once once the
        group was aborted; profiled as ``label``; on gloo, each operation launched inside is
        bounded by `wait_bound` in gloo's own worker too ([Note: abort]).

        Raises:
            zerolite.CollectiveTimeout: an earlier exchange of this sharded model failed.
        """
        if (reason := self.world._aborted) is not None:
            raise CollectiveTimeout(
                f"{self.prefix()} zerolite: {what} at step {self.step} refused: the process "
                f"group was aborted after {reason}. {_AFTER_ABORT}"
            )
        with record_function(label):
            if self._gloo is None:
                yield
                return
            user_timeout = self._gloo.options._timeout
            self._gloo._set_default_timeout(self.wait_bound)
            try:
                yield
            finally:
                self._gloo._set_default_timeout(user_timeout)

    def abort(self, what: str, exc: BaseException) -> CollectiveTimeout:
        """Exchange ``what`` did not complete (``exc``: the backend's error): mark the sharded
        model's groups aborted, abort the process group, and return the error to raise
        ([Note: abort])."""
        error = self.failure(what, exc)
        if self.world._aborted is None:
            self.world._aborted = f"{what} at step {self.step} did not complete"
            for pg in {id(g): g for g in (self.pg, self.world.pg)}.values():
                _abort_process_group(pg)
        return error

    def failure(self, what: str, exc: BaseException) -> CollectiveTimeout:
        """The error for exchange ``what`` that did not complete (``exc``: the backend's)."""
        text = str(exc)
        timed_out = "imed out" in text or "timeout" in text.lower()
        if not self.bounded_waits:
            bound = "the process group's timeout"
        elif self.pg_bound:
            bound = (
                f"the process group's timeout of {self.wait_bound.total_seconds():g}s "
                f"(init_process_group(timeout=...), shorter than ZeroConfig.timeout_s="
                f"{self.timeout.total_seconds():g}s)"
            )
        else:
            bound = f"ZeroConfig.timeout_s={self.timeout.total_seconds():g}s"
        reason = (
            f"did not complete within {bound}"
            if timed_out
            else f"failed ({text.splitlines()[0][:200] if text else type(exc).__name__})"
        )
        return CollectiveTimeout(
            f"{self.prefix()} zerolite: {what} at step {self.step} {reason}. Another rank is "
            "not taking part: it may have skipped step() or an iteration, run save(), load(), "
            "full_state_dict() or a stage-3 forward alone, or died. Every rank must run the "
            f"same zerolite operations in the same order. {_AFTER_ABORT}"
        )


_AFTER_ABORT = (
    "zerolite has aborted the process group: it cannot carry collectives any more (zerolite's "
    "or yours). End every process (an uncaught error does; pending operations end within the "
    "bound) and restart from the last checkpoint."
)


def _gloo_backend(process_group: dist.ProcessGroup | None) -> object | None:
    """The gloo backend carrying ``process_group``'s CPU tensors (None: not found)."""
    try:
        pg = process_group or dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        return None
    usable = hasattr(backend, "_set_default_timeout") and hasattr(backend, "options")
    return backend if usable else None


def _abort_process_group(process_group: dist.ProcessGroup | None) -> None:
    """``ProcessGroup.abort()``: NCCL aborts its communicators (kernels waiting on a peer
    return); gloo's does nothing in torch 2.13 ([Note: abort]). Best effort: the error
    being raised matters more than a backend that cannot abort."""
    try:
        pg = process_group or dist.distributed_c10d._get_default_group()
        pg.abort()
    except (RuntimeError, ValueError, AttributeError):
        pass
