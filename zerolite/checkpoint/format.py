"""The on-disk format of a zerolite checkpoint (DESIGN §5).

A checkpoint is a directory::

    index.json                              written by rank 0, last
    rank-00000-of-00002.safetensors         one per rank, written by that rank
    rank-00001-of-00002.safetensors

Requirements it meets:

- **Topology-agnostic.** Tensors are keyed by parameter name and element range of the
  flattened parameter, never by rank or bucket: ``master/{name}/{start}-{end}`` (fp32
  master values) and ``state/{key}/{name}/{start}-{end}`` (optimizer state; 0-dim for
  scalar state such as Adam's ``step``). A loader at any world size, stage or bucket
  size reads the ranges it owns with ``safe_open(...).get_slice``.
- **Complete.** Rank 0's file also holds ``model/{name}``: module buffers, frozen
  parameters and parameters outside the optimizer. Every file holds ``rng/cpu`` (and
  ``rng/cuda``) of its rank. Stage 3 shards frozen parameters too: each rank writes its
  ranges as ``frozen/{name}/{start}-{end}`` (in the parameter dtype) instead of rank 0
  writing them whole. The index holds hyperparameters, the loss scaler,
  scheduler states, the step and the user's ``extra``.
- **Verified.** The index records every file's byte size and sha256.
- **No pickle.** Tensors are safetensors; everything else is JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "INDEX",
    "FORMAT",
    "VERSION",
    "LATEST",
    "CheckpointError",
    "shard_file",
    "master_key",
    "state_key",
    "model_key",
    "frozen_key",
    "read_index",
    "file_digest",
    "check_file",
    "dtype_name",
    "dtype_from_name",
    "to_json_value",
]

INDEX = "index.json"
FORMAT = "zerolite-checkpoint"
VERSION = 1
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the model and optimizer."""


def shard_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def master_key(name: str, start: int, end: int) -> str:
    return f"master/{name}/{start}-{end}"


def state_key(key: str, name: str, start: int, end: int) -> str:
    return f"state/{key}/{name}/{start}-{end}"


def model_key(name: str) -> str:
    return f"model/{name}"


def frozen_key(name: str, start: int, end: int) -> str:
    return f"frozen/{name}/{start}-{end}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


def file_digest(path: Path) -> tuple[int, str]:
    """(byte size, sha256 hex) of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def check_file(path: Path, entry: dict[str, Any]) -> None:
    """Raise unless the shard file ``entry`` of checkpoint ``path`` exists with the byte
    size and sha256 its index records (error names the file)."""
    file = path / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file}: missing shard file (rank {entry['rank']} of the save)")
    size, sha = file_digest(file)
    if size != entry["bytes"]:
        raise CheckpointError(f"{file}: {size} bytes, the index says {entry['bytes']} (truncated or replaced)")
    if sha != entry["sha256"]:
        raise CheckpointError(f"{file}: sha256 mismatch (corrupt)")


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``index.json`` of checkpoint directory ``path``.

    Raises:
        CheckpointError: no directory, no index, unreadable JSON or another format.
    """
    index_path = Path(path) / INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{path}: not a zerolite checkpoint (no {INDEX}); was the save interrupted?")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index_path}: unreadable index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path}: not a zerolite checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{index_path}: format version {index.get('version')} is not supported (expected {VERSION})")
    return index


def to_json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON (tuples become lists, 0-dim tensors numbers); else ValueError."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json_value(v, where) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{where}: {type(value).__name__} value {value!r} is not JSON-serialisable")
