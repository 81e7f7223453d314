"""`assemble`: what `zerolite.shard` does, below the public face: validate, agree across
ranks, then build what the stage needs, step by step.

Nothing is modified until every rank has validated its inputs and all ranks agree on the
plan (`zerolite.assemble.agree`): where the flat buffers live and over which group, which
parameters go into which flat buffer (`zerolite.plan`) and what the offload tier holds.
Then `_build` runs one named step per concern, in the order data will travel:

1. `_choose_exchanges`: each flat buffer's exchange (`zerolite.comm.exchange`);
2. `_place_parameters`: the flat buffers, bound to the parameters, holding rank 0's
   values (as DDP does), or a meta-device model materialised unit by unit
   (`zerolite.params.meta_init`); stage 3 keeps only this rank's shards;
3. `_make_masters`: the fp32 master of each shard (`zerolite.state.master`);
4. `_adopt_optimizer`: the user's param groups re-pointed at the master pieces, any
   existing state re-sharded, the offload tier filled;
5. `_wire_gradients`: one gradient bucket per flat buffer, the reducer and the hooks
   (full gradients kept in stage 1, sharded in backward from stage 2);
6. `_schedule_units`: stage 3's gather-before-use scheduler;
7. `_change_model`: what changes on the model itself: the hooks' forward watch, the
   ``.to()`` guard, ``no_sync()``, the meta build's first-forward check;

and the `ShardState` holding all of it, complete, wrapped by the `ShardedOptimizer`.
What the stage shards (`zerolite.plan.stages.STAGES`) picks the pieces; no step branches
on the stage number.

`zerolite.shard` (`zerolite.sharding`) is `assemble` plus its log line; the memory tools
(`zerolite.memory`) call `assemble` directly to build a sharded step in a simulated world.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from zerolite.assemble.agree import agree_on_offload, agree_on_plan, world_of
from zerolite.comm.collectives import Group, broadcast, broadcast_coalesced
from zerolite.comm.exchange import Exchange, exchange_for
from zerolite.comm.hybrid import sharding_group
from zerolite.config import ZeroConfig
from zerolite.grads.bucket import GradBucket
from zerolite.grads.hooks import KeepFullGrads, ShardGradsInBackward
from zerolite.grads.reducer import GradReducer, install_no_sync
from zerolite.ground import phase_events
from zerolite.ground.compile_guard import exclude_from_compile, not_compiled
from zerolite.optim.multi import MultiOptimizer
from zerolite.optim.repoint import repoint_optimizer
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.guard import guard_conversions
from zerolite.params.meta_init import MetaBuild, check_before_first_forward, materialize
from zerolite.params.tiered_shard import ShardTier, in_memory
from zerolite.params.unit_scheduler import UnitScheduler
from zerolite.plan.offload import OffloadPlan
from zerolite.plan.owners import assign_owners
from zerolite.plan.quantization import buffer_wires, skipped_parameters
from zerolite.plan.shard_plan import ShardPlan
from zerolite.plan.stages import STAGES
from zerolite.state.arena import DiskArena, HostArena
from zerolite.state.master import MasterShard
from zerolite.state.offload import OffloadTier, build_tier
from zerolite.state.param_tier import attach_buckets
from zerolite.state.pieces import pieces_of
from zerolite.state.shard_state import ShardState, register

__all__ = ["Assembled", "assemble"]


class Assembled(NamedTuple):
    """What `assemble` built: the optimizer to use, and the plan as built (owners assigned;
    its ``partition`` is the one ``ZeroConfig.partition="auto"`` resolved)."""

    sharded: ShardedOptimizer
    plan: ShardPlan


def assemble(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig,
) -> Assembled:
    """`zerolite.shard` without its log line (its docstring says what changes and who
    calls): every rank of ``config.process_group`` must call, with the same model
    structure, optimizer and config. ``sharded.config`` is ``config`` with ``param_dtype``
    decided. The building is announced to the memory tools
    (`zerolite.ground.phase_events`: the ``"build"`` phase, then `built`)."""
    world = world_of(model, optimizer, config)
    optimizer, plan, k, lines, config = agree_on_plan(model, optimizer, config, world)
    group = sharding_group(world, k, config)
    offload, arena, params_tier = agree_on_offload(plan, optimizer, config, group)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    # Before anything is cast: what a stock run keeps, and saves (`zerolite.integrations`).
    source_dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    with phase_events.phase("build", world.buffer_device):
        plan, sharded = _build(model, optimizer, config, group, plan, digest,
                               (offload, arena, params_tier), source_dtypes)
    phase_events.built(sharded)
    return Assembled(sharded, plan)


def _build(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    group: Group,
    plan: ShardPlan,
    layout_digest: str,
    reserved: tuple[OffloadPlan | None, DiskArena | HostArena | None, ShardTier | None],
    source_dtypes: dict[str, torch.dtype],
) -> tuple[ShardPlan, ShardedOptimizer]:
    """Every rank agreed: build, one step per concern (the module docstring). Returns the
    plan as built (owners assigned) and the optimizer."""
    offload, arena, params_tier = reserved
    if plan.partition == "tensor":  # each buffer's parameters ordered by owner: the layout
        plan = assign_owners(plan, group.size)
    exchanges = _choose_exchanges(model, plan, config, group)
    all_flats, meta_build = _place_parameters(model, plan, exchanges, config, group, params_tier)
    flats, frozen_flats = all_flats[: len(plan.flat_params)], all_flats[len(plan.flat_params) :]
    masters = _make_masters(flats, config, group, offload)
    tier = _adopt_optimizer(optimizer, masters, plan, (offload, arena), config, group)
    reducer, grads = _wire_gradients(flats, config, group, params_tier)
    scheduler = None
    if plan.units is not None and isinstance(grads, ShardGradsInBackward):
        scheduler = _schedule_units(plan, all_flats, flats, group, config, grads)
    _change_model(model, grads, reducer, scheduler, all_flats, meta_build)
    state = ShardState(
        model, group=group, config=config, inner=optimizer, flats=flats, masters=masters,
        frozen_flats=frozen_flats, reducer=reducer, grads=grads, scheduler=scheduler,
        layout_digest=layout_digest, meta_build=meta_build, offload=tier,
        source_dtypes=source_dtypes, params_tier=params_tier,
    )
    sharded = ShardedOptimizer(optimizer, state)
    register(model, state, sharded)
    return plan, sharded


def _choose_exchanges(
    model: nn.Module, plan: ShardPlan, config: ZeroConfig, group: Group
) -> list[Exchange]:
    """Each flat buffer's exchange ([Note: exchanges] in `zerolite.comm.exchange`): owned
    chunks, int8 wires (`zerolite.plan.quantization`), a replica step when hybrid."""
    skipped = skipped_parameters(model, config)
    replicas = 1 if group.replicas is None else group.replicas.size
    exchanges = []
    for index, params in enumerate(plan.all_flat_params):
        layout = plan.layout(index, group.size)
        wires = buffer_wires(
            [p for _, p in params], layout, config, trained=index < len(plan.flat_params),
            skipped=skipped, shard_rank=group.rank, replicas=replicas,
        )
        exchanges.append(exchange_for(
            group, index, device=plan.device, owner_sizes=layout.chunk_sizes,
            gather_wire=wires.gather, reduce_wire=wires.reduce, replica_wire=wires.replica,
            error_feedback=wires.error_feedback,
        ))
    return exchanges


@torch.no_grad()
def _bound_flat(
    plan: ShardPlan, index: int, exchange: Exchange, config: ZeroConfig,
    params_tier: ShardTier | None,
) -> FlatParamBuffer:
    """Flat buffer ``index`` of ``plan``, bound to its parameters (their values copied in)."""
    params = plan.all_flat_params[index]
    flat = FlatParamBuffer(
        [p for _, p in params],
        [n for n, _ in params],
        plan.layout(index, exchange.group.size),
        rank=exchange.group.rank,
        dtype=config.param_dtype,
        device=plan.device,
        index=index,
        exchange=exchange,
        params_tier=params_tier,
    )
    flat.bind()
    return flat


def _place_parameters(
    model: nn.Module,
    plan: ShardPlan,
    exchanges: list[Exchange],
    config: ZeroConfig,
    group: Group,
    params_tier: ShardTier | None,
) -> tuple[list[FlatParamBuffer], MetaBuild | None]:
    """Every flat buffer, bound to its parameters, in `ShardPlan.all_flat_params` order, and
    a meta build's `MetaBuild` (None otherwise). Stage 3 keeps only this rank's shards
    (parked on ``params_tier`` with ``offload_params``, each as soon as it is complete)."""
    shards = STAGES[config.stage].shards_parameters

    def make_flat(index: int) -> FlatParamBuffer:
        return _bound_flat(plan, index, exchanges[index], config, params_tier)

    if plan.on_meta:
        # Every rank computes the same values from rank 0's generator: nothing to broadcast.
        # A unit is complete once its module is initialised (the root: at the end).
        units = (plan.units or [])[:-1]
        closed_by = {id(u.module): b for u, b in zip(units, plan.unit_buffers())}
        return materialize(
            model, plan.all_flat_params, closed_by, make_flat,
            param_dtype=config.param_dtype, device=plan.device, shard=shards,
            init_fn=config.init_fn, group=group.world,
        )
    # As DDP: every rank starts from rank 0's parameters and buffers.
    all_flats = [make_flat(index) for index in range(len(plan.all_flat_params))]
    for flat in all_flats:
        broadcast(
            flat.data, 0, group.world,
            what=f"shard()'s broadcast of rank 0's flat buffer {flat.index}",
        )
    if shards:
        for flat in all_flats:
            flat.shard_only()
    in_flats = {id(p) for flat in all_flats for p in flat.params}
    unsharded = [p for p in model.parameters() if id(p) not in in_flats]
    broadcast_coalesced(
        [*unsharded, *model.buffers()], 0, group.world,
        what="shard()'s broadcast of rank 0's unsharded parameters and buffers",
    )
    return all_flats, None


def _make_masters(
    flats: list[FlatParamBuffer], config: ZeroConfig, group: Group, offload: OffloadPlan | None
) -> list[MasterShard]:
    """The fp32 master of each trained buffer's shard; the first pieces of each are left to
    the offload tier. A quantized all-gather overwrites a replicated buffer's own shard, so
    there the masters are copies even in fp32."""
    copy = config.quantize_gather and group.size > 1
    masters = []
    for i, flat in enumerate(flats):
        with in_memory(flat.tiered):  # a 16-bit master starts as the shard's values
            masters.append(MasterShard(
                flat, 0 if offload is None else offload.per_buffer[i],
                copy=copy and flat.replicated,
            ))
    return masters


def _adopt_optimizer(
    optimizer: torch.optim.Optimizer,
    masters: list[MasterShard],
    plan: ShardPlan,
    reserved: tuple[OffloadPlan | None, DiskArena | HostArena | None],
    config: ZeroConfig,
    group: Group,
) -> OffloadTier | None:
    """The user's optimizer steps the master pieces from now on (its param groups keep their
    identity; existing state is sliced to the pieces); the offload tier takes what is
    offloaded, in the arena reserved before the ranks agreed. Returns the tier (None
    without offload)."""
    if isinstance(optimizer, MultiOptimizer):
        optimizer.bind()
    repoint_optimizer(
        optimizer, pieces_of(masters, optimizer.state), plan.param_group_of,
        [p for _, p in plan.frozen],
    )
    offload, arena = reserved
    if offload is None:
        return None
    return build_tier(offload, masters, optimizer, config, group.rank, arena)


def _wire_gradients(
    flats: list[FlatParamBuffer], config: ZeroConfig, group: Group,
    params_tier: ShardTier | None,
) -> tuple[GradReducer, KeepFullGrads | ShardGradsInBackward]:
    """One gradient bucket per trained flat buffer, the reducer over them, and the hooks:
    full gradients kept until the step (stage 1) or sharded in backward (stages 2-3).
    With ``offload_params`` each bucket's gradient shard is parked as soon as it is made,
    so the build never holds them all."""
    policy = STAGES[config.stage]
    for flat in flats:
        for p in flat.params:
            p.grad = None
    buckets = []
    for flat in flats:
        buckets.append(GradBucket(
            flat,
            full_dtype=policy.kept_grad_dtype(config.param_dtype, config.grad_dtype),
            shard_dtype=config.grad_dtype,
            keep_full=not policy.shards_gradients,
        ))
        if params_tier is not None:
            attach_buckets(params_tier, buckets[-1:])
    reducer = GradReducer(buckets, group, stage=config.stage)
    if policy.shards_gradients:
        return reducer, ShardGradsInBackward(reducer)
    return reducer, KeepFullGrads(reducer)


def _change_model(
    model: nn.Module,
    grads: KeepFullGrads | ShardGradsInBackward,
    reducer: GradReducer,
    scheduler: UnitScheduler | None,
    all_flats: list[FlatParamBuffer],
    meta_build: MetaBuild | None,
) -> None:
    """What `shard()` changes on the model itself, in place: its forward watched by the
    gradient hooks, all of zerolite's hooks kept out of ``torch.compile`` graphs, the
    ``.to()`` guard, ``no_sync()`` and (a meta build) the first forward's check."""
    grads.watch_root(model)
    exclude_from_compile([*grads._handles, *(scheduler._handles if scheduler is not None else [])])
    guard_conversions(
        model,
        {id(p): (flat.data.dtype, flat.data.device) for flat in all_flats for p in flat.params},
    )
    install_no_sync(model, reducer)
    check_before_first_forward(model, meta_build)


