"""Block quantization of the data zerolite sends: int8 codes, one fp32 scale per block.

A block of ``B`` elements ``x`` travels as ``codes = round(x / s)`` (int8 in [-127, 127],
round half to even) with ``s = max|x| / 127`` (fp32), and arrives as ``codes * s``. So
each element of a finite block is off by at most ``s / 2 = max|x| / 254`` (plus the fp32
rounding of the product).

Non-finite values are never lost: a block holding a NaN or an infinity gets a NaN scale
and arrives as NaN in every element, so a non-finite gradient still makes the reduced
gradient (and the gradient norm) non-finite, as it would unquantized. A block of zeros
gets scale 0 and arrives as zeros.

`WireFormat` says how one buffer's chunks travel: each chunk's `ChunkCodec` sends some
element ranges raw, in their own dtype (`zerolite.plan.quantization` picks them: the
elements of parameters of fewer than ``B`` elements or named in ``ZeroConfig.quantize_skip``)
and quantizes the rest in blocks of ``B`` consecutive elements of the chunk (a block may
span two parameters). A chunk's message is one byte string::

    [fp32 scales][raw elements][int8 codes][padding to the message size]

(scales first so that their view stays 4-byte aligned). Every chunk's message has the
same size, the largest over the buffer's chunks, so native all-gathers and all-to-alls
carry them as equal rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["quantize_blocks", "dequantize_blocks", "ChunkCodec", "WireFormat", "QMAX"]

QMAX = 127


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (1-D, any float dtype, any length) in blocks of ``block`` elements.

    Returns ``(codes, scales)``: int8 with ``x``'s length, and fp32 with one scale per
    block (``ceil(len / block)``; the last block may be short). A block with a NaN or an
    infinity has a NaN scale and zero codes (see the module docstring).
    """
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)
    rows = padded.view(blocks, block)
    # amax propagates NaN; an infinity gives an infinite scale: both become NaN.
    scales = rows.abs().amax(dim=1).div_(QMAX)
    finite = torch.isfinite(scales)
    scales = torch.where(finite, scales, torch.full_like(scales, math.nan))
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = rows.div_(divisor[:, None]).round_().clamp_(-QMAX, QMAX)
    codes = torch.where(finite[:, None], codes, torch.zeros_like(codes))
    return codes.to(torch.int8).view(-1)[:n], scales


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``codes * scale`` per block: fp32, ``codes``' length (written into ``out`` if given,
    1-D, any float dtype: cast once)."""
    n = codes.numel()
    blocks = scales.numel()
    values = torch.zeros(blocks * block, dtype=torch.float32, device=codes.device)
    values[:n].copy_(codes)
    values = values.view(blocks, block).mul_(scales[:, None]).view(-1)[:n]
    if out is None:
        return values
    out.copy_(values)
    return out


class ChunkCodec:
    """How one chunk of a flat buffer is packed into its message and read back.

    Args:
        numel: the chunk's elements.
        raw: ``(start, end)`` element ranges of the chunk that travel raw, sorted,
            disjoint.
        raw_dtype: the dtype raw elements travel in.
        block: elements per quantization block.
    """

    def __init__(
        self, numel: int, raw: Sequence[tuple[int, int]], raw_dtype: torch.dtype, block: int
    ) -> None:
        self.numel = numel
        self.raw = list(raw)
        self.block = block
        self.raw_dtype = raw_dtype
        quantized, at = [], 0
        for start, end in self.raw:
            if start > at:
                quantized.append((at, start))
            at = end
        if at < numel:
            quantized.append((at, numel))
        self.quantized = quantized
        self.raw_numel = sum(e - s for s, e in self.raw)
        self.codes_numel = numel - self.raw_numel
        self.blocks = -(-self.codes_numel // block)
        self._raw_bytes = self.raw_numel * torch.empty(0, dtype=raw_dtype).element_size()
        # Bytes of this chunk's message before padding.
        self.nbytes = 4 * self.blocks + self._raw_bytes + self.codes_numel

    def _gather(self, chunk: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        if len(ranges) == 1 and ranges[0] == (0, self.numel):
            return chunk
        return torch.cat([chunk[s:e] for s, e in ranges]) if ranges else chunk[:0]

    def encode(self, chunk: torch.Tensor, message: torch.Tensor) -> None:
        """Pack ``chunk`` (1-D, ``numel`` elements, float) into ``message`` (1-D uint8, at
        least `nbytes`, its start 4-byte aligned)."""
        codes, scales = quantize_blocks(self._gather(chunk, self.quantized), self.block)
        at = 4 * self.blocks
        message[:at].view(torch.float32).copy_(scales)
        if self.raw:
            raw = message[at : at + self._raw_bytes].view(self.raw_dtype)
            raw.copy_(self._gather(chunk, self.raw))
            at += self._raw_bytes
        message[at : at + self.codes_numel].view(torch.int8).copy_(codes)

    def decode(self, message: torch.Tensor, out: torch.Tensor) -> None:
        """Unpack ``message`` into ``out`` (1-D, ``numel`` elements, any float dtype)."""
        at = 4 * self.blocks
        scales = message[:at].view(torch.float32)
        raw = message[at : at + self._raw_bytes].view(self.raw_dtype)
        codes = message[at + self._raw_bytes : at + self._raw_bytes + self.codes_numel]
        values = dequantize_blocks(codes.view(torch.int8), scales, self.block)
        if len(self.quantized) == 1 and self.quantized[0] == (0, self.numel):
            out.copy_(values)
            return
        _scatter(values, self.quantized, out)
        _scatter(raw, self.raw, out)


def _scatter(values: torch.Tensor, ranges: list[tuple[int, int]], out: torch.Tensor) -> None:
    at = 0
    for start, end in ranges:
        out[start:end].copy_(values[at : at + end - start])
        at += end - start


class WireFormat:
    """The messages of a buffer's chunks (one `ChunkCodec` each, in chunk order): a flat
    buffer's ``N`` chunks (`zerolite.plan.quantization.wire_format`), or the parts of one
    gradient shard crossing a replica group (`zerolite.plan.quantization.replica_wire`).

    Args:
        chunks: the codecs; their chunks have equal lengths.
    Attributes:
        message_bytes: every chunk's message size (the largest `ChunkCodec.nbytes`,
            rounded up to 4 bytes).
    """

    def __init__(self, chunks: Sequence[ChunkCodec]) -> None:
        self.chunks: list[ChunkCodec] = list(chunks)
        self.message_bytes = -(-max(c.nbytes for c in self.chunks) // 4) * 4

    def messages(self, device: torch.device) -> torch.Tensor:
        """An uninitialised ``(N, message_bytes)`` uint8 buffer: one row per chunk."""
        return torch.empty(
            (len(self.chunks), self.message_bytes), dtype=torch.uint8, device=device
        )
