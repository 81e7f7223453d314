"""Every communication call zerolite makes, in one place.

Two primitives carry the data path, both on 1-D buffers that split into ``N`` equal
chunks (chunk ``r`` is rank ``r``'s shard, see `zerolite.layout`):

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
are tagged with it, and the small exchanges carry it (the step's gradient agreement,
`all_gather_bytes`): a rank that skipped a step or an iteration cannot pair its messages
with another step's -- it raises `RankMismatchError`, or waits and times out. Every wait
is bounded by ``ZeroConfig.timeout_s`` and raises `CollectiveTimeout` naming the operation
and the step.

Launches are asynchronous and return a `Pending`; callers decide when to `wait()`.
With world size 1 (or no process group) nothing is communicated.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zerolite.errors import CollectiveTimeout, RankMismatchError

__all__ = [
    "Pending",
    "Group",
    "reduce_scatter_avg",
    "all_gather_inplace",
    "all_reduce",
    "broadcast",
    "broadcast_coalesced",
    "all_gather_bytes",
]

# torch 2.13 renamed the flat collectives and deprecated the old names (FutureWarning).
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_KEY_BITS = 11  # point-to-point tag: (sequence mod 2**19) << 11 | (key mod 2**11)
_SEQUENCE_SPACE = 1 << (30 - _KEY_BITS)


def _tag(sequence: int, key: int) -> int:
    """A point-to-point tag from an exchange's sequence number and its key (which buffer,
    which direction): ranks out of step can only pair exchanges of the same buffer and
    direction, which have the same size (gloo aborts the process on a size mismatch)."""
    return (sequence % _SEQUENCE_SPACE) << _KEY_BITS | key % (1 << _KEY_BITS)


class Group:
    """The communicator of one sharded model: a process group with its rank, size and
    backend looked up once, how exchanges travel, how long they may wait, and the
    sequence numbers of [Note: lockstep].

    Args:
        process_group: the group, or ``None`` for the default group; when
            torch.distributed is not initialised this is a group of one.
        collectives: ``"auto"``, ``"native"`` or ``"point_to_point"`` (`ZeroConfig`).
        timeout_s: the bound on every wait, in seconds.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        collectives: str = "auto",
        timeout_s: float = 600.0,
    ) -> None:
        self.pg = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(process_group)
            self.size = dist.get_world_size(process_group)
            self.backend = str(dist.get_backend(process_group)).lower()
            self._global_ranks = [
                r if process_group is None else dist.get_global_rank(process_group, r)
                for r in range(self.size)
            ]
        else:
            self.rank, self.size, self.backend, self._global_ranks = 0, 1, "none", [0]
        # True where reduce-scatter and all-gather are built from isend/irecv.
        self.point_to_point = collectives == "point_to_point" or (
            collectives == "auto" and self.backend == "gloo"
        )
        self.timeout = timedelta(seconds=timeout_s)
        # Lockstep counters, equal on every rank that runs the same loop, compared at each
        # step (`zerolite.grad_reducer`): exchanges issued so far on this group, optimizer
        # steps completed (named in errors), and forwards started with gradients enabled
        # (a rank that raised in a forward and skipped the iteration issues the same
        # exchanges as its peers, one batch late: only this count tells).
        self.sequence = 0
        self.step = 0
        self.forwards = 0

    # Hybrid sharding (`zerolite.hybrid`): this shard group's replica group; None when flat.
    replicas: Group | None = None

    @property
    def world(self) -> Group:
        """Every data-parallel rank: the group itself unless hybrid (`zerolite.hybrid`)."""
        return self

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence

    def global_rank(self, rank: int) -> int:
        return self._global_ranks[rank]

    @property
    def device(self) -> torch.device:
        """Where small exchanges (flags, bytes) live: NCCL needs CUDA tensors."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def prefix(self) -> str:
        """``[rank r/N]``, for internal error messages."""
        return f"[rank {self.rank}/{self.size}]"

    def failure(self, what: str, exc: BaseException) -> CollectiveTimeout:
        """The error for exchange ``what`` that did not complete (``exc``: the backend's)."""
        text = str(exc)
        timed_out = "imed out" in text or "timeout" in text.lower()
        reason = (
            f"did not complete within ZeroConfig.timeout_s={self.timeout.total_seconds():g}s"
            if timed_out
            else f"failed ({text.splitlines()[0][:200] if text else type(exc).__name__})"
        )
        return CollectiveTimeout(
            f"{self.prefix()} zerolite: {what} at step {self.step} {reason}. Another rank is "
            "not taking part: it may have skipped step() or an iteration, run save(), load(), "
            "full_state_dict() or a stage-3 forward alone, or died. Every rank must run the "
            "same zerolite operations in the same order."
        )


class Pending:
    """Handle of launched communication; `wait` blocks (bounded), then runs the finishing step."""

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
            _bounded_wait(work, self._group, self._what)
        self._works.clear()
        if self._finish is not None:
            self._finish()
            self._finish = None
        self.done = True


def _bounded_wait(work: dist.Work, group: Group | None, what: str) -> None:
    if group is None:
        work.wait()
        return
    try:
        work.wait(group.timeout)
    except RuntimeError as exc:
        raise group.failure(what, exc) from exc


def _chunk(full: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return full.narrow(0, index * size, size)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the local sum, rounded once into the output.

    16-bit gradients are summed in fp32. fp32 stays fp32, as in DDP: a wider sum is
    not closer to what single-process training computes (it turns gradients that
    cancel to exactly 0 in fp32 into tiny non-zeros, which Adagrad-like updates then
    amplify into lr-sized steps; measured on the parity suite at 4 ranks).
    """
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


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
    tag = _tag(group.next_sequence(), key)
    with record_function("zerolite::reduce_scatter"):
        if not group.point_to_point:
            work = _reduce_scatter_flat(
                out, full, op=dist.ReduceOp.AVG, group=group.pg, async_op=True
            )
            return Pending([work], group=group, what=what)
        received = torch.empty((n - 1, shard), dtype=full.dtype, device=full.device)
        works = []
        for k in range(1, n):
            dst, src = (group.rank + k) % n, (group.rank - k) % n
            works.append(
                dist.isend(_chunk(full, dst, shard), group.global_rank(dst), group.pg, tag)
            )
            works.append(dist.irecv(received[k - 1], group.global_rank(src), group.pg, tag))

    def finish() -> None:
        mine = _chunk(full, group.rank, shard)
        acc_dtype = _accumulate_dtype(out.dtype)
        acc = out if acc_dtype == out.dtype else torch.empty_like(out, dtype=acc_dtype)
        acc.copy_(mine)
        for k in range(n - 1):
            acc.add_(received[k])
        acc.div_(n)
        if acc is not out:
            out.copy_(acc)

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
    tag = _tag(group.next_sequence(), key)
    with record_function("zerolite::all_gather"):
        if not group.point_to_point:
            mine = _chunk(full, group.rank, shard)
            return Pending(
                [_all_gather_flat(full, mine, group=group.pg, async_op=True)],
                group=group,
                what=what,
            )
        works = []
        for k in range(1, n):
            dst, src = (group.rank + k) % n, (group.rank - k) % n
            works.append(
                dist.isend(_chunk(full, group.rank, shard), group.global_rank(dst), group.pg, tag)
            )
            works.append(
                dist.irecv(_chunk(full, src, shard), group.global_rank(src), group.pg, tag)
            )
    return Pending(works, group=group, what=what)


def all_reduce(
    tensor: torch.Tensor,
    group: Group,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    *,
    what: str,
) -> None:
    """Bounded, in-place all-reduce of a small tensor (norms, flags); no-op for one rank."""
    if group.size > 1:
        group.next_sequence()
        with record_function("zerolite::all_reduce"):
            work = dist.all_reduce(tensor, op=op, group=group.pg, async_op=True)
        _bounded_wait(work, group, what)


def broadcast(tensor: torch.Tensor, src: int, group: Group, *, what: str) -> None:
    """Bounded, in-place broadcast from group rank ``src``; no-op for one rank."""
    if group.size > 1:
        group.next_sequence()
        with record_function("zerolite::broadcast"):
            work = dist.broadcast(tensor, group.global_rank(src), group=group.pg, async_op=True)
        _bounded_wait(work, group, what)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int, group: Group, *, what: str
) -> None:
    """Bounded in-place broadcast of many tensors from group rank ``src``, one exchange per
    (dtype, device) kind (as DDP's construction-time broadcast); no-op for one rank."""
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


def all_gather_bytes(payload: bytes, group: Group, *, what: str) -> list[bytes]:
    """Every rank's ``payload``, in rank order (two bounded collectives; no pickle).

    All ranks must call; payloads may differ in length. Each carries this exchange's
    sequence number: ranks out of lockstep raise `RankMismatchError` on every rank.
    """
    if group.size == 1:
        return [payload]
    sequence = group.next_sequence()
    framed = struct.pack("<Q", sequence) + payload
    device = group.device
    length = torch.tensor([len(framed)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(group.size)]
    _bounded_wait(dist.all_gather(lengths, length, group=group.pg, async_op=True), group, what)
    longest = max(int(x.item()) for x in lengths)
    data = torch.zeros(longest, dtype=torch.uint8, device=device)
    data[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
    gathered = [torch.empty_like(data) for _ in range(group.size)]
    _bounded_wait(dist.all_gather(gathered, data, group=group.pg, async_op=True), group, what)
    frames = [bytes(g[: int(n.item())].cpu().tolist()) for g, n in zip(gathered, lengths)]
    sequences = [struct.unpack("<Q", f[:8])[0] if len(f) >= 8 else -1 for f in frames]
    if len(set(sequences)) > 1:
        raise RankMismatchError(
            f"{group.prefix()} zerolite: {what} at step {group.step}: ranks are out of step "
            f"(exchange numbers {sequences}): a rank skipped or added a zerolite operation "
            "(step(), an iteration, save()/load()/full_state_dict() on some ranks only)"
        )
    return [f[8:] for f in frames]
