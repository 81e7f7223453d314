"""The data path's collectives on equal chunks, and what every exchange of `zerolite.comm` shares.

Two primitives carry the data path, both on 1-D buffers that split into ``N`` equal
chunks (chunk ``r`` is rank ``r``'s shard, see `zerolite.plan.layout`):

- `reduce_scatter_avg`: each rank contributes a full buffer; rank ``r`` receives the
  average over ranks of chunk ``r``.
- `all_gather_inplace`: rank ``r`` holds chunk ``r`` of a full buffer; afterwards every
  rank holds all chunks.

Each has two implementations, chosen per group (``ZeroConfig.collectives``): the
*native* kernels of ``torch.distributed`` (what NCCL runs), and a *point-to-point*
exchange built from ``isend``/``irecv`` (each rank sends chunk ``j`` to rank ``j`` and
receives its own chunk from everyone: the same (N-1)/N of the buffer per rank as a
ring). gloo has no real reduce-scatter (it runs a full all-reduce) and a slow all-gather,
so ``"auto"`` picks point-to-point there. Point-to-point averages are summed locally in a
fixed order, so results do not depend on message arrival.

[Note: lockstep] Every rank issues zerolite's exchanges in the same order, so each has a
sequence number that is equal on every rank (`Group.sequence`). Point-to-point messages
are tagged with it, and the small collectives carry it (the step's gradient agreement,
`zerolite.comm.small_collectives.all_gather_bytes`): a rank that skipped a step or an iteration
cannot pair its messages with another step's -- it raises `RankMismatchError`, or waits
and times out.

[Note: waits] On gloo every wait is bounded by ``ZeroConfig.timeout_s`` (or the process
group's own timeout, where shorter) and raises `CollectiveTimeout` naming the operation, the
step and the bound; the group is then aborted ([Note: abort] in `zerolite.comm.group`). On
NCCL a wait takes no timeout: ``WorkNCCL::wait`` with a timeout busy-waits the host until
the kernel finishes (and aborts the communicator on expiry), which would make every bucket
wait, unshard and step all-gather a host sync. Without one it makes the current CUDA stream
wait for the exchange and returns at once; the process group's own timeout and NCCL's
watchdog bound it.

Where tensors live is `zerolite.comm.devices`' decision (the group's buffer device and the
communication device of small collectives); small collectives themselves are
`zerolite.comm.small_collectives`'s; uneven and int8 chunks are `zerolite.comm.owned`'s and
`zerolite.comm.quantized`'s; which of them one flat buffer uses is its exchange object's
(`zerolite.comm.exchange`). Data broadcasts, a gather to one rank and the replica
all-reduce of hybrid sharding are here too: every collective of the package is in
`zerolite.comm` (``tests/structure/test_comm_boundary.py`` checks the source).

Launches are asynchronous and return a `Pending`; callers decide when to `wait()`.
With world size 1 (or no process group) nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zerolite.comm.group import Group

__all__ = [
    "Pending",
    "Group",
    "reduce_scatter_avg",
    "all_gather_inplace",
    "all_reduce",
    "broadcast",
    "broadcast_coalesced",
    "gather",
    # The building blocks the other exchanges of `zerolite.comm` share:
    "accumulate_dtype",
    "all_gather_flat",
    "sum_in_rank_order",
    "chunk_of",
    "chunks_of",
    "tag_of",
    "wait_for",
]

# torch 2.13 renamed the flat collectives and deprecated the old names (FutureWarning).
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_KEY_BITS = 11  # point-to-point tag: (sequence mod 2**19) << 11 | (key mod 2**11)
_SEQUENCE_SPACE = 1 << (30 - _KEY_BITS)


def tag_of(sequence: int, key: int) -> int:
    """A point-to-point tag from an exchange's sequence number and its key (which buffer,
    which direction): ranks out of step can only pair exchanges of the same buffer and
    direction, which have the same size (gloo aborts the process on a size mismatch)."""
    return (sequence % _SEQUENCE_SPACE) << _KEY_BITS | key % (1 << _KEY_BITS)


class Pending:
    """Handle of launched communication; `wait` waits ([Note: waits]), then runs the
    finishing step."""

    def __init__(
        self,
        works: Sequence[dist.Work] = (),
        finish: Callable[[], None] | None = None,
        *,
        group: Group | None = None,
        what: str = "",
    ):
        self._works = list(works)
        self._finish = finish
        self._group = group
        self._what = what
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for work in self._works:
            wait_for(work, self._group, self._what)
        self._works.clear()
        if self._finish is not None:
            self._finish()
            self._finish = None
        self.done = True


def wait_for(work: dist.Work, group: Group | None, what: str) -> None:
    """Wait for ``work`` as [Note: waits] says: bounded on gloo, a stream wait on NCCL."""
    if group is None:
        work.wait()
        return
    try:
        if group.bounded_waits:
            work.wait(group.wait_bound)
        else:
            work.wait()
    except RuntimeError as exc:
        raise group.abort(what, exc) from exc


def chunk_of(full: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """Chunk ``index`` of ``full``, whose chunks have ``size`` elements each (a view)."""
    return full.narrow(0, index * size, size)


def chunks_of(full: torch.Tensor, n: int) -> Sequence[torch.Tensor]:
    """``full`` (1-D, a multiple of ``n`` elements) as its ``n`` equal chunks, views, in
    one operation: an exchange with every peer takes each chunk's view once (under
    `zerolite.memory.predict_peak` each view is a dispatch)."""
    size = full.numel() // n
    return full.split(size) if size else [full] * n


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the local sum, rounded once into the output.

    16-bit gradients are summed in fp32. fp32 stays fp32, as in DDP: a wider sum is
    not closer to what single-process training computes (it turns gradients that
    cancel to exactly 0 in fp32 into tiny non-zeros, which Adagrad-like updates then
    amplify into lr-sized steps; measured on the parity suite at 4 ranks).
    """
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def sum_in_rank_order(contributions: Sequence[torch.Tensor], out: torch.Tensor, n: int) -> None:
    """``out`` = (contributions[0] + contributions[1] + ... ) / ``n``, added left to right in
    `accumulate_dtype` and rounded once into ``out``.

    [Note: rank order] Every element of a reduced gradient is the sum of the ranks'
    contributions in rank order, 0 first, whichever rank receives it. Which rank receives an
    element depends on the layout (the stage, the bucket size, the partition), so summing in
    any order relative to the receiver (its own chunk first, then the nearest sender) makes the
    result depend on the layout once fp32 addition stops being commutative enough: at 3 or
    more ranks. In rank order, stages 1, 2 and 3 do the same arithmetic on every element.
    """
    acc_dtype = accumulate_dtype(out.dtype)
    acc = out if acc_dtype == out.dtype else torch.empty_like(out, dtype=acc_dtype)
    acc.copy_(contributions[0])
    for term in contributions[1:]:
        acc.add_(term)
    acc.div_(n)
    if acc is not out:
        out.copy_(acc)


