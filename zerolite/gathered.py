"""Full parameters on demand: `gathered_parameters`, `iter_full_state_dict`, `full_state_dict`.

Stage 3 keeps only shards between uses. These gather on request -- all units at once
inside `gathered_parameters` (for inspection, custom initialisation, or an edit made on
one rank and broadcast), or one unit at a time in `iter_full_state_dict` (streaming a
full state dict with a peak of one unit) and `full_state_dict` (the unsharded
``model.state_dict()`` copied out unit by unit, so the device never holds more than one
extra unit; at stage 3 ``model.state_dict()`` itself gathers the same way,
`zerolite.params.state_dict_hooks`). In stages 1-2 parameters are always full and all
three are cheap.

With ``masters=True`` the trained parameters come from the fp32 masters instead of the
16-bit compute copy: each trained flat buffer's master shards are all-gathered, exactly
(never through a quantized wire), one buffer at a time. That is what an unsharded run
with fp32 parameters and autocast would save; with fp32 parameters the masters are the
parameters and nothing extra travels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from zerolite.checkpoint.rank_file import state_dict_names
from zerolite.comm.collectives import all_gather_inplace, broadcast
from zerolite.comm.owned import gather_from_owners
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.tiered_shard import in_memory
from zerolite.params.unit_scheduler import UnitScheduler
from zerolite.state.shard_state import ShardState, require_state, state_of

__all__ = ["full_state_dict", "gathered_parameters", "iter_full_state_dict"]


@contextlib.contextmanager
@torch.no_grad()
def gathered_parameters(model: nn.Module, modifier_rank: int | None = None) -> Iterator[None]:
    """Inside the block every managed parameter holds its full values. All ranks must enter.

    Stage 3 gathers every unit once on entry and frees them on exit (those that were not
    gathered before); forwards inside the block use the full parameters without any
    communication, so wrapping a ``generate()`` loop costs one gather in all. Nested
    blocks free nothing until the outermost one exits.

    Args:
        model: a model sharded by `zerolite.shard` (any stage).
        modifier_rank: if set, the values this rank holds when the block exits are
            broadcast to every rank and written into the shards and fp32 masters, so an
            edit made there (e.g. ``p.copy_(...)`` or re-initialisation) survives
            resharding and is what the optimizer steps next. If None, edits are
            discarded on exit in stage 3 (and must be identical on every rank in stages 1-2).
    """
    state = require_state(model, "gathered_parameters()")
    world = state.group.world.size
    if modifier_rank is not None and (
        isinstance(modifier_rank, bool)
        or not isinstance(modifier_rank, int)
        or not 0 <= modifier_rank < world
    ):
        raise ValueError(
            f"gathered_parameters(): modifier_rank must be None or a rank in [0, {world}), got "
            f"{modifier_rank!r}"
        )
    scheduler = state.scheduler
    was_gathered = []
    if scheduler is not None:
        scheduler.refresh_stale()
        was_gathered = scheduler.unsharded_units()
        for i in range(len(scheduler.flats)):
            scheduler.gather(i)
        for i in range(len(scheduler.flats)):
            scheduler.unshard(i)
        # Forwards inside the block (a generation loop) must neither free nor re-gather.
        scheduler.pinned += 1
    try:
        yield
    finally:
        if scheduler is not None:
            scheduler.pinned -= 1
        if modifier_rank is not None:
            _keep_edits(state, modifier_rank)
        if scheduler is not None and not scheduler.pinned:
            for i in range(len(scheduler.flats)):
                if i not in was_gathered:
                    scheduler.reshard(i)


def _keep_edits(state: ShardState, modifier_rank: int) -> None:
    """``modifier_rank``'s full parameters, broadcast, into every rank's shards and fp32
    masters (through the pieces: a 16-bit master offloaded to the tier is written there)."""
    masters = {id(m.flat): m for m in state.masters}
    pieces: dict[int, list] = {}
    for piece in state.pieces():
        pieces.setdefault(id(piece.flat), []).append(piece)
    for flat in [*state.flats, *state.frozen_flats]:
        broadcast(flat.data, modifier_rank, state.group.world,
                  what="gathered_parameters()'s broadcast of the edits")
        lo, hi = flat.layout.shard_range(flat.rank)
        with in_memory(flat.tiered, changes=True):  # offload_params: parked between uses
            if not flat.replicated:
                flat.shard.copy_(flat.data[lo:hi])
            master = masters.get(id(flat))
            if master is None or master.is_view:
                continue
            for piece in pieces.get(id(flat), []):
                start = lo + piece.span.shard_start
                values = flat.data[start : start + piece.span.numel].float()
                piece.write_master(values.reshape(piece.master.shape))


@torch.no_grad()
def iter_full_state_dict(
    model: nn.Module, to_cpu: bool = True, *, masters: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of the full state dict, gathering one unit at a time.

    All ranks must iterate to the end together (each unit is an all-gather). Tensors are
    copies (on CPU by default). Names and order are those of ``model.state_dict()``,
    except that parameters come unit by unit and buffers at the end; a tied parameter
    is yielded under each of its names (the same tensor).

    Args:
        model: a sharded model (any stage) or a plain one.
        to_cpu: copy to the CPU (else clones on the model's device).
        masters: trained parameters from the fp32 masters, every other floating-point
            parameter upcast to float32 (buffers as they are); see the module docstring.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"iter_full_state_dict() needs an nn.Module, got {type(model).__name__}")
    state = state_of(model)
    scheduler: UnitScheduler | None = None if state is None else state.scheduler
    gather_masters = masters and state is not None and any(not m.is_view for m in state.masters)
    if scheduler is None:
        exact = {} if not gather_masters else _master_values(state, state.flats)
        shared: dict[int, torch.Tensor] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) not in shared:
                source = exact.get(id(tensor), tensor)
                shared[id(tensor)] = _copy(source, to_cpu, upcast=masters and _is_param(tensor))
            yield name, shared[id(tensor)]
        return
    assert state is not None  # a scheduler exists only for a sharded model
    scheduler.refresh_stale()
    scheduler.allow_state_dict = True
    try:
        entries = model.state_dict(keep_vars=True)
    finally:
        scheduler.allow_state_dict = False
    names_of: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        names_of.setdefault(id(tensor), []).append(name)
    done: set[int] = set()
    for i in range(state.num_units):
        with state.gather(i) as flats:
            exact = {} if not gather_masters else _master_values(state, flats)
            for p in (p for flat in flats for p in flat.params):
                copy = _copy(exact.get(id(p), p), to_cpu, upcast=masters)
                for name in names_of.get(id(p), []):
                    yield name, copy
                done.add(id(p))
    for name, tensor in entries.items():
        if id(tensor) not in done:
            yield name, _copy(tensor, to_cpu, upcast=masters and _is_param(tensor))


def _master_values(state: ShardState, flats: list[FlatParamBuffer]) -> dict[int, torch.Tensor]:
    """``id(param) -> its full fp32 master values`` (in the parameter's shape) for the
    trained buffers among ``flats``: each buffer's master pieces are written where this
    rank's shard lies in a padded fp32 buffer, and the shards are all-gathered, exactly,
    over the buffer's shard group (uneven chunks with whole-tensor ownership). Every rank
    calls, with the same ``flats``."""
    pieces: dict[int, list] = {}
    for piece in state.pieces():
        pieces.setdefault(id(piece.flat), []).append(piece)
    trained = {id(m.flat) for m in state.masters}
    out: dict[int, torch.Tensor] = {}
    for flat in (f for f in flats if id(f) in trained):
        full = torch.zeros(flat.layout.padded_numel, dtype=torch.float32, device=flat.data.device)
        lo, _ = flat.layout.shard_range(flat.rank)
        for piece in pieces.get(id(flat), []):
            start = lo + piece.span.shard_start
            full[start : start + piece.span.numel] = piece.read_master().reshape(-1)
        exchange, what = flat.exchange, f"the fp32 master all-gather of flat buffer {flat.index}"
        sizes = flat.layout.chunk_sizes
        pending = (
            all_gather_inplace(full, exchange.group, key=exchange.gather_key, what=what)
            if sizes is None
            else gather_from_owners(full, sizes, exchange.group, key=exchange.gather_key, what=what)
        )
        pending.wait()
        for i, p in enumerate(flat.params):
            out[id(p)] = flat.param_view(full, i)
    return out


@torch.no_grad()
def full_state_dict(
    model: nn.Module, rank0_only: bool = True, to_cpu: bool = True, *, masters: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full state dict (names and shapes of the unsharded ``model.state_dict()``).

    Every rank must call it (stage 3 all-gathers each unit in turn, so the device holds
    at most one extra unit). Tied parameters appear under each of their names, sharing
    one tensor, as in ``model.state_dict()``.

    Args:
        model: a model sharded by `zerolite.shard` (any stage), or a plain model.
        rank0_only: only rank 0 keeps the tensors; other ranks get ``{}`` (they still
            take part in the gathers).
        to_cpu: copy tensors to CPU (else clones on the model's device).
        masters: trained parameters from the fp32 masters (an all-gather of the master
            shards even in stages 1-2 when parameters are 16-bit), every other
            floating-point parameter upcast to float32; buffers as they are. This is what
            an unsharded run with fp32 parameters under autocast holds.
    Returns:
        ``name -> tensor`` copies, in ``model.state_dict()`` order.
    """
    state = state_of(model)
    scheduler = None if state is None else state.scheduler
    rank = scheduler.group.world.rank if scheduler is not None else _rank()
    keep = not rank0_only or rank == 0
    items = {}
    for name, tensor in iter_full_state_dict(model, to_cpu=to_cpu, masters=masters):
        if keep:  # other ranks only take part in the gathers
            items[name] = tensor
    if not keep:
        return {}
    return {name: items[name] for name in state_dict_names(model)}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter)


def _copy(t: torch.Tensor, to_cpu: bool, *, upcast: bool = False) -> torch.Tensor:
    """A copy of ``t`` (on the CPU if ``to_cpu``); floating point upcast to float32 if
    ``upcast``."""
    t = t.detach()
    dtype = torch.float32 if upcast and t.is_floating_point() else t.dtype
    return t.to("cpu" if to_cpu else t.device, dtype=dtype, copy=True)
