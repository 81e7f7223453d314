"""Error-feedback residuals (``ZeroConfig.quantize_reduce``) in checkpoints.

A rank's residual is what quantization lost of its own contributions to the other ranks'
chunks (`zerolite.comm.quantized`). Each rank's residuals are stored, keyed like
everything else by parameter name and element range:
``residual/{name}/{start}-{end}`` (fp32). There are no residuals for this rank's own
chunk (it never travels quantized).

With hybrid sharding every rank has its own residuals, including replicas of the same
shard, and two kinds: the shard group's (as above) and the cross-node step's
(`zerolite.comm.quantized_replicas`: what phase 1 lost of each part sent to another replica,
what phase 2 lost of this replica's reduced part). Only the first replica group writes
files, so at save the other replicas' residuals are gathered (over the replica group)
onto the rank that writes their shard's file, which holds them all for the length of the
save: ``residual@replica{q}/{name}/{start}-{end}``,
``residual-across@replica{q}/send/{name}/{start}-{end}`` and ``.../gather/...`` for
replica ``q``.

A load at the same world size, shard group size and flat-buffer layout restores them
exactly, so a resumed run continues bit for bit. Anywhere else (another world size, k or
bucket size, a checkpoint saved without error feedback) they are not meaningful per rank
and restart from zero: what is dropped is at most one exchange's quantization error per
element (half a block's scale), delivered to no step -- a one-step perturbation, logged
as a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from zerolite.comm.collectives import gather
from zerolite.comm.quantized import residual_chunks
from zerolite.comm.quantized_replicas import replica_residual_rows
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.params.flat_buffer import FlatParamBuffer

__all__ = ["residual_tensors", "gather_replica_residuals", "read_residuals", "apply_residuals"]

logger = logging.getLogger(__name__)

PREFIX = "residual/"


def _replica(opt: ShardedOptimizer) -> int | None:
    """This rank's index in its replica group; None when not hybrid (flat keys)."""
    replicas = opt.group.replicas
    return None if replicas is None or replicas.size == 1 else replicas.rank


def _ranges(
    flat: FlatParamBuffer, chunk: int, lo: int, hi: int
) -> Iterator[tuple[str, int, int, int]]:
    """(name, param start, param end, offset from ``lo``) of each parameter's elements in
    ``[lo, hi)`` of chunk ``chunk`` of ``flat``."""
    for span in flat.layout.spans(chunk):
        start, end = max(lo, span.shard_start), min(hi, span.shard_start + span.numel)
        if start < end:
            first = span.param_start + start - span.shard_start
            yield flat.names[span.index], first, first + end - start, start - lo


def _views(opt: ShardedOptimizer, replica: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, 1-D fp32 view of a residual) for every range this rank sends quantized with
    error feedback; keys name replica ``replica`` (None: flat keys). What each residual row
    holds is its exchange's (`zerolite.comm.quantized.residual_chunks`,
    `zerolite.comm.quantized_replicas.replica_residual_rows`)."""
    n, rank = opt.group.size, opt.group.rank
    within = PREFIX if replica is None else f"residual@replica{replica}/"
    across = f"residual-across@replica{replica}/"
    for flat in opt.flats:
        exchange = flat.exchange
        if exchange.residual is not None:
            shard = flat.layout.shard_numel
            for row, chunk in zip(exchange.residual, residual_chunks(rank, n)):
                for name, start, end, at in _ranges(flat, chunk, 0, shard):
                    yield f"{within}{name}/{start}-{end}", row[at : at + end - start]
        if exchange.replica_residual is not None and replica is not None:
            r, part = exchange.replica_residual.shape
            rows = replica_residual_rows(replica, r)
            for row, (d, phase) in zip(exchange.replica_residual, rows):
                for name, start, end, at in _ranges(flat, rank, d * part, (d + 1) * part):
                    yield f"{across}{phase}/{name}/{start}-{end}", row[at : at + end - start]


def residual_tensors(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """This rank's residuals by checkpoint key (views; the caller copies them to CPU)."""
    return dict(_views(opt, _replica(opt)))


def gather_replica_residuals(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """Hybrid sharding: the residuals of every other replica of this rank's shard, by their
    keys, on the first replica (the one that writes the shard's file); {} elsewhere, and
    when not hybrid or without residuals. Every rank of the replica group must call."""
    q = _replica(opt)
    replicas = opt.group.replicas
    if q is None or replicas is None:
        return {}
    mine = list(_views(opt, q))
    if not mine:
        return {}
    # Slot keys and sizes follow from the layout, the shard and the replica index only:
    # the writer lays out what replica q sent by its own _views(opt, q).
    sent = torch.cat([view.reshape(-1) for _, view in mine])
    received = gather(sent, 0, replicas, what="checkpoint.save() (gathering replicas' residuals)")
    if received is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    for other in range(1, replicas.size):
        at = 0
        for key, view in _views(opt, other):
            out[key] = received[other][at : at + view.numel()]
            at += view.numel()
    return out


def read_residuals(
    file: Path | None, opt: ShardedOptimizer
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target view, saved values) for every residual of ``opt``, read from ``file`` (the
    saved file of this rank's shard when the checkpoint's layout is this one, else None);
    zeros when they cannot be restored exactly (see the module docstring), after a
    warning. Reads only."""
    views = list(_views(opt, _replica(opt)))
    if not views:
        return []
    if file is not None:
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            if all(key in keys for key, _ in views):
                pairs = [(target, f.get_tensor(key)) for key, target in views]
                if all(values.shape == target.shape for target, values in pairs):
                    return pairs
    logger.warning(
        "%s zerolite: the checkpoint holds no error-feedback residuals for this world size and "
        "layout; they restart from zero (at most one exchange's quantization error is dropped)",
        opt.group.prefix(),
    )
    return [(target, torch.zeros_like(target)) for _, target in views]


def apply_residuals(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write what `read_residuals` returned (after every rank has read successfully)."""
    for target, values in pairs:
        target.copy_(values)
