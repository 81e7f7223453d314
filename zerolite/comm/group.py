"""`Group`: the communicator of one sharded model, as every exchange sees it.

A process group with its rank, size and backends looked up once (`zerolite.comm.devices`),
where the model's flat buffers live and where its small exchanges run, how reduce-scatters
and all-gathers travel (native kernels or point-to-point), how long a wait may take, and
the lockstep counters of [Note: lockstep] in `zerolite.comm.collectives`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

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
        """Where small exchanges (flags, counters, norms, bytes) run: the communication
        device of `zerolite.comm.devices` (the buffers' CUDA device on NCCL, else the CPU)."""
        return communication_device(self.buffer_device, self.backends)

    def prefix(self) -> str:
        """``[rank r/N]``, for internal error messages."""
        return f"[rank {self.rank}/{self.size}]"

    def failure(self, what: str, exc: BaseException) -> CollectiveTimeout:
        """The error for exchange ``what`` that did not complete (``exc``: the backend's)."""
        text = str(exc)
        timed_out = "imed out" in text or "timeout" in text.lower()
        bound = (
            f"ZeroConfig.timeout_s={self.timeout.total_seconds():g}s"
            if self.bounded_waits
            else "the process group's timeout"
        )
        reason = (
            f"did not complete within {bound}"
            if timed_out
            else f"failed ({text.splitlines()[0][:200] if text else type(exc).__name__})"
        )
        return CollectiveTimeout(
            f"{self.prefix()} zerolite: {what} at step {self.step} {reason}. Another rank is "
            "not taking part: it may have skipped step() or an iteration, run save(), load(), "
            "full_state_dict() or a stage-3 forward alone, or died. Every rank must run the "
            "same zerolite operations in the same order."
        )
