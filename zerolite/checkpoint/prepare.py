"""`prepare_async_save`: the first asynchronous save of a run blocks as little as later ones.

An asynchronous save blocks while it copies the rank's tensors into its staging area; the
first one of a run also allocates that area, and the kernel's first touch of its pages
costs several times the copy ([Note: first save] in `zerolite.checkpoint.staging`). Called
once, after `shard()`, this has the area allocated and touched on a background thread as
soon as its size is known: at the end of the first optimizer step that was not skipped
(the optimizer's state exists only from then on), or at once if one was taken already.

It is a call, not something `shard()` does by itself, because the area is a second copy of
the rank's checkpoint file in host memory (about 12 bytes per trained parameter over the
world size with AdamW), held from then on: a run that never saves asynchronously should not
pay for it. `ZeroTrainer(async_save=True)` calls it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from zerolite.checkpoint.file_writer import byte_ranges
from zerolite.checkpoint.rank_file import rank_file
from zerolite.checkpoint.staging import staging_area
from zerolite.ground import runtime
from zerolite.optim.sharded_optimizer import (
    ShardedOptimizer,
    require_model_of,
    require_sharded_optimizer,
)

__all__ = ["prepare_async_save"]


def prepare_async_save(model: nn.Module, optimizer: ShardedOptimizer) -> None:
    """Allocate this rank's staging area for ``save(..., blocking=False)`` ahead of the first
    such save, on a background thread (module docstring). Returns at once.

    Local to the rank (no communication); call it on every rank that saves, once, any time
    after `shard()`. Before the first step it waits for that step's end (a step hook, removed
    once it has run); a save before then allocates as it would have. The area is held from
    then on (`zerolite.memory.track` reports it as ``staging``), as after a first save. A
    rank that writes no file (hybrid sharding: outside the first replica group) holds none.

    Args:
        model: the sharded model (or a wrapper of it), as passed to ``save``.
        optimizer: its `ShardedOptimizer` (or what ``accelerator.prepare`` returned for it).
    Raises:
        TypeError: ``optimizer`` is not a `ShardedOptimizer`.
        ValueError: ``model`` is not the model ``optimizer`` was sharded with.
    """
    caller = "zerolite.checkpoint.prepare_async_save()"
    if not isinstance(optimizer, ShardedOptimizer):  # Accelerate's wrapper around it
        optimizer = getattr(optimizer, "optimizer", optimizer)
    optimizer = require_sharded_optimizer(optimizer, caller)
    require_model_of(model, optimizer, caller)
    if optimizer.group.step > 0 and not optimizer.step_was_skipped:
        _prepare(model, optimizer)
        return
    model_ref = weakref.ref(model)  # the hook must not keep the model alive

    def after_step(opt: Any, args: Any, kwargs: Any) -> None:
        # ``opt`` is the optimizer (torch passes it): no reference cycle through the hook.
        if opt.step_was_skipped:  # fp16 overflow: no state was made; wait for one
            return
        handle.remove()
        held = model_ref()
        if held is not None:
            _prepare(held, opt)

    handle = optimizer.register_step_post_hook(after_step)


def _prepare(model: nn.Module, optimizer: ShardedOptimizer) -> None:
    """Size this rank's file now (shapes only: nothing is copied) and have its staging area
    prepared at that size."""
    shards = optimizer.group
    if shards.replicas is not None and shards.replicas.rank != 0:
        return  # only the first replica group writes files
    tensors = rank_file(model, optimizer).tensors
    ranges = byte_ranges(tensors)
    on_device = any(isinstance(t, torch.Tensor) and runtime.is_accelerator(t.device)
                    for t in tensors.values())
    staging_area(optimizer).prepare(ranges[-1].end if ranges else 0, pinned=on_device)
