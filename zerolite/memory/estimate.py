"""`estimate`: what `shard()` will hold per rank, before building anything.

Given a parameter count, it is `formula` (no padding). Given a model, it plans exactly
as `zerolite.shard` does -- the same flat buffers (buckets, or units in stage 3), the
same padding, the same per-parameter master pieces on the chosen rank -- and counts:

- params: full padded buffers (stages 1-2) or shards (stage 3) in ``param_dtype``,
  plus every parameter zerolite does not manage (frozen, outside the optimizer);
- grads: full padded buffers in ``param_dtype`` (stage 1) or shards in the reduce dtype
  (stages 2-3); parameters outside the optimizer that require grad keep a full gradient;
- master: fp32 shards (padding included) when ``param_dtype`` is 16-bit;
- optimizer_state: per-element fp32 state per piece (padding excluded) plus the 0-dim
  scalar state per piece (Adam's ``step``: 4 bytes);
- transient: the configured bound, not a measurement: stage 1 the reduced shards at
  the step; stage 2 two buckets (one filling, one in flight) and one autograd gradient of
  the largest parameter; stage 3 adds ``prefetch + 1`` gathered units plus the root;
  16-bit gradients add the fp32 upcast of one shard.
- offloaded (``config.offload``): the pieces `zerolite.state.offload` would move to the
  tier -- their per-element state, and their masters when 16-bit -- taken out of
  ``master`` and ``optimizer_state``; transient adds the streamed step's three chunks
  in flight (each at most the tier's size).
- offloaded (``config.offload_params``, stage 3): every parameter and gradient shard,
  parked on its tier between uses (`zerolite.plan.param_offload`), taken out of ``params``
  and ``grads``; transient adds the step's bucket and the next one read ahead (parameter
  and gradient shards of the largest bucket, twice).

The four model-state fields are byte-exact against `footprint` of the same model,
optimizer and config (that is tested), so it can be used to choose a stage, a world
size and a batch size before a run.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from zerolite.comm.hybrid import shard_group_size
from zerolite.config import ZeroConfig
from zerolite.memory.footprint import MemoryBreakdown, formula, layout_imbalance
from zerolite.optim.multi import inner_optimizers
from zerolite.optim.sharded_optimizer import check_not_sharded, require_sharded_optimizer
from zerolite.plan.layout import FlatLayout
from zerolite.plan.offload import (
    OffloadPlan,
    assign_slots,
    chunk_bytes_for,
    state_fields,
    tensor_fields_of,
)
from zerolite.plan.optimizers import NAMED, build_named, name_of, spec_of
from zerolite.plan.owners import assign_owners
from zerolite.plan.param_offload import arena_bytes
from zerolite.plan.quantization import residual_numel
from zerolite.plan.shard_plan import ShardPlan, plan_layout
from zerolite.plan.stages import STAGES

__all__ = ["estimate", "estimate_planned", "state_bytes"]


def _optimizer_of_groups(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """Per param group of ``optimizer``, the user's optimizer stepping it (several optimizers
    in one model: `zerolite.optim.multi`)."""
    return [o for o in inner_optimizers(optimizer) for _ in o.param_groups]


def state_bytes(optimizer: torch.optim.Optimizer, group: dict) -> tuple[int, int]:
    """(bytes per element, bytes of 0-dim scalars) of ``optimizer``'s state for one tensor."""
    spec = spec_of(optimizer)
    if spec is None:
        raise ValueError(
            f"estimate() does not know the state fields of {type(optimizer).__name__}; use a "
            "count, or measure with footprint()"
        )
    return spec.state_bytes(group)