def reduce_scatter_avg(
    full: torch.Tensor, out: torch.Tensor, group: Group, *, key: int, what: str
) -> Pending:
    """Launch: ``out`` (this rank's chunk) = mean over ranks of their ``full``'s chunk ``rank``.

    Args:
        full: 1-D, ``N * S`` elements, contributed by this rank; not modified. Must stay
            alive and unchanged until the returned handle is waited on.
        out: 1-D, ``S`` elements, same dtype and device as ``full``; written at `wait`.
        group: the data-parallel group; every rank of it must call with equal sizes, in
            the same order relative to zerolite's other exchanges.
        key: identifies the buffer and direction, equal on every rank (a reduce-scatter and
            an all-gather of one buffer have different keys).
        what: the exchange, for errors (``"the reduce-scatter of gradient bucket 3"``).
    Returns:
        A `Pending`; ``out`` is valid after its `wait`.
    """
    n = group.size
    shard = out.numel()
    if full.numel() != n * shard:
        raise RuntimeError(
            f"{group.prefix()} reduce_scatter_avg: buffer of {full.numel()} elements does not "
            f"split into {n} shards of {shard}"
        )
    if n == 1:
        out.copy_(full)
        return Pending()
    tag = tag_of(group.next_sequence(), key)
    with group.launching("zerolite::reduce_scatter", what):
        if not group.point_to_point:
            # torch 2.4.1's gloo returned the sum for ReduceOp.AVG, silently; the floor's
            # average, and every later one's, is held by tests/comm/test_gloo_average.py.
            work = _reduce_scatter_flat(
                out, full, op=dist.ReduceOp.AVG, group=group.pg, async_op=True
            )
            return Pending([work], group=group, what=what)
        sent = chunks_of(full, n)
        received = chunks_of(
            torch.empty((n - 1) * shard, dtype=full.dtype, device=full.device), n - 1)
        works = []
        for k in range(1, n):
            dst, src = (group.rank + k) % n, (group.rank - k) % n
            works.append(dist.isend(sent[dst], group.global_rank(dst), group.pg, tag))
            works.append(dist.irecv(received[k - 1], group.global_rank(src), group.pg, tag))

    def finish() -> None:
        contributions = [sent[src] if src == group.rank else received[(group.rank - src) % n - 1]
                         for src in range(n)]
        sum_in_rank_order(contributions, out, n)

    return Pending(works, finish, group=group, what=what)


