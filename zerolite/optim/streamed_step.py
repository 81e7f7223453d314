"""The streamed step: offloaded pieces go through the user's optimizer chunk by chunk.

`ShardedOptimizer` first steps the resident pieces (the offloaded ones have no
``.grad`` then, so torch skips them), then calls `stream_step` for the same buffers.
The offloaded elements are cut into chunks of at most ``tier.chunk_bytes`` (a piece may
span several chunks). While one chunk steps, a reader thread loads the next from the
arena and a writer thread stores the previous one: three staging buffers of about
``chunk_bytes``, allocated once per tier and reused, hold everything in flight.

Each chunk is stepped by the user's own optimizer instance: its param groups are
pointed, for the call, at the chunk's fp32 master segments (new tensors: values read
from the tier, or views of the parameter shard in fp32), ``optimizer.state`` gets each
segment's state (its per-element slices and a copy of the piece's scalars), and
``optimizer.step()`` runs the same elementwise update it runs in memory -- so results
are bitwise those of the in-memory step. A piece's ``step`` counter is shared by its
segments: each starts from the piece's value, and the piece keeps the result.

Under whole-tensor ownership (``partition="tensor"``) a shape-aware optimizer (Muon,
Adafactor) must see each owned tensor whole: chunks are cut at piece boundaries only, each
segment is a whole piece stepped in its parameter's shape, with its state in the shapes
the tier holds them (`zerolite.plan.offload.Slot.shapes`). A piece larger than
``chunk_bytes`` is a chunk of its own, and the staging buffer that carries it grows to its
size (kept for later steps): with three buffers in flight, up to three times the largest
offloaded tensor's bytes (master and state) of staging memory.

[Note: streamed step on CUDA] No copy blocks the host. A chunk's values go to the device
with non-blocking copies from its (pinned) staging buffer, step there, and come back with
non-blocking copies into the same staging buffer; one CUDA event, recorded after those
copies on the device's current stream, is the staging buffer's: the writer thread waits on
it before storing the chunk, and the buffer is reloaded only after that store. So the main
thread queues chunk after chunk while the reader, the device and the writer work, and no
chunk waits for unrelated GPU work. On the CPU the staging buffers are stepped in place,
as before, and no event exists.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future
from typing import Any

import torch

from zerolite.ground import runtime
from zerolite.plan.offload import MASTER
from zerolite.state.master import MasterShard
from zerolite.state.offload import OffloadTier

__all__ = ["stream_step"]

_ALIGN = 64  # bytes: where each field's view starts in a staging buffer


@dataclasses.dataclass
class _Segment:
    """Elements [lo, hi) of one offloaded piece, and what one chunk step needs of them."""

    slot: int
    master: MasterShard
    position: int
    lo: int
    hi: int
    group: int
    # Snapshots taken before the step's first chunk: a later segment of the same piece
    # must start from the piece's state before this step, not after its earlier chunk.
    initialized: bool
    scalars: dict[str, Any]
    values: torch.Tensor | None = None  # fp32 master segment (the tensor that steps)
    state: dict[str, Any] | None = None
    # Views of the staging buffer per field: where values were read, and (CUDA) where the
    # stepped values come back to be stored.
    host: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # What the writer stores, per field (host tensors).
    outgoing: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def stream_step(
    tier: OffloadTier, masters: list[MasterShard], optimizer: torch.optim.Optimizer
) -> None:
    """Step the offloaded pieces of ``masters`` (their gradients set by ``set_grads``).

    Args:
        tier: the model's offload tier.
        masters: the buffers stepped now, each with ``grad_shard`` and ``used`` set.
        optimizer: the user's optimizer (its param groups hold the pieces' master views).
    """
    param_group_of = {
        id(t): g for g, group in enumerate(optimizer.param_groups) for t in group["params"]
    }
    chunks = _chunks(tier, masters, param_group_of, optimizer.state)
    if not chunks:
        return
    reader, writer = tier.threads()
    loading: Future = reader.submit(_load, tier, chunks[0], 0)
    writing: Future | None = None
    try:
        for i in range(len(chunks)):
            chunk = loading.result()
            if i + 1 < len(chunks):
                # Staging buffer (i + 1) % 3 last held chunk i - 2, whose write is done.
                loading = reader.submit(_load, tier, chunks[i + 1], (i + 1) % len(tier.staging))
            copied = _step_chunk(tier, chunk, optimizer)
            if writing is not None:
                writing.result()
            writing = writer.submit(_store, tier, chunk, copied)
    finally:
        for pending in (loading, writing):
            if pending is not None:
                pending.result()


def _chunks(
    tier: OffloadTier,
    masters: list[MasterShard],
    param_group_of: dict[int, int],
    optimizer_state: dict[Any, Any],
) -> list[list[_Segment]]:
    """This step's offloaded, used pieces, cut into chunks of at most ``chunk_bytes``."""
    chunks: list[list[_Segment]] = []
    current: list[_Segment] = []
    room = 0
    for master in masters:
        if master.offloaded == 0:
            continue
        buffer = master.flat.index  # trained buffers come first: the bucket's index
        assert master.used is not None
        for j in range(master.offloaded):
            span = master.flat.spans[j]
            if not master.used[span.index]:
                continue  # no gradient anywhere: torch would skip it, state unchanged
            slot = tier.slot_of(buffer, j)
            assert slot is not None
            per = max(1, tier.plan.slots[slot].bytes_per_element)
            whole = tier.plan.slots[slot].nbytes
            group = param_group_of[id(master.views[j])]
            initialized = tier.initialized[slot]
            scalars = optimizer_state.get(master.views[j], {})
            lo = 0
            while lo < span.numel:
                if room <= 0 or (master.shaped and whole > room):
                    if current:
                        chunks.append(current)
                    current, room = [], tier.chunk_bytes
                # A whole owned tensor is never cut (its optimizer needs all of it).
                take = span.numel if master.shaped else min(span.numel - lo, max(1, room // per))
                # The piece's last segment steps its own scalars (in place, as in memory);
                # an earlier one a copy. No new long-lived tensors: allocated amid the
                # step's freed temporaries, they would pin holes the next forward needs.
                last = lo + take == span.numel
                current.append(_Segment(
                    slot, master, j, lo, lo + take, group, initialized,
                    dict(scalars) if last else _copy(scalars),
                ))
                room -= whole if master.shaped else take * per
                lo += take
    if current:
        chunks.append(current)
    return chunks


def _copy(scalars: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}


def _fields(tier: OffloadTier, seg: _Segment) -> list[str]:
    """The fields a segment needs staging room for: those read from the tier (the master
    when offloaded, the state once initialised) and, for a CUDA model, every field the
    stepped values come back into ([Note: streamed step on CUDA])."""
    names = [MASTER] if tier.has_master(seg.slot) else []
    if seg.initialized or runtime.is_accelerator(tier.device):
        names += tier.state_keys(seg.slot)
    return names


def _shape(tier: OffloadTier, seg: _Segment, field: str) -> tuple[int, ...]:
    """A segment's field as the optimizer sees it: 1-D, or a whole owned tensor's shape."""
    if seg.master.shaped:
        return tier.field_shape(seg.slot, field)
    return (seg.hi - seg.lo,)


def _numel(tier: OffloadTier, seg: _Segment, field: str) -> int:
    return math.prod(_shape(tier, seg, field))


def _load(tier: OffloadTier, chunk: list[_Segment], buffer: int) -> list[_Segment]:
    """Reader thread: the segments' masters (when offloaded) and per-element state, read
    into views of staging buffer ``buffer`` (reused every step: no allocation, so nothing
    for the allocator to keep)."""
    need = 0
    for seg in chunk:
        need += sum(_ALIGN + _numel(tier, seg, n) * tier.field_dtype(seg.slot, n).itemsize
                    for n in _fields(tier, seg))
    staging = tier.staging[buffer]
    if staging.numel() < need:  # many tiny segments: their alignment overran chunk_bytes
        staging = tier.staging[buffer] = tier.staging_buffer(need)
    offset = 0
    for seg in chunk:
        seg.host = {}
        for name in _fields(tier, seg):
            dtype = tier.field_dtype(seg.slot, name)
            offset = -(-offset // _ALIGN) * _ALIGN
            nbytes = _numel(tier, seg, name) * dtype.itemsize
            view = staging[offset : offset + nbytes].view(dtype)
            seg.host[name] = view.view(_shape(tier, seg, name))
            offset += nbytes
    for seg in chunk:
        if tier.has_master(seg.slot):
            seg.values = seg.host[MASTER]
            tier.read_into(seg.slot, MASTER, seg.lo, seg.values)
        seg.state = {}
        if seg.initialized:
            for key in tier.state_keys(seg.slot):
                seg.state[key] = seg.host[key]
                tier.read_into(seg.slot, key, seg.lo, seg.state[key])
    return chunk


def _step_chunk(
    tier: OffloadTier, chunk: list[_Segment], optimizer: torch.optim.Optimizer
) -> runtime.Event | None:
    """Main thread: one ``optimizer.step()`` over the chunk's segments; sets each segment's
    ``outgoing``. Returns, for a CUDA model, the event after which the stepped values have
    landed in the chunk's staging buffer ([Note: streamed step on CUDA]); else None."""
    groups: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    device = tier.device
    for seg in chunk:
        master, span = seg.master, seg.master.flat.spans[seg.position]
        if seg.values is None:  # fp32: the master is the parameter shard; step it in place
            view = master.views[seg.position]
            seg.values = view if master.shaped else view[seg.lo : seg.hi]
        elif seg.values.device != device:
            seg.values = seg.values.to(device, non_blocking=True)
        assert master.grad_shard is not None and seg.state is not None
        start = span.shard_start
        grad = master.grad_shard[start + seg.lo : start + seg.hi]
        seg.values.grad = grad.view(seg.values.shape)
        seg.state = {
            **seg.scalars, **{k: v.to(device, non_blocking=True) for k, v in seg.state.items()}
        }
        groups[seg.group].append(seg.values)
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        for seg in chunk:
            optimizer.state[seg.values] = seg.state
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        for seg in chunk:
            assert seg.values is not None
            seg.state = optimizer.state.pop(seg.values, {})
            seg.values.grad = None
    for seg in chunk:
        master, span = seg.master, seg.master.flat.spans[seg.position]
        keys = tier.state_keys(seg.slot)
        assert seg.state is not None
        assert seg.values is not None
        unknown = [
            k for k, v in seg.state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
            and (k not in keys or tuple(v.shape) != _shape(tier, seg, k))
        ]
        if unknown:
            shapes = {k: tuple(seg.state[k].shape) for k in unknown}
            raise RuntimeError(
                f"{type(optimizer).__qualname__} made state {shapes} that the offload plan "
                f"does not hold (it holds {keys}, sized from the parameter's shape): use "
                "offload=None"
            )
        optimizer.state[master.views[seg.position]] = {
            k: v for k, v in seg.state.items() if k not in keys
        }
        tier.initialized[seg.slot] = True
        if tier.has_master(seg.slot):  # cast down into the parameter shard, as write_back
            start = span.shard_start
            master.flat.shard[start + seg.lo : start + seg.hi].copy_(seg.values.reshape(-1))
        seg.outgoing = {MASTER: seg.values} if tier.has_master(seg.slot) else {}
        seg.outgoing.update((k, seg.state[k]) for k in keys if k in seg.state)
    if not runtime.is_accelerator(device):
        return None
    for seg in chunk:  # back into the staging buffer, without blocking the host
        for name, value in seg.outgoing.items():
            seg.host[name].copy_(value, non_blocking=True)
        seg.outgoing = {name: seg.host[name] for name in seg.outgoing}
    return runtime.record_event(device)


def _store(tier: OffloadTier, chunk: list[_Segment], copied: runtime.Event | None) -> None:
    """Writer thread: the stepped masters (when offloaded) and per-element state, once
    ``copied`` (CUDA) says they are in host memory."""
    if copied is not None:
        copied.synchronize()
    for seg in chunk:
        for name, value in seg.outgoing.items():
            tier.write(seg.slot, name, seg.lo, value)
