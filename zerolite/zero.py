"""`shard()`: validate, agree across ranks, then wire the pieces a stage needs.

Nothing is modified until every rank has validated its inputs and all ranks agree on
the plan (`zerolite.consensus`). Then:

- managed parameters (those the optimizer holds and that require grad) are packed into
  flat buffers of about ``bucket_size_mb``, in reverse registration order (roughly the
  order backward produces gradients), and rank 0's values are broadcast, as DDP does
  (a model built on the meta device is materialised and initialised instead, unit by
  unit, see `zerolite.meta_init`);
- the optimizer's param groups are re-pointed at fp32 master pieces and any existing
  state is re-sharded;
- what the stage shards (`zerolite.stages.STAGES`) picks the pieces: kept full
  gradients wire `KeepFullGrads`, sharded ones `ShardGradsInBackward`; both share
  buckets, the reducer and the optimizer. Sharded parameters add one buffer per unit
  and the `UnitScheduler` that gathers them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from typing import cast

import torch
from torch import nn

from zerolite import phases
from zerolite.bucket import GradBucket
from zerolite.collectives import Group, broadcast, broadcast_coalesced
from zerolite.compile_guard import exclude_from_compile, not_compiled
from zerolite.config import ZeroConfig
from zerolite.consensus import agreed
from zerolite.flat_buffer import FlatParamBuffer
from zerolite.grad_reducer import GradReducer
from zerolite.hooks import KeepFullGrads, ShardGradsInBackward
from zerolite.layout import bucket_partition
from zerolite.meta_init import (
    check_before_first_forward,
    check_meta_build,
    check_nothing_on_meta,
    materialize,
    materialize_device,
)
from zerolite.optim.contract import check_optimizer
from zerolite.optim.master import MasterShard
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.params import guard_conversions, install_no_sync
from zerolite.shard_state import ShardState, register, state_of
from zerolite.stages import STAGES
from zerolite.unit_scheduler import UnitScheduler
from zerolite.units import Unit, find_units

__all__ = ["shard"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Plan:
    """Everything `shard()` decided, before anything is modified."""

    device: torch.device
    buckets: list[list[tuple[str, nn.Parameter]]]  # per flat buffer: (name, param), buffer order
    group_of: dict[int, int]  # id(param) -> index of its optimizer param group
    # (group index, param) held by the optimizer, not trainable
    frozen: list[tuple[int, nn.Parameter]]
    units: list[Unit] | None = None  # stage 3: the units, root last
    # stage 3
    frozen_buckets: list[list[tuple[str, nn.Parameter]]] = dataclasses.field(default_factory=list)
    on_meta: bool = False  # built under torch.device("meta"): materialised by zerolite.meta_init

    @property
    def all_buckets(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Every flat buffer's parameters in index order: trained buffers (whose indices
        are also the gradient buckets'), then stage 3's frozen ones."""
        return [*self.buckets, *self.frozen_buckets]

    def unit_buffers(self) -> list[list[int]]:
        """Stage 3: each unit's buffer indices (trained, then frozen), root last."""
        index_of = {id(bucket[0][1]): i for i, bucket in enumerate(self.all_buckets)}
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
            f"reduce_dtype={config.reduce_dtype} bucket_size_mb={config.bucket_size_mb}",
            f"optimizer: {type(optimizer).__qualname__} with {len(optimizer.param_groups)} groups",
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
        in_model_order = reversed([item for bucket in self.buckets for item in bucket])
        for name, p in in_model_order:
            lines.append(f"param {name}: shape={tuple(p.shape)} group={self.group_of[id(p)]}")
        sharded = {id(p) for bucket in self.all_buckets for _, p in bucket}
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
        for b, bucket in enumerate(self.buckets):
            lines.append(f"buffer {b}: params {[n for n, _ in bucket]}")
        for unit in self.units or []:
            lines.append(
                f"unit {unit.name!r}: {type(unit.module).__name__}, frozen "
                f"{[n for n, _ in unit.frozen]}"
            )
            lines += [f"frozen {n}: shape={tuple(p.shape)}" for n, p in unit.frozen]
        return lines


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
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
    ``reset_parameters()`` (see `zerolite.meta_init`); tensors nothing initialised must
    be loaded (`zerolite.checkpoint.load_pretrained`) before the first forward.

    Args:
        model: any ``nn.Module`` whose parameters are on one device (``meta`` included).
        optimizer: the user's optimizer over (some of) ``model``'s parameters; an
            elementwise class (Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam)
            or one declared in ``config.elementwise_optimizers``.
        config: a `ZeroConfig`; ``None`` means ``ZeroConfig()`` (which reads ``ZEROLITE_*``
            environment variables).
    Returns:
        The `ShardedOptimizer` to use instead of ``optimizer`` from now on.
    Raises:
        TypeError: unsupported optimizer class, or arguments of the wrong type.
        ValueError: stage 0, parameters not in the model, on mixed devices, or listed twice.
        RuntimeError: the model was already sharded; ranks disagree (`RankMismatchError`).

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))
        loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
    """
    config = ZeroConfig() if config is None else config
    group = Group(config.process_group, collectives=config.collectives, timeout_s=config.timeout_s)
    plan: _Plan | None = None
    # Raises on every rank if any rank failed or ranks describe different plans.
    with agreed("zerolite.shard()", group) as lines:
        plan = plan_layout(model, optimizer, config)
        lines += plan.describe(config, optimizer, model)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    with phases.phase("build"):
        sharded = _build(model, optimizer, config, group, cast(_Plan, plan), digest)
    phases.built(sharded)
    return sharded


def plan_layout(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig) -> _Plan:
    """Validate the inputs of `shard` and decide its flat buffers; modifies nothing.

    Used by `shard` and by `zerolite.memory.estimate`.
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
    check_optimizer(optimizer, config.elementwise_optimizers)
    policy = STAGES[config.stage]
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
        device = config.device if config.device is not None else materialize_device(config)
    else:
        check_nothing_on_meta(model, source)
        device = config.device if config.device is not None else source
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
        buckets = [u.params for u in ordered_units if u.params]
        return _Plan(device=device, buckets=buckets, group_of=group_of, frozen=frozen, units=units,
                     frozen_buckets=[u.frozen for u in units if u.frozen], on_meta=on_meta)
    itemsize = torch.empty(0, dtype=config.param_dtype).element_size()
    ordered = list(reversed(managed))  # roughly the order in which backward yields gradients
    runs = bucket_partition([p.numel() * itemsize for _, p in ordered], config.bucket_bytes)
    buckets = [[ordered[i] for i in run] for run in runs]
    return _Plan(device=device, buckets=buckets, group_of=group_of, frozen=frozen, on_meta=on_meta)


