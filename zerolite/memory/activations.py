"""`checkpoint_blocks`: activation checkpointing as `predict_peak` and `plan` mean it.

Activations are most of a training step's peak at a useful batch size; recomputing each
block's forward during backward keeps only the blocks' inputs alive instead. One
definition of "activation checkpointing on" is needed, so that the configuration
`zerolite.memory.plan` picks is the one you train with.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks"]


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Run each block of ``model`` under ``torch.utils.checkpoint`` (non-reentrant).

    A transformers model that supports it gets its own
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``;
    any other model has every element of every ``nn.ModuleList`` (the blocks, which are also
    stage 3's units) wrapped: the element's ``forward`` runs inside a checkpoint, its
    parameters, names and hooks unchanged. Call it before or after `zerolite.shard`, on every
    rank, and in the run whose peak `predict_peak` predicted.

    Args:
        model: the model (changed in place).
    Returns:
        ``model``.
    Raises:
        ValueError: the model has no ``nn.ModuleList`` and no transformers support, so
            nothing would be checkpointed.
    """
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(
        model, "gradient_checkpointing_enable"
    ):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    if not blocks:
        raise ValueError(
            f"checkpoint_blocks(): {type(model).__name__} has no nn.ModuleList of blocks to "
            "checkpoint; wrap its blocks with torch.utils.checkpoint yourself"
        )
    for block in blocks:
        forward = block.forward
        if not (isinstance(forward, partial) and forward.func is _checkpointed):  # twice: once
            block.forward = partial(_checkpointed, block.forward)
    return model
