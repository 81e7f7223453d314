"""The on-disk format of a zerolite checkpoint (docs/design.md, "A checkpoint on disk").

A checkpoint is a directory::

    index.json                              written by rank 0
    index.json.sha256                       the index's own sha256 (``sha256sum`` format), last
    rank-00000-of-00002.safetensors         one per rank, written by that rank
    rank-00001-of-00002.safetensors

Requirements it meets:

- **Topology-agnostic.** Tensors are keyed by parameter name and element range of the
  flattened parameter, never by rank or bucket: ``master/{name}/{start}-{end}`` (fp32
  master values) and ``state/{key}/{name}/{start}-{end}`` (optimizer state; 0-dim for
  scalar state such as Adam's ``step``). A loader at any world size, stage or bucket
  size reads the ranges it owns with ``safe_open(...).get_slice``.
- **Complete.** Rank 0's file also holds ``model/{name}``: module buffers, frozen
  parameters and parameters outside the optimizer. Every file holds ``rng/cpu`` (and, for a
  CUDA model, ``rng/cuda``: the generator of the model's device) of its rank. Stage 3
  shards frozen parameters too: each rank writes its
  ranges as ``frozen/{name}/{start}-{end}`` (in the parameter dtype) instead of rank 0
  writing them whole. With ``ZeroConfig.quantize_reduce``'s error feedback each file
  also holds its rank's residuals, ``residual/{name}/{start}-{end}`` (hybrid: every
  replica's, by replica index), read back under any layout
  (`zerolite.checkpoint.residual_fold`). The index holds
  hyperparameters, the loss scaler, scheduler states, the step and the user's ``extra``.
- **Verified.** The index records every file's byte size and sha256, and the index's
  own sha256 sits beside it in ``index.json.sha256``, written last and checked first, so
  an edited index is refused before any value in it is used. The sidecar (rather than the
  ``latest`` pointer) holds it because every checkpoint directory, not only the newest,
  must be checkable on its own, also after being copied elsewhere. It detects accidental
  edits and corruption; it is not a signature (whoever edits both files on purpose gets
  past it), so `read_index` also checks the schema: types, known dtypes and stages, the
  world size against the file list, rank file names (plain names inside the directory),
  and that the saved ranges of every parameter cover it exactly once.
- **No pickle.** Tensors are safetensors; everything else is JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "INDEX",
    "INDEX_DIGEST",
    "LATEST",
    "VERSION",
    "CheckpointError",
    "check_file",
    "checkpoint_name_problem",
    "dtype_from_name",
    "dtype_name",
    "file_digest",
    "frozen_key",
    "index_digest_text",
    "master_key",
    "model_key",
    "read_index",
    "rank_file_name",
    "state_key",
    "to_json_value",
    "validate_index",
]

INDEX = "index.json"
INDEX_DIGEST = "index.json.sha256"
FORMAT = "zerolite-checkpoint"
VERSION = 1
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the model and optimizer."""


def rank_file_name(rank: int, world_size: int) -> str:
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
    """Raise unless the rank file ``entry`` of checkpoint ``path`` exists with the byte
    size and sha256 its index records (error names the file)."""
    file = path / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file}: missing rank file (rank {entry['rank']} of the save)")
    size, sha = file_digest(file)
    if size != entry["bytes"]:
        raise CheckpointError(
            f"{file}: {size} bytes, the index says {entry['bytes']} (truncated or replaced)"
        )
    if sha != entry["sha256"]:
        raise CheckpointError(f"{file}: sha256 mismatch (corrupt)")


