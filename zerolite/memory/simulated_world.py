"""A simulated world: one rank of ``N`` in this process, every other rank imagined.

`zerolite.memory.predict_peak` runs the real `zerolite.shard` and a real training step on
one rank, with sharding exactly as rank ``r`` of ``N`` would see it, without the other
``N - 1`` processes. `simulated_world` makes that possible: it initialises the default
process group with `SimulatedProcessGroup`, a backend that completes every collective at
once and whose answer is what ``N`` ranks holding *this rank's* values would agree on:

- all-reduce: a sum is ``N`` times this rank's values, a max, min or average its values;
- all-gather: every rank's slot holds this rank's values;
- broadcast, gather, send, receive, reduce-scatter, all-to-all: buffers are left as they
  are (under the simulation they hold fake tensors, which have no values anyway).

Small collectives (the step's agreement, plan digests, counters) therefore carry real,
self-consistent values -- every agreement holds, no rank is out of step -- while data
tensors travel nowhere. The group also counts the bytes this rank would send, per
collective as a ring or point-to-point exchange sends them (`SimulatedProcessGroup.sent`),
which is what `zerolite.memory.plan` ranks configurations by.

Nothing here touches the network or a store shared with another process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from zerolite.ground import runtime

__all__ = ["BACKEND", "SimulatedProcessGroup", "SimulatedWorld", "simulated_world"]

BACKEND = "zerolite_simulated"  # the name the backend is registered under


class _Done(dist.Work):
    """A collective that completed when it was issued."""

    def __init__(self, result: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self._result = result or []

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - nothing to wait for
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._result)
        return future


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SimulatedProcessGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size`` ranks that all hold what this rank holds (module docstring).

    Attributes:
        sent: bytes this rank would have sent since it was made: point-to-point sends in
            full; a ring all-gather ``(N - 1)`` times its input; a reduce-scatter ``(N - 1)
            / N`` of its input; an all-reduce twice that; a broadcast its tensor from the
            source rank.
    """

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self.sent = 0

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _ring(self, nbytes: int) -> int:  # (N - 1) / N of a buffer, as a ring sends it
        return nbytes * (self._size - 1) // self._size

    # -- collectives: torch calls these with lists of tensors ------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        self.sent += 2 * self._ring(_nbytes(tensors))
        if opts.reduceOp == dist.ReduceOp.SUM:
            for t in tensors:
                t.mul_(self._size)
        return _Done(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        self.sent += (self._size - 1) * _nbytes(inputs)
        for slots, mine in zip(outputs, inputs):
            for slot in slots:
                slot.copy_(mine)
        return _Done(inputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:  # noqa: A002
        self.sent += (self._size - 1) * _nbytes([input])
        return _Done([output])

    all_gather_single = _allgather_base

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any  # noqa: A002
    ) -> dist.Work:
        self.sent += self._ring(_nbytes([input]))
        return _Done([output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> dist.Work:
        self.sent += self._ring(sum(_nbytes(parts) for parts in inputs))
        return _Done(outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        if opts.rootRank == self._rank:
            self.sent += _nbytes(tensors)
        return _Done(tensors)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        if opts.rootRank != self._rank:
            self.sent += _nbytes(inputs)
        return _Done(inputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:  # noqa: ARG002
        self.sent += _nbytes(tensors)
        return _Done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:  # noqa: ARG002
        return _Done(tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> dist.Work:  # noqa: A002
        self.sent += self._ring(_nbytes([input]))
        return _Done([output])

    def barrier(self, opts: Any = None) -> dist.Work:  # noqa: ARG002
        return _Done()


class SimulatedWorld:
    """The groups of one `simulated_world` block: the default group and its subgroups."""

    def __init__(self) -> None:
        self.groups: list[SimulatedProcessGroup] = []

    @property
    def sent(self) -> int:
        """Bytes this rank would have sent so far, over every group it belongs to."""
        return sum(group.sent for group in self.groups)


_current: SimulatedWorld | None = None  # the open block's world (one at a time: one default group)


def _create(store: Any, rank: int, size: int, timeout: Any) -> SimulatedProcessGroup:  # noqa: ARG001
    group = SimulatedProcessGroup(rank, size)
    if _current is not None:
        _current.groups.append(group)
    return group


def _register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", runtime.GPU_TYPE])


@contextlib.contextmanager
def simulated_world(rank: int, world_size: int) -> Iterator[SimulatedWorld]:
    """The default process group is rank ``rank`` of a `SimulatedProcessGroup` of
    ``world_size`` ranks inside the block, and is destroyed after it.

    Subgroups made inside (hybrid sharding's shard and replica groups) are simulated too.

    Raises:
        RuntimeError: this process already belongs to a process group (a simulated world
            would replace its default group); run the simulation in another process.
        ValueError: ``rank`` is not in ``range(world_size)``.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a simulated world needs a process without a process group, and "
            "torch.distributed is initialised here; simulate in another process"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in range({world_size}), got {rank!r}")
    global _current
    _register()
    world = _current = SimulatedWorld()
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
        try:
            yield world
        finally:
            dist.destroy_process_group()
    finally:
        _current = None
