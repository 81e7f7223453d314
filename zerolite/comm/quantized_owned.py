"""The quantized variants of `zerolite.comm.owned`'s exchanges (uneven chunks, whole-tensor
ownership with ``quantize_gather`` / ``quantize_reduce``).

Chunk ``r`` of a buffer is what rank ``r`` owns whole (``sizes[r]`` elements, possibly 0).
Each owner's chunk is quantized as *its own message*, with its own `ChunkCodec` of
``sizes[r]`` elements (`zerolite.plan.quantization.wire_format`), rather than padded to
the largest owner's size first: the blocks, and so the bound, are exactly those of a flat
chunk (every element within half a quantization step of its block, ``max|x| / 254``), and
no block carries padding.

What travels:

- point-to-point groups (gloo) send each owner's message at its own size
  (``ChunkCodec.nbytes``: ``4 * ceil(q / B)`` scale bytes, the raw elements, ``q`` code
  bytes for ``q`` quantized elements), and nothing to or from an owner of nothing. Summed
  over ranks that is the flat path's total up to padding: ``(N - 1)`` messages per chunk;
- native groups (NCCL) run the same all-to-all / all-gather of message rows as
  `zerolite.comm.quantized`, every row the size of the largest owner's message.

Error feedback keeps one residual row per other owner, as for flat: ``(N - 1, S)`` fp32
with ``S`` the largest chunk; row ``k - 1`` holds, in its first ``sizes[dst]`` elements,
what quantization lost of the chunk sent to ``dst = rank + k``
(`zerolite.comm.quantized.residual_chunks`); its tail stays zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerolite.comm.codec import WireFormat
from zerolite.comm.collectives import Group, Pending
from zerolite.comm.quantized import encode_with_feedback, exchange_rows, gather_rows

__all__ = ["quantized_gather_from_owners", "quantized_reduce_to_owners"]


def _chunks(full: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(full.split(list(sizes)))


def _bytes(wire: WireFormat) -> list[int]:
    """Each owner's message at its own size (what point-to-point groups send)."""
    return [c.nbytes for c in wire.chunks]


def _check(wire: WireFormat, sizes: Sequence[int], full: torch.Tensor, group: Group) -> None:
    if [c.numel for c in wire.chunks] != list(sizes) or full.numel() != sum(sizes):
        raise RuntimeError(
            f"{group.prefix()} quantized owned exchange: buffer of {full.numel()} elements and "
            f"wire chunks {[c.numel for c in wire.chunks]} do not fit chunks {list(sizes)}"
        )


def quantized_reduce_to_owners(
    full: torch.Tensor,
    out: torch.Tensor,
    sizes: Sequence[int],
    wire: WireFormat,
    residual: torch.Tensor | None,
    group: Group,
    *,
    key: int,
    what: str,
) -> Pending:
    """Launch: ``out`` = mean over ranks of their ``full``'s chunk ``rank``, each other rank's
    contribution quantized (this rank's own kept exact), summed in fp32 in rank order.

    Args:
        full: 1-D, ``sum(sizes)`` elements, this rank's contribution; not modified. Must
            stay alive and unchanged until the returned handle is waited on.
        out: 1-D, ``sizes[rank]`` elements (possibly 0), any float dtype; written at `wait`.
        sizes: elements of each rank's chunk, in rank order; equal on every rank.
        wire: one codec per chunk, of ``sizes[r]`` elements (raw elements in ``full``'s
            dtype).
        residual: error feedback, ``(N - 1, max(sizes))`` fp32 (see the module docstring),
            or None.
        group, key, what: as `zerolite.comm.owned.reduce_to_owners`; every rank calls.
    """
    n, rank = group.size, group.rank
    _check(wire, sizes, full, group)
    if n == 1:
        out.copy_(full)
        return Pending()
    chunks = _chunks(full, sizes)
    messages = wire.messages(full.device)
    for k in range(1, n):
        dst = (rank + k) % n
        if sizes[dst]:
            row = None if residual is None else residual[k - 1, : sizes[dst]]
            encode_with_feedback(wire.chunks[dst], chunks[dst], messages[dst], row)
    received = wire.messages(full.device)
    with group.launching("zerolite::quantized_reduce_to_owners", what):
        works = exchange_rows(messages, received, group, key=key, row_bytes=_bytes(wire))

    def finish() -> None:
        codec = wire.chunks[rank]
        acc = torch.zeros(sizes[rank], dtype=torch.float32, device=out.device)
        term = torch.empty_like(acc)
        for src in range(n):
            if src == rank:
                acc.add_(chunks[rank])
            elif sizes[rank]:
                codec.decode(received[src], term)
                acc.add_(term)
        out.copy_(acc.div_(n))

    return Pending(works, finish, group=group, what=what)


def quantized_gather_from_owners(
    full: torch.Tensor,
    sizes: Sequence[int],
    wire: WireFormat,
    group: Group,
    *,
    key: int,
    what: str,
) -> Pending:
    """Launch: every owner's chunk of ``full``, quantized, into all ranks' ``full``; the
    owner decodes its own too, so every rank holds the same values.

    Args:
        full: 1-D, ``sum(sizes)`` elements; chunk ``rank`` is the input, overwritten (like
            every chunk) at `wait`. Must not be read or written until then.
        sizes, wire, group, key, what: as `quantized_reduce_to_owners` (raw elements in
            ``full``'s dtype).
    """
    n, rank = group.size, group.rank
    _check(wire, sizes, full, group)
    if n == 1:
        return Pending()
    chunks = _chunks(full, sizes)
    messages = wire.messages(full.device)
    if sizes[rank]:
        wire.chunks[rank].encode(chunks[rank], messages[rank])
    with group.launching("zerolite::quantized_gather_from_owners", what):
        works = gather_rows(messages, group, key=key, row_bytes=_bytes(wire))

    def finish() -> None:
        for r, codec in enumerate(wire.chunks):
            if sizes[r]:
                codec.decode(messages[r], chunks[r])

    return Pending(works, finish, group=group, what=what)
