"""`consolidate`, `verify` and `inspect`: offline tools on a checkpoint directory.

`consolidate` writes one plain safetensors file whose names and shapes are those of the
unsharded ``model.state_dict()``. safetensors has no streaming writer (``save_file``
needs every tensor alive at once), so zerolite writes the format itself -- an 8-byte
little-endian header length, the JSON header, then raw little-endian data -- one
parameter at a time, and checks the result with ``safe_open``. A tied parameter is
written under each of its names, so ``model.load_state_dict(load_file(out))`` works with
``strict=True`` (what ``torch.save(model.state_dict())`` users expect): safetensors refuses
shared storage and overlapping data offsets, so the data is written twice, costing one
extra tensor on disk (e.g. GPT-2's 154 MB fp32 embedding) but no extra memory (it is read
again). The header's ``__metadata__["aliases"]`` records ``{alias: first name}`` so a
reader can re-tie or drop the copy. Each read reopens the source file, since an open
``safe_open`` handle keeps its pages mapped (docs/design.md, "A checkpoint on disk").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zerolite.checkpoint.file_writer import SAFETENSORS_DTYPE, as_bytes, safetensors_header
from zerolite.checkpoint.format import (
    CheckpointError,
    check_file,
    dtype_from_name,
    frozen_key,
    master_key,
    model_key,
    read_index,
)

__all__ = ["consolidate", "inspect", "verify"]

def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check that every rank file exists with the size and sha256 the index records.

    Single process; no communication. Returns the index.

    Raises:
        zerolite.checkpoint.CheckpointError: naming the first bad file.
    """
    path = Path(path)
    index = read_index(path)
    for entry in index["files"]:
        check_file(path, entry)
    return index


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """A summary: world size (the shard group's, hybrid), replica groups (1 unless hybrid),
    stage, step, dtype, optimizer, parameter count, bytes per file."""
    index = read_index(path)
    return {
        "world_size": index["world_size"],
        # Checkpoints written before hybrid sharding have no entry: one replica.
        "replicas": index.get("replicas", 1),
        "stage": index["stage"],
        "step": index["step"],
        "param_dtype": index["param_dtype"],
        "optimizer": index["optimizer"]["class"],
        "parameters": sum(_numel(p["shape"]) for p in index["params"]),
        "files": {e["file"]: e["bytes"] for e in index["files"]},
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aliases(index: dict[str, Any]) -> dict[str, str]:
    """``{tied name: the first name it is saved under}``, for every tied parameter
    (``tied``: also frozen and non-optimized ones; older checkpoints: trained ones only)."""
    trained = {a: p["name"] for p in index["params"] for a in p["aliases"]}
    return {**index.get("tied", {}), **trained}


def _entries(
    path: Path, index: dict[str, Any], dtype: torch.dtype | None
) -> list[tuple[str, list[int], torch.dtype, str]]:
    """(name, shape, output dtype, kind) in state-dict order; kind is 'param', 'frozen' or
    'model'. A tied name gets its first name's entry (its data is read from there)."""
    params = {p["name"]: p for p in index["params"]}
    frozen = {p["name"]: p for p in index.get("frozen", [])}
    with safe_open(path / index["files"][0]["file"], framework="pt") as f:
        model_shapes = {k[len("model/"):]: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype())
                        for k in f.keys() if k.startswith("model/")}
    aliases = _aliases(index)
    out = []
    for name in index["state_dict_keys"]:
        source = aliases.get(name, name)
        if source in params:
            out.append((name, params[source]["shape"], dtype or torch.float32, "param"))
        elif source in frozen:
            saved_dtype = dtype_from_name(frozen[source]["dtype"])
            out.append((name, frozen[source]["shape"], dtype or saved_dtype, "frozen"))
        elif source in model_shapes:
            shape, saved = model_shapes[source]
            saved_dtype = _from_safetensors(saved)
            cast = dtype if dtype is not None and saved_dtype.is_floating_point else saved_dtype
            out.append((name, list(shape), cast, "model"))
        else:
            raise CheckpointError(f"{path}: no tensor for state-dict entry {name!r}")
    return out


