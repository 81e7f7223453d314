"""`plan_layout`: validate `shard()`'s inputs and decide its flat buffers, changing nothing.

A `ShardPlan` says which parameters go into which flat buffer (in the order backward
produces their gradients), which optimizer group each belongs to, and, in stage 3, the
units whose buffers are gathered together. `shard()` agrees on it across ranks
(`ShardPlan.describe`) before building anything; `zerolite.memory.estimate` sizes it
without building.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zerolite.comm.devices import buffer_device
from zerolite.comm.hybrid import data_parallel_group
from zerolite.config import ZeroConfig
from zerolite.plan.inputs import (
    check_meta_build,
    check_model,
    check_nothing_on_meta,
    check_one_device,
    refuse_sparse_gradients,
    trained_parameters,
)
from zerolite.plan.layout import FlatLayout, size_partition
from zerolite.plan.optimizers import check_optimizer, check_tensor_optimizer, resolve_partition
from zerolite.plan.precision import resolve_param_dtype
from zerolite.plan.stages import STAGES
from zerolite.plan.units import Unit, find_units

__all__ = ["ShardPlan", "plan_layout"]

Params = list[tuple[str, nn.Parameter]]  # (name, parameter) pairs of one flat buffer


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Everything `shard()` decided, before anything is modified.

    Attributes:
        device: where the flat buffers live.
        flat_params: per trained flat buffer, in buffer order, its (name, param) list.
        param_group_of: ``id(param) -> index`` of its param group (over every user optimizer).
        frozen: (group index, param) held by the optimizer but not trainable.
        units: stage 3: the units, root last.
        frozen_flat_params: stage 3: per frozen flat buffer, its (name, param) list.
        on_meta: built under ``torch.device("meta")`` (`zerolite.params.meta_init`).
        partition: ``"flat"`` (equal 1-D shards) or ``"tensor"`` (whole parameters to
            owners, `zerolite.plan.owners`).
        owners: ``"tensor"``, once `zerolite.plan.owners.assign_owners` ran: per trained
            buffer, its parameters' owner ranks.
        param_dtype: the flat buffers' dtype: ``config.param_dtype``, or the model's own
            when that is None (`zerolite.plan.inputs.resolve_param_dtype`).
    """

    device: torch.device
    flat_params: list[Params]
    param_group_of: dict[int, int]
    frozen: list[tuple[int, nn.Parameter]]
    units: list[Unit] | None = None
    frozen_flat_params: list[Params] = dataclasses.field(default_factory=list)
    on_meta: bool = False
    partition: str = "flat"
    owners: list[tuple[int, ...]] | None = None
    param_dtype: torch.dtype = torch.float32

    @property
    def all_flat_params(self) -> list[Params]:
        """Every flat buffer's parameters in index order: trained buffers (whose indices
        are also the gradient buckets'), then stage 3's frozen ones."""
        return [*self.flat_params, *self.frozen_flat_params]

    def layout(self, index: int, world_size: int) -> FlatLayout:
        """The layout of flat buffer ``index`` (`all_flat_params` order) over ``world_size``."""
        params = self.all_flat_params[index]
        owned = self.owners is not None and index < len(self.owners)
        owners = self.owners[index] if owned else None
        return FlatLayout(tuple(p.numel() for _, p in params), world_size, owners)

    def unit_buffers(self) -> list[list[int]]:
        """Stage 3: each unit's buffer indices (trained, then frozen), root last."""
        # Keyed by every parameter: with owners a buffer's first parameter need not be its
        # unit's first (`zerolite.plan.owners.assign_owners` sorts each buffer by owner).
        index_of = {id(p): i for i, params in enumerate(self.all_flat_params) for _, p in params}
        return [
            [index_of[id(ps[0][1])] for ps in (u.params, u.frozen) if ps] for u in self.units or []
        ]

    def describe(
        self,
        config: ZeroConfig,
        model: nn.Module,
        optimizer_name: str,
        param_groups: Sequence[Mapping[str, Any]],
    ) -> list[str]:
        """One line per fact every rank must agree on: the config, the optimizer
        (``optimizer_name``, ``param_groups``) and its groups, every parameter (sharded or
        not) and every buffer, the flat buffers, the units."""
        lines = [
            f"config: stage={config.stage} param_dtype={self.param_dtype} "
            f"reduce_dtype={config.reduce_dtype} bucket_size_mb={config.bucket_size_mb} "
            f"partition={self.partition}",
            f"optimizer: {optimizer_name} with {len(param_groups)} groups",
        ]
        if self.on_meta:
            init_fn = config.init_fn
            lines.append(
                f"meta build on {self.device.type}: "
                f"init_fn={getattr(init_fn, '__qualname__', init_fn)!r}"
            )
        for g, group in enumerate(param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            lines.append(f"group {g}: {sorted((k, _stable_repr(v)) for k, v in hyper.items())}")
        in_model_order = reversed([item for params in self.flat_params for item in params])
        for name, p in in_model_order:
            lines.append(f"param {name}: shape={tuple(p.shape)} group={self.param_group_of[id(p)]}")
        return lines + self._describe_model(model) + self._describe_buffers()

    def _describe_model(self, model: nn.Module) -> list[str]:
        lines = []
        sharded = {id(p) for params in self.all_flat_params for _, p in params}
        for name, p in model.named_parameters():
            if id(p) not in sharded:
                lines.append(f"unsharded param {name}: shape={tuple(p.shape)} dtype={p.dtype} "
                             f"requires_grad={p.requires_grad}")
        for prefix, module in model.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    persistent = key not in module._non_persistent_buffers_set
                    lines.append(
                        f"module buffer {prefix + '.' if prefix else ''}{key}: "
                        f"shape={tuple(buf.shape)} dtype={buf.dtype} persistent={persistent}"
                    )
        return lines

    def _describe_buffers(self) -> list[str]:
        lines = [f"buffer {b}: params {[n for n, _ in params]}"
                 for b, params in enumerate(self.flat_params)]
        for unit in self.units or []:
            lines.append(
                f"unit {unit.name!r}: {type(unit.module).__name__}, frozen "
                f"{[n for n, _ in unit.frozen]}"
            )
            lines += [f"frozen {n}: shape={tuple(p.shape)}" for n, p in unit.frozen]
        return lines


def plan_layout(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    config: ZeroConfig,
    *,
    device: torch.device | None = None,
) -> ShardPlan:
    """Validate the inputs of `shard` and decide its flat buffers; modifies nothing.

    Used by `shard` and by `zerolite.memory.estimate`.

    Args:
        model, config: as `zerolite.shard`.
        optimizers: the user's optimizers (several when `shard` got a list); their param
            groups, in order, are the groups the plan indexes.
        device: where the flat buffers live, as `shard()` decided it for its group
            (`zerolite.comm.devices.buffer_device`); None decides it here the same way.
    """
    check_model(model)
    partition = resolve_partition(config, optimizers)
    _check_optimizers(optimizers, partition, config)
    param_groups = [group for opt in optimizers for group in opt.param_groups]
    param_group_of, frozen = trained_parameters(model, param_groups)
    managed = [(n, p) for n, p in model.named_parameters() if id(p) in param_group_of]
    if not managed:
        raise ValueError(
            "the optimizer holds no trainable parameter of the model; nothing to shard"
        )
    refuse_sparse_gradients(model, param_group_of)
    source = check_one_device(managed)
    param_dtype = resolve_param_dtype(managed, config)
    on_meta = source.type == "meta"
    if on_meta:
        check_meta_build(model, optimizers, config)
    else:
        check_nothing_on_meta(model, source)
    if device is None:  # the group matters only to a meta build without config.device
        needs_group = on_meta and config.device is None
        device = buffer_device(
            [p for _, p in managed], config.device,
            data_parallel_group(config) if needs_group else None,
        )
    plan = ShardPlan(
        device=device, flat_params=[], param_group_of=param_group_of, frozen=frozen,
        on_meta=on_meta, partition=partition, param_dtype=param_dtype,
    )
    if STAGES[config.stage].shards_parameters:
        return _unit_buffers(plan, model, managed, source, config)
    return _gradient_order_buffers(plan, managed, config)


def _check_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], partition: str, config: ZeroConfig
) -> None:
    """Each optimizer steps its partition exactly (any stage 1-3 shards either partition)."""
    for inner in optimizers:
        if partition == "flat":
            check_optimizer(inner, config.elementwise_optimizers)
        else:
            check_tensor_optimizer(inner)
    policy = STAGES[config.stage]
    if not policy.shards_optimizer_state:
        raise ValueError(
            "ZeroConfig.stage=0 means plain DDP and is only meaningful to the memory estimator; "
            "shard() accepts stages 1, 2 and 3"
        )