def all_gather_inplace(full: torch.Tensor, group: Group, *, key: int, what: str) -> Pending:
    """Launch: every rank's chunk ``rank`` of ``full`` is copied into all ranks' ``full``.

    Args:
        full: 1-D, ``N * S`` elements; chunk ``rank`` is this rank's input, the other
            chunks are overwritten. Must not be read or written until `wait`.
        group: the data-parallel group; every rank of it must call with equal sizes, in
            the same order relative to zerolite's other exchanges.
        key: identifies the buffer and direction, equal on every rank.
        what: the exchange, for errors (``"the all-gather of unit 'blocks.3'"``).
    """
    n = group.size
    if n == 1:
        return Pending()
    if full.numel() % n:
        raise RuntimeError(
            f"{group.prefix()} all_gather_inplace: {full.numel()} elements do not split into {n} "
            f"shards"
        )
    shard = full.numel() // n
    tag = tag_of(group.next_sequence(), key)
    with group.launching("zerolite::all_gather", what):
        if not group.point_to_point:
            mine = chunk_of(full, group.rank, shard)
            return Pending(
                [all_gather_flat(full, mine, group=group.pg, async_op=True)],
                group=group,
                what=what,
            )
        chunks = chunks_of(full, n)
        works = []
        for k in range(1, n):
            dst, src = (group.rank + k) % n, (group.rank - k) % n
            works.append(dist.isend(chunks[group.rank], group.global_rank(dst), group.pg, tag))
            works.append(dist.irecv(chunks[src], group.global_rank(src), group.pg, tag))
    return Pending(works, group=group, what=what)


def all_reduce(
    tensor: torch.Tensor,
    group: Group,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    *,
    what: str,
) -> None:
    """In-place all-reduce of a data tensor where it lives (a gradient shard across replica
    groups), waited ([Note: waits]); no-op for one rank. Small values (flags, counters,
    norms) go through `zerolite.comm.small_collectives.small_collective` instead."""
    if group.size > 1:
        group.next_sequence()
        with group.launching("zerolite::all_reduce", what):
            work = dist.all_reduce(tensor, op=op, group=group.pg, async_op=True)
        wait_for(work, group, what)


def broadcast(tensor: torch.Tensor, src: int, group: Group, *, what: str) -> None:
    """In-place broadcast of a data tensor where it lives (a flat buffer) from group rank
    ``src``, waited ([Note: waits]); no-op for one rank."""
    if group.size > 1:
        group.next_sequence()
        with group.launching("zerolite::broadcast", what):
            work = dist.broadcast(tensor, group.global_rank(src), group=group.pg, async_op=True)
        wait_for(work, group, what)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int, group: Group, *, what: str
) -> None:
    """In-place broadcast of many tensors from group rank ``src``, one exchange per (dtype,
    device) kind (as DDP's construction-time broadcast), each packed on the group's
    communication device (`Group.device`); no-op for one rank."""
    if group.size == 1 or not tensors:
        return
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    for members in kinds.values():
        wire = torch.cat([t.detach().reshape(-1) for t in members]).to(group.device)
        broadcast(wire, src, group, what=what)
        offset = 0
        with torch.no_grad():
            for t in members:
                t.copy_(wire[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()


def gather(tensor: torch.Tensor, dst: int, group: Group, *, what: str) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (equal shapes and dtypes), in rank order, on group rank
    ``dst``; None on the other ranks. Waited ([Note: waits]); ``[tensor]`` for one rank.

    All ranks of ``group`` must call, in the same order relative to zerolite's other
    exchanges. The gathered tensors live where ``tensor`` does.
    """
    if group.size == 1:
        return [tensor]
    received = (
        [torch.empty_like(tensor) for _ in range(group.size)] if group.rank == dst else None
    )
    group.next_sequence()
    with group.launching("zerolite::gather", what):
        work = dist.gather(
            tensor, received, dst=group.global_rank(dst), group=group.pg, async_op=True
        )
    wait_for(work, group, what)
    return received