@dataclasses.dataclass
class _Buffer:
    layout: FlatLayout
    groups: list[int]  # optimizer group of each parameter in the buffer
    root: bool = False  # stage 3: the root unit


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _breakdown(
    buffers: list[_Buffer],
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    rank: int,
    unmanaged: list[nn.Parameter],
    frozen: list[FlatLayout],
    offload: OffloadPlan | None = None,
    replicas: int = 1,
) -> MemoryBreakdown:
    """``frozen``: stage 3's buffers of frozen parameters (sharded, no gradient, no state);
    ``offload``: what moves to the tier; ``replicas``: hybrid sharding's replica groups."""
    policy = STAGES[config.stage]
    p = _size(config.param_dtype)
    g = _size(config.grad_dtype)  # reduced gradients (the buckets and their shards)
    kept_g = _size(policy.kept_grad_dtype(config.param_dtype, config.grad_dtype))
    padded = sum(b.layout.padded_numel for b in buffers)
    shard = sum(b.layout.shard_size(rank) for b in buffers)
    stepped_by = _optimizer_of_groups(optimizer)

    def held(sharded: bool) -> int:  # elements per rank
        return shard if sharded else padded

    state = 0
    for b in buffers:
        for span in b.layout.spans(rank):
            g_index = b.groups[span.index]
            per_element, scalars = state_bytes(stepped_by[g_index], optimizer.param_groups[g_index])
            state += span.numel * per_element + scalars
    other = sum(q.numel() * q.element_size() for q in unmanaged)
    other_grads = sum(q.numel() * q.element_size() for q in unmanaged if q.requires_grad)
    upcast = (
        0
        if config.grad_dtype == torch.float32
        else 4 * max(b.layout.shard_size(rank) for b in buffers)
    )
    largest_bucket = max(b.layout.padded_numel for b in buffers)
    largest_param = max(n for b in buffers for n in b.layout.numels)
    if policy.shards_gradients:  # two buckets (filling, in flight), one autograd gradient
        transient = 2 * largest_bucket * g + largest_param * p + upcast
    else:  # the reduced shards at the step
        transient = shard * g + upcast
    if policy.shards_parameters:  # gathered units
        units = [b.layout.padded_numel for b in buffers if not b.root]
        root = sum(b.layout.padded_numel for b in buffers if b.root)
        units += [f.padded_numel for f in frozen]
        transient += ((config.prefetch + 1) * max(units, default=0) + root) * p
    frozen_shards = sum(f.shard_numel for f in frozen) * p
    world = buffers[0].layout.world_size
    # A quantized gather overwrites a replicated buffer's own shard: the master is a copy.
    copied = config.quantize_gather and world > 1 and not policy.shards_parameters
    master = (
        0
        if config.param_dtype == torch.float32 and not copied
        else 4 * held(policy.shards_optimizer_state)
    )
    if offload is not None:
        master -= offload.master_bytes
        state -= offload.state_bytes
        # Whole owned tensors are never cut: a larger one widens its staging buffer.
        whole = max((s.nbytes for s in offload.slots if s.shapes), default=0)
        transient += 3 * min(offload.nbytes, max(whole, chunk_bytes_for(offload.nbytes)))
    parked = _parked(buffers, frozen, config, rank) if config.offload_params else 0
    if parked:  # stage 3's shards on the tier between uses
        # The step's bucket (parameter and gradient shard) and the next one, read ahead.
        transient += 2 * max(b.layout.shard_size(rank) for b in buffers) * (p + g)
    return MemoryBreakdown(
        params=(0 if parked else held(policy.shards_parameters) * p + frozen_shards) + other,
        grads=(0 if parked else held(policy.shards_gradients) * kept_g) + other_grads,
        master=master,
        optimizer_state=state,
        transient=transient,
        residual=4 * sum(
            residual_numel(b.layout.shard_numel, world, config, replicas) for b in buffers
        ),
        ownership_imbalance=layout_imbalance(b.layout for b in buffers),
        offloaded=parked + (0 if offload is None else offload.nbytes),
        offload_tier=config.offload or config.offload_params,
    )


def _parked(buffers: list[_Buffer], frozen: list[FlatLayout], config: ZeroConfig,
            rank: int) -> int:
    """Bytes of ``offload_params``' arena: every parameter and gradient shard, aligned as
    `zerolite.plan.param_offload` lays them."""
    shards = [b.layout.shard_size(rank) for b in buffers]
    return arena_bytes([(n, config.param_dtype) for n in shards]
                       + [(f.shard_numel, config.param_dtype) for f in frozen]
                       + [(n, config.grad_dtype) for n in shards])


