"""`plan_layout`: validate `shard()`'s inputs and decide its flat buffers, changing nothing.

A `ShardPlan` says which parameters go into which flat buffer (in the order backward
produces their gradients), which optimizer group each belongs to, and, in stage 3, the
units whose buffers are gathered together. `shard()` agrees on it across ranks
(`ShardPlan.describe`) before building anything; `zerolite.memory.estimate` sizes it
without building.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from zerolite.comm.devices import buffer_device
from zerolite.comm.hybrid import data_parallel_group
from zerolite.config import ZeroConfig
from zerolite.optim.contract import check_optimizer, check_tensor_optimizer
from zerolite.optim.multi import class_name, inner_optimizers
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.params.meta_init import check_meta_build, check_nothing_on_meta
from zerolite.plan.layout import size_partition
from zerolite.plan.owners import resolve_partition
from zerolite.plan.stages import STAGES
from zerolite.plan.units import Unit, find_units
from zerolite.state.shard_state import state_of

__all__ = ["ShardPlan", "plan_layout"]

@dataclasses.dataclass
class ShardPlan:
    """Everything `shard()` decided, before anything is modified."""

    device: torch.device
    # per flat buffer, in buffer order: its (name, param) list
    flat_params: list[list[tuple[str, nn.Parameter]]]
    group_of: dict[int, int]  # id(param) -> index of its optimizer param group
    # (group index, param) held by the optimizer, not trainable
    frozen: list[tuple[int, nn.Parameter]]
    units: list[Unit] | None = None  # stage 3: the units, root last
    # stage 3
    frozen_flat_params: list[list[tuple[str, nn.Parameter]]] = dataclasses.field(
        default_factory=list
    )
    # built under torch.device("meta"): materialised by zerolite.params.meta_init
    on_meta: bool = False
    # "flat" (equal 1-D shards) or "tensor" (whole parameters to owners: zerolite.plan.owners)
    partition: str = "flat"

    @property
    def all_flat_params(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Every flat buffer's parameters in index order: trained buffers (whose indices
        are also the gradient buckets'), then stage 3's frozen ones."""
        return [*self.flat_params, *self.frozen_flat_params]

    def unit_buffers(self) -> list[list[int]]:
        """Stage 3: each unit's buffer indices (trained, then frozen), root last."""
        index_of = {id(params[0][1]): i for i, params in enumerate(self.all_flat_params)}
        return [
            [index_of[id(ps[0][1])] for ps in (u.params, u.frozen) if ps] for u in self.units or []
        ]

    def describe(
        self, config: ZeroConfig, optimizer: torch.optim.Optimizer, model: nn.Module
    ) -> list[str]:
        """One line per fact every rank must agree on: the config, the optimizer and its
        groups, every parameter (sharded or not) and every buffer, the flat buffers, the units."""
        lines = [
            f"config: stage={config.stage} param_dtype={config.param_dtype} "
            f"reduce_dtype={config.reduce_dtype} bucket_size_mb={config.bucket_size_mb} "
            f"partition={self.partition}",
            f"optimizer: {class_name(optimizer)} with {len(optimizer.param_groups)} groups",
        ]
        if self.on_meta:
            init_fn = config.init_fn
            lines.append(
                f"meta build on {self.device.type}: "
                f"init_fn={getattr(init_fn, '__qualname__', init_fn)!r}"
            )
        for g, group in enumerate(optimizer.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            lines.append(f"group {g}: {sorted((k, repr(v)) for k, v in hyper.items())}")
        in_model_order = reversed([item for params in self.flat_params for item in params])
        for name, p in in_model_order:
            lines.append(f"param {name}: shape={tuple(p.shape)} group={self.group_of[id(p)]}")
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
        for b, params in enumerate(self.flat_params):
            lines.append(f"buffer {b}: params {[n for n, _ in params]}")
        for unit in self.units or []:
            lines.append(
                f"unit {unit.name!r}: {type(unit.module).__name__}, frozen "
                f"{[n for n, _ in unit.frozen]}"
            )
            lines += [f"frozen {n}: shape={tuple(p.shape)}" for n, p in unit.frozen]
        return lines


def plan_layout(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    *,
    device: torch.device | None = None,
) -> ShardPlan:
    """Validate the inputs of `shard` and decide its flat buffers; modifies nothing.

    Used by `shard` and by `zerolite.memory.estimate`.

    Args:
        model, optimizer, config: as `zerolite.shard`.
        device: where the flat buffers live, as `shard()` decided it for its group
            (`zerolite.comm.devices.buffer_device`); None decides it here the same way.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() needs an nn.Module as model, got {type(model).__name__}")
    if isinstance(optimizer, ShardedOptimizer):
        raise TypeError("this optimizer is already a ShardedOptimizer; call shard() once per model")
    if state_of(model) is not None:
        raise RuntimeError(
            "this model was already sharded by zerolite.shard(); shard() may be called once per "
            "model (build a new model and optimizer to shard again)"
        )
    partition = resolve_partition(config, inner_optimizers(optimizer))
    for inner in inner_optimizers(optimizer):
        if partition == "flat":
            check_optimizer(inner, config.elementwise_optimizers)
        else:
            check_tensor_optimizer(inner)
    policy = STAGES[config.stage]
    if partition == "tensor" and policy.shards_parameters:
        names = ", ".join(type(o).__name__ for o in inner_optimizers(optimizer))
        raise ValueError(
            f"ZeroConfig.partition={config.partition!r} resolves to whole-tensor ownership (for "
            f"{names}), which zerolite supports at stages 1-2 only: stage 3 gathers each unit "
            "from equal 1-D shards of its parameters, which an owner-by-tensor layout does not "
            "have. Use stage=2 with partition='tensor' (gradients and optimizer state stay "
            "sharded), or stage=3 with an elementwise optimizer and partition='flat'"
        )
    if not policy.shards_optimizer_state:
        raise ValueError(
            "ZeroConfig.stage=0 means plain DDP and is only meaningful to the memory estimator; "
            "shard() accepts stages 1, 2 and 3"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    group_of: dict[int, int] = {}
    frozen: list[tuple[int, nn.Parameter]] = []
    for g, param_group in enumerate(optimizer.param_groups):
        for i, p in enumerate(param_group["params"]):
            where = f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
            if id(p) not in names:
                raise ValueError(
                    f"{where} is not a parameter of the model passed to shard(); build the "
                    "optimizer from this model's parameters"
                )
            if id(p) in group_of:
                raise ValueError(
                    f"{where} ({names[id(p)]!r}) appears in more than one place in the optimizer"
                )
            if not p.is_floating_point():
                raise ValueError(
                    f"{where} ({names[id(p)]!r}) has dtype {p.dtype}; only floating parameters "
                    f"can be sharded"
                )
            if p.requires_grad:
                group_of[id(p)] = g
            else:
                frozen.append((g, p))
    managed = [(n, p) for n, p in model.named_parameters() if id(p) in group_of]
    if not managed:
        raise ValueError(
            "the optimizer holds no trainable parameter of the model; nothing to shard"
        )
    _refuse_sparse_gradients(model, group_of)
    devices = {p.device for _, p in managed}
    if len(devices) > 1:
        by_device: dict[torch.device, str] = {}
        for n, p in managed:
            by_device.setdefault(p.device, n)
        listed = ", ".join(f"{n!r} on {d}" for d, n in by_device.items())
        raise ValueError(
            f"parameters are on mixed devices ({listed}); move the whole model to one device "
            "before shard()"
        )
    source = devices.pop()
    on_meta = source.type == "meta"
    if on_meta:
        check_meta_build(model, optimizer, config)
    else:
        check_nothing_on_meta(model, source)
    if device is None:  # the group matters only to a meta build without config.device
        needs_group = on_meta and config.device is None
        device = buffer_device(
            [p for _, p in managed], config.device,
            data_parallel_group(config) if needs_group else None,
        )
    if policy.shards_parameters:
        # One flat buffer per unit, in the order backward completes them: the blocks in
        # reverse, then the root (its embedding's gradient is the last to arrive). Frozen
        # parameters are sharded too (a frozen base model is not replicated), in a
        # second buffer per unit without master or gradients.
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
        flat_params = [u.params for u in ordered_units if u.params]
        return ShardPlan(
            device=device, flat_params=flat_params, group_of=group_of, frozen=frozen,
            units=units, frozen_flat_params=[u.frozen for u in units if u.frozen],
            on_meta=on_meta, partition=partition,
        )
    itemsize = torch.empty(0, dtype=config.param_dtype).element_size()
    ordered = list(reversed(managed))  # roughly the order in which backward yields gradients
    runs = size_partition([p.numel() * itemsize for _, p in ordered], config.bucket_bytes)
    flat_params = [[ordered[i] for i in run] for run in runs]
    return ShardPlan(
        device=device, flat_params=flat_params, group_of=group_of, frozen=frozen, on_meta=on_meta,
        partition=partition,
    )


def _refuse_sparse_gradients(model: nn.Module, trained: dict[int, int]) -> None:
    # A sparse gradient cannot enter a dense flat gradient bucket; without this check it
    # fails deep inside the first backward.
    for name, module in model.named_modules():
        sparse = isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
        if sparse and id(module.weight) in trained:
            raise ValueError(
                f"{name or 'the model'} ({type(module).__name__}) has sparse=True, so its weight "
                "gets sparse gradients, which zerolite cannot shard; build it with sparse=False, "
                "or freeze it"
            )
