"""`measure_peak`: the measured counterpart of `predict_peak`.

It runs, for real on this process group, the loop `predict_peak` simulates
(`zerolite.memory.loop`) and measures the last optimizer step with `track`: the peak of
live tensor bytes per phase (`zerolite.memory.live`), and on an accelerator the
allocator's peak as well. It is what the prediction's tests and its benchmark hold the
prediction against, and what a user runs to check a prediction on their own hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from zerolite.config import ZeroConfig
from zerolite.memory.activations import checkpoint_blocks
from zerolite.memory.loop import OptimizerChoice, build_sharded, train_step
from zerolite.memory.track import MemoryTracker, track

__all__ = ["measure_peak"]


def measure_peak(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    config: ZeroConfig | None = None,
    *,
    micro_batch: int = 1,
    accumulation: int = 1,
    activation_checkpointing: bool = False,
    optimizer: OptimizerChoice = "adamw",
    max_grad_norm: float | None = 1.0,
    steps: int = 2,
) -> MemoryTracker:
    """Train ``steps`` optimizer steps of `predict_peak`'s loop and measure the last one.

    Every rank of the data-parallel group calls it (it calls `zerolite.shard` and trains),
    with the same arguments as the `predict_peak` call it checks (``world_size`` is the
    group's). The first steps create the optimizer state; the last is the steady state
    `predict_peak` predicts.

    Args:
        model_fn: ``() -> nn.Module``, called once; build the model where it trains.
        batch_fn: ``(micro_batch) -> batch`` (see `predict_peak`).
        config: the `ZeroConfig` to shard with.
        micro_batch: samples per forward.
        accumulation: forwards per optimizer step.
        activation_checkpointing: apply `checkpoint_blocks` first.
        optimizer: a name or ``(model) -> optimizer``, as for `predict_peak`.
        max_grad_norm: `clip_grad_norm_` before each step; None: no clipping.
        steps: optimizer steps to run, >= 2.
    Returns:
        The `MemoryTracker` of the last step: ``.peak`` is its peak of live tensor bytes,
        ``.peaks[phase].tensors`` each phase's, ``.peaks[phase].process`` the allocator's
        (an accelerator) or RSS growth (the CPU).
    Raises:
        ValueError: ``steps`` < 2.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"measure_peak(): steps must be an int >= 2, got {steps!r}")
    model = model_fn()
    if activation_checkpointing:
        checkpoint_blocks(model)
    model.train()
    opt = build_sharded(model, optimizer, ZeroConfig() if config is None else config)
    device = opt.group.buffer_device
    args = (model, opt, batch_fn, micro_batch, accumulation, max_grad_norm, device)
    for _ in range(steps - 1):
        train_step(*args)
    with track(opt) as tracker:
        train_step(*args)
    return tracker
