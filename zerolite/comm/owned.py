"""The two data-path exchanges for buffers split into *uneven* chunks (whole-tensor ownership).

`zerolite.comm.collectives` moves buffers that split into ``N`` equal chunks. Under
``ZeroConfig.partition="tensor"`` rank ``r``'s chunk is exactly the parameters it owns
(`zerolite.plan.owners`), so chunk sizes differ and some are empty. These are the same
two exchanges for such buffers, with the same contract (asynchronous, a `Pending` to wait
on, bounded waits, [Note: lockstep] sequence numbers):

- `reduce_to_owners`: rank ``r`` receives the average over ranks of chunk ``r``;
- `gather_from_owners`: every rank's chunk is copied into all ranks' buffers.

Point-to-point groups (gloo) exchange chunks with tagged ``isend``/``irecv``, skipping empty
chunks, and sum in a fixed order as `zerolite.comm.collectives` does. Native groups (NCCL) run one
``reduce`` / ``broadcast`` per non-empty owner chunk: torch's flat reduce-scatter and
all-gather kernels need equal chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zerolite.comm.collectives import Group, Pending, sum_in_rank_order, tag_of

__all__ = ["gather_from_owners", "reduce_to_owners"]


def _bounds(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def reduce_to_owners(
    full: torch.Tensor,
    out: torch.Tensor,
    sizes: Sequence[int],
    group: Group,
    *,
    key: int,
    what: str,
) -> Pending:
    """Launch: ``out`` = mean over ranks of their ``full``'s chunk ``group.rank``.

    Args:
        full: 1-D, ``sum(sizes)`` elements, this rank's contribution; not modified, kept
            alive and unchanged until the returned handle is waited on.
        out: 1-D, ``sizes[group.rank]`` elements (possibly 0), same dtype and device.
        sizes: elements of each rank's chunk, in rank order; equal on every rank.
        group, key, what: as `zerolite.comm.collectives.reduce_scatter_avg` (every rank calls,
            in the same order relative to zerolite's other exchanges).
    """
    n, rank = group.size, group.rank
    bounds = _bounds(sizes)
    if full.numel() != bounds[-1] or out.numel() != sizes[rank]:
        raise RuntimeError(
            f"{group.prefix()} reduce_to_owners: buffer of {full.numel()} elements and output of "
            f"{out.numel()} do not fit chunks {list(sizes)}"
        )

    def chunk(r: int) -> torch.Tensor:
        return full[bounds[r] : bounds[r + 1]]

    if n == 1:
        out.copy_(full)
        return Pending()
    tag = tag_of(group.next_sequence(), key)
    works = []
    with group.launching("zerolite::reduce_to_owners", what):
        if group.point_to_point:
            received = torch.empty((n - 1, sizes[rank]), dtype=full.dtype, device=full.device)
            for k in range(1, n):
                dst, src = (rank + k) % n, (rank - k) % n
                if sizes[dst]:
                    works.append(dist.isend(chunk(dst), group.global_rank(dst), group.pg, tag))
                if sizes[rank]:
                    works.append(dist.irecv(received[k - 1], group.global_rank(src), group.pg, tag))
        else:
            # A reduce may use its input as scratch: reduce a copy of each chunk.
            sent = [chunk(r).clone() for r in range(n)]
            for r in range(n):
                if sizes[r]:
                    works.append(dist.reduce(
                        sent[r], group.global_rank(r), dist.ReduceOp.SUM, group.pg, async_op=True
                    ))

    def finish() -> None:
        if group.point_to_point:  # [Note: rank order] in zerolite.comm.collectives
            contributions = [chunk(rank) if src == rank else received[(rank - src) % n - 1]
                             for src in range(n)]
        else:
            contributions = [sent[rank]]
        sum_in_rank_order(contributions, out, n)

    return Pending(works, finish, group=group, what=what)


def gather_from_owners(
    full: torch.Tensor, sizes: Sequence[int], group: Group, *, key: int, what: str
) -> Pending:
    """Launch: chunk ``r`` of every rank's ``full`` becomes rank ``r``'s chunk.

    Args:
        full: 1-D, ``sum(sizes)`` elements; chunk ``group.rank`` is the input, the other
            chunks are overwritten. Must not be read or written until `wait`.
        sizes, group, key, what: as `reduce_to_owners`.
    """
    n, rank = group.size, group.rank
    bounds = _bounds(sizes)
    if full.numel() != bounds[-1]:
        raise RuntimeError(
            f"{group.prefix()} gather_from_owners: buffer of {full.numel()} elements does not fit "
            f"chunks {list(sizes)}"
        )
    if n == 1:
        return Pending()

    def chunk(r: int) -> torch.Tensor:
        return full[bounds[r] : bounds[r + 1]]

    tag = tag_of(group.next_sequence(), key)
    works = []
    with group.launching("zerolite::gather_from_owners", what):
        if group.point_to_point:
            for k in range(1, n):
                dst, src = (rank + k) % n, (rank - k) % n
                if sizes[rank]:
                    works.append(dist.isend(chunk(rank), group.global_rank(dst), group.pg, tag))
                if sizes[src]:
                    works.append(dist.irecv(chunk(src), group.global_rank(src), group.pg, tag))
        else:
            works = [
                dist.broadcast(chunk(r), group.global_rank(r), group.pg, async_op=True)
                for r in range(n)
                if sizes[r]
            ]
    return Pending(works, group=group, what=what)
