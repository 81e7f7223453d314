"""`StagingArea`: one rank's checkpoint tensors copied aside, reused between saves.

An asynchronous save must write the state as it was at the call while training goes on
changing the live tensors. So the call copies every tensor of the rank's file (masters,
optimizer state, stage-3 parameter and frozen shards, RNG states; on rank 0 buffers and
unsharded parameters) into one host byte buffer laid out exactly as the file's data
section (`zerolite.checkpoint.file_writer.byte_ranges`), and the background thread writes
that buffer as it is. Offloaded values (`LazyTensor`) are read from their tier straight
into the buffer, one tensor at a time: the buffer is the only copy made.

[Note: staging memory] The buffer is kept for the next save of the same optimizer, so
an asynchronous save costs one extra copy of the rank's file -- about its shard of masters
and optimizer state (12 bytes per parameter with AdamW, divided by the world size) --
held from the first asynchronous save until the optimizer is gone. A save whose layout
differs (optimizer state that appeared after the first step) replaces it. On CUDA the
buffer is pinned host memory of exactly its size (`zerolite.state.pinned`), so the copies run
asynchronously at full bus speed; `stage` returns once the copies from every device they
came from have landed (each device's current stream, where they were queued).
`staging_bytes` is what `zerolite.memory.track` reports.

[Note: first save] A fresh buffer costs more than the copy into it: the kernel maps and
zeroes each page at its first touch, and that made the first asynchronous save of a run
block for about ten times as long as the next ones. `StagingArea.prepare` moves that work
off the save: it allocates the buffer at its final size and touches every page (and pins
it, on CUDA) on a background thread, and the save that comes next finds it ready (or waits
only for what is left of it). `zerolite.checkpoint.prepare_async_save` calls it once the
layout is known (after the first step, when the optimizer state exists). A prepared buffer
is held, and counted by `staging_bytes`, from that call on, as if a save had been made.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import torch

from zerolite.checkpoint.file_writer import ByteRange, LazyTensor, as_bytes, byte_ranges
from zerolite.ground import runtime
from zerolite.state.pinned import host_buffer

__all__ = ["StagingArea", "staging_area", "staging_bytes"]


class StagingArea:
    """A host byte buffer holding one rank's file data, reused while its size stays.

    Attributes:
        buffer: uint8, 1-D, the file's data section (pinned when staged from CUDA).
        ranges: where each tensor lies in ``buffer``.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.ranges: list[ByteRange] = []
        self._pinned = False  # whether ``buffer`` was allocated for device copies
        # A buffer being allocated and touched by `prepare`: its thread, size and result.
        self._preparing: tuple[threading.Thread, int, list[torch.Tensor]] | None = None
        _AREAS.add(self)

    @property
    def nbytes(self) -> int:
        """The bytes held, a buffer being prepared included."""
        if self._preparing is not None:
            return self._preparing[1]
        return 0 if self.buffer is None else self.buffer.numel()

    def prepare(self, nbytes: int, *, pinned: bool) -> None:
        """Allocate a buffer of ``nbytes`` (pinned for device copies if ``pinned``) and
        touch every page of it on a background thread ([Note: first save]); returns at
        once. Nothing is done if the buffer held already fits. A failure there (no memory)
        is not raised: the next `copy_in` allocates as it would have."""
        self._finish_preparing()
        if self._fits(nbytes, pinned):
            return
        self.buffer = None  # free the old buffer before allocating the new one
        self._pinned = pinned
        made: list[torch.Tensor] = []

        def allocate_and_touch() -> None:
            buffer = host_buffer(nbytes, pinned=pinned)
            buffer.fill_(0)  # the first touch of every page, here rather than at the save
            made.append(buffer)

        thread = threading.Thread(target=allocate_and_touch, name="zerolite-staging",
                                  daemon=True)
        self._preparing = (thread, nbytes, made)
        thread.start()

    def _finish_preparing(self) -> None:
        """Wait for `prepare`'s thread, if any, and hold what it made."""
        if self._preparing is None:
            return
        thread, _, made = self._preparing
        thread.join()
        self._preparing = None
        self.buffer = made[0] if made else None

    def _fits(self, nbytes: int, pinned: bool) -> bool:
        return (self.buffer is not None and self.buffer.numel() == nbytes
                and self._pinned == pinned)

    @property
    def data(self) -> memoryview:
        """The staged bytes (the file's data section)."""
        if self.buffer is None:
            raise RuntimeError("StagingArea.data: nothing was staged")
        return as_bytes(self.buffer)

    def copy_in(self, tensors: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """Copy ``tensors`` (any device, any strides) into the buffer; on return the copy
        is complete, so the caller may change the tensors at once."""
        ranges = byte_ranges(tensors)
        devices = {
            t.device for t in tensors.values()
            if isinstance(t, torch.Tensor) and runtime.is_accelerator(t.device)
        }
        on_device = bool(devices)
        size = ranges[-1].end if ranges else 0
        self._finish_preparing()
        if not self._fits(size, on_device):  # a buffer of the same size serves any layout
            self.buffer = None  # free the old buffer before allocating the new one
            self.buffer = host_buffer(size, pinned=on_device)
            self._pinned = on_device
        self.ranges = ranges
        for extent in ranges:
            view = self.buffer[extent.start : extent.end].view(extent.dtype).view(extent.shape)
            source = tensors[extent.key]
            if isinstance(source, LazyTensor):  # offloaded: read from its tier into place
                source.read_into(view.reshape(-1))
            else:
                view.copy_(source.detach(), non_blocking=on_device)
        for device in devices:  # the copies were queued on each device's current stream
            runtime.synchronize_stream(device)


_AREAS: weakref.WeakSet[StagingArea] = weakref.WeakSet()
# One area per optimizer, alive as long as the optimizer is.
_BY_OPTIMIZER: weakref.WeakKeyDictionary[object, StagingArea] = weakref.WeakKeyDictionary()


def staging_area(optimizer: object) -> StagingArea:
    """The staging area of ``optimizer``'s saves (created empty on first use)."""
    area = _BY_OPTIMIZER.get(optimizer)
    if area is None:
        area = _BY_OPTIMIZER[optimizer] = StagingArea()
    return area


def staging_bytes() -> int:
    """Host bytes held by every staging area of this process."""
    return sum(area.nbytes for area in list(_AREAS))