def index_digest_text(data: bytes) -> str:
    """The content of ``index.json.sha256`` for index bytes ``data`` (``sha256sum -c`` reads it)."""
    return f"{hashlib.sha256(data).hexdigest()}  {INDEX}\n"


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed, checked ``index.json`` of checkpoint directory ``path``.

    The index's sha256 is checked against ``index.json.sha256`` before it is parsed, then
    its schema is checked (`validate_index`), so callers may index it without further checks.
    Any process may call; no communication.

    Raises:
        CheckpointError: no directory, no index or checksum, a checksum mismatch (the index
            was edited or is corrupt), unreadable JSON, another format, or a value that does
            not fit the schema -- naming the file and the key.
    """
    index_path = Path(path) / INDEX
    digest_path = Path(path) / INDEX_DIGEST
    if not index_path.is_file():
        raise CheckpointError(
            f"{path}: not a zerolite checkpoint (no {INDEX}); was the save interrupted?"
        )
    if not digest_path.is_file():
        raise CheckpointError(
            f"{path}: no {INDEX_DIGEST} (the index's checksum), so the index cannot be trusted; "
            f"a checkpoint saved before zerolite wrote it can be sealed with "
            f"`sha256sum {INDEX} > {INDEX_DIGEST}` in its directory, once you trust it"
        )
    try:
        data = index_path.read_bytes()
        recorded = digest_path.read_text()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index_path}: unreadable index ({exc})") from None
    if recorded != index_digest_text(data):
        raise CheckpointError(
            f"{index_path}: sha256 does not match {INDEX_DIGEST} "
            "(the index was edited or is corrupt)"
        )
    try:
        index = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{index_path}: unreadable index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path}: not a zerolite checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(
            f"{index_path}: format version {index.get('version')} is not supported "
            f"(expected {VERSION})"
        )
    validate_index(index, str(index_path))
    return index


# Parameter dtypes zerolite saves (floating; consolidate can write each).
PARAM_DTYPES = ("float64", "float32", "float16", "bfloat16")
_HEX = frozenset("0123456789abcdef")


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _need(obj: dict[str, Any], key: str, where: str, *types: type) -> Any:
    """``obj[key]``, checked to be one of ``types`` (a bool is not an int here)."""
    if key not in obj:
        raise CheckpointError(f"{where}: missing key {key!r}")
    value = obj[key]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise CheckpointError(f"{where}: {key!r} is {value!r}, expected {_type_names(types)}")
    return value


def _entries_of(obj: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    items = _need(obj, key, where, list)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise CheckpointError(f"{where}: {key}[{i}] is {item!r}, expected an object")
    return items


def _count(obj: dict[str, Any], key: str, where: str, low: int = 0) -> int:
    value = _need(obj, key, where, int)
    if value < low:
        raise CheckpointError(f"{where}: {key!r} is {value}, expected an integer >= {low}")
    return value


def _dtype(obj: dict[str, Any], key: str, where: str) -> str:
    value = _need(obj, key, where, str)
    if value not in PARAM_DTYPES:
        raise CheckpointError(
            f"{where}: {key!r} is {value!r}, expected one of {', '.join(PARAM_DTYPES)}"
        )
    return value


def _tensor_table(index: dict[str, Any], key: str, where: str, param_dtype: str) -> dict[str, int]:
    """name -> numel of the ``params`` or ``frozen`` table, every entry checked."""
    numels: dict[str, int] = {}
    for i, entry in enumerate(_entries_of(index, key, where)):
        here = f"{where}: {key}[{i}]"
        name = _need(entry, "name", here, str)
        if not name or name in numels:
            raise CheckpointError(f"{here}: name {name!r} is empty or repeated")
        shape = _need(entry, "shape", here, list)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise CheckpointError(f"{here}: 'shape' is {shape!r}, expected a list of integers >= 0")
        if _dtype(entry, "dtype", here) != param_dtype:
            raise CheckpointError(
                f"{here}: 'dtype' is {entry['dtype']!r} but the checkpoint's param_dtype "
                f"is {param_dtype!r}"
            )
        numels[name] = math.prod(shape)
    return numels


def _ranges(entry: dict[str, Any], key: str, where: str, numels: dict[str, int],
            covered: dict[str, list[tuple[int, int]]]) -> None:
    """Check one file's ``pieces`` / ``frozen_pieces`` and add them to ``covered``."""
    for i, piece in enumerate(_need(entry, key, where, list)):
        ok = isinstance(piece, list) and len(piece) == 3 and isinstance(piece[0], str)
        ok = ok and all(isinstance(n, int) and not isinstance(n, bool) for n in piece[1:])
        if not ok or piece[0] not in numels or not 0 <= piece[1] < piece[2] <= numels[piece[0]]:
            raise CheckpointError(
                f"{where}: {key}[{i}] is {piece!r}, expected [name, start, end] of a parameter "
                "in the index with 0 <= start < end <= its number of elements"
            )
        covered[piece[0]].append((piece[1], piece[2]))


def _check_coverage(
    covered: dict[str, list[tuple[int, int]]], numels: dict[str, int], where: str
) -> None:
    for name, numel in numels.items():
        at = 0
        for start, end in sorted(covered.get(name, [])):
            if start != at:  # a gap or an overlap
                break
            at = end
        else:
            if at == numel:
                continue
        raise CheckpointError(
            f"{where}: the saved ranges of {name!r} do not cover its {numel} elements exactly once "
            f"(contiguous up to element {at})"
        )