def _build(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    group: Group,
    plan: _Plan,
    layout_digest: str,
) -> ShardedOptimizer:
    policy = STAGES[config.stage]
    all_buckets = plan.all_buckets
    unit_buffers = plan.unit_buffers()

    def make_flat(index: int) -> FlatParamBuffer:
        return _bound_flat(all_buckets[index], index, group, config, plan.device)

    meta_build = None
    if plan.on_meta:
        # Every rank computes the same values from rank 0's generator: nothing to broadcast.
        # A unit is complete once its module is initialised (the root: at the end).
        closed_by = {id(u.module): b for u, b in zip((plan.units or [])[:-1], unit_buffers)}
        all_flats, meta_build = materialize(
            model, all_buckets, closed_by, make_flat,
            param_dtype=config.param_dtype, device=plan.device, shard=policy.shards_parameters,
            init_fn=config.init_fn, group=group,
        )
    else:
        # Every rank starts from rank 0's values, as with DDP.
        all_flats = [make_flat(index) for index in range(len(all_buckets))]
        for flat in all_flats:
            broadcast(
                flat.data,
                0,
                group,
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
            [*unsharded, *model.buffers()], 0, group,
            what="shard()'s broadcast of rank 0's unsharded parameters and buffers",
        )
    flats, frozen_flats = all_flats[: len(plan.buckets)], all_flats[len(plan.buckets) :]
    masters = [MasterShard(flat) for flat in flats]
    _repoint_optimizer(optimizer, plan, flats, masters)
    for flat in flats:
        for p in flat.params:
            p.grad = None
    buckets = [
        GradBucket(
            flat,
            group,
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
    sharded = ShardedOptimizer(optimizer, state)
    state.optimizer = sharded
    register(model, state)
    numel = sum(flat.numel for flat in flats)
    if group.rank == 0:
        logger.info(
            "zerolite: stage %d sharded %d parameters (%d elements) into %d flat buffers across "
            "%d ranks",
            config.stage,
            sum(len(f.params) for f in flats),
            numel,
            len(flats),
            group.size,
        )
    return sharded


@torch.no_grad()
def _bound_flat(
    bucket: list[tuple[str, nn.Parameter]],
    index: int,
    group: Group,
    config: ZeroConfig,
    device: torch.device,
) -> FlatParamBuffer:
    """A flat buffer holding ``bucket``'s parameters, bound to them (their values copied in)."""
    flat = FlatParamBuffer(
        [p for _, p in bucket],
        [n for n, _ in bucket],
        rank=group.rank,
        world_size=group.size,
        dtype=config.param_dtype,
        device=device,
        index=index,
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
    # (see zerolite.shard_state).
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


@torch.no_grad()
def _repoint_optimizer(
    optimizer: torch.optim.Optimizer,
    plan: _Plan,
    flats: list[FlatParamBuffer],
    masters: list[MasterShard],
) -> None:
    """Replace each group's ``"params"`` by this rank's master pieces; re-shard state."""
    new_params: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for flat, master in zip(flats, masters):
        for piece, tensor in zip(flat.pieces, master.pieces):
            param = flat.params[piece.index]
            new_params[plan.group_of[id(param)]].append(tensor)
            old = optimizer.state.get(param)
            if old:
                optimizer.state[tensor] = {
                    key: _slice_state(key, value, param, piece.param_start, piece.param_end)
                    for key, value in old.items()
                }
    for flat in flats:
        for param in flat.params:
            optimizer.state.pop(param, None)
    for _, param in plan.frozen:
        optimizer.state.pop(param, None)
    for param_group, params in zip(optimizer.param_groups, new_params):
        param_group["params"] = params


# 0-dim state that is never per-element, even for a 0-dim parameter.
_SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})


def _slice_state(key: str, value: object, param: torch.Tensor, start: int, end: int) -> object:
    """A state entry for one piece: per-element tensors sliced (fp32), scalars copied."""
    if isinstance(value, torch.Tensor):
        if value.shape == param.shape and key not in _SCALAR_STATE:
            out = value.detach().reshape(-1)[start:end].clone()
            return out.float() if out.is_floating_point() else out
        return value.detach().clone()
    return value


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
