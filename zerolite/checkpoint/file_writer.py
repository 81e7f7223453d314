"""Writing a safetensors file from raw bytes: where each tensor lies, the header, the hashed
write.

safetensors' own writer (``safetensors.torch.save``) builds the whole file in one
``bytes`` object -- a second copy of everything it writes -- and a file is then read back
to hash it. zerolite writes the format itself (an 8-byte little-endian header length,
the JSON header padded to 8 bytes, then the tensors' raw little-endian bytes back to
back) straight from the tensors' memory, hashing each block as it goes: one pass over
the data and no extra copy. Tensors are laid out by descending element size, then name,
so every tensor starts at an offset aligned to its dtype; `StagingArea` relies on that
to view slices of one byte buffer as typed tensors.

Offloaded optimizer state is not in memory: a `LazyTensor` gives its dtype and shape up
front (for its byte range and the header) and reads its values only when written or staged, so
a save holds one offloaded tensor at a time, never the whole tier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from zerolite.checkpoint.commit import fault_point, hold_point
from zerolite.ground.tensor_bytes import bytes_of

__all__ = [
    "SAFETENSORS_DTYPE", "ByteRange", "LazyTensor", "byte_ranges", "data_blocks",
    "safetensors_header", "write_file",
]

SAFETENSORS_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BLOCK = 64 << 20  # bytes per write and hash update: large enough to stream, small enough to fault


@dataclasses.dataclass(frozen=True)
class ByteRange:
    """Where one tensor lies in a file's data section: bytes ``[start, end)``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor known by dtype and shape, whose values ``read_into`` fills on demand.

    Attributes:
        dtype, shape: of the values.
        read_into: fills a contiguous 1-D CPU tensor of ``dtype`` and ``numel()`` elements
            (e.g. `zerolite.state.offload.OffloadTier.read_into` for one field of an offload slot).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    read_into: Callable[[torch.Tensor], None]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def read(self) -> torch.Tensor:
        """The values: a new CPU tensor of ``shape``."""
        out = torch.empty(self.numel(), dtype=self.dtype)
        self.read_into(out)
        return out.view(self.shape)


def byte_ranges(tensors: Mapping[str, torch.Tensor | LazyTensor]) -> list[ByteRange]:
    """Where each of ``tensors`` lies in the file's data section: by descending element
    size, then name."""
    ranges = []
    offset = 0
    for key in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        t = tensors[key]
        size = t.numel() * t.element_size()
        ranges.append(ByteRange(key, t.dtype, tuple(t.shape), offset, offset + size))
        offset += size
    return ranges


def safetensors_header(
    entries: Iterable[tuple[str, torch.dtype, list[int] | tuple[int, ...], int, int]],
    metadata: dict[str, str],
) -> bytes:
    """The bytes before the data: length prefix and JSON header (space-padded to 8 bytes).

    ``entries``: (name, dtype, shape, start, end) per tensor, offsets into the data section.
    """
    header: dict[str, object] = {
        name: {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [a, b]}
        for name, dtype, shape, a, b in entries
    }
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, without copying."""
    return bytes_of(tensor)


def data_blocks(
    ranges: list[ByteRange], tensors: Mapping[str, torch.Tensor | LazyTensor]
) -> Iterator[memoryview]:
    """The data of ``ranges`` in order, for `write_file`: resident tensors as they are
    (contiguous CPU copies where they are not), each `LazyTensor` read only when its turn
    comes and released once written -- one lazy tensor's values in memory at a time."""
    for extent in ranges:
        tensor = tensors[extent.key]
        value = tensor.read() if isinstance(tensor, LazyTensor) else tensor
        yield as_bytes(value.contiguous().cpu())
        del value, tensor  # written by now (write_file asks for the next chunk after it)


def write_file(
    target: Path, ranges: list[ByteRange], chunks: Iterable[memoryview], rank: int, metadata: dict
) -> tuple[int, str]:
    """Write a safetensors file of ``ranges`` whose data are ``chunks`` (in the ranges'
    order, back to back), fsync it, and return its (byte size, sha256 hex). ``rank`` names this rank
    for the test-only fault points (`zerolite.checkpoint.commit`)."""
    head = safetensors_header(((s.key, s.dtype, s.shape, s.start, s.end) for s in ranges), metadata)
    total = len(head) + (ranges[-1].end if ranges else 0)
    digest = hashlib.sha256(head)
    written = len(head)
    half = total // 2  # the test-only "writing" fault point sits here
    hold_point("writing")
    with open(target, "wb") as f:
        f.write(head)
        if written > half:  # a header larger than the data
            f.flush()
            fault_point("writing", rank)
        for chunk in chunks:
            for start in range(0, len(chunk), _BLOCK):
                block = chunk[start : start + _BLOCK]
                if written <= half < written + len(block):
                    cut = half - written
                    f.write(block[:cut])
                    f.flush()
                    fault_point("writing", rank)
                    f.write(block[cut:])
                else:
                    f.write(block)
                digest.update(block)  # hashlib releases the GIL on large blocks, as write does
                written += len(block)
            # Let go of the chunk before asking for the next: a lazily read one is freed.
            chunk = block = None
        f.flush()
        os.fsync(f.fileno())
    if written != total:
        raise RuntimeError(f"[rank {rank}] {target}: wrote {written} bytes, laid out {total}")
    return written, digest.hexdigest()