def _gradient_order_buffers(plan: ShardPlan, managed: Params, config: ZeroConfig) -> ShardPlan:
    """Stages 1-2: buffers of about ``bucket_size_mb``, in reverse registration order
    (roughly the order in which backward yields gradients)."""
    itemsize = torch.empty(0, dtype=plan.param_dtype).element_size()
    ordered = list(reversed(managed))
    runs = size_partition([p.numel() * itemsize for _, p in ordered], config.bucket_bytes)
    return dataclasses.replace(plan, flat_params=[[ordered[i] for i in run] for run in runs])


def _unit_buffers(
    plan: ShardPlan, model: nn.Module, managed: Params, source: torch.device, config: ZeroConfig
) -> ShardPlan:
    """Stage 3: one flat buffer per unit, in the order backward completes them: the blocks
    in reverse, then the root (its embedding's gradient is the last to arrive). Frozen
    parameters are sharded too (a frozen base model is not replicated), in a second buffer
    per unit without master or gradients."""
    frozen_params = [
        (n, p)
        for n, p in model.named_parameters()
        if not p.requires_grad and p.is_floating_point()
    ]
    if any(p.device != source for _, p in frozen_params):
        raise ValueError(
            "frozen parameters are on another device than the trained ones; move the whole "
            "model first"
        )
    units = find_units(
        model, {id(p): n for n, p in [*managed, *frozen_params]}, config.unit_modules
    )
    ordered_units = [*reversed(units[:-1]), units[-1]]
    return dataclasses.replace(
        plan,
        flat_params=[u.params for u in ordered_units if u.params],
        units=units,
        frozen_flat_params=[u.frozen for u in units if u.frozen],
    )


def _stable_repr(value: Any) -> str:
    """``repr(value)`` without memory addresses (``<object object at 0x7f..>``): they differ
    between processes, and ranks holding equal objects in a param group must agree."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
