"""`predict_peak`: the peak of one rank's training step, before the run, for any model size.

The prediction runs the real thing on fake tensors (`zerolite.memory.fake_step`): the
model is built, `zerolite.shard` shards it as rank ``r`` of ``N`` in a simulated world
(`zerolite.memory.simulated_world`: no other process, every exchange completes at once) and two
optimizer steps run, each of ``accumulation`` micro-steps, as a training loop would (the
loop in `zerolite.memory.loop`, which `measure_peak` runs for real).

Every storage the real code would allocate is counted when it is made and when it is
freed (`zerolite.memory.ledger`), so parameters, gradients, masters, optimizer state,
activations, gathered units, buckets, receive buffers, clipping and the optimizer's own
temporaries are all in the peak, with activation checkpointing, accumulation, offload and
stage 3's prefetch as they happen. Nothing is allocated: a 7B-parameter model at 8 ranks
is predicted in 4-10 s of CPU time. The peak is the second optimizer step's (the first
creates the optimizer state; the second holds it from its start).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zerolite.config import ZeroConfig
from zerolite.ground import runtime
from zerolite.memory.activations import checkpoint_blocks
from zerolite.memory.fake_step import fake_step
from zerolite.memory.ledger import PHASES, LimitPassed, StorageLedger
from zerolite.memory.loop import OptimizerChoice, build_sharded, train_step
from zerolite.memory.peak_report import PeakPrediction
from zerolite.memory.simulated_world import simulated_world
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.optimizers import NAMED

__all__ = ["predict_peak"]

STEPS = 2  # optimizer steps simulated: the second is the steady state
_SIMULATED = 2  # micro-steps of the second step run at most ([Note: micro-steps simulated])


def predict_peak(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    config: ZeroConfig | None = None,
    world_size: int = 1,
    *,
    micro_batch: int = 1,
    accumulation: int = 1,
    activation_checkpointing: bool = False,
    optimizer: OptimizerChoice = "adamw",
    max_grad_norm: float | None = 1.0,
    rank: int = 0,
    device: str = "cpu",
    every_micro_step: bool = False,
    stop_above: int | None = None,
) -> PeakPrediction:
    """Predict the peak of live tensor bytes on rank ``rank`` of ``world_size`` during a
    training step (see the module docstring for the loop it simulates).

    Single process, no process group needed (it must not already be in one: the
    simulation sets up its own default group for its duration); nothing is allocated but
    small integer flags, so a model far larger than this machine can be predicted.

    Args:
        model_fn: ``() -> nn.Module``, called once inside the simulation (its tensors are
            fake) under ``torch.device(device)``; e.g. ``lambda: GPT(cfg)``.
        batch_fn: ``(micro_batch) -> batch``: a dict of keyword arguments for
            ``model(**batch)`` (or a tuple of positional ones, or one tensor) of that many
            samples. The model's output must be the loss or carry it (``.loss``).
        config: the `ZeroConfig` you will train with; its ``process_group`` is ignored (the
            simulation has its own), a ``DeviceMesh`` counts as ``shard_group_size``.
        world_size: N, the data-parallel ranks.
        micro_batch: samples per forward (passed to ``batch_fn``).
        accumulation: micro-steps per optimizer step.
        activation_checkpointing: apply `checkpoint_blocks` to the model first.
        optimizer: a name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``,
            ``"adagrad"``, ``"rmsprop"``: default hyperparameters over every parameter) or
            ``(model) -> optimizer`` (or a list of optimizers) as you build it.
        max_grad_norm: `clip_grad_norm_` before each step; None: no clipping.
        rank: which rank to simulate (pieces, padding and the root unit differ a little).
        device: ``"cpu"`` (gloo's point-to-point exchanges) or ``"cuda"`` (NCCL's).
        every_micro_step: simulate all ``accumulation`` micro-steps of both optimizer
            steps; by default the first step runs one and the second at most two, the
            rest counted ([Note: micro-steps simulated]: the same prediction, faster).
        stop_above: bytes: stop the simulation as soon as the rank holds more than this
            during a step ([Note: stopped simulation]); None: simulate both steps.
    Returns:
        A `PeakPrediction`: the peak, its phase, a breakdown by category and by phase;
        with ``complete`` False (stopped above ``stop_above``) the peak is a lower bound.
    Raises:
        ValueError: an argument out of range, a config `zerolite.shard` refuses, or
            torch.distributed already initialised in this process.
        TypeError: ``model_fn`` or ``batch_fn`` not callable, a model output without a loss.
    """
    config = ZeroConfig() if config is None else config
    _check(model_fn, batch_fn, config, world_size, micro_batch, accumulation, rank, device,
           optimizer)
    ledger = StorageLedger(
        device, arena_resident=_arena_resident(config, device),
        granularity=runtime.allocation_granularity(device), stop_above=stop_above,
    )
    started = time.perf_counter()
    with simulated_world(rank, world_size) as world, fake_step(ledger):
        model, opt = _build(model_fn, activation_checkpointing, optimizer, config, device)
        try:
            sent: int | None = _steps(world, ledger, model, opt, batch_fn, micro_batch,
                                      accumulation, max_grad_norm, device, every_micro_step)
        except LimitPassed:
            sent = None
        _name_survivors(ledger, opt)
        tier, params_tier = opt.shard_state.offload, opt.shard_state.params_tier
        offloaded = (0 if tier is None else tier.arena_bytes) + (
            0 if params_tier is None else params_tier.capacity)
    if config.param_dtype is None:  # the model's own, as the simulated shard() chose it
        config = config.with_param_dtype(opt.config.param_dtype)
    return _prediction(ledger, config, sent, offloaded, world_size, rank, micro_batch,
                       accumulation, activation_checkpointing, device,
                       time.perf_counter() - started)


def _build(model_fn: Callable[[], nn.Module], activation_checkpointing: bool,
           optimizer: OptimizerChoice, config: ZeroConfig,
           device: str) -> tuple[nn.Module, ShardedOptimizer]:
    """The simulated rank's model and its sharded optimizer (inside the simulation)."""
    with torch.device(device):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"predict_peak(): model_fn returned {type(model).__name__}, "
                        "not an nn.Module")
    if activation_checkpointing:
        checkpoint_blocks(model)
    model.train()
    return model, build_sharded(model, optimizer, _simulated(config, device))


