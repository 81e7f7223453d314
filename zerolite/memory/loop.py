"""The training step that `predict_peak` simulates and `measure_peak` runs: one definition,
so the prediction and the measurement it is held against are the same loop::

    for _ in range(accumulation):
        loss = model(**batch_fn(micro_batch))          # or its .loss
        (loss / accumulation).backward()
        after_backward()
    opt.clip_grad_norm_(max_grad_norm)                 # when max_grad_norm is not None
    opt.step()
    opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zerolite.assemble.steps import assemble
from zerolite.config import ZeroConfig
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.optimizers import build_named

__all__ = ["OptimizerChoice", "build_sharded", "call_model", "loss_of", "train_step"]

# A name of `zerolite.plan.optimizers.NAMED`, or ``(model) -> optimizer(s)``.
OptimizerChoice = str | Callable[[nn.Module], torch.optim.Optimizer | Sequence[Any]]


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself (a 0-dim tensor), its ``.loss`` or
    its ``["loss"]``.

    Raises:
        TypeError: none of those is a 0-dim tensor.
    """
    for candidate in (output, getattr(output, "loss", None),
                      output.get("loss") if isinstance(output, Mapping) else None):
        if isinstance(candidate, torch.Tensor) and candidate.dim() == 0:
            return candidate
    raise TypeError(
        f"the model returned {type(output).__name__}; the memory tools need the loss: a "
        "0-dim tensor, or an output with .loss (pass labels in the batch)"
    )


def build_sharded(
    model: nn.Module, optimizer: OptimizerChoice, config: ZeroConfig
) -> ShardedOptimizer:
    """``zerolite.shard(model, optimizer, config)`` without its log line
    (`zerolite.assemble.steps.assemble`), the optimizer built from its name (default
    hyperparameters over every parameter) or by ``optimizer(model)``."""
    if isinstance(optimizer, str):
        opt: Any = build_named(optimizer, list(model.parameters()))
    else:
        opt = optimizer(model)
    return assemble(model, opt, config).sharded


def train_step(
    model: nn.Module, opt: ShardedOptimizer, batch_fn: Callable[[int], Any], micro_batch: int,
    accumulation: int, max_grad_norm: float | None, device: str | torch.device,
    on_phase: Callable[[str], None] = lambda phase: None,
    after_backward: Callable[[], None] = lambda: None,
) -> None:
    """One optimizer step of the module docstring's loop. ``on_phase`` is told where
    `zerolite.memory.track` sees each phase begin: forward when the model is called,
    backward when a gradient reaches the model's outputs, step at ``step()`` (the batch is
    made in the phase before; the gradients' reduction and clipping are backward's).
    ``after_backward`` is called when each micro-step's ``backward()`` returns."""

    def backward_begins(grad: torch.Tensor) -> None:
        on_phase("backward")

    for _ in range(accumulation):
        batch = _on(batch_fn(micro_batch), device)
        on_phase("forward")
        output = call_model(model, batch)
        del batch
        _when_gradient_reaches(output, backward_begins)
        loss = loss_of(output)
        del output  # what the model returned (a transformers cache too) lives no longer
        (loss / accumulation).backward()
        after_backward()
    if max_grad_norm is not None:
        opt.clip_grad_norm_(max_grad_norm)
    on_phase("step")
    opt.step()
    opt.zero_grad()


def _when_gradient_reaches(output: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Run ``hook`` when backward reaches any tensor of ``output`` (a function of its own:
    no name here outlives it to keep a part of the output alive)."""
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)


def _on(batch: Any, device: str | torch.device) -> Any:
    """The batch's tensors on ``device`` (`batch_fn` may make them on the CPU)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _on(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_on(v, device) for v in batch)
    return batch
