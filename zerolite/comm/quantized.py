"""The quantized variants of `zerolite.comm.collectives`' two data-path exchanges.

Same contracts as `reduce_scatter_avg` and `all_gather_inplace` (1-D buffers of ``N``
equal chunks, asynchronous launch, a `Pending` to wait on, tags and sequence numbers of
[Note: lockstep]), but each chunk travels as one message of a `WireFormat`
(`zerolite.comm.codec`): int8 blocks, fp32 scales, skipped parameters raw.

- `quantized_all_gather`: rank ``r`` encodes chunk ``r``; every rank, ``r`` included,
  decodes every chunk into the full buffer, so all ranks hold the same values.
- `quantized_reduce_scatter_avg`: rank ``r`` encodes chunk ``j`` of its contribution for
  each other rank ``j`` (plus, with error feedback, what quantization lost of it last
  time) and keeps its own chunk exact. Rank ``j`` decodes and sums the ``N``
  contributions in fp32 in rank order, then divides by ``N``.

Both paths of ``ZeroConfig.collectives`` are supported: point-to-point messages, or the
native all-gather / all-to-all of the message rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zerolite.comm.codec import ChunkCodec, WireFormat
from zerolite.comm.collectives import Group, Pending, all_gather_flat, chunk_of, tag_of

__all__ = ["quantized_all_gather", "quantized_reduce_scatter_avg", "residual_chunks"]


def encode_with_feedback(
    codec: ChunkCodec, chunk: torch.Tensor, message: torch.Tensor, residual: torch.Tensor | None
) -> None:
    """Encode ``chunk`` (1-D, ``codec.numel``, float) into ``message``; with error feedback,
    encode ``residual + chunk`` instead and leave in ``residual`` (1-D fp32, ``codec.numel``)
    what the receivers will not see of it, non-finite values zeroed."""
    if residual is None:
        codec.encode(chunk, message)
        return
    contribution = torch.add(residual, chunk)  # fp32, a new tensor
    codec.encode(contribution, message)
    # What the receiver will see, subtracted: the loss carried to the next exchange.
    codec.decode(message, residual)
    torch.sub(contribution, residual, out=residual)
    # A non-finite block is sent as NaN (never hidden); it must not poison later steps.
    torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)


def residual_chunks(rank: int, world_size: int) -> list[int]:
    """Which chunk each row of a reduce-scatter's error-feedback residual (``(N - 1, S)``)
    belongs to, in row order: row ``k - 1`` is what quantization lost of the chunk rank
    ``rank`` sends to rank ``rank + k``."""
    return [(rank + k) % world_size for k in range(1, world_size)]


def exchange_rows(
    send: torch.Tensor,
    received: torch.Tensor,
    group: Group,
    *,
    key: int,
    row_bytes: Sequence[int] | None = None,
) -> list[dist.Work]:
    """Launch an all-to-all of message rows: row ``j`` of ``send`` (``(N, bytes)`` uint8)
    goes to rank ``j``, row ``j`` of ``received`` comes from rank ``j`` (this rank's own
    rows are not exchanged). Every rank of ``group`` calls, in lockstep.

    ``row_bytes`` (uneven messages, `zerolite.comm.quantized_owned`): the message for rank
    ``j`` is the first ``row_bytes[j]`` bytes of its row; point-to-point groups send only
    those and nothing where it is 0 (native groups send whole rows)."""
    n = group.size
    tag = tag_of(group.next_sequence(), key)
    if not group.point_to_point:
        return [dist.all_to_all_single(received, send, group=group.pg, async_op=True)]
    size = [send.shape[1]] * n if row_bytes is None else row_bytes
    mine = size[group.rank]
    works = []
    for k in range(1, n):
        dst, src = (group.rank + k) % n, (group.rank - k) % n
        if size[dst]:
            works.append(dist.isend(send[dst, : size[dst]], group.global_rank(dst), group.pg, tag))
        if mine:
            works.append(dist.irecv(received[src, :mine], group.global_rank(src), group.pg, tag))
    return works


def gather_rows(
    messages: torch.Tensor, group: Group, *, key: int, row_bytes: Sequence[int] | None = None
) -> list[dist.Work]:
    """Launch an all-gather of message rows: row ``rank`` of ``messages`` (``(N, bytes)``
    uint8) into every rank's row ``rank``. Every rank of ``group`` calls, in lockstep.

    ``row_bytes``: rank ``j``'s message is the first ``row_bytes[j]`` bytes of its row, as
    in `exchange_rows`."""
    n = group.size
    tag = tag_of(group.next_sequence(), key)
    if not group.point_to_point:
        mine = messages[group.rank]
        return [all_gather_flat(messages.view(-1), mine, group=group.pg, async_op=True)]
    size = [messages.shape[1]] * n if row_bytes is None else row_bytes
    mine = size[group.rank]
    works = []
    for k in range(1, n):
        dst, src = (group.rank + k) % n, (group.rank - k) % n
        if mine:
            works.append(
                dist.isend(messages[group.rank, :mine], group.global_rank(dst), group.pg, tag)
            )
        if size[src]:
            works.append(
                dist.irecv(messages[src, : size[src]], group.global_rank(src), group.pg, tag)
            )
    return works


def quantized_all_gather(
    full: torch.Tensor,
    wire: WireFormat,
    group: Group,
    *,
    key: int,
    what: str,
    residual: torch.Tensor | None = None,
) -> Pending:
    """Launch: every rank's chunk ``rank`` of ``full``, quantized, into all ranks' ``full``.

    Args:
        full: 1-D, ``N * S`` elements (``wire``'s layout padded); chunk ``rank`` is this
            rank's input, and is overwritten with its own dequantized values at `wait`
            like every other chunk. Must not be read or written until `wait`.
        wire: the buffer's `WireFormat` (raw elements in ``full``'s dtype).
        group, key, what: as `zerolite.comm.collectives.all_gather_inplace`; every rank calls.
        residual: error feedback for this rank's chunk (1-D fp32, ``S``; see
            `encode_with_feedback`), or None. Parameters (whose masters stay exact) use none.
    """
    n = group.size
    if n == 1:
        return Pending()
    shard = full.numel() // n
    messages = wire.messages(full.device)
    encode_with_feedback(
        wire.chunks[group.rank], chunk_of(full, group.rank, shard), messages[group.rank], residual
    )
    with group.launching("zerolite::quantized_all_gather", what):
        works = gather_rows(messages, group, key=key)

    def finish() -> None:
        for j, codec in enumerate(wire.chunks):
            codec.decode(messages[j], chunk_of(full, j, shard))

    return Pending(works, finish, group=group, what=what)


def quantized_reduce_scatter_avg(
    full: torch.Tensor,
    out: torch.Tensor,
    wire: WireFormat,
    residual: torch.Tensor | None,
    group: Group,
    *,
    key: int,
    what: str,
) -> Pending:
    """Launch: ``out`` = mean over ranks of their ``full``'s chunk ``rank``, quantized.

    Args:
        full: 1-D, ``N * S`` elements, this rank's contribution; not modified. Must stay
            alive and unchanged until the returned handle is waited on.
        out: 1-D, ``S`` elements, any float dtype; written at `wait`.
        wire: the buffer's `WireFormat` (raw elements in ``full``'s dtype).
        residual: error feedback: ``(N - 1, S)`` fp32, row ``k - 1`` is what quantization
            lost of the chunk sent to rank ``rank + k`` last time; added to this
            contribution before quantizing and replaced by this one's loss. None: none.
        group, key, what: as `zerolite.comm.collectives.reduce_scatter_avg`; every rank calls.
    """
    n = group.size
    shard = out.numel()
    if n == 1:
        out.copy_(full)
        return Pending()
    messages = wire.messages(full.device)
    for k in range(1, n):
        dst = (group.rank + k) % n
        row = None if residual is None else residual[k - 1]
        encode_with_feedback(wire.chunks[dst], chunk_of(full, dst, shard), messages[dst], row)
    received = wire.messages(full.device)
    with group.launching("zerolite::quantized_reduce_scatter", what):
        works = exchange_rows(messages, received, group, key=key)

    def finish() -> None:
        codec = wire.chunks[group.rank]
        acc = torch.zeros(shard, dtype=torch.float32, device=out.device)
        term = torch.empty_like(acc)
        for src in range(n):
            if src == group.rank:
                acc.add_(chunk_of(full, src, shard))
            else:
                codec.decode(received[src], term)
                acc.add_(term)
        out.copy_(acc.div_(n))

    return Pending(works, finish, group=group, what=what)
