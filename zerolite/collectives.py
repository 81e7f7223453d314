"""Every communication call zerolite makes, in one place.

Two primitives carry the data path, both on 1-D buffers that split into ``N`` equal
chunks (chunk ``r`` is rank ``r``'s shard, see `zerolite.layout`):

- `reduce_scatter_avg`: each rank contributes a full buffer; rank ``r`` receives the
  average over ranks of chunk ``r``.
- `all_gather_inplace`: rank ``r`` holds chunk ``r`` of a full buffer; afterwards every
  rank holds all chunks.

They are backend-aware. NCCL has real reduce-scatter and all-gather kernels, so those
are used (through the torch-version shim below). gloo has neither: its reduce-scatter
runs as a full all-reduce and its all-gather is slow on loopback, so for gloo the
same exchange is written with `torch.distributed` point-to-point operations (each
rank sends chunk ``j`` to rank ``j`` and receives its own chunk from everyone), which
moves the same (N-1)/N of the buffer per rank. Averaging is done locally, summing in
a fixed order, so results do not depend on message arrival.

Launches are asynchronous and return a `Pending`; callers decide when to `wait()`.
With world size 1 (or no process group) nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = [
    "Pending",
    "Group",
    "reduce_scatter_avg",
    "all_gather_inplace",
    "all_reduce",
    "broadcast",
    "all_gather_bytes",
]

# torch 2.13 renamed the flat collectives and deprecated the old names (FutureWarning).
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Group:
    """A process group with its rank, size and backend looked up once.

    Args:
        process_group: the group, or ``None`` for the default group; when
            torch.distributed is not initialised this is a group of one.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
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

    @property
    def point_to_point(self) -> bool:
        """True where collectives are emulated with isend/irecv (gloo)."""
        return self.backend == "gloo"

    def global_rank(self, rank: int) -> int:
        return self._global_ranks[rank]

    def prefix(self) -> str:
        """``[rank r/N]``, for internal error messages."""
        return f"[rank {self.rank}/{self.size}]"


class Pending:
    """Handle of launched communication; `wait` blocks, then runs the finishing step."""

    def __init__(self, works: Sequence[dist.Work] = (), finish: Callable[[], None] | None = None):
        self._works = list(works)
        self._finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for work in self._works:
            work.wait()
        self._works.clear()
        if self._finish is not None:
            self._finish()
            self._finish = None
        self.done = True


def _chunk(full: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return full.narrow(0, index * size, size)


def _accumulate_dtype(dtype: torch.dtype, n: int) -> torch.dtype:
    """Precision of the local sum, rounded once into the output.

    16-bit gradients are summed in fp32. fp32 stays fp32, as in DDP: a wider sum is
    not closer to what single-process training computes (it turns gradients that
    cancel to exactly 0 in fp32 into tiny non-zeros, which Adagrad-like updates then
    amplify into lr-sized steps; measured on the parity suite at 4 ranks).
    """
    del n  # same rule for every world size
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def reduce_scatter_avg(full: torch.Tensor, out: torch.Tensor, group: Group, *, tag: int = 0) -> Pending:
    """Launch: ``out`` (this rank's chunk) = mean over ranks of their ``full``'s chunk ``rank``.

    Args:
        full: 1-D, ``N * S`` elements, contributed by this rank; not modified. Must stay
            alive and unchanged until the returned handle is waited on.
        out: 1-D, ``S`` elements, same dtype and device as ``full``; written at `wait`.
        group: the data-parallel group; every rank of it must call with equal sizes.
        tag: distinguishes concurrent exchanges between the same ranks (point-to-point).
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
    with record_function("zerolite::reduce_scatter"):
        if not group.point_to_point:
            return Pending([_reduce_scatter_flat(out, full, op=dist.ReduceOp.AVG, group=group.pg, async_op=True)])
        received = torch.empty((n - 1, shard), dtype=full.dtype, device=full.device)
        works = []
        for k in range(1, n):
            dst, src = (group.rank + k) % n, (group.rank - k) % n
            works.append(dist.isend(_chunk(full, dst, shard), group.global_rank(dst), group.pg, tag))
            works.append(dist.irecv(received[k - 1], group.global_rank(src), group.pg, tag))

    def finish() -> None:
        mine = _chunk(full, group.rank, shard)
        acc_dtype = _accumulate_dtype(out.dtype, n)
        acc = out if acc_dtype == out.dtype else torch.empty_like(out, dtype=acc_dtype)
        acc.copy_(mine)
        for k in range(n - 1):
            acc.add_(received[k])
        acc.div_(n)
        if acc is not out:
            out.copy_(acc)

    return Pending(works, finish)


def all_gather_inplace(full: torch.Tensor, group: Group, *, tag: int = 0) -> Pending:
    """Launch: every rank's chunk ``rank`` of ``full`` is copied into all ranks' ``full``.

    Args:
        full: 1-D, ``N * S`` elements; chunk ``rank`` is this rank's input, the other
            chunks are overwritten. Must not be read or written until `wait`.
        group: the data-parallel group; every rank of it must call with equal sizes.
        tag: distinguishes concurrent exchanges between the same ranks (point-to-point).
    """
    n = group.size
    if n == 1:
        return Pending()
    if full.numel() % n:
        raise RuntimeError(
            f"{group.prefix()} all_gather_inplace: {full.numel()} elements do not split into {n} shards"
        )
    shard = full.numel() // n
    with record_function("zerolite::all_gather"):
        if not group.point_to_point:
            mine = _chunk(full, group.rank, shard)
            return Pending([_all_gather_flat(full, mine, group=group.pg, async_op=True)])
        works = []
        for k in range(1, n):
            dst, src = (group.rank + k) % n, (group.rank - k) % n
            works.append(dist.isend(_chunk(full, group.rank, shard), group.global_rank(dst), group.pg, tag))
            works.append(dist.irecv(_chunk(full, src, shard), group.global_rank(src), group.pg, tag))
    return Pending(works)


def all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """Blocking in-place all-reduce of a small tensor (norms, flags); no-op for one rank."""
    if group.size > 1:
        with record_function("zerolite::all_reduce"):
            dist.all_reduce(tensor, op=op, group=group.pg)


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> None:
    """Blocking in-place broadcast from group rank ``src``; no-op for one rank."""
    if group.size > 1:
        with record_function("zerolite::broadcast"):
            dist.broadcast(tensor, group.global_rank(src), group=group.pg)


def all_gather_bytes(payload: bytes, group: Group) -> list[bytes]:
    """Every rank's ``payload``, in rank order (two collectives; no pickle).

    All ranks must call; payloads may differ in length.
    """
    if group.size == 1:
        return [payload]
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(group.size)]
    dist.all_gather(lengths, length, group=group.pg)
    longest = max(int(x.item()) for x in lengths)
    data = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(data) for _ in range(group.size)]
    dist.all_gather(gathered, data, group=group.pg)
    return [bytes(g[: int(n.item())].cpu().tolist()) for g, n in zip(gathered, lengths)]
