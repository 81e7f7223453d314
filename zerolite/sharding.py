"""`shard()`, the public face of `zerolite.assemble`: the one call that shards a model's
optimizer state, gradients and parameters.

`shard` fills in the default `ZeroConfig`, lets `zerolite.assemble.steps.assemble` validate,
agree and build (its docstring lists the steps), and logs one line on rank 0 saying what
was built: at INFO, or at WARNING where its recipe differs from the stock run's in a way
the user did not ask for. The Accelerate and Trainer integrations say which framework's
loop the model trains in, and its autocast (`announcing_host`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from zerolite.assemble.steps import assemble
from zerolite.config import ZeroConfig
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.precision import HostPrecision, describe_precision
from zerolite.plan.shard_plan import ShardPlan

__all__ = ["announcing_host", "shard"]

logger = logging.getLogger(__name__)

# Which framework's loop the model trains in, and its autocast, for `shard()`'s log line: set
# by the Accelerate and Trainer integrations, whose autocast `shard()` cannot see (it wraps
# the model's forward, outside zerolite).
_HOST: contextvars.ContextVar[HostPrecision | None] = contextvars.ContextVar(
    "zerolite_host_precision", default=None
)


@contextlib.contextmanager
def announcing_host(host: HostPrecision | None) -> Iterator[None]:
    """Inside, `shard()`'s log line compares its recipe with the stock run of ``host``'s
    framework (`zerolite.plan.precision.describe_precision`); None: a plain loop."""
    token = _HOST.set(host)
    try:
        yield
    finally:
        _HOST.reset(token)


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig | None = None,
) -> ShardedOptimizer:
    """Shard ``optimizer``'s state (and, in stage 2, gradients) across data-parallel ranks.

    ``model`` is changed in place: each parameter the optimizer holds becomes a view of
    a flat buffer (same ``nn.Parameter`` object, dtype ``config.param_dtype``: by default
    the model's own, [Note: the model's own dtype] in `zerolite.plan.precision`), gets a
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
    requested = ZeroConfig() if config is None else config
    sharded, plan = assemble(model, optimizer, requested)
    if sharded.group.world.rank == 0:
        _announce(sharded, plan, requested)
    return sharded


def _announce(sharded: ShardedOptimizer, plan: ShardPlan, requested: ZeroConfig) -> None:
    """Log `shard()`'s one line (rank 0): at INFO, or at WARNING where the recipe differs
    from the stock run's in a way the user did not ask for (`describe_precision`)."""
    source_dtypes = sharded.shard_state.source_dtypes
    trained = {n: source_dtypes[n] for params in plan.flat_params for n, _ in params}
    dtype = sharded.config.param_dtype
    cast_frozen = {
        n: source_dtypes[n] for params in plan.frozen_flat_params for n, _ in params
        if source_dtypes[n] != dtype
    }
    precision, level = describe_precision(requested, dtype, trained, cast_frozen, _HOST.get())
    if logger.isEnabledFor(level):
        logger.log(level, _announcement(sharded, plan.partition, precision))


def _announcement(sharded: ShardedOptimizer, partition: str, precision: str) -> str:
    """The one line `shard()` logs on rank 0: that zerolite is on, how (``precision``), and
    what this rank holds now (`zerolite.memory.footprint`; the optimizer's moments appear at
    its first step)."""
    # Here, not at the top: `import zerolite` stays light (zerolite.memory loads on first use).
    from zerolite.memory.footprint import footprint

    config, group, flats = sharded.config, sharded.group, sharded.flats
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
