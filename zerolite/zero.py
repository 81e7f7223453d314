"""`shard()`: validate, agree across ranks, then wire the pieces a stage needs.

Nothing is modified until every rank has validated its inputs and all ranks agree on
the plan (`zerolite.comm.consensus`). Then:

- managed parameters (those the optimizer holds and that require grad) are packed into
  flat buffers of about ``bucket_size_mb`` (`zerolite.plan.shard_plan`), in reverse registration
  order (roughly the order backward produces gradients); rank 0's values are broadcast, as DDP does
  (a model built on the meta device is materialised and initialised instead, unit by
  unit, see `zerolite.params.meta_init`);
- the optimizer's param groups are re-pointed at fp32 master pieces and any existing
  state is re-sharded;
- what the stage shards (`zerolite.plan.stages.STAGES`) picks the pieces: kept full
  gradients wire `KeepFullGrads`, sharded ones `ShardGradsInBackward`; both share
  buckets, the reducer and the optimizer. Sharded parameters add one buffer per unit
  and the `UnitScheduler` that gathers them.
"""

from __future__ import annotations

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
from zerolite.grads.reducer import GradReducer
from zerolite.optim.multi import MultiOptimizer, class_name, inner_optimizers
from zerolite.optim.repoint import repoint_optimizer
from zerolite.optim.sharded_optimizer import ShardedOptimizer, check_not_sharded
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.meta_init import (
    check_before_first_forward,
    materialize,
)
from zerolite.params.model_changes import guard_conversions, install_no_sync
from zerolite.params.unit_scheduler import UnitScheduler
from zerolite.plan.offload import OffloadLayout, plan_offload
from zerolite.plan.owners import assign_owners
from zerolite.plan.quantization import buffer_wires, describe_quantization, skipped_parameters
from zerolite.plan.shard_plan import ShardPlan, plan_layout
from zerolite.plan.stages import STAGES
from zerolite.plan.units import Unit
from zerolite.state.master import MasterShard
from zerolite.state.offload import build_tier, check_offload
from zerolite.state.shard_state import ShardState, pieces_of, register

__all__ = ["shard"]

logger = logging.getLogger(__name__)


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
    pg = data_parallel_group(config)
    # Where the flat buffers live decides where the ranks' agreement travels, so it is
    # decided first; a group that cannot carry it is refused on every rank alike.
    device = buffer_device(_candidate_parameters(model, optimizer), config.device, pg)
    check_buffer_device(device, backends_of(pg), config.collectives)
    world = Group(
        pg, collectives=config.collectives, timeout_s=config.timeout_s, device=device
    )
    plan: ShardPlan | None = None
    k: int | None = None
    # Raises on every rank if any rank failed or ranks describe different plans.
    with agreed("zerolite.shard()", world) as lines:
        if isinstance(optimizer, (list, tuple)):
            optimizer = MultiOptimizer(optimizer)
        k = shard_group_size(config, world.size)
        lines.append(f"shard_group_size: {k or world.size} of {world.size} ranks")
        check_not_sharded(model, optimizer)
        plan = plan_layout(model, inner_optimizers(optimizer), config, device=device)
        lines += plan.describe(config, model, class_name(optimizer), optimizer.param_groups)
        lines += describe_quantization(config, model, plan.partition)
    group = sharding_group(world, k, config)
    offload = None
    # The tier is laid out over this rank's shard group; a bad directory raises on every rank.
    with agreed("zerolite.shard() (offload)", world):
        offload = plan_offload(
            cast(ShardPlan, plan), optimizer, config, rank=group.rank, world_size=group.size
        )
        if offload is not None:
            check_offload(offload, config, cast(ShardPlan, plan).device)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    with phase_events.phase("build", device):
        sharded = _build(
            model, cast(torch.optim.Optimizer, optimizer), config, group, cast(ShardPlan, plan),
            digest, offload,
        )
    phase_events.built(sharded)
    return sharded


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


