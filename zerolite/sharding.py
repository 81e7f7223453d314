"""`shard()`, the public face of `zerolite.assemble`: the one call that shards a model's
optimizer state, gradients and parameters.

`shard` fills in the default `ZeroConfig`, lets `zerolite.assemble.steps.assemble` validate,
agree and build (its docstring lists the steps), and logs one line on rank 0 saying what
was built. The Accelerate and Trainer integrations add to that line how the model computes
(`announcing_autocast`).
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

__all__ = ["announcing_autocast", "shard"]

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
    sharded, partition = assemble(model, optimizer, config)
    if sharded.group.world.rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info(_announcement(sharded, partition))
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
