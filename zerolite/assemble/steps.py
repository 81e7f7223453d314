"""`shard()`: validate, agree across ranks, then build what the stage needs, step by step.

Nothing is modified until every rank has validated its inputs and all ranks agree on the
plan (`zerolite.comm.consensus`): where the flat buffers live and over which group
(`_world`), which parameters go into which flat buffer (`zerolite.plan`, `_agree_on_plan`)
and what the offload tier holds (`_agree_on_offload`). Then `_build` runs one named step
per concern, in the order data will travel:

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
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import nn

from zerolite import phase_events
from zerolite.comm.collectives import Group, broadcast, broadcast_coalesced
from zerolite.comm.consensus import agreed
from zerolite.comm.devices import backends_of, buffer_device, check_buffer_device
from zerolite.comm.exchange import Exchange, exchange_for
from zerolite.comm.hybrid import data_parallel_group, shard_group_size, sharding_group
from zerolite.compile_guard import exclude_from_compile, not_compiled
from zerolite.config import ZeroConfig
from zerolite.grads.bucket import GradBucket
from zerolite.grads.hooks import KeepFullGrads, ShardGradsInBackward
from zerolite.grads.reducer import GradReducer, install_no_sync
from zerolite.optim.multi import MultiOptimizer, class_name, inner_optimizers
from zerolite.optim.repoint import repoint_optimizer
from zerolite.optim.sharded_optimizer import ShardedOptimizer, check_not_sharded
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.guard import guard_conversions
from zerolite.params.meta_init import MetaBuild, check_before_first_forward, materialize
from zerolite.params.unit_scheduler import UnitScheduler
from zerolite.plan.offload import OffloadLayout, plan_offload
from zerolite.plan.owners import assign_owners
from zerolite.plan.quantization import buffer_wires, describe_quantization, skipped_parameters
from zerolite.plan.shard_plan import ShardPlan, plan_layout
from zerolite.plan.stages import STAGES
from zerolite.state.arena import DiskArena, HostArena
from zerolite.state.master import MasterShard
from zerolite.state.offload import OffloadTier, build_tier, check_offload, reserve_arena
from zerolite.state.pieces import pieces_of
from zerolite.state.shard_state import ShardState, register

__all__ = ["shard"]

logger = logging.getLogger(__name__)

# How the model computes around zerolite's parameters, for `shard()`'s log line: set by the
# Accelerate and Trainer integrations, whose autocast `shard()` cannot see (it wraps the
# model's forward, outside zerolite).
_AUTOCAST_NOTE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "zerolite_autocast_note", default=None
)


@contextlib.contextmanager
def announcing_autocast(note: str | None) -> Iterator[None]:
    """Inside, `shard()`'s log line says the model computes ``note`` (e.g. "under
    Accelerate's bf16 autocast"); ``None`` says nothing more."""
    token = _AUTOCAST_NOTE.set(note)
    try:
        yield
    finally:
        _AUTOCAST_NOTE.reset(token)


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig | None = None,
) -> ShardedOptimizer:
    """Shard ``optimizer``'s state (and, in stage 2, gradients) across data-parallel ranks.

    ``model`` is changed in place: each parameter the optimizer holds becomes a view of
    a flat buffer (same ``nn.Parameter`` object, dtype ``config.param_dtype``), gets a
    gradient hook, and ``model.no_sync()`` appears. ``optimizer`` is kept: its
    ``param_groups`` (the same dicts) now hold this rank's fp32 master pieces.

    Every rank of ``config.process_group`` must call this with the same model
    structure, optimizer class and groups, and config; a mismatch raises
    `zerolite.RankMismatchError` on every rank instead of hanging.

    A model built under ``torch.device("meta")`` is materialised on ``config.device``
    one unit at a time and initialised by ``config.init_fn`` or its modules'
    ``reset_parameters()`` (see `zerolite.params.meta_init`); tensors nothing initialised must
    be loaded (`zerolite.checkpoint.load_pretrained`) before the first forward.

    Args:
        model: any ``nn.Module`` whose parameters are on one device (``meta`` included).
        optimizer: the user's optimizer over (some of) ``model``'s parameters, or a list of
            optimizers over disjoint parameters (e.g. ``[muon, adamw]``), stepped, clipped,
            saved and loaded together (`zerolite.optim.multi`). With ``partition="flat"``
            each must be elementwise (Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam,
            RAdam, or declared in ``config.elementwise_optimizers``); with ``"tensor"``
            (what ``"auto"`` picks otherwise) any optimizer stepping each tensor on its own.
        config: a `ZeroConfig`; ``None`` means ``ZeroConfig()`` (which reads ``ZEROLITE_*``
            environment variables).
    Returns:
        The `ShardedOptimizer` to use instead of ``optimizer`` from now on.
    Raises:
        TypeError: unsupported optimizer class, or arguments of the wrong type.
        ValueError: stage 0, parameters not in the model, on mixed devices, or listed twice;
            a device the process group cannot carry (a CPU model with an NCCL group), or
            ``collectives="point_to_point"`` over NCCL (`zerolite.comm.devices`).
        RuntimeError: the model was already sharded; ranks disagree (`RankMismatchError`).

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))
        loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
    """
    config = ZeroConfig() if config is None else config
    world = _world(model, optimizer, config)
    optimizer, plan, k, lines = _agree_on_plan(model, optimizer, config, world)
    group = sharding_group(world, k, config)
    offload, arena = _agree_on_offload(plan, optimizer, config, group)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    with phase_events.phase("build", world.buffer_device):
        sharded = _build(model, optimizer, config, group, plan, digest, (offload, arena))
    phase_events.built(sharded)
    return sharded


