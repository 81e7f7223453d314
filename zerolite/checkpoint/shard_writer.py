"""Writing a safetensors file from raw bytes: the layout, the header, the hashed write.

safetensors' own writer (``safetensors.torch.save``) builds the whole file in one
``bytes`` object -- a second copy of everything it writes -- and a file is then read back
to hash it. zerolite writes the format itself (an 8-byte little-endian header length,
the JSON header padded to 8 bytes, then the tensors' raw little-endian bytes back to
back) straight from the tensors' memory, hashing each block as it goes: one pass over
the data and no extra copy. Tensors are laid out by descending element size, then name,
so every tensor starts at an offset aligned to its dtype; `StagingArea` relies on that
to view slices of one byte buffer as typed tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from zerolite.checkpoint.commit import fault_point, hold_point

__all__ = ["SAFETENSORS_DTYPE", "Slot", "layout", "safetensors_header", "write_shard"]

SAFETENSORS_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BLOCK = 64 << 20  # bytes per write and hash update: large enough to stream, small enough to fault


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a file's data section: bytes ``[start, end)``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def layout(tensors: Mapping[str, torch.Tensor]) -> list[Slot]:
    """The data-section layout of ``tensors``: descending element size, then name."""
    slots = []
    offset = 0
    for key in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        t = tensors[key]
        size = t.numel() * t.element_size()
        slots.append(Slot(key, t.dtype, tuple(t.shape), offset, offset + size))
        offset += size
    return slots


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
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_shard(
    target: Path, slots: list[Slot], chunks: Iterable[memoryview], rank: int, metadata: dict
) -> tuple[int, str]:
    """Write a safetensors file of ``slots`` whose data are ``chunks`` (in slot order, back
    to back), fsync it, and return its (byte size, sha256 hex). ``rank`` names this rank
    for the test-only fault points (`zerolite.checkpoint.commit`)."""
    head = safetensors_header(((s.key, s.dtype, s.shape, s.start, s.end) for s in slots), metadata)
    total = len(head) + (slots[-1].end if slots else 0)
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
        f.flush()
        os.fsync(f.fileno())
    if written != total:
        raise RuntimeError(f"[rank {rank}] {target}: wrote {written} bytes, laid out {total}")
    return written, digest.hexdigest()
