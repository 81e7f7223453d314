"""Hybrid sharding's cross-node step, quantized (``quantize_reduce`` with
``shard_group_size``).

After the within-group reduce-scatter, each rank holds its gradient shard (``S``
elements) averaged over its shard group; `zerolite.comm.hybrid.average_across_replicas`
all-reduces it across the replica group (``R`` ranks holding the same shard index, one
per "node"). Here the same mean travels as int8 blocks (`zerolite.comm.codec`), in two
phases over the replica group, the shard cut into ``R`` parts of ``C = ceil(S / R)``
elements (the last padded with zeros):

1. Reduce-scatter: replica ``q`` encodes part ``d`` of its shard for each other replica
   ``d`` and keeps part ``q`` exact; replica ``q`` decodes the ``R`` contributions and
   sums them in fp32 in replica order, then divides by ``R``.
2. All-gather: replica ``q`` encodes its reduced part; every replica, ``q`` included,
   decodes every part. All replicas therefore end with bitwise-identical shards (an
   owner keeping its exact part would make replicas drift apart step after step).

Per rank, ``2 (R-1) C`` code bytes plus the scales cross the slow link, against
``2 (R-1)/R S`` elements for the unquantized all-reduce: 0.25x of fp32 gradients, 0.5x
of 16-bit ones, at any ``R`` (plus ``4 / quant_block`` per element for the scales).

Pieces follow ``quantize_skip`` and the small-tensor rule as elsewhere: elements of raw
parameters travel raw in the gradient dtype (a block may span two parameters).

Error feedback (``error_feedback``) covers both phases: phase 1 carries what each
contribution lost (``R - 1`` rows, one per other replica), phase 2 what the reduced
part lost (one row): a ``(R, C)`` fp32 residual per bucket, about ``S`` elements.
Non-finite values are sent as NaN blocks (every replica's step sees them) and zeroed in
the residual, as `zerolite.comm.quantized` does.
"""

from __future__ import annotations

import torch

from zerolite.comm.codec import WireFormat
from zerolite.comm.collectives import Group, Pending, chunk_of
from zerolite.comm.quantized import quantized_all_gather, quantized_reduce_scatter_avg

__all__ = [
    "quantized_average_across_replicas", "replica_residual_rows", "replica_residual_shape"
]


def replica_residual_shape(shard_numel: int, replicas: int) -> tuple[int, int]:
    """The error-feedback residual of one bucket's cross-node step: ``(R, C)`` fp32; row
    ``k - 1`` (k = 1..R-1) is phase 1's loss on the part sent to replica ``q + k``, row
    ``R - 1`` phase 2's loss on this replica's reduced part."""
    return replicas, -(-shard_numel // replicas)


def replica_residual_rows(replica: int, replicas: int) -> list[tuple[int, str]]:
    """What each row of replica ``replica``'s residual (`replica_residual_shape`) holds, in
    row order: ``(part, "send")`` for phase 1's loss on the part sent to another replica,
    then ``(replica, "gather")`` for phase 2's loss on its own reduced part."""
    sent = [((replica + k) % replicas, "send") for k in range(1, replicas)]
    return [*sent, (replica, "gather")]


def quantized_average_across_replicas(
    inner: Pending,
    out: torch.Tensor,
    wire: WireFormat,
    residual: torch.Tensor | None,
    group: Group,
    *,
    key: int,
    what: str,
) -> Pending:
    """`zerolite.comm.hybrid.average_across_replicas`, quantized (see the module docstring).

    Args:
        inner: the shard group's reduction into ``out``.
        out: 1-D, ``S`` elements, any float dtype: this rank's gradient shard; at `wait`,
            the mean over every data-parallel rank, equal bitwise on every replica.
        wire: how this shard's parts travel (`zerolite.plan.quantization.replica_wire`;
            raw elements in ``out``'s dtype).
        residual: `replica_residual_shape` fp32, or None (no error feedback).
        group: the shard group (a `zerolite.comm.hybrid.LinkedGroup`); returns ``inner`` when
            it has no replica group of more than one rank.
        key, what: the bucket's exchange key and description (errors, tags).
    Every rank of the replica group calls, in the same order relative to zerolite's other
    exchanges; both phases run when the returned handle is waited on.
    """
    replicas = group.replicas
    if replicas is None or replicas.size == 1:
        return inner

    def finish() -> None:
        inner.wait()
        _two_phase_mean(out, wire, residual, replicas, key=key, what=what)

    return Pending(finish=finish, group=group, what=what)


def _two_phase_mean(
    out: torch.Tensor,
    wire: WireFormat,
    residual: torch.Tensor | None,
    replicas: Group,
    *,
    key: int,
    what: str,
) -> None:
    n, q = replicas.size, replicas.rank
    part = wire.chunks[0].numel
    padded = torch.zeros(n * part, dtype=torch.float32, device=out.device)
    padded[: out.numel()].copy_(out)
    what = f"{what} (across replica groups)"
    # Phase 1: this replica's part, averaged over the replicas (its own contribution exact),
    # written over its own part (read only before the mean is written).
    mine = chunk_of(padded, q, part)
    sent = None if residual is None else residual[: n - 1]
    quantized_reduce_scatter_avg(padded, mine, wire, sent, replicas, key=key, what=what).wait()
    # Phase 2: every replica, this one included, decodes every reduced part: all hold the
    # same bits.
    own = None if residual is None else residual[n - 1]
    quantized_all_gather(padded, wire, replicas, key=key, what=what, residual=own).wait()
    out.copy_(padded[: out.numel()])