def estimate(
    model_or_count: nn.Module | int | float,
    *,
    world_size: int,
    config: ZeroConfig | None = None,
    optimizer: str | torch.optim.Optimizer = "adamw",
    rank: int = 0,
) -> MemoryBreakdown:
    """Per-rank memory of sharding ``model_or_count`` over ``world_size`` ranks.

    Single process, no communication; nothing is allocated but the optimizer object.

    Args:
        model_or_count: the model `shard()` will receive, or a parameter count (then
            the result is `formula`, without padding; transient 0).
        world_size: N.
        config: the `ZeroConfig` (``stage=0`` means DDP, count only); None is ``ZeroConfig()``.
            Its ``shard_group_size`` k (hybrid sharding) shards states over k of the N ranks.
            ``param_dtype=None`` counts the model's own dtype, as `shard()` takes it (fp32
            for a parameter count).
        optimizer: the optimizer instance `shard()` will receive (built on this model; a
            ``zerolite.optim.multi.MultiOptimizer`` of several), or one of ``"adamw"``,
            ``"adam"``, ``"sgd"``, ``"sgd_momentum"``, ``"adagrad"``,
            ``"rmsprop"`` (default hyperparameters, over all the model's parameters).
        rank: whose shard to count (pieces and so scalar state differ slightly by rank;
            with hybrid sharding, world rank r holds shard r mod k).
    Returns:
        A `MemoryBreakdown`; its four model-state fields equal ``footprint(opt)`` after
        ``opt = shard(model, optimizer, config)`` on that rank.
    """
    config = ZeroConfig() if config is None else config
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate(): world_size must be an int >= 1, got {world_size!r}")
    # Hybrid sharding: every layout below is over the k ranks of a shard group.
    shards = shard_group_size(config, world_size) or world_size
    if not isinstance(model_or_count, nn.Module):
        # A count has no dtype of its own: param_dtype=None (the model's) counts fp32.
        dtype = torch.float32 if config.param_dtype is None else config.param_dtype
        return formula(_count(model_or_count), world_size=world_size, stage=config.stage,
                       param_dtype=dtype, reduce_dtype=config.reduce_dtype,
                       optimizer=_formula_name(optimizer), offload=config.offload,
                       offload_fraction=config.offload_fraction,
                       quantize_gather=config.quantize_gather,
                       error_feedback=config.quantize_reduce and config.error_feedback,
                       shard_group_size=None if shards == world_size else shards)
    if config.stage == 0:
        raise ValueError("stage=0 (DDP) is estimated from a count: estimate(num_params, ...)")
    return estimate_planned(model_or_count, world_size=world_size, config=config,
                            optimizer=optimizer, rank=rank)[0]


def estimate_planned(
    model: nn.Module,
    *,
    world_size: int,
    config: ZeroConfig,
    optimizer: str | torch.optim.Optimizer = "adamw",
    rank: int = 0,
) -> tuple[MemoryBreakdown, OffloadPlan | None]:
    """`estimate` of a model (``config.stage`` 1-3; arguments checked by `estimate`), and
    the offload plan it counted: the one ``shard()`` makes on ``rank`` (None: no offload).

    Two configurations that differ only in ``offload_fraction`` and get equal plans shard
    and step identically (the fraction is read nowhere else): `zerolite.memory.plan`
    predicts one of them for both."""
    shards = shard_group_size(config, world_size) or world_size
    if isinstance(optimizer, str):
        opt = build_named(_formula_name(optimizer), list(model.parameters()))
    else:
        opt = optimizer
    check_not_sharded(model, opt)
    plan = plan_layout(model, inner_optimizers(opt), config)
    config = config.with_param_dtype(plan.param_dtype)  # fills None: the model's own dtype
    if plan.partition == "tensor":
        plan = assign_owners(plan, shards)
    root_last = STAGES[config.stage].shards_parameters  # the last buffer is the root unit's
    buffers = [
        _Buffer(
            plan.layout(b, shards),
            [plan.param_group_of[id(p)] for _, p in params],
            root=root_last and b == len(plan.flat_params) - 1,
        )
        for b, params in enumerate(plan.flat_params)
    ]
    frozen = [
        FlatLayout(tuple(p.numel() for _, p in params), shards)
        for params in plan.frozen_flat_params
    ]
    managed = {id(p) for params in plan.all_flat_params for _, p in params}
    unmanaged = [p for p in model.parameters() if id(p) not in managed]
    offload = None
    if config.offload is not None:
        offload = _offload(plan, buffers, opt, config, rank % shards, shards)
    # A world rank's shard is its rank within its shard group (consecutive blocks of k).
    return _breakdown(
        buffers, opt, config, rank % shards, unmanaged, frozen, offload, world_size // shards
    ), offload


