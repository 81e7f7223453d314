"""What the offload tier will hold on this rank, decided from sizes alone.

With ``ZeroConfig(offload="disk" | "host")`` the first pieces of this rank's shard (in
layout order, until ``offload_fraction`` of its elements is covered) keep their
per-element optimizer state (Adam's moments, SGD's momentum: whatever the optimizer
keeps per element) and, for 16-bit parameters, their fp32 master in the tier's arena
(`zerolite.state.offload`). `offload_layout` picks those pieces and gives each a `Slot`:
where its fields lie in the arena, byte for byte. `plan_offload` is `shard()`'s decision,
checked against the tier (`zerolite.state.offload.check_offload`: the directory, its free
space for the exact byte count, pinned memory) before anything changes;
`zerolite.memory.estimate` counts the same layout.

What stays resident: scalar state (a piece's ``step``) in ``optimizer.state``, fp32
masters that are the parameters themselves, and, in 16-bit, a meta placeholder for each
offloaded master (the object the param group holds).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from zerolite.config import ZeroConfig
from zerolite.plan.layout import FlatLayout

if TYPE_CHECKING:
    from zerolite.plan.shard_plan import ShardPlan

__all__ = [
    "MASTER",
    "OffloadLayout",
    "Slot",
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
        position: index of the piece in ``flat.spans`` (offloaded pieces come first).
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
    pieces = [(b, j, pc) for b, lay in enumerate(layouts) for j, pc in enumerate(lay.spans(rank))]
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


def plan_offload(
    plan: ShardPlan,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    *,
    rank: int,
    world_size: int,
) -> OffloadLayout | None:
    """`shard()`'s offload decision for rank ``rank`` of the ``world_size`` that shard (None
    without ``config.offload``); reads sizes only, changes nothing. Whether the tier can hold
    it here is `zerolite.state.offload.check_offload`'s question."""
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
        rank=rank,
        world_size=world_size,
    )
    return layout
