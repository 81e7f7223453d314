"""What the offload tier will hold on this rank, decided from sizes alone.

With ``ZeroConfig(offload="disk" | "host")`` the first pieces of this rank's shard (in
layout order, until ``offload_fraction`` of its elements is covered) keep their
per-element optimizer state (Adam's moments, SGD's momentum: whatever the optimizer
keeps per element) and, for 16-bit parameters, their fp32 master in the tier's arena
(`zerolite.state.offload`). `assign_slots` picks those pieces and gives each a `Slot`:
where its fields lie in the arena, byte for byte. `plan_offload` is `shard()`'s decision,
checked against the tier (`zerolite.state.offload.check_offload`: the directory, its free
space for the exact byte count, pinned memory) before anything changes;
`zerolite.memory.estimate` counts the same plan.

What stays resident: scalar state (a piece's ``step``) in ``optimizer.state``, fp32
masters that are the parameters themselves, and, in 16-bit, a meta placeholder for each
offloaded master (the object the param group holds).

Under whole-tensor ownership (``partition="tensor"``) a piece is a whole owned parameter
and its state may have other shapes than its own (Adafactor's row and column factors):
each field of such a slot has a shape (`Slot.shapes`), found by `tensor_state_fields`,
and the streamed step moves the piece whole.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from zerolite.config import ZeroConfig
from zerolite.plan.layout import FlatLayout
from zerolite.plan.owners import assign_owners

if TYPE_CHECKING:
    from zerolite.plan.shard_plan import ShardPlan

__all__ = [
    "MASTER",
    "OffloadPlan",
    "Slot",
    "assign_slots",
    "chunk_bytes_for",
    "plan_offload",
    "state_fields",
    "tensor_fields_of",
    "tensor_state_fields",
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
        shapes: per field, its shape (whole-tensor ownership: the master in the
            parameter's shape, state in whatever shape the optimizer keeps); ``()`` when
            every field is 1-D of ``numel`` elements (flat pieces).
    """

    buffer: int
    position: int
    numel: int
    fields: tuple[tuple[str, torch.dtype, int], ...]
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def bytes_per_element(self) -> int:
        return sum(dtype.itemsize for _, dtype, _ in self.fields)

    def shape(self, field: str) -> tuple[int, ...]:
        """The shape of field ``field`` (1-D of ``numel`` for flat pieces)."""
        if not self.shapes:
            return (self.numel,)
        return self.shapes[[name for name, _, _ in self.fields].index(field)]

    @property
    def nbytes(self) -> int:
        """Bytes of all the slot's fields."""
        if not self.shapes:
            return self.numel * self.bytes_per_element
        return sum(math.prod(shape) * dtype.itemsize
                   for (_, dtype, _), shape in zip(self.fields, self.shapes))


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
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


def _probe(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], probe: torch.Tensor
) -> dict[str, Any]:
    """The state one step of the optimizer holding ``group`` (the inner one, for several
    optimizers given as a list) creates for ``probe``, stepped as a throwaway copy."""
    inner = [
        opt for opt in getattr(optimizer, "optimizers", [optimizer])
        if any(g is group for g in opt.param_groups)
    ]
    cls = type(inner[0] if inner else optimizer)
    hyper = {k: v for k, v in group.items() if k != "params"}
    accepted = inspect.signature(cls.__init__).parameters
    try:
        twin = cls([probe], **{k: v for k, v in hyper.items() if k in accepted})
        twin.param_groups[0].update(hyper)
        probe.grad = torch.ones_like(probe)
        twin.step()
    except Exception as exc:
        raise ValueError(
            f"ZeroConfig.offload: cannot tell which state {cls.__qualname__} keeps per element "
            f"(a probe step on a tensor of shape {tuple(probe.shape)} failed: {exc}); use "
            "offload=None"
        ) from None
    return twin.state[probe]


def state_fields(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device: torch.device
) -> tuple[tuple[str, torch.dtype], ...]:
    """The per-element state keys (and dtypes) one step of ``optimizer``'s class creates
    for a parameter of ``group``: found by stepping a throwaway 2-element copy."""
    probe = torch.zeros(2, dtype=torch.float32, device=device)
    return tuple(
        (key, value.dtype)
        for key, value in _probe(optimizer, group, probe).items()
        if isinstance(value, torch.Tensor) and value.shape == probe.shape
    )


# The probe of a whole owned tensor: distinct sizes per dimension, so that each dimension
# of a state tensor names the parameter's dimension it follows (or is 1).
_PROBE_DIMS = (2, 3, 5, 7, 11, 13, 17, 19)
FieldSpec = tuple[str, torch.dtype, tuple[int | None, ...]]


def tensor_state_fields(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], ndim: int, device: torch.device
) -> tuple[FieldSpec, ...]:
    """The non-scalar state one step of ``optimizer``'s class creates for an ``ndim``-D
    parameter of ``group`` stepped whole: ``(key, dtype, dims)``, where ``dims`` gives,
    per dimension of the state tensor, the parameter dimension whose size it has (None:
    size 1). Found by stepping a throwaway tensor of shape ``(2, 3, 5, ...)``; 0-D state
    (a ``step`` counter) stays resident and is not listed.

    Raises:
        ValueError: the probe step failed, or a state tensor's size follows no dimension.
    """
    if ndim > len(_PROBE_DIMS):
        raise ValueError(
            f"ZeroConfig.offload: a parameter of {ndim} dimensions is beyond what the offload "
            f"tier can lay out for partition='tensor' (at most {len(_PROBE_DIMS)}); use "
            "offload=None"
        )
    probe = torch.zeros(_PROBE_DIMS[:ndim], dtype=torch.float32, device=device)
    out = []
    for key, value in _probe(optimizer, group, probe).items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if any(n != 1 and n not in probe.shape for n in value.shape):
            raise ValueError(
                f"ZeroConfig.offload: the optimizer's state {key!r} of a {ndim}-D parameter "
                f"has shape {tuple(value.shape)} for a parameter of shape "
                f"{tuple(probe.shape)}; the offload tier cannot size it from the parameter's "
                "shape. Use offload=None"
            )
        dims = tuple(None if n == 1 else _PROBE_DIMS.index(n) for n in value.shape)
        out.append((key, value.dtype, dims))
    return tuple(out)