def validate_index(index: dict[str, Any], where: str) -> None:
    """Check the schema of a parsed index; ``where`` names it in messages.

    Raises:
        CheckpointError: naming the first missing key or bad value.
    """
    _need(index, "zerolite_version", where, str)
    world_size = _count(index, "world_size", where, low=1)
    if _need(index, "stage", where, int) not in (1, 2, 3):
        raise CheckpointError(f"{where}: 'stage' is {index['stage']!r}, expected 1, 2 or 3")
    param_dtype = _dtype(index, "param_dtype", where)
    if _need(index, "reduce_dtype", where, str, type(None)) is not None:
        _dtype(index, "reduce_dtype", where)
    optimizer = _need(index, "optimizer", where, dict)
    _need(optimizer, "class", f"{where}: optimizer", str)
    groups = _entries_of(optimizer, "param_groups", f"{where}: optimizer")
    params = _tensor_table(index, "params", where, param_dtype)
    frozen = _tensor_table(index, "frozen", where, param_dtype)
    if set(params) & set(frozen):
        both = sorted(set(params) & set(frozen))[:3]
        raise CheckpointError(f"{where}: {both} are both trained and frozen")
    for i, entry in enumerate(index["params"]):
        group = _need(entry, "group", f"{where}: params[{i}]", int, type(None))
        if group is not None and not 0 <= group < len(groups):
            raise CheckpointError(
                f"{where}: params[{i}]: 'group' is {group}, the optimizer has {len(groups)}"
            )
        aliases = _need(entry, "aliases", f"{where}: params[{i}]", list)
        if not all(isinstance(a, str) and a and a not in params for a in aliases):
            raise CheckpointError(
                f"{where}: params[{i}]: 'aliases' {aliases!r} are not other names"
            )
    tied = index.get("tied", {})  # absent in checkpoints saved before it was recorded
    if not isinstance(tied, dict) or not all(
        isinstance(a, str) and isinstance(n, str) and a not in params and a not in frozen
        for a, n in tied.items()
    ):
        raise CheckpointError(f"{where}: 'tied' is {tied!r}, expected {{tied name: first name}}")
    keys = _need(index, "state_dict_keys", where, list)
    if not all(isinstance(k, str) for k in keys):
        raise CheckpointError(f"{where}: 'state_dict_keys' holds a non-string")
    if _need(index, "step", where, int, type(None)) is not None:
        _count(index, "step", where)
    _need(index, "loss_scaler", where, dict, type(None))
    for key in ("schedulers", "extra"):  # their content is the user's (any JSON)
        if key not in index:
            raise CheckpointError(f"{where}: missing key {key!r}")
    _check_files(index, where, world_size, params, frozen, len(groups))


def _check_files(index: dict[str, Any], where: str, world_size: int, params: dict[str, int],
                 frozen: dict[str, int], n_groups: int) -> None:
    files = _entries_of(index, "files", where)
    if len(files) != world_size:
        raise CheckpointError(
            f"{where}: 'world_size' is {world_size} but 'files' lists {len(files)} files"
        )
    covered: dict[str, list[tuple[int, int]]] = defaultdict(list)
    covered_frozen: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for rank, entry in enumerate(files):
        here = f"{where}: files[{rank}]"
        if _need(entry, "rank", here, int) != rank:
            raise CheckpointError(f"{here}: 'rank' is {entry['rank']}, expected {rank}")
        expected = rank_file_name(rank, world_size)
        if _need(entry, "file", here, str) != expected:
            raise CheckpointError(
                f"{here}: 'file' is {entry['file']!r}, expected {expected!r} (rank files are "
                "plain names inside the checkpoint directory)"
            )
        _count(entry, "bytes", here)
        sha = _need(entry, "sha256", here, str)
        if len(sha) != 64 or not set(sha) <= _HEX:
            raise CheckpointError(f"{here}: 'sha256' is {sha!r}, expected 64 lowercase hex digits")
        _ranges(entry, "pieces", here, params, covered)
        groups = entry.get("groups", {})  # {name: param group} of this rank's pieces
        if not isinstance(groups, dict) or not all(
            name in params and isinstance(g, int) and not isinstance(g, bool) and 0 <= g < n_groups
            for name, g in groups.items()
        ):
            raise CheckpointError(
                f"{here}: 'groups' is {groups!r}, expected {{parameter: param group}}"
            )
        _ranges(entry, "frozen_pieces", here, frozen, covered_frozen)
    _check_coverage(covered, params, where)
    _check_coverage(covered_frozen, frozen, where)


def checkpoint_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a checkpoint directory in a root (None if it can).

    The ``latest`` pointer stores the name exactly, so names that differ only in
    surrounding whitespace, contain separators or control characters, or are hidden
    (the names of zerolite's own temporaries) are refused, and so is ``latest`` itself.
    """
    if name in ("", ".", ".."):
        return f"{name!r} is not a directory name"
    if name != name.strip():
        return f"{name!r} has leading or trailing whitespace"
    if "/" in name or "\\" in name or os.sep in name:
        return f"{name!r} contains a path separator"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return f"{name!r} contains a control character"
    if name.startswith("."):
        return f"{name!r} is hidden (names starting with '.' are zerolite's temporaries)"
    if name == LATEST:
        return f"{name!r} is the name of the pointer file zerolite keeps next to checkpoints"
    return None


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
