"""The offload tier: this rank's share of the optimizer state outside compute memory.

With ``ZeroConfig(offload="disk" | "host")`` the first pieces of this rank's shard (in
layout order, until ``offload_fraction`` of its elements is covered) keep their
per-element optimizer state (Adam's moments, SGD's momentum: whatever the optimizer
keeps per element) and, for 16-bit parameters, their fp32 master in an *arena*:

- ``"disk"``: one preallocated file per rank and model under ``offload_dir``, read and
  written with ``pread``/``pwrite`` (the page cache is the kernel's, not the process's),
  unlinked once reserved so that no exit, however abrupt, leaves it behind;
- ``"host"``: one host tensor (never pinned: only the host touches it).

For a CUDA model the streamed step's three staging buffers are pinned, at exactly their
size (`zerolite.state.pinned`), so its device copies are asynchronous.

What stays resident: scalar state (a piece's ``step``) in ``optimizer.state``, fp32
masters that are the parameters themselves, and, in 16-bit, a meta placeholder for each
offloaded master (the object the param group holds). `offload_layout` decides all this
from sizes alone, so `shard()` can check the directory and its free space (against the
exact byte count) before anything changes. The step that streams the arena through the
user's optimizer is `zerolite.optim.streamed_step`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from zerolite.config import ZeroConfig
from zerolite.plan.layout import FlatLayout
from zerolite.state.arena import DiskArena, HostArena
from zerolite.state.pinned import host_buffer, pinning_available

if TYPE_CHECKING:
    from zerolite.comm.collectives import Group
    from zerolite.plan.shard_plan import ShardPlan
    from zerolite.state.master import MasterShard

__all__ = [
    "OffloadLayout",
    "OffloadTier",
    "Slot",
    "build_tier",
    "check_offload",
    "chunk_bytes_for",
    "offload_layout",
    "plan_offload",
    "state_fields",
]

# What the streamed step moves per chunk, bounded (reader, stepper and writer: 3 alive):
# at most 64 MiB, and at most 1/64 of the tier (but not under 1 MiB, where per-chunk
# overhead would dominate), so the chunks in flight stay a small part of what was offloaded.
CHUNK_BYTES = 64 * 2**20
CHUNK_MIN_BYTES = 2**20
CHUNK_FRACTION = 64
MASTER = "master"  # the field of an offloaded fp32 master (16-bit parameters)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one offloaded piece lives in the arena.

    Attributes:
        buffer: index of the piece's flat buffer (and `MasterShard`).
        position: index of the piece in ``flat.pieces`` (offloaded pieces come first).
        numel: elements of the piece.
        fields: ``(name, dtype, byte offset)`` per field: ``"master"`` (fp32) when the
            master is offloaded, then each per-element state key of the piece's group.
    """

    buffer: int
    position: int
    numel: int
    fields: tuple[tuple[str, torch.dtype, int], ...]

    @property
    def bytes_per_element(self) -> int:
        return sum(dtype.itemsize for _, dtype, _ in self.fields)


@dataclasses.dataclass(frozen=True)
class OffloadLayout:
    """What `shard()` offloads on this rank, decided before anything is built.

    Attributes:
        tier: ``"disk"`` or ``"host"``.
        slots: one per offloaded piece, in layout order.
        per_buffer: per flat buffer, how many of its leading pieces are offloaded.
        nbytes: the arena's exact size.
        master_bytes: of ``nbytes``, fp32 masters (0 with fp32 parameters).
    """

    tier: str
    slots: tuple[Slot, ...]
    per_buffer: tuple[int, ...]
    nbytes: int
    master_bytes: int

    @property
    def state_bytes(self) -> int:
        """Of ``nbytes``, per-element optimizer state."""
        return self.nbytes - self.master_bytes