def _shaped(dims: tuple[int | None, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d is None else shape[d] for d in dims)


def assign_slots(
    numels: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    fields: Sequence[tuple[tuple[str, torch.dtype], ...]],
    *,
    config: ZeroConfig,
    rank: int,
    world_size: int,
    owners: Sequence[Sequence[int]] | None = None,
    shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
    tensor_fields: Callable[[int, int], tuple[FieldSpec, ...]] | None = None,
) -> OffloadPlan:
    """Pick the offloaded pieces and lay out the arena (sizes only, no tensors).

    Args:
        numels: per flat buffer, each trained parameter's element count (buffer order).
        groups: per flat buffer, each parameter's param group index.
        fields: per param group, its per-element state (`state_fields`); unused with
            ``owners``.
        config: with ``offload`` set; ``offload_fraction`` picks how much.
        rank, world_size: this rank, the number of shards.
        owners: whole-tensor ownership: per flat buffer, each parameter's owner (the
            buffer ordered by owner, `zerolite.plan.owners.assign_owners`); None: flat.
        shapes: with ``owners``, per flat buffer each parameter's shape.
        tensor_fields: with ``owners``, ``(param group, ndim)`` -> `tensor_state_fields`.
    """
    assert config.offload is not None
    layouts = [
        FlatLayout(tuple(n), world_size, None if owners is None else tuple(owners[b]))
        for b, n in enumerate(numels)
    ]
    pieces = [(b, j, pc) for b, lay in enumerate(layouts) for j, pc in enumerate(lay.spans(rank))]
    total = sum(pc.numel for _, _, pc in pieces)
    target = total if config.offload_fraction >= 1 else math.ceil(config.offload_fraction * total)
    master = config.param_dtype != torch.float32
    slots, per_buffer, offset, taken, master_bytes = [], [0] * len(layouts), 0, 0, 0
    for b, j, pc in pieces:
        if taken >= target:
            break
        group = groups[b][pc.index]
        if owners is None:
            named = [(name, dtype, (pc.numel,)) for name, dtype in fields[group]]
            master_shape: tuple[int, ...] = (pc.numel,)
        else:
            assert shapes is not None and tensor_fields is not None
            master_shape = tuple(shapes[b][pc.index])
            named = [(name, dtype, _shaped(dims, master_shape))
                     for name, dtype, dims in tensor_fields(group, len(master_shape))]
        if master:
            named.insert(0, (MASTER, torch.float32, master_shape))
        placed = []
        for name, dtype, shape in named:
            placed.append((name, dtype, offset))
            offset += math.prod(shape) * dtype.itemsize
        master_bytes += pc.numel * 4 if master else 0
        field_shapes = () if owners is None else tuple(shape for _, _, shape in named)
        slots.append(Slot(b, j, pc.numel, tuple(placed), field_shapes))
        per_buffer[b] = j + 1
        taken += pc.numel
    return OffloadPlan(config.offload, tuple(slots), tuple(per_buffer), offset, master_bytes)


def tensor_fields_of(
    optimizer: torch.optim.Optimizer, device: torch.device
) -> Callable[[int, int], tuple[FieldSpec, ...]]:
    """``(param group, ndim)`` -> `tensor_state_fields` of ``optimizer``, each probed once,
    when a piece first needs it (a Muon group has only 2-D parameters: no 1-D probe)."""
    cache: dict[tuple[int, int], tuple[FieldSpec, ...]] = {}

    def fields(group: int, ndim: int) -> tuple[FieldSpec, ...]:
        if (group, ndim) not in cache:
            cache[group, ndim] = tensor_state_fields(
                optimizer, optimizer.param_groups[group], ndim, device
            )
        return cache[group, ndim]

    return fields


def plan_offload(
    plan: ShardPlan,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    *,
    rank: int,
    world_size: int,
) -> OffloadPlan | None:
    """`shard()`'s offload decision for rank ``rank`` of the ``world_size`` that shard (None
    without ``config.offload``); reads sizes only, changes nothing. Whether the tier can hold
    it here is `zerolite.state.offload.check_offload`'s question."""
    if config.offload is None:
        return None
    if plan.partition == "tensor":  # the owners `shard()` assigns next, from sizes alone
        plan = assign_owners(plan, world_size)
        return assign_slots(
            [[p.numel() for _, p in params] for params in plan.flat_params],
            [[plan.param_group_of[id(p)] for _, p in params] for params in plan.flat_params],
            [],
            config=config,
            rank=rank,
            world_size=world_size,
            owners=plan.owners,
            shapes=[[tuple(p.shape) for _, p in params] for params in plan.flat_params],
            tensor_fields=tensor_fields_of(optimizer, plan.device),
        )
    fields = [state_fields(optimizer, g, plan.device) for g in optimizer.param_groups]
    offload = assign_slots(
        [[p.numel() for _, p in params] for params in plan.flat_params],
        [[plan.param_group_of[id(p)] for _, p in params] for params in plan.flat_params],
        fields,
        config=config,
        rank=rank,
        world_size=world_size,
    )
    return offload