def _steps(
    world: Any, ledger: StorageLedger, model: nn.Module, opt: ShardedOptimizer,
    batch_fn: Callable[[int], Any], micro_batch: int, accumulation: int,
    max_grad_norm: float | None, device: str, every_micro_step: bool,
) -> int:
    """[Note: micro-steps simulated] Run the `STEPS` optimizer steps; the bytes sent in
    the last one.

    Micro-steps after the first of a step start from the same live storages and run the
    same code (the loop has no ``no_sync``; nothing counts micro-steps, and clipping and
    the step come after the last one's backward), so they allocate, free and send the
    same bytes. The first step only creates the optimizer state: one micro-step of it is
    enough (its peaks are never above the second step's, which holds that state
    throughout). The second runs `_SIMULATED` micro-steps -- the first and one after it
    -- and its sends are those plus the second one's (from its forward to the end of its
    backward) for each micro-step left out. ``every_micro_step`` runs them all (what
    `tests/memory/test_plan_search.py` holds this against)."""
    simulated = accumulation if every_micro_step else min(accumulation, _SIMULATED)
    begun: list[int] = []  # bytes sent so far when each micro-step's forward begins
    ended: list[int] = []  # ... and when its backward returns

    def on_phase(phase: str) -> None:
        if phase == "forward":
            begun.append(world.sent)
        ledger.enter(phase)

    for step in range(STEPS):
        micro_steps = simulated if step == STEPS - 1 or every_micro_step else 1
        begun.clear()
        ended.clear()
        sent = world.sent
        train_step(model, opt, batch_fn, micro_batch, micro_steps, max_grad_norm, device,
                   on_phase=on_phase, after_backward=lambda: ended.append(world.sent))
    sent = world.sent - sent
    if simulated < accumulation:
        sent += (accumulation - simulated) * (ended[1] - begun[1])
    return sent


# [Note: stopped simulation] The peak is the most the ledger counts at any moment of the
# steps' phases, and the ledger only adds up: once the live bytes pass ``stop_above``, the
# peak is above it whatever happens next. `plan` asks only whether a micro-batch fits, so
# it stops a simulation there (`LimitPassed`, raised by the allocation that passed it):
# most micro-batches it tries are over the budget, and they pass it in the first step's
# forward or backward. What the stopped run saw is a lower bound of everything it
# reports (peaks, activations, the phases it reached); it sent nothing it can report.


def _arena_resident(config: ZeroConfig, device: str) -> bool:
    """Whether the tiers' arenas are memory of ``device``: host tiers of a CPU model. (A
    disk tier is simulated by a host arena that is not; with one tier on disk and the
    other on the host, neither arena is counted.)"""
    tiers = {config.offload, config.offload_params} - {None}
    return device == "cpu" and tiers == {"host"}