def chunk_bytes_for(nbytes: int) -> int:
    """The streamed step's chunk size for a tier of ``nbytes`` (see `CHUNK_BYTES`)."""
    return min(CHUNK_BYTES, max(CHUNK_MIN_BYTES, nbytes // CHUNK_FRACTION))


def state_fields(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device: torch.device
) -> tuple[tuple[str, torch.dtype], ...]:
    """The per-element state keys (and dtypes) one step of ``optimizer``'s class creates
    for a parameter of ``group``: found by stepping a throwaway 2-element copy."""
    cls = type(optimizer)
    hyper = {k: v for k, v in group.items() if k != "params"}
    accepted = inspect.signature(cls.__init__).parameters
    probe = torch.zeros(2, dtype=torch.float32, device=device)
    try:
        twin = cls([probe], **{k: v for k, v in hyper.items() if k in accepted})
        twin.param_groups[0].update(hyper)
        probe.grad = torch.ones_like(probe)
        twin.step()
    except Exception as exc:
        raise ValueError(
            f"ZeroConfig.offload: cannot tell which state {cls.__qualname__} keeps per element "
            f"(a probe step on a 2-element tensor failed: {exc}); use offload=None"
        ) from None
    return tuple(
        (key, value.dtype)
        for key, value in twin.state[probe].items()
        if isinstance(value, torch.Tensor) and value.shape == probe.shape
    )


def offload_layout(
    numels: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    fields: Sequence[tuple[tuple[str, torch.dtype], ...]],
    *,
    config: ZeroConfig,
    rank: int,
    world_size: int,
) -> OffloadLayout:
    """Pick the offloaded pieces and lay out the arena (sizes only, no tensors).

    Args:
        numels: per flat buffer, each trained parameter's element count (buffer order).
        groups: per flat buffer, each parameter's param group index.
        fields: per param group, its per-element state (`state_fields`).
        config: with ``offload`` set; ``offload_fraction`` picks how much.
        rank, world_size: this rank, the number of shards.
    """
    assert config.offload is not None
    layouts = [FlatLayout(tuple(n), world_size) for n in numels]
    pieces = [(b, j, pc) for b, lay in enumerate(layouts) for j, pc in enumerate(lay.pieces(rank))]
    total = sum(pc.numel for _, _, pc in pieces)
    target = total if config.offload_fraction >= 1 else math.ceil(config.offload_fraction * total)
    master = config.param_dtype != torch.float32
    slots, per_buffer, offset, taken, master_bytes = [], [0] * len(layouts), 0, 0, 0
    for b, j, pc in pieces:
        if taken >= target:
            break
        named = ([(MASTER, torch.float32)] if master else []) + list(fields[groups[b][pc.index]])
        placed = []
        for name, dtype in named:
            placed.append((name, dtype, offset))
            offset += pc.numel * dtype.itemsize
        master_bytes += pc.numel * 4 if master else 0
        slots.append(Slot(b, j, pc.numel, tuple(placed)))
        per_buffer[b] = j + 1
        taken += pc.numel
    return OffloadLayout(config.offload, tuple(slots), tuple(per_buffer), offset, master_bytes)


def check_offload(layout: OffloadLayout, config: ZeroConfig, device: torch.device) -> None:
    """Raise ValueError if the tier cannot hold ``layout`` (run by `shard()` before it
    changes anything): a missing or unwritable directory, too little free space for the
    exact byte count, or ``"host"`` for a CUDA model on a system that cannot pin memory
    (its staging buffers need it)."""
    if layout.tier == "disk":
        where = config.offload_dir
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
        if free < layout.nbytes:
            raise ValueError(
                f"ZeroConfig.offload_dir: {where!r} has {free} bytes free; offloading this "
                f"rank's optimizer state needs {layout.nbytes} bytes. Free space, pick another "
                "directory or lower offload_fraction"
            )
    elif device.type == "cuda" and not pinning_available():
        raise ValueError(
            "ZeroConfig.offload: 'host' needs pinned host memory for a CUDA model (the "
            "streamed step's staging buffers), and this system cannot pin memory; use "
            "offload='disk' or offload=None"
        )


def _shutdown(threads: tuple[ThreadPoolExecutor, ...]) -> None:
    for pool in threads:
        pool.shutdown(wait=False)


class OffloadTier:
    """This rank's offloaded pieces: their arena, and which ones have state yet.

    Built by `shard()`; found as ``state_of(model).offload``. Reads and writes take CPU
    tensors and may run on any thread; one piece is never read and written at once.

    Args:
        layout: from `offload_layout` (already checked by `check_offload`).
        config: the model's config (``offload_dir``).
        device: the model's device (its staging buffers are pinned for CUDA).
        rank: this rank (in the file name).
    """

    def __init__(
        self, layout: OffloadLayout, config: ZeroConfig, device: torch.device, rank: int
    ) -> None:
        self.layout = layout
        self.device = device
        self.arena: DiskArena | HostArena = (
            DiskArena(str(config.offload_dir), layout.nbytes, rank)
            if layout.tier == "disk"
            else HostArena(layout.nbytes)
        )
        # Bytes the streamed step moves at once (tests lower it to split pieces).
        self.chunk_bytes = chunk_bytes_for(layout.nbytes)
        # Per slot: whether the optimizer has made its state yet (torch creates state
        # lazily, and e.g. SGD's first momentum is the gradient, not a zero-started one).
        self.initialized = [False] * len(layout.slots)
        # The streamed step's three staging buffers (reading, stepping, writing) and its
        # reader and writer threads; made at the first step, kept while the tier lives.
        self.staging: list[torch.Tensor] = []
        self._threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._slot_of = {(s.buffer, s.position): i for i, s in enumerate(layout.slots)}

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
        return host_buffer(nbytes, pinned=self.device.type == "cuda")

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

    def read_into(self, slot: int, field: str, lo: int, out: torch.Tensor) -> None:
        """Read elements [lo, lo + out.numel()) of one field into ``out`` (1-D, CPU)."""
        dtype, offset = self._field(slot, field)
        self.arena.read(offset + lo * dtype.itemsize, out)

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
        self.arena.write(offset + lo * dtype.itemsize, values.detach().to("cpu", dtype))

    def state_keys(self, slot: int) -> list[str]:
        """The per-element state keys slot ``slot`` holds."""
        return [name for name, _, _ in self.layout.slots[slot].fields if name != MASTER]

    def has_master(self, slot: int) -> bool:
        return any(name == MASTER for name, _, _ in self.layout.slots[slot].fields)

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        """A whole piece's per-element state (empty before its first step)."""
        if not self.initialized[slot]:
            return {}
        numel = self.layout.slots[slot].numel
        return {key: self.read(slot, key, 0, numel) for key in self.state_keys(slot)}

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
        for name, dtype, offset in self.layout.slots[slot].fields:
            if name == field:
                return dtype, offset
        raise KeyError(f"offload slot {slot} has no field {field!r}")


def plan_offload(
    plan: ShardPlan, optimizer: torch.optim.Optimizer, config: ZeroConfig, group: Group
) -> OffloadLayout | None:
    """`shard()`'s offload decision for this rank (None without ``config.offload``),
    checked against the tier (`check_offload`); reads sizes only, changes nothing."""
    if config.offload is None:
        return None
    if plan.partition == "tensor":
        # The tier streams 1-D chunks of flat shards through the optimizer; a whole owned
        # tensor stepped by a shape-aware optimizer cannot be cut into chunks.
        raise ValueError(
            f"ZeroConfig.offload={config.offload!r} works with partition='flat' only; this "
            "model's optimizer needs whole-tensor ownership (partition='tensor'). Use "
            "offload=None, or an elementwise optimizer with partition='flat' or 'auto'"
        )
    fields = [state_fields(optimizer, g, plan.device) for g in optimizer.param_groups]
    layout = offload_layout(
        [[p.numel() for _, p in params] for params in plan.flat_params],
        [[plan.group_of[id(p)] for _, p in params] for params in plan.flat_params],
        fields,
        config=config,
        rank=group.rank,
        world_size=group.size,
    )
    check_offload(layout, config, plan.device)
    return layout


@torch.no_grad()
def build_tier(
    layout: OffloadLayout,
    masters: list[MasterShard],
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    group: Group,
) -> OffloadTier:
    """The tier for ``layout``, holding the offloaded pieces' masters (16-bit: their
    values from the parameter shard) and any state the optimizer already had."""
    from zerolite.state.shard_state import pieces_of  # shard_state imports this module's types

    tier = OffloadTier(layout, config, masters[0].flat.data.device if masters else
                       torch.device("cpu"), group.rank)
    for piece in pieces_of(masters, optimizer.state, tier):
        if piece.tier is None:
            continue
        if tier.has_master(piece.slot):
            shard = piece.flat.shard[piece.offsets.shard_start :][: piece.offsets.numel]
            tier.write(piece.slot, MASTER, 0, shard.float())
        state = optimizer.state.pop(piece.master, {})
        scalars = tier.write_state(piece.slot, state)
        if scalars:
            optimizer.state[piece.master] = scalars
    return tier