def _offload(
    plan: ShardPlan,
    buffers: list[_Buffer],
    opt: torch.optim.Optimizer,
    config: ZeroConfig,
    rank: int,
    shards: int,
) -> OffloadPlan:
    """The offload plan `shard()` would make for ``rank`` of ``shards``."""
    # The probe step runs on CPU: a meta model's state has the same keys and dtypes.
    cpu = torch.device("cpu")
    owned = plan.owners is not None
    fields = [] if owned else [state_fields(opt, g, cpu) for g in opt.param_groups]
    return assign_slots(
        [b.layout.numels for b in buffers], [b.groups for b in buffers], fields,
        config=config, rank=rank, world_size=shards, owners=plan.owners,
        shapes=[[tuple(p.shape) for _, p in params] for params in plan.flat_params],
        tensor_fields=tensor_fields_of(opt, cpu) if owned else None,
    )


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TypeError(
            f"estimate(): model_or_count must be an nn.Module or a whole number of parameters, "
            f"got {value!r}"
        )
    if value <= 0:
        raise ValueError(f"estimate(): the parameter count must be positive, got {value!r}")
    return int(value)


def _formula_name(optimizer: str | torch.optim.Optimizer) -> str:
    """The `STATE_BYTES_PER_PARAM` key for ``optimizer``; an unknown one is refused, never
    guessed."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name = name_of(optimizer)
    elif isinstance(optimizer, str):
        name = optimizer
    else:
        raise TypeError(
            f"estimate(): optimizer must be a name or a torch.optim.Optimizer, got {optimizer!r}"
        )
    if name not in NAMED:
        raise ValueError(
            f"estimate(): no state fields known for optimizer {name!r}; use one of "
            f"{sorted(NAMED)}, "
            "or pass the model with the optimizer instance, or measure with footprint()"
        )
    return name


def estimate_sharded(opt) -> MemoryBreakdown:  # noqa: ANN001 - a ShardedOptimizer
    """`estimate` for an optimizer already built by `shard()`, from its own layout."""
    require_sharded_optimizer(opt, "estimate_sharded()")
    buffers = []
    param_group_of = {id(t): g for g, group in enumerate(opt.param_groups) for t in group["params"]}
    groups_of = {id(flat): [0] * len(flat.params) for flat in opt.flats}
    for piece in opt.shard_state.pieces():
        groups_of[id(piece.flat)][piece.index] = param_group_of[id(piece.master)]
    for i, flat in enumerate(opt.flats):
        root = STAGES[opt.config.stage].shards_parameters and i == len(opt.flats) - 1
        buffers.append(_Buffer(flat.layout, groups_of[id(flat)], root=root))
    model = opt.model
    managed = {id(p) for flat in [*opt.flats, *opt.frozen_flats] for p in flat.params}
    unmanaged = [p for p in model.parameters() if id(p) not in managed] if model is not None else []
    return _breakdown(
        buffers,
        opt.optimizer,
        opt.config,
        opt.group.rank,
        unmanaged,
        [f.layout for f in opt.frozen_flats],
        None if opt.shard_state.offload is None else opt.shard_state.offload.plan,
        opt.group.world.size // opt.group.size,
    )
