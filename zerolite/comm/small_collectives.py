"""Small collectives: flags, counters, norms, digests, generator states -- one helper.

`small_collective` is the only way zerolite exchanges small values across ranks. It takes
them on any device, copies them to the group's communication device (`Group.device`,
decided by `zerolite.comm.devices`: the buffers' CUDA device on NCCL, the CPU on gloo), runs one
collective there, waits ([Note: waits] in `zerolite.comm.collectives`), and returns the result
as a new CPU tensor: the caller's tensor is never modified, and decisions made from the
result (skip the step, raise, clip) read host memory. On CUDA that read is the one host
sync a decision needs; nothing else here synchronises.

`all_gather_bytes` carries byte strings (plan digests, checkpoint records) on top of it.
Data tensors (gradient buckets, flat buffers) never come here: they travel where they live
(`zerolite.comm.collectives`).
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from zerolite.comm.collectives import Group, wait_for
from zerolite.errors import RankMismatchError

__all__ = ["SMALL_COLLECTIVES", "all_gather_bytes", "small_collective"]

# What `small_collective` can do: element-wise sum or max over ranks, a broadcast from one
# rank, or every rank's values stacked in rank order.
SMALL_COLLECTIVES = ("sum", "max", "broadcast", "all_gather")
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def small_collective(
    values: torch.Tensor, group: Group, how: str, *, what: str, src: int = 0
) -> torch.Tensor:
    """Exchange ``values`` over ``group``; the result is a new tensor on the CPU.

    Args:
        values: any shape, dtype and device; not modified.
        group: every rank of it must call, in the same order relative to zerolite's other
            exchanges, with values of the same shape and dtype.
        how: ``"sum"`` or ``"max"`` (element-wise over ranks), ``"broadcast"`` (group rank
            ``src``'s values), or ``"all_gather"`` (every rank's values stacked in rank
            order: shape ``(group.size, *values.shape)``).
        what: the exchange, for errors (``"step()'s gradient agreement"``).
        src: the broadcasting rank (``how="broadcast"``).
    Returns:
        The exchanged values on the CPU (with one rank: a copy of ``values``, or
        ``values[None]`` for ``"all_gather"``).
    Raises:
        ValueError: ``how`` is not one of `SMALL_COLLECTIVES`.
        zerolite.CollectiveTimeout: the exchange did not complete (another rank is not
            taking part).
    """
    if how not in SMALL_COLLECTIVES:
        raise ValueError(
            f"small_collective(): how={how!r}; allowed: {', '.join(SMALL_COLLECTIVES)}"
        )
    if group.size == 1:  # nothing to exchange: no trip through the device either
        out = values.detach().to("cpu", copy=True)
        return out[None] if how == "all_gather" else out
    group.next_sequence()
    return run_small(values.detach().to(group.device, copy=True), group, how, what=what, src=src)


def run_small(
    wire: torch.Tensor, group: Group, how: str, *, what: str, src: int = 0
) -> torch.Tensor:
    """`small_collective`'s collective on ``wire`` (already on ``group.device``, modified in
    place), at any group size; the result on the CPU. Only `small_collective` and the GPU
    checks (which have one GPU, so a group of one) call it."""
    with group.launching(f"zerolite::small_{how}", what):
        if how in _OPS:
            work = dist.all_reduce(wire, op=_OPS[how], group=group.pg, async_op=True)
        elif how == "broadcast":
            work = dist.broadcast(wire, group.global_rank(src), group=group.pg, async_op=True)
        else:
            parts = [torch.empty_like(wire) for _ in range(group.size)]
            work = dist.all_gather(parts, wire, group=group.pg, async_op=True)
    wait_for(work, group, what)
    return (torch.stack(parts) if how == "all_gather" else wire).cpu()


def all_gather_bytes(payload: bytes, group: Group, *, what: str) -> list[bytes]:
    """Every rank's ``payload``, in rank order (two small collectives; no pickle).

    All ranks must call; payloads may differ in length. Each carries this exchange's
    sequence number: ranks out of lockstep raise `RankMismatchError` on every rank.
    """
    if group.size == 1:
        return [payload]
    sequence = group.next_sequence()
    framed = struct.pack("<Q", sequence) + payload
    length = torch.tensor([len(framed)], dtype=torch.int64)
    lengths = small_collective(length, group, "all_gather", what=what)[:, 0].tolist()
    data = torch.zeros(max(lengths), dtype=torch.uint8)
    data[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
    gathered = small_collective(data, group, "all_gather", what=what)
    frames = [g[:n].numpy().tobytes() for g, n in zip(gathered, lengths)]
    sequences = [struct.unpack("<Q", f[:8])[0] if len(f) >= 8 else -1 for f in frames]
    if len(set(sequences)) > 1:
        raise RankMismatchError(
            f"{group.prefix()} zerolite: {what} at step {group.step}: ranks are out of step "
            f"(exchange numbers {sequences}): a rank skipped or added a zerolite operation "
            "(step(), an iteration, save()/load()/full_state_dict() on some ranks only)"
        )
    return [f[8:] for f in frames]