def _simulated(config: ZeroConfig, device: str) -> ZeroConfig:
    """``config`` as the simulated rank runs it: the simulated world's default group, the
    exchanges gloo (CPU) or NCCL (CUDA) would get, a disk tier as a host arena."""
    collectives = config.collectives
    if collectives == "auto":
        collectives = "point_to_point" if device == "cpu" else "native"
    k = config.shard_group_size
    if isinstance(config.process_group, DeviceMesh):
        k = config.process_group.shape[1]
    disk = config.offload == "disk"
    params_disk = config.offload_params == "disk"
    return dataclasses.replace(
        config, process_group=None, collectives=collectives, shard_group_size=k,
        offload="host" if disk else config.offload,
        offload_params="host" if params_disk else config.offload_params,
        offload_dir=None if disk or params_disk else config.offload_dir,
        device=torch.device(device) if config.device is None else config.device,
    )


def _name_survivors(ledger: StorageLedger, opt: ShardedOptimizer) -> None:
    """[Note: categories] in `zerolite.memory.ledger`: storages alive after the steps are
    named by what holds them; a storage two of these hold is the later one's (the fp32
    master that is the parameter shard is a parameter)."""
    model = opt.model
    params = [] if model is None else list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    ledger.rename("residual", [r for f in opt.flats for r in f.exchange.residuals])
    ledger.rename("optimizer_state", state)
    ledger.rename("grads", [b.full if b.keep_full else b.shard for b in opt.buckets])
    ledger.rename("grads", [p.grad for p in params])
    ledger.rename("master", [m.data for m in opt.masters])
    flats = [*opt.flats, *opt.frozen_flats]
    ledger.rename("params", [f.data if f.replicated else f.shard for f in flats])
    ledger.rename("params", [*params, *([] if model is None else model.buffers())])


def _prediction(
    ledger: StorageLedger, config: ZeroConfig, sent: int | None, offloaded: int, world_size: int,
    rank: int, micro_batch: int, accumulation: int, checkpointing: bool, device: str,
    seconds: float,
) -> PeakPrediction:
    by_phase = {p: ledger.peaks[p][0] for p in PHASES if p in ledger.peaks}
    phase = max(by_phase, key=lambda p: by_phase[p])
    breakdowns = {p: ledger.breakdown_at(ledger.peaks[p][1]) for p in by_phase}
    return PeakPrediction(
        peak=by_phase[phase], phase=phase, by_phase=by_phase, breakdown=breakdowns[phase],
        phase_breakdowns=breakdowns, communication_bytes=sent or 0, offloaded=offloaded,
        config=config, world_size=world_size, rank=rank, micro_batch=micro_batch,
        accumulation=accumulation, activation_checkpointing=checkpointing, device=device,
        seconds=seconds, activations_peak=ledger.activations_peak, complete=sent is not None,
    )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"predict_peak(): {name} must be an int >= 1, got {value!r}")


def _check(
    model_fn: object, batch_fn: object, config: object, world_size: object, micro_batch: object,
    accumulation: object, rank: object, device: object, optimizer: object,
) -> None:
    """predict_peak()'s arguments, each refused with what is allowed."""
    for name, fn in (("model_fn", model_fn), ("batch_fn", batch_fn)):
        if not callable(fn):
            raise TypeError(f"predict_peak(): {name} must be callable, got {fn!r}")
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"predict_peak(): config must be a ZeroConfig, got {config!r}")
    if config.stage == 0:
        raise ValueError("predict_peak(): stage=0 (DDP) is not simulated; use stage 1, 2 or 3")
    for name, value in (("world_size", world_size), ("micro_batch", micro_batch),
                        ("accumulation", accumulation)):
        _positive_int(name, value)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:  # type: ignore[operator]
        raise ValueError(f"predict_peak(): rank must be in range({world_size}), got {rank!r}")
    if device not in ("cpu", runtime.GPU_TYPE):
        raise ValueError(
            f"predict_peak(): device must be 'cpu' or {runtime.GPU_TYPE!r}, got {device!r}"
        )
    if isinstance(optimizer, str) and optimizer not in NAMED:
        raise ValueError(
            f"predict_peak(): optimizer {optimizer!r} is not one of {sorted(NAMED)}; or pass "
            "(model) -> optimizer"
        )
    if not isinstance(optimizer, str) and not callable(optimizer):
        raise TypeError(f"predict_peak(): optimizer must be a name or callable, got {optimizer!r}")
