"""The offload tier: this rank's share of the optimizer state outside compute memory.

`zerolite.plan.offload` decides which pieces are offloaded and where each field lies (an
`OffloadPlan` of `Slot`s); the `OffloadTier` holds them in an *arena*:

- ``"disk"``: one preallocated file per rank and model under ``offload_dir``, read and
  written with ``pread``/``pwrite`` (the page cache is the kernel's, not the process's),
  unlinked once reserved so that no exit, however abrupt, leaves it behind;
- ``"host"``: one host tensor (never pinned: only the host touches it).

For a CUDA model the streamed step's three staging buffers are pinned, at exactly their
size (`zerolite.state.pinned`), so its device copies are asynchronous. The step that
streams the arena through the user's optimizer is `zerolite.optim.streamed_step`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from zerolite.config import ZeroConfig
from zerolite.ground import runtime
from zerolite.params.tiered_shard import in_memory
from zerolite.plan.offload import MASTER, OffloadPlan, chunk_bytes_for
from zerolite.state.arena import DiskArena, HostArena
from zerolite.state.master import MasterShard
from zerolite.state.pinned import host_buffer, pinning_available

__all__ = ["OffloadTier", "build_tier", "check_disk_room", "check_offload"]


def check_offload(plan: OffloadPlan, config: ZeroConfig, device: torch.device) -> None:
    """Raise ValueError if the tier cannot hold ``plan`` (run by `shard()` before it
    changes anything): an ``offload_dir`` that neither exists nor can be created (its
    parent missing or unwritable), one that is not writable, too little free space for the
    exact byte count, or ``"host"`` for a CUDA model on a system that cannot pin memory
    (its staging buffers need it). A missing ``offload_dir`` whose parent is a writable
    directory is created here (and removed again if a later check fails)."""
    if plan.tier == "disk":
        check_disk_room(config.offload_dir, plan.nbytes, "this rank's optimizer state")
    elif runtime.is_accelerator(device) and not pinning_available():
        raise ValueError(
            "ZeroConfig.offload: 'host' needs pinned host memory for a CUDA model (the "
            "streamed step's staging buffers), and this system cannot pin memory; use "
            "offload='disk' or offload=None"
        )


def check_disk_room(where: str | None, nbytes: int, what: str) -> None:
    """Raise ValueError unless ``where`` is (or, its parent being a writable directory, is
    now made) a writable directory with ``nbytes`` free for ``what`` (the message's words);
    a directory made here is removed again when the check fails."""
    created = _make_offload_dir(where)
    try:
        _check_disk(where, nbytes, what)
    except ValueError:
        if created:  # only if still empty: another rank may be using it
            with contextlib.suppress(OSError):
                os.rmdir(where)
        raise


def _make_offload_dir(where: str | None) -> bool:
    """Create ``where`` if it is missing and its parent is an existing directory, as
    DeepSpeed creates its swap folder (one level only: a mistyped path far from any
    existing directory is refused, not built). Whether this call created it; several
    ranks may race to, and the losers find it made."""
    if where is None or os.path.lexists(where):
        return False
    parent = os.path.dirname(os.path.abspath(where))
    if not os.path.isdir(parent):
        raise ValueError(
            f"ZeroConfig.offload_dir: {where!r} is not an existing directory, and its parent "
            f"{parent!r} is not one either, so it is not created; create it or pass another "
            "offload_dir"
        )
    try:
        os.mkdir(where)
    except FileExistsError:
        return False  # another rank made it first
    except OSError as exc:
        raise ValueError(
            f"ZeroConfig.offload_dir: {where!r} does not exist and cannot be created in "
            f"{parent!r} ({exc}); create it or pass a directory you can write to"
        ) from None
    return True


def _check_disk(where: str | None, nbytes: int, what: str) -> None:
    """The disk tier's directory exists, is writable and has ``nbytes`` free."""
    if where is None or not os.path.isdir(where):
        raise ValueError(
            f"ZeroConfig.offload_dir: {where!r} is not an existing directory; create it "
            "or pass another offload_dir"
        )
    try:  # a real file: permission bits, read-only mounts and root all answer truly
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise ValueError(
            f"ZeroConfig.offload_dir: {where!r} is not writable by this process ({exc}); "
            "pass a directory you can write to"
        ) from None
    free = shutil.disk_usage(where).free
    if free < nbytes:
        raise ValueError(
            f"ZeroConfig.offload_dir: {where!r} has {free} bytes free; offloading {what} "
            f"needs {nbytes} bytes. Free space, pick another directory or offload less"
        )


def _shutdown(threads: tuple[ThreadPoolExecutor, ...]) -> None:
    for pool in threads:
        pool.shutdown(wait=False)


class OffloadTier:
    """This rank's offloaded pieces: their arena, and which ones have state yet.

    Built by `shard()`; found as ``state_of(model).offload``. Reads and writes take CPU
    tensors and may run on any thread; one piece is never read and written at once.

    Args:
        plan: from `assign_slots` (already checked by `check_offload`).
        config: the model's config (``offload_dir``).
        device: the model's device (its staging buffers are pinned for CUDA).
        rank: this rank (in the file name).
        arena: the arena `reserve_arena` reserved (``shard()`` does, before the ranks
            agree); None: reserve it here.
    """

    def __init__(
        self,
        plan: OffloadPlan,
        config: ZeroConfig,
        device: torch.device,
        rank: int,
        arena: DiskArena | HostArena | None = None,
    ) -> None:
        self.plan = plan
        self.device = device
        self.arena = arena if arena is not None else reserve_arena(plan, config, rank)
        # Bytes the streamed step moves at once (tests lower it to split pieces).
        self.chunk_bytes = chunk_bytes_for(plan.nbytes)
        # Per slot: whether the optimizer has made its state yet (torch creates state
        # lazily, and e.g. SGD's first momentum is the gradient, not a zero-started one).
        self.initialized = [False] * len(plan.slots)
        # The streamed step's three staging buffers (reading, stepping, writing) and its
        # reader and writer threads; made at the first step, kept while the tier lives.
        self.staging: list[torch.Tensor] = []
        self._threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._slot_of = {(s.buffer, s.position): i for i, s in enumerate(plan.slots)}

    @property
    def path(self) -> str | None:
        """The name the arena's file was created under (``"disk"``; already unlinked: the
        open descriptor holds its space), else None."""
        return self.arena.path

    def threads(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The (reader, writer) threads; also allocates the staging buffers."""
        if self._threads is None:
            self.staging = [self.staging_buffer(self.chunk_bytes) for _ in range(3)]
            self._threads = (ThreadPoolExecutor(1), ThreadPoolExecutor(1))
            weakref.finalize(self, _shutdown, self._threads)
        return self._threads

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of exactly ``nbytes``: pinned for a CUDA model
        (`zerolite.state.pinned`)."""
        return host_buffer(nbytes, pinned=runtime.is_accelerator(self.device))

    @property
    def arena_bytes(self) -> int:
        """Bytes the arena holds, as allocated (the host tensor, or the file's reservation)."""
        return self.arena.nbytes

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the streamed step's staging buffers, as allocated (0 before the
        first step; pinned for a CUDA model)."""
        return sum(t.untyped_storage().nbytes() for t in self.staging)

    def field_dtype(self, slot: int, field: str) -> torch.dtype:
        return self._field(slot, field)[0]

    def field_shape(self, slot: int, field: str) -> tuple[int, ...]:
        """The field's shape: 1-D of the piece's elements, or, for a whole owned tensor,
        the shape the optimizer keeps it in (`zerolite.plan.offload.Slot.shapes`)."""
        return self.plan.slots[slot].shape(field)

    def read_into(self, slot: int, field: str, lo: int, out: torch.Tensor) -> None:
        """Read elements [lo, lo + out.numel()) of one field into ``out`` (contiguous,
        CPU, any shape)."""
        dtype, offset = self._field(slot, field)
        self.arena.read(offset + lo * dtype.itemsize, out.view(-1))

    def slot_of(self, buffer: int, position: int) -> int | None:
        """The slot of piece ``position`` of flat buffer ``buffer``; None if resident."""
        return self._slot_of.get((buffer, position))

    def read(self, slot: int, field: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of one field of slot ``slot``: a new CPU tensor."""
        dtype, offset = self._field(slot, field)
        out = torch.empty(hi - lo, dtype=dtype)
        self.arena.read(offset + lo * dtype.itemsize, out)
        return out

    def write(self, slot: int, field: str, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` (1-D, the field's dtype) at element ``lo`` of a field."""
        dtype, offset = self._field(slot, field)
        values = values.detach().to("cpu", dtype).reshape(-1)
        self.arena.write(offset + lo * dtype.itemsize, values)

    def state_keys(self, slot: int) -> list[str]:
        """The per-element state keys slot ``slot`` holds."""
        return [name for name, _, _ in self.plan.slots[slot].fields if name != MASTER]

    def has_master(self, slot: int) -> bool:
        return any(name == MASTER for name, _, _ in self.plan.slots[slot].fields)

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        """A whole piece's per-element state, each field in its shape (empty before its
        first step)."""
        if not self.initialized[slot]:
            return {}
        out = {}
        for key in self.state_keys(slot):
            shape = self.field_shape(slot, key)
            out[key] = self.read(slot, key, 0, math.prod(shape)).view(shape)
        return out

    def write_state(self, slot: int, state: dict[str, Any]) -> dict[str, Any]:
        """Store the per-element entries of ``state`` (a whole piece's); returns the rest
        (the scalars, which stay in ``optimizer.state``). Empty ``state``: no state yet."""
        keys = self.state_keys(slot)
        per_element = {k: v for k, v in state.items() if k in keys}
        if per_element and set(per_element) != set(keys):
            raise ValueError(
                f"offloaded optimizer state has keys {sorted(per_element)}, the optimizer "
                f"keeps {sorted(keys)} per element"
            )
        for key, value in per_element.items():
            shape = self.field_shape(slot, key)
            if value.numel() != math.prod(shape):
                raise ValueError(
                    f"offloaded optimizer state {key!r} has shape {tuple(value.shape)}, the "
                    f"offload plan holds {shape}"
                )
            self.write(slot, key, 0, value.reshape(-1))
        self.initialized[slot] = bool(per_element) or (not keys and bool(state))
        return {k: v for k, v in state.items() if k not in keys}

    def close(self) -> None:
        """Release the arena now (files removed); also happens at garbage collection."""
        self.arena.close()
        if self._threads is not None:
            _shutdown(self._threads)
        self.staging = []

    def _field(self, slot: int, field: str) -> tuple[torch.dtype, int]:
        for name, dtype, offset in self.plan.slots[slot].fields:
            if name == field:
                return dtype, offset
        raise KeyError(f"offload slot {slot} has no field {field!r}")


def reserve_arena(plan: OffloadPlan, config: ZeroConfig, rank: int) -> DiskArena | HostArena:
    """The bytes ``plan`` needs, reserved in full (disk: ``posix_fallocate`` of a file
    unlinked at once). `shard()` reserves inside the ranks' agreement, before anything
    changes: a rank without room (a full or shared filesystem, ``ulimit -f``) raises there,
    on every rank, and the peers' reservations are released with their arenas.

    Raises:
        ValueError: the space cannot be reserved, naming the directory and the byte count.
    """
    if plan.tier == "disk":
        return DiskArena(str(config.offload_dir), plan.nbytes, rank)
    return HostArena(plan.nbytes)


@torch.no_grad()
def build_tier(
    plan: OffloadPlan,
    masters: list[MasterShard],
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    rank: int,
    arena: DiskArena | HostArena | None = None,
) -> OffloadTier:
    """The tier for ``plan`` (in ``arena``, if reserved already), holding the offloaded
    pieces' masters (16-bit: their values from the parameter shard) and any state the
    optimizer already had."""
    device = masters[0].flat.data.device if masters else torch.device("cpu")
    tier = OffloadTier(plan, config, device, rank, arena)
    for b, master in enumerate(masters):
        # A parked shard (offload_params) comes in one buffer at a time.
        with in_memory(master.flat.tiered):
            for index, slot in enumerate(plan.slots):
                if slot.buffer == b:
                    _fill_slot(tier, index, master, optimizer)
    return tier


def _fill_slot(
    tier: OffloadTier, index: int, master: MasterShard, optimizer: torch.optim.Optimizer
) -> None:
    """Slot ``index``'s master (16-bit: the parameter shard's values) and the optimizer's
    state for its piece, moved to the tier."""
    slot = tier.plan.slots[index]
    span = master.flat.spans[slot.position]
    view = master.views[slot.position]
    if tier.has_master(index):
        values = master.flat.shard[span.shard_start : span.shard_start + span.numel]
        tier.write(index, MASTER, 0, values.float())
    scalars = tier.write_state(index, optimizer.state.pop(view, {}))
    if scalars:
        optimizer.state[view] = scalars
