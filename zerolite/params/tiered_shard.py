"""Shards whose bytes live on a slower tier between uses (``ZeroConfig.offload_params``).

At stage 3 with ``offload_params``, each flat buffer's parameter shard (``flat.shard``) and
each bucket's gradient shard (``bucket.shard``) is a `TieredTensor`: the tensor object
stays (its views, the fp32 masters that are views of the parameter shard, and every
reference to it remain valid), but between uses its storage is resized to 0 bytes and its
values live at a fixed byte range of an arena (a preallocated file or a host tensor, the
same arenas the optimizer tier uses, `zerolite.state.arena`).

- `TieredTensor.fetch` brings the values back (waiting for a read-ahead in flight, or
  reading now); `TieredTensor.park` writes them out if they changed (on the writer thread)
  and frees the storage.
- `TieredTensor.read_ahead` starts the read on the reader thread, so that the unit
  scheduler reads the next unit's shard while this unit computes
  (`zerolite.params.unit_scheduler`), and the step reads the next bucket's while this one
  steps.
- `one_at_a_time` hands a list of tiered shards to code that walks them in order (the
  global gradient norm, the fp16 overflow check) holding one at a time.

[Note: tier threads] One reader and one writer thread per tier, so a tensor's reads and
writes are each in order; a tensor is never read while its own write is pending (`fetch`
waits for it first, `read_ahead` skips it), and the main thread touches the tensor (even its
data pointer) only after `fetch` returned: the threads never race on one tensor. A parked
tensor's memory is freed once its write is done; `park` waits while more than
`WRITES_IN_FLIGHT` writes are queued, so a tier slower than compute holds the main thread
back instead of letting parked shards pile up in memory.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import weakref
from collections.abc import Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from zerolite.plan.param_offload import aligned

__all__ = ["Arena", "ShardTier", "TieredTensor", "in_memory", "one_at_a_time"]

WRITES_IN_FLIGHT = 2  # parked shards whose memory may wait for their write at once


class Arena(Protocol):
    """Byte storage that reads into and writes from CPU tensors at byte offsets, from any
    thread (`zerolite.state.arena.DiskArena`, `HostArena`)."""

    def read(self, offset: int, out: torch.Tensor) -> None: ...

    def write(self, offset: int, src: torch.Tensor) -> None: ...


class ShardTier:
    """The arena that parks shards, its byte layout and its two threads.

    Args:
        arena: reserved with ``capacity`` bytes (`zerolite.plan.param_offload.param_tier_bytes`).
        tier: ``"disk"`` or ``"host"`` (for messages and reports).
        capacity: the arena's bytes.
    """

    def __init__(self, arena: Arena, tier: str, capacity: int) -> None:
        self.arena = arena
        self.tier = tier
        self.capacity = capacity
        self.tensors: list[TieredTensor] = []
        # Open `resident` blocks: while > 0, `park` keeps every tensor in memory.
        self.pinned = 0
        # Writes submitted and maybe not done, oldest first: a tensor's memory is freed only
        # once its write is done, so when the tier is slower than compute, `park` waits for
        # the oldest beyond `WRITES_IN_FLIGHT` instead of letting parked shards pile up.
        self._writes: collections.deque[Future] = collections.deque()
        self.nbytes = 0  # bytes laid out so far (each tensor 64-byte aligned)
        self._threads = (ThreadPoolExecutor(1), ThreadPoolExecutor(1))
        weakref.finalize(self, _shutdown, self._threads)

    def add(self, tensor: torch.Tensor, name: str, *, zeros: bool = False) -> TieredTensor:
        """Give ``tensor`` (contiguous, owning all of its storage) a home on the tier and
        park it (``zeros``: its values are zeros, nothing is written).

        Raises:
            ValueError: the arena was reserved for less (`param_tier_bytes` did not count it).
        """
        offset = self.nbytes
        self.nbytes += aligned(tensor.numel() * tensor.element_size())
        if self.nbytes > self.capacity:
            raise ValueError(
                f"{name}: the offload_params arena holds {self.capacity} bytes, its tensors "
                f"need {self.nbytes} or more"
            )
        tiered = TieredTensor(self, tensor, offset, name)
        self.tensors.append(tiered)
        if zeros:
            tiered.dirty, tiered.zeros = False, True
        tiered.park()
        return tiered

    def written(self, write: Future) -> None:
        """A write was submitted: wait for the oldest while more than `WRITES_IN_FLIGHT`
        are queued (its error, if any, surfaces at that tensor's next `settle`)."""
        self._writes.append(write)
        while len(self._writes) > WRITES_IN_FLIGHT:
            oldest = self._writes.popleft()
            futures.wait([oldest])
        while self._writes and self._writes[0].done():
            self._writes.popleft()

    @property
    def reader(self) -> ThreadPoolExecutor:
        return self._threads[0]

    @property
    def writer(self) -> ThreadPoolExecutor:
        return self._threads[1]

    @property
    def resident_bytes(self) -> int:
        """Bytes of tiered tensors resident now."""
        return sum(t.tensor.untyped_storage().nbytes() for t in self.tensors)

    def park_all(self) -> None:
        for t in self.tensors:
            t.park()

    @contextlib.contextmanager
    def resident(self, writes: bool = False) -> Iterator[None]:
        """Every tensor in memory for the block, parked again after the outermost block
        (written back if ``writes``: the block may change them). For what is not on the
        hot path (checkpoints, state dicts, loads): it holds the whole shard at once."""
        if self.pinned == 0:
            for t in self.tensors:
                t.fetch()
        self.pinned += 1
        try:
            yield
        finally:
            self.pinned -= 1
            if writes:
                for t in self.tensors:
                    t.mark_dirty()
            if self.pinned == 0:
                self.park_all()

    def drain(self) -> None:
        """Wait for every read and write in flight."""
        for t in self.tensors:
            t.settle()


class TieredTensor:
    """One tensor's home on a `ShardTier` (see the module docstring).

    Attributes:
        tensor: the tensor itself (same object while resident and while parked).
        name: what it holds, for errors (``"parameter shard of flat buffer 3"``).
    """

    def __init__(self, tier: ShardTier, tensor: torch.Tensor, offset: int, name: str) -> None:
        if tensor.storage_offset() != 0 or not tensor.is_contiguous() or (
            tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
        ):
            raise ValueError(f"{name}: a tiered tensor must own all of its storage")
        self.tier = tier
        self.tensor = tensor
        self.offset = offset
        self.name = name
        self._nbytes = tensor.numel() * tensor.element_size()
        self.resident = True
        self.dirty = True  # nothing on the tier yet
        # The values are all zero (`clear`): a fetch fills zeros instead of reading.
        self.zeros = False
        self._pending: Future | None = None  # a read-ahead or a write in flight

    def settle(self) -> None:
        """Wait for this tensor's read or write in flight (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def fetch(self, read: bool = True) -> torch.Tensor:
        """Make the tensor resident and return it; ``read=False``: its storage only (the
        caller overwrites every element), no read."""
        self.settle()
        if not self.resident:
            self._allocate()
            if read and self.zeros:
                self.tensor.zero_()
            elif read:
                self._read()
            self.resident = True
            self.dirty = not read or self.zeros
            self.zeros = False
        return self.tensor

    def clear(self) -> None:
        """The values become zeros, without touching the tier while parked."""
        self.settle()
        if self.resident:
            self.tensor.zero_()
            self.dirty = True
        else:
            self.zeros = True

    def mark_dirty(self) -> None:
        """The resident values changed: the next `park` writes them."""
        self.dirty = True

    def park(self, dirty: bool = False) -> None:
        """Free the storage; write the values first (writer thread) if they changed since
        they were read (or ``dirty``)."""
        self.settle()
        if not self.resident:
            return
        if self.tier.pinned:
            self.dirty = self.dirty or dirty
            return
        self.resident = False
        if not (dirty or self.dirty) or self._nbytes == 0:
            self._free()
            return
        self.dirty = False
        self._pending = self.tier.writer.submit(self._write_and_free)
        self.tier.written(self._pending)

    def read_ahead(self) -> None:
        """Start reading the parked values on the reader thread (`fetch` then waits)."""
        if self.resident or self._pending is not None or self.zeros:
            return
        self.resident = True  # from now on only `fetch` (after `settle`) touches it
        self.dirty = False
        self._pending = self.tier.reader.submit(self._allocate_and_read)

    def _write_and_free(self) -> None:
        self.tier.arena.write(self.offset, self.tensor.cpu())
        self._free()

    def _allocate_and_read(self) -> None:
        self._allocate()
        self._read()

    def _read(self) -> None:
        if self.tensor.device.type == "cpu":
            self.tier.arena.read(self.offset, self.tensor)
        else:  # an accelerator's shard comes through host memory
            host = torch.empty(self.tensor.shape, dtype=self.tensor.dtype)
            self.tier.arena.read(self.offset, host)
            self.tensor.copy_(host)

    def _allocate(self) -> None:
        self.tensor.untyped_storage().resize_(self._nbytes)

    def _free(self) -> None:
        self.tensor.untyped_storage().resize_(0)
        if self.tensor.device.type == "cpu":
            release_freed_memory(self._nbytes)


@contextlib.contextmanager
def in_memory(tiered: TieredTensor | None, changes: bool = False) -> Iterator[None]:
    """``tiered``'s tensor resident for the block, parked after (written back if
    ``changes``); nothing when ``tiered`` is None (the tensor is always in memory)."""
    if tiered is None:
        yield
        return
    tiered.fetch()
    try:
        yield
    finally:
        tiered.park(dirty=changes)


def one_at_a_time(tiered: Sequence[TieredTensor], *, dirty: bool = False) -> Sequence[torch.Tensor]:
    """The tensors of ``tiered`` as a sequence for code that walks it once, in order
    (``for t in shards``): each is fetched when reached and parked (written back if
    ``dirty``) when the walk moves on, so one is resident at a time. The next one is read
    ahead while the current one is used."""
    return _OneAtATime(list(tiered), dirty)


class _OneAtATime(Sequence[torch.Tensor]):
    def __init__(self, tiered: list[TieredTensor], dirty: bool) -> None:
        self._tiered = tiered
        self._dirty = dirty

    def __len__(self) -> int:
        return len(self._tiered)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        # Indexing is for metadata (``shards[0].device``): the tensor as it is.
        return self._tiered[i].tensor

    def __iter__(self) -> Iterator[torch.Tensor]:
        was_resident = [t.resident and t._pending is None for t in self._tiered]
        for i, t in enumerate(self._tiered):
            if i + 1 < len(self._tiered):
                self._tiered[i + 1].read_ahead()
            # In `finally`: a walk may stop without asking for more (``zip`` with a shorter
            # sequence stops after the last tensor): closing the generator parks it.
            try:
                yield t.fetch()
            finally:
                if not was_resident[i]:
                    t.park(dirty=self._dirty)
                elif self._dirty:
                    t.mark_dirty()


_TRIM_BYTES = 64 << 20  # parked since the last trim, before the next: one call per so much
_freed = 0
_libc_trim = None


def release_freed_memory(nbytes: int) -> None:
    """[Note: freed shards leave the process] A parked shard's storage goes back to the C
    allocator, and glibc keeps what heap memory is freed for reuse (and raises its mmap
    threshold each time a large mapped block is freed, so the next shards come from the
    heap too): the process's RSS would keep the bytes the tier was meant to take off it.
    ``malloc_trim(0)`` hands every free page of every arena back to the system; it is
    called each time another 64 MiB of shards were parked. Elsewhere than glibc, nothing."""
    global _libc_trim, _freed
    _freed += nbytes  # from two threads: a count off by one shard only moves the next trim
    if _freed < _TRIM_BYTES:
        return
    _freed = 0
    if _libc_trim is None:
        _libc_trim = _find_malloc_trim()
    if _libc_trim:
        _libc_trim(0)


def _find_malloc_trim():  # noqa: ANN202 - a ctypes function, or False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return False


def _shutdown(threads: tuple[ThreadPoolExecutor, ...]) -> None:
    for pool in threads:
        pool.shutdown(wait=False)