def _schedule_units(
    plan: ShardPlan,
    all_flats: list[FlatParamBuffer],
    flats: list[FlatParamBuffer],
    group: Group,
    config: ZeroConfig,
    grads: ShardGradsInBackward,
) -> UnitScheduler:
    """Stage 3: unshard/reshard hooks, freed units when their gradients are in."""
    units = plan.units or []
    unit_flats = [[all_flats[i] for i in buffers] for buffers in plan.unit_buffers()]
    scheduler = UnitScheduler(
        [u.module for u in units],
        unit_flats,
        group,
        prefetch=config.prefetch,
        reshard_after_forward=config.reshard_after_forward,
    )
    unit_of_bucket = {
        flat.index: i for i, fs in enumerate(unit_flats) for flat in fs if flat in flats
    }
    # Weakly: the model's hooks keep the scheduler alive, and a strong reference from the
    # hooks (held by the model's registered ShardState) would keep the model alive forever
    # (see zerolite.state.shard_state).
    owner = weakref.ref(scheduler)

    def on_bucket_complete(b: int) -> None:
        if (alive := owner()) is not None:
            alive.on_unit_gradients_ready(unit_of_bucket[b])

    def on_backward_end() -> None:
        if (alive := owner()) is not None:
            alive.on_backward_end()

    grads.on_bucket_complete = on_bucket_complete
    # Both run from autograd callbacks, inside a compiled frame when a compiled function
    # calls backward; they must not be traced (see zerolite.ground.compile_guard).
    grads.on_backward_end = not_compiled(on_backward_end)
    return scheduler
