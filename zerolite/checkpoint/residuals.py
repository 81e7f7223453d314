"""Error-feedback residuals (``ZeroConfig.quantize_reduce``) in checkpoints.

A rank's residual is what quantization lost of its own contributions to the other ranks'
chunks (`zerolite.quantized_collectives`). Each rank writes its own, in its own file,
keyed like everything else by parameter name and element range:
``residual/{name}/{start}-{end}`` (fp32). There are no residuals for this rank's own
chunk (it never travels quantized).

A load at the same world size and flat-buffer layout restores them exactly, so a resumed
run continues bit for bit. Anywhere else (another world size or bucket size, a checkpoint
saved without error feedback) they are not meaningful per rank and restart from zero:
what is dropped is at most one exchange's quantization error per element (half a block's
scale), delivered to no step -- a one-step perturbation, logged as a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["residual_tensors", "read_residuals", "apply_residuals"]

logger = logging.getLogger(__name__)

PREFIX = "residual/"


def _slots(opt: ShardedOptimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, 1-D fp32 view of a bucket's residual) for every piece of every chunk this rank
    sends quantized with error feedback."""
    n, rank = opt.group.size, opt.group.rank
    for bucket in opt.buckets:
        if bucket.residual is None:
            continue
        flat = bucket.flat
        for k in range(1, n):
            row = bucket.residual[k - 1]
            for piece in flat.layout.pieces((rank + k) % n):
                name = flat.names[piece.index]
                key = f"{PREFIX}{name}/{piece.param_start}-{piece.param_end}"
                yield key, row[piece.shard_start : piece.shard_start + piece.numel]


def residual_tensors(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """This rank's residuals by checkpoint key (views; the caller copies them to CPU)."""
    return dict(_slots(opt))


def read_residuals(
    f: Any, opt: ShardedOptimizer, same_world: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target view, saved values) for every residual of ``opt``, read from this rank's open
    safetensors file ``f``; [] when they cannot be restored exactly (see the module
    docstring), after a warning. Reads only."""
    slots = list(_slots(opt))
    if not slots:
        return []
    keys = set(f.keys())
    if same_world and all(key in keys for key, _ in slots):
        pairs = [(target, f.get_tensor(key)) for key, target in slots]
        if all(values.shape == target.shape for target, values in pairs):
            return pairs
    logger.warning(
        "%s zerolite: the checkpoint holds no error-feedback residuals for this world size and "
        "layout; they restart from zero (at most one exchange's quantization error is dropped)",
        opt.group.prefix(),
    )
    return [(target, torch.zeros_like(target)) for _, target in slots]


def apply_residuals(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write what `read_residuals` returned (after every rank has read successfully)."""
    for target, values in pairs:
        target.copy_(values)