phase_events.provide_shard(shard)  # for the memory tools' simulations, below this layer


def _world(model: object, optimizer: object, config: ZeroConfig) -> Group:
    """Every data-parallel rank, with the device its flat buffers will live on. That device
    decides where the ranks' agreement travels, so it is decided first; a group that cannot
    carry it is refused on every rank alike."""
    pg = data_parallel_group(config)
    device = buffer_device(_candidate_parameters(model, optimizer), config.device, pg)
    check_buffer_device(device, backends_of(pg), config.collectives)
    return Group(pg, collectives=config.collectives, timeout_s=config.timeout_s, device=device)


def _candidate_parameters(
    model: object, optimizer: object
) -> Iterator[torch.Tensor]:
    """The tensors whose device the flat buffers take, before anything is validated: the
    optimizer's trainable ones first (as `zerolite.plan.shard_plan` takes them), then the model's.
    Never raises: odd input is refused later, inside the ranks' agreement."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        for group in getattr(opt, "param_groups", None) or []:
            params = group.get("params", []) if isinstance(group, dict) else []
            for p in params if isinstance(params, (list, tuple)) else []:
                if isinstance(p, torch.Tensor) and p.requires_grad:
                    yield p
    if isinstance(model, nn.Module):
        yield from model.parameters()


def _agree_on_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig,
    world: Group,
) -> tuple[torch.optim.Optimizer, ShardPlan, int | None, list[str]]:
    """Validate and plan on every rank, then agree: raises on every rank if any rank failed
    or ranks describe different plans. Returns the optimizer (several as one
    `MultiOptimizer`), the plan, the shard group size (None: every rank) and the lines
    agreed on."""
    plan: ShardPlan | None = None
    k: int | None = None
    with agreed("zerolite.shard()", world) as lines:
        if isinstance(optimizer, (list, tuple)):
            optimizer = MultiOptimizer(optimizer)
        k = shard_group_size(config, world.size)
        lines.append(f"shard_group_size: {k or world.size} of {world.size} ranks")
        check_not_sharded(model, optimizer)
        plan = plan_layout(model, inner_optimizers(optimizer), config, device=world.buffer_device)
        lines += plan.describe(config, model, class_name(optimizer), optimizer.param_groups)
        lines += describe_quantization(config, model)
    # (Reached only when every rank planned: `agreed` raised otherwise.)
    return cast(torch.optim.Optimizer, optimizer), cast(ShardPlan, plan), k, lines


def _agree_on_offload(
    plan: ShardPlan, optimizer: torch.optim.Optimizer, config: ZeroConfig, group: Group
) -> tuple[OffloadLayout | None, DiskArena | HostArena | None]:
    """This rank's offload layout over its shard group, and its arena, reserved before
    anything changes (`reserve_arena`); a tier that cannot hold it (a bad
    directory, too little space) raises on every rank."""
    offload, arena = None, None
    with agreed("zerolite.shard() (offload)", group.world):
        offload = plan_offload(plan, optimizer, config, rank=group.rank, world_size=group.size)
        if offload is not None:
            check_offload(offload, config, plan.device)
            arena = reserve_arena(offload, config, group.rank)
    return offload, arena


def _build(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    group: Group,
    plan: ShardPlan,
    layout_digest: str,
    reserved: tuple[OffloadLayout | None, DiskArena | HostArena | None],
) -> ShardedOptimizer:
    """Every rank agreed: build, one step per concern (the module docstring)."""
    offload, arena = reserved
    if plan.partition == "tensor":  # each buffer's parameters ordered by owner: the layout
        plan = assign_owners(plan, group.size)
    exchanges = _choose_exchanges(model, plan, config, group)
    all_flats, meta_build = _place_parameters(model, plan, exchanges, config, group)
    flats, frozen_flats = all_flats[: len(plan.flat_params)], all_flats[len(plan.flat_params) :]
    masters = _make_masters(flats, config, group, offload)
    tier = _adopt_optimizer(optimizer, masters, plan, reserved, config, group)
    reducer, grads = _wire_gradients(flats, config, group)
    scheduler = None
    if plan.units is not None and isinstance(grads, ShardGradsInBackward):
        scheduler = _schedule_units(plan, all_flats, flats, group, config, grads)
    _change_model(model, grads, reducer, scheduler, all_flats, meta_build)
    state = ShardState(
        model, group=group, config=config, inner=optimizer, flats=flats, masters=masters,
        frozen_flats=frozen_flats, reducer=reducer, grads=grads, scheduler=scheduler,
        layout_digest=layout_digest, meta_build=meta_build, offload=tier,
    )
    sharded = ShardedOptimizer(optimizer, state)
    register(model, state, sharded)
    if group.world.rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info(_announcement(sharded, plan.partition))
    return sharded


def _announcement(sharded: ShardedOptimizer, partition: str) -> str:
    """The one line `shard()` logs on rank 0 (at INFO): that zerolite is on, how, and what
    this rank holds now (`zerolite.memory.footprint`; the optimizer's moments appear at its
    first step)."""
    # Here, not at the top: `import zerolite` stays light (zerolite.memory loads on first use).
    from zerolite.memory.footprint import footprint

    config, group, flats = sharded.config, sharded.group, sharded.flats
    dtype = str(config.param_dtype).removeprefix("torch.")
    precision = "fp32" if dtype == "float32" else f"{dtype} parameters with fp32 masters"
    note = _AUTOCAST_NOTE.get()
    if note is not None:  # fp32 parameters are their own masters
        precision = f"{'fp32 parameters' if dtype == 'float32' else precision} {note}"
    held = footprint(sharded)
    mib = 2.0**20
    return (
        f"zerolite: stage {config.stage} over {group.world.size} ranks, {precision}, partition "
        f"{partition}: {sum(len(f.params) for f in flats)} parameters "
        f"({sum(f.numel for f in flats)} elements) in {len(flats)} flat buffers; rank 0 holds "
        f"{held.model_states / mib:.2f} MiB (parameters {held.params / mib:.2f}, gradients "
        f"{held.grads / mib:.2f}, fp32 masters {held.master / mib:.2f}; optimizer state from "
        f"its first step)"
    )


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
    plan: ShardPlan, index: int, exchange: Exchange, config: ZeroConfig
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
    )
    flat.bind()
    return flat


def _place_parameters(
    model: nn.Module,
    plan: ShardPlan,
    exchanges: list[Exchange],
    config: ZeroConfig,
    group: Group,
) -> tuple[list[FlatParamBuffer], MetaBuild | None]:
    """Every flat buffer, bound to its parameters, in `ShardPlan.all_flat_params` order, and
    a meta build's `MetaBuild` (None otherwise). Stage 3 keeps only this rank's shards."""
    shards = STAGES[config.stage].shards_parameters

    def make_flat(index: int) -> FlatParamBuffer:
        return _bound_flat(plan, index, exchanges[index], config)

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
    flats: list[FlatParamBuffer], config: ZeroConfig, group: Group, offload: OffloadLayout | None
) -> list[MasterShard]:
    """The fp32 master of each trained buffer's shard; the first pieces of each are left to
    the offload tier. A quantized all-gather overwrites a replicated buffer's own shard, so
    there the masters are copies even in fp32."""
    copy = config.quantize_gather and group.size > 1
    return [
        MasterShard(
            flat, 0 if offload is None else offload.per_buffer[i], copy=copy and flat.replicated
        )
        for i, flat in enumerate(flats)
    ]


def _adopt_optimizer(
    optimizer: torch.optim.Optimizer,
    masters: list[MasterShard],
    plan: ShardPlan,
    reserved: tuple[OffloadLayout | None, DiskArena | HostArena | None],
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
        optimizer, pieces_of(masters, optimizer.state), plan.group_of,
        [p for _, p in plan.frozen],
    )
    offload, arena = reserved
    if offload is None:
        return None
    return build_tier(offload, masters, optimizer, config, group.rank, arena)


def _wire_gradients(
    flats: list[FlatParamBuffer], config: ZeroConfig, group: Group
) -> tuple[GradReducer, KeepFullGrads | ShardGradsInBackward]:
    """One gradient bucket per trained flat buffer, the reducer over them, and the hooks:
    full gradients kept until the step (stage 1) or sharded in backward (stages 2-3)."""
    policy = STAGES[config.stage]
    for flat in flats:
        for p in flat.params:
            p.grad = None
    buckets = [
        GradBucket(
            flat,
            full_dtype=policy.grad_dtype(config.param_dtype, config.grad_dtype),
            shard_dtype=config.grad_dtype,
            keep_full=not policy.shards_gradients,
        )
        for flat in flats
    ]
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
    # calls backward; they must not be traced (see zerolite.compile_guard).
    grads.on_backward_end = not_compiled(on_backward_end)
    return scheduler
