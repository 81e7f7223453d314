"""Before anything is built: where the flat buffers live and over which ranks, and the
plan every rank agrees on.

`assemble` (`zerolite.assemble.steps`) calls these three in order. Each validates and plans
on every rank inside one agreement (`zerolite.comm.consensus.agreed`), so an error on any
rank -- a bad argument, a model that differs, too little disk for the offload tier -- is
raised on every rank, and nothing has been changed yet:

1. `world_of`: every data-parallel rank, with the device the flat buffers will live on (it
   decides where the agreement itself travels, so it comes first);
2. `agree_on_plan`: which parameters go into which flat buffer (`zerolite.plan`), with
   the lines the ranks compare;
3. `agree_on_offload`: what the offload tier holds on this rank, and its arena, reserved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import nn

from zerolite.comm.collectives import Group
from zerolite.comm.consensus import agreed
from zerolite.comm.devices import backends_of, buffer_device, check_buffer_device
from zerolite.comm.hybrid import data_parallel_group, shard_group_size
from zerolite.config import ZeroConfig
from zerolite.optim.multi import MultiOptimizer, class_name, inner_optimizers
from zerolite.optim.sharded_optimizer import check_not_sharded
from zerolite.params.tiered_shard import ShardTier
from zerolite.plan.offload import OffloadPlan, plan_offload
from zerolite.plan.param_offload import param_tier_bytes
from zerolite.plan.quantization import describe_quantization
from zerolite.plan.shard_plan import ShardPlan, plan_layout
from zerolite.state.arena import DiskArena, HostArena
from zerolite.state.offload import check_offload, reserve_arena
from zerolite.state.param_tier import reserve_param_tier

__all__ = ["agree_on_offload", "agree_on_plan", "world_of"]


def world_of(model: object, optimizer: object, config: ZeroConfig) -> Group:
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


def agree_on_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig,
    world: Group,
) -> tuple[torch.optim.Optimizer, ShardPlan, int | None, list[str], ZeroConfig]:
    """Validate and plan on every rank, then agree: raises on every rank if any rank failed
    or ranks describe different plans. Returns the optimizer (several as one
    `MultiOptimizer`), the plan, the shard group size (None: every rank), the lines
    agreed on and the config with ``param_dtype`` decided (`ShardPlan.param_dtype`)."""
    plan: ShardPlan | None = None
    k: int | None = None
    with agreed("zerolite.shard()", world) as lines:
        if isinstance(optimizer, (list, tuple)):
            optimizer = MultiOptimizer(optimizer)
        k = shard_group_size(config, world.size)
        lines.append(f"shard_group_size: {k or world.size} of {world.size} ranks")
        check_not_sharded(model, optimizer)
        plan = plan_layout(model, inner_optimizers(optimizer), config, device=world.buffer_device)
        config = config.with_param_dtype(plan.param_dtype)  # re-checks the fields together
        lines += plan.describe(config, model, class_name(optimizer), optimizer.param_groups)
        lines += describe_quantization(config, model)
    # (Reached only when every rank planned: `agreed` raised otherwise.)
    return cast(torch.optim.Optimizer, optimizer), cast(ShardPlan, plan), k, lines, config


def agree_on_offload(
    plan: ShardPlan, optimizer: torch.optim.Optimizer, config: ZeroConfig, group: Group
) -> tuple[OffloadPlan | None, DiskArena | HostArena | None, ShardTier | None]:
    """This rank's offload plan over its shard group, and its arena, reserved before
    anything changes (`reserve_arena`), and the ``offload_params`` tier, reserved too
    (`reserve_param_tier`); a tier that cannot hold its bytes (a bad directory, too little
    space) raises on every rank."""
    offload, arena, params_tier = None, None, None
    with agreed("zerolite.shard() (offload)", group.world):
        offload = plan_offload(plan, optimizer, config, rank=group.rank, world_size=group.size)
        if offload is not None:
            check_offload(offload, config, plan.device)
            arena = reserve_arena(offload, config, group.rank)
        parked = param_tier_bytes(plan, config, rank=group.rank, world_size=group.size)
        params_tier = reserve_param_tier(config, parked, group.rank)
    return offload, arena, params_tier
