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

Every key names a parameter's element range and, through the file and the replica index,
the data-parallel rank that holds it, so any layout can read them back:
`zerolite.checkpoint.residual_fold` restores them exactly where the layout is the saved one
and folds them onto another layout elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from zerolite.comm.collectives import gather
from zerolite.comm.quantized import residual_chunks
from zerolite.comm.quantized_replicas import replica_residual_rows
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.params.flat_buffer import FlatParamBuffer

__all__ = [
    "PREFIX", "ResidualRange", "gather_replica_residuals", "replica_of", "residual_ranges",
    "residual_tensors",
]

PREFIX = "residual/"


def replica_of(opt: ShardedOptimizer) -> int | None:
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


@dataclasses.dataclass(frozen=True)
class ResidualRange:
    """One range of a residual this rank holds: a parameter's elements ``[start, end)``,
    whose gradient goes to chunk ``chunk`` of the shard group (its owner's). ``kind``:
    ``"inner"`` (the shard group's reduce-scatter, what this rank's contribution lost),
    ``"send"`` or ``"gather"`` (hybrid's cross-node step, phase 1 or 2)."""

    key: str
    view: torch.Tensor  # 1-D fp32, a view of the live residual
    kind: str
    name: str
    start: int
    end: int
    chunk: int
    crossed: bool  # the owner of these elements holds a cross-node residual for them


def residual_ranges(opt: ShardedOptimizer, replica: int | None) -> Iterator[ResidualRange]:
    """Every range this rank sends quantized with error feedback; keys name replica
    ``replica`` (None: flat keys). What each residual row holds is its exchange's
    (`zerolite.comm.quantized.residual_chunks`,
    `zerolite.comm.quantized_replicas.replica_residual_rows`)."""
    n, rank = opt.group.size, opt.group.rank
    within = PREFIX if replica is None else f"residual@replica{replica}/"
    across = f"residual-across@replica{replica}/"
    for flat in opt.flats:
        exchange = flat.exchange
        crossed = exchange.replica_residual is not None and replica is not None
        if exchange.residual is not None:
            shard = flat.layout.shard_numel
            for row, chunk in zip(exchange.residual, residual_chunks(rank, n)):
                for name, start, end, at in _ranges(flat, chunk, 0, shard):
                    view = row[at : at + end - start]
                    key = f"{within}{name}/{start}-{end}"
                    yield ResidualRange(key, view, "inner", name, start, end, chunk, crossed)
        if exchange.replica_residual is not None and replica is not None:
            r, part = exchange.replica_residual.shape
            rows = replica_residual_rows(replica, r)
            for row, (d, phase) in zip(exchange.replica_residual, rows):
                for name, start, end, at in _ranges(flat, rank, d * part, (d + 1) * part):
                    view = row[at : at + end - start]
                    key = f"{across}{phase}/{name}/{start}-{end}"
                    yield ResidualRange(key, view, phase, name, start, end, rank, crossed)


def _views(opt: ShardedOptimizer, replica: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, 1-D fp32 view) of every `slots` range."""
    for held in residual_ranges(opt, replica):
        yield held.key, held.view


def residual_tensors(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """This rank's residuals by checkpoint key (views; the caller copies them to CPU)."""
    return dict(_views(opt, replica_of(opt)))


def gather_replica_residuals(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """Hybrid sharding: the residuals of every other replica of this rank's shard, by their
    keys, on the first replica (the one that writes the shard's file); {} elsewhere, and
    when not hybrid or without residuals. Every rank of the replica group must call."""
    q = replica_of(opt)
    replicas = opt.group.replicas
    if q is None or replicas is None:
        return {}
    mine = list(_views(opt, q))
    if not mine:
        return {}
    # Residual ranges: keys and sizes follow from the layout, the shard and the replica index only:
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