def _from_safetensors(code: str) -> torch.dtype:
    for dtype, c in SAFETENSORS_DTYPE.items():
        if c == code:
            return dtype
    raise CheckpointError(f"unsupported safetensors dtype {code}")


def _read_param(
    path: Path, index: dict[str, Any], name: str, numel: int, kind: str = "param"
) -> torch.Tensor:
    """A parameter assembled from its ranges: fp32 master pieces, or frozen pieces (stage 3)."""
    field, key_of = ("pieces", master_key) if kind == "param" else ("frozen_pieces", frozen_key)
    ranges = sorted(
        (s, e, entry["file"])
        for entry in index["files"]
        for n, s, e in entry.get(field, [])
        if n == name
    )
    full: torch.Tensor | None = None
    covered = 0
    for s, e, file in ranges:
        with safe_open(path / file, framework="pt") as f:
            part = f.get_slice(key_of(name, s, e))[:]
        if full is None:
            full = torch.empty(numel, dtype=part.dtype)
        full[s:e] = part
        covered += e - s
    if covered != numel or full is None:
        raise CheckpointError(
            f"parameter {name!r}: the rank files cover {covered} of {numel} elements"
        )
    return full


def consolidate(
    path: str | os.PathLike,
    out_file: str | os.PathLike,
    dtype: torch.dtype | None = None,
    *,
    progress: Callable[[int, int, str], None] | None = None,
) -> Path:
    """Write checkpoint ``path`` as one safetensors file matching the unsharded state dict.

    Single process; peak memory about one parameter. Verifies the checkpoint first.

    Args:
        path: checkpoint directory.
        out_file: the ``.safetensors`` file to write (replaced atomically).
        dtype: dtype of parameters (and floating buffers); None keeps the fp32 masters.
        progress: called as ``progress(done, total, name)`` after each tensor is written.
    Returns:
        ``out_file`` as a `Path`.
    Raises:
        ValueError: ``dtype`` is not a floating dtype (an integer cast would zero the
            weights), before anything is read or written.
        CheckpointError: the checkpoint does not verify.
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(
            f"consolidate(): dtype must be a floating torch.dtype or None, got {dtype!r}; "
            "e.g. torch.bfloat16"
        )
    path, out_file = Path(path), Path(out_file)
    index = verify(path)
    entries = _entries(path, index, dtype)
    header_entries = []
    offset = 0
    for name, shape, out_dtype, _ in entries:
        size = _numel(shape) * torch.empty(0, dtype=out_dtype).element_size()
        header_entries.append((name, out_dtype, shape, offset, offset + size))
        offset += size
    aliases = _aliases(index)
    head = safetensors_header(header_entries, {"format": "pt", "aliases": json.dumps(aliases)})
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for done, (name, shape, out_dtype, kind) in enumerate(entries, 1):
            if kind in ("param", "frozen"):
                source = aliases.get(name, name)
                tensor = _read_param(path, index, source, _numel(shape), kind).to(out_dtype)
            else:
                with safe_open(path / index["files"][0]["file"], framework="pt") as src:
                    tensor = src.get_tensor(model_key(aliases.get(name, name)))
                tensor = tensor.to(out_dtype).reshape(-1)
            f.write(as_bytes(tensor.contiguous()))
            del tensor
            if progress is not None:
                progress(done, len(entries), name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_file)
    _check_written(out_file, entries)
    return out_file


def _check_written(out_file: Path, entries: list[tuple[str, list[int], torch.dtype, str]]) -> None:
    with safe_open(out_file, framework="pt") as f:
        keys = set(f.keys())
        for name, shape, out_dtype, _ in entries:
            if name not in keys or list(f.get_slice(name).get_shape()) != shape:
                raise CheckpointError(f"{out_file}: {name!r} did not come out as written")
            if f.get_slice(name).get_dtype() != SAFETENSORS_DTYPE[out_dtype]:
                raise CheckpointError(f"{out_file}: {name!r} has the wrong dtype")