def _build(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    group: Group,
    plan: ShardPlan,
    layout_digest: str,
    offload: OffloadLayout | None = None,
) -> ShardedOptimizer:
    policy = STAGES[config.stage]
    # Whole-tensor ownership: each buffer's parameters reordered by owner (before any buffer
    # exists: the order is the layout).
    if plan.partition == "tensor":
        plan = assign_owners(plan, group.size)
    all_flat_params = plan.all_flat_params
    unit_buffers = plan.unit_buffers()
    exchanges = _choose_exchanges(model, plan, config, group)

    def make_flat(index: int) -> FlatParamBuffer:
        return _bound_flat(plan, index, exchanges[index], config)

    meta_build = None
    if plan.on_meta:
        # Every rank computes the same values from rank 0's generator: nothing to broadcast.
        # A unit is complete once its module is initialised (the root: at the end).
        closed_by = {id(u.module): b for u, b in zip((plan.units or [])[:-1], unit_buffers)}
        all_flats, meta_build = materialize(
            model, all_flat_params, closed_by, make_flat,
            param_dtype=config.param_dtype, device=plan.device, shard=policy.shards_parameters,
            init_fn=config.init_fn, group=group.world,
        )
    else:
        # Every rank starts from rank 0's values, as with DDP.
        all_flats = [make_flat(index) for index in range(len(all_flat_params))]
        for flat in all_flats:
            broadcast(
                flat.data,
                0,
                group.world,
                what=f"shard()'s broadcast of rank 0's flat buffer {flat.index}",
            )
        if policy.shards_parameters:
            for flat in all_flats:
                flat.shard_only()
    if not plan.on_meta:  # (a meta build computes the same values on every rank)
        # As DDP: every rank starts from rank 0's unsharded parameters and buffers.
        in_flats = {id(p) for flat in all_flats for p in flat.params}
        unsharded = [p for p in model.parameters() if id(p) not in in_flats]
        broadcast_coalesced(
            [*unsharded, *model.buffers()], 0, group.world,
            what="shard()'s broadcast of rank 0's unsharded parameters and buffers",
        )
    flats, frozen_flats = all_flats[: len(plan.flat_params)], all_flats[len(plan.flat_params) :]
    # A quantized all-gather overwrites a replicated buffer's own shard: masters are copies.
    copy = config.quantize_gather and group.size > 1
    masters = [
        MasterShard(
            flat, 0 if offload is None else offload.per_buffer[i], copy=copy and flat.replicated
        )
        for i, flat in enumerate(flats)
    ]
    if isinstance(optimizer, MultiOptimizer):
        optimizer.bind()
    repoint_optimizer(
        optimizer, pieces_of(masters, optimizer.state), plan.group_of,
        [p for _, p in plan.frozen],
    )
    tier = None if offload is None else build_tier(offload, masters, optimizer, config, group.rank)
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
    reducer = GradReducer(buckets, group)
    grads = ShardGradsInBackward(reducer) if policy.shards_gradients else KeepFullGrads(reducer)
    scheduler = None
    if plan.units is not None and isinstance(grads, ShardGradsInBackward):
        unit_flats = [[all_flats[i] for i in buffers] for buffers in unit_buffers]
        scheduler = _schedule_units(plan.units, unit_flats, flats, group, config, grads)
    grads.watch_root(model)
    # torch.compile: zerolite's hooks are graph breaks, never traced (see compile_guard).
    exclude_from_compile([*grads._handles, *(scheduler._handles if scheduler is not None else [])])
    guard_conversions(
        model,
        {
            id(p): (flat.data.dtype, flat.data.device)
            for flat in [*flats, *frozen_flats]
            for p in flat.params
        },
    )
    install_no_sync(model, reducer)
    check_before_first_forward(model, meta_build)
    state = ShardState(
        model,
        group=group,
        config=config,
        inner=optimizer,
        flats=flats,
        masters=masters,
        frozen_flats=frozen_flats,
        reducer=reducer,
        grads=grads,
        scheduler=scheduler,
        layout_digest=layout_digest,
        meta_build=meta_build,
    )
    state.offload = tier
    sharded = ShardedOptimizer(optimizer, state)
    state.optimizer = sharded
    register(model, state)
    numel = sum(flat.numel for flat in flats)
    if group.world.rank == 0:
        logger.info(
            "zerolite: stage %d (partition %s) sharded %d parameters (%d elements) into %d flat "
            "buffers across %d ranks",
            config.stage,
            plan.partition,
            sum(len(f.params) for f in flats),
            numel,
            len(flats),
            group.size,
        )
    return sharded


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


def _schedule_units(
    units: list[Unit],
    unit_flats: list[list[FlatParamBuffer]],
    flats: list[FlatParamBuffer],
    group: Group,
    config: ZeroConfig,
    grads: ShardGradsInBackward,
) -> UnitScheduler:
    """Stage 3: unshard/reshard hooks, freed units when their gradients are in."""
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
