"""`load_pretrained`: plain safetensors weights straight into a sharded model.

Files are ordinary ``model.safetensors`` files (or a sharded set with its
``*.safetensors.index.json``), not zerolite checkpoints. Each rank reads only the element
ranges it owns: a flat range of a parameter is read as the rows of its first dimension
that cover it (``get_slice``), so a rank's peak is about its shard plus one row, never a
full file. Names are checked against the model (tied weights may appear under any of
their names) before anything changes, and all ranks agree on the verdict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from zerolite.checkpoint.format import CheckpointError
from zerolite.checkpoint.save import model_only_tensors, state_dict_names
from zerolite.comm.consensus import agreed
from zerolite.ground import phase_events
from zerolite.state.pieces import Piece
from zerolite.state.shard_state import ShardState, require_state

__all__ = ["load_pretrained"]


def _read_weight_map(index_file: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index_file}: not a safetensors index ({type(exc).__name__}: {exc}); pass the "
            "*.safetensors.index.json written with the files (it has a 'weight_map')"
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_file}: 'weight_map' must map tensor names to file names")
    return weight_map


def _files(
    files: str | os.PathLike | Sequence[str | os.PathLike],
) -> tuple[list[Path], dict[str, Path]]:
    """The files to read, and the tensor -> file map of the indexes among ``files``."""
    items = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    out: list[Path] = []
    mapped: dict[str, Path] = {}
    for item in map(Path, items):
        if item.name.endswith(".index.json"):
            for key, name in _read_weight_map(item).items():
                file = item.parent / name
                if key in mapped and mapped[key].resolve() != file.resolve():
                    raise CheckpointError(
                        f"{item}: {key!r} is mapped to {file} here and to {mapped[key]} by "
                        "another index"
                    )
                mapped[key] = file
                out.append(file)
        else:
            out.append(item)
    out = list({p.resolve(): p for p in out}.values())  # each file once
    if not out:
        raise CheckpointError(
            "load_pretrained: no files given; pass a .safetensors file, several, or an index"
        )
    for path in out:
        if not path.is_file():
            raise CheckpointError(f"{path}: no such safetensors file")
    return out, mapped


def _shapes(path: Path) -> list[tuple[str, list[int]]]:
    """(name, shape) of every tensor in safetensors file ``path``, reading only its header."""
    try:
        with safe_open(path, framework="pt") as f:
            return [(key, list(f.get_slice(key).get_shape())) for key in f.keys()]
    except Exception as exc:  # safetensors' own error types vary by version
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
            "load_pretrained reads .safetensors files only (convert .bin files first)"
        ) from None


def _locate(paths: list[Path], mapped: dict[str, Path]) -> dict[str, tuple[Path, list[int]]]:
    """``{tensor name: (file, shape)}``. A name in two files, or in a file its index's
    ``weight_map`` does not name for it, is ambiguous: refused, naming the files."""
    where: dict[str, tuple[Path, list[int]]] = {}
    indexed = {p.resolve() for p in mapped.values()}
    for path in paths:
        for key, shape in _shapes(path):
            named = mapped.get(key)
            if named is not None and named.resolve() != path.resolve():
                raise CheckpointError(
                    f"load_pretrained: tensor {key!r} is in {path}, but the index's "
                    f"weight_map puts it in {named}: the files disagree with their index "
                    "(remove the stray copy or fix the index)"
                )
            if named is None and path.resolve() in indexed:
                raise CheckpointError(
                    f"load_pretrained: tensor {key!r} is in {path}, which its index's "
                    "weight_map lists, but the weight_map does not name it: fix the index "
                    "or the file"
                )
            if key in where:
                raise CheckpointError(
                    f"load_pretrained: tensor {key!r} is in both {where[key][0]} and {path}; "
                    "pass the *.safetensors.index.json that says which file holds it"
                )
            where[key] = (path, shape)
    absent = sorted(k for k in mapped if k not in where)
    if absent:
        more = f" ({len(absent)} tensors in all: {absent[:5]})" if len(absent) > 1 else ""
        raise CheckpointError(
            f"load_pretrained: the weight_map puts {absent[0]!r} in {mapped[absent[0]]}, which "
            f"does not hold it{more}: the index does not match the files"
        )
    return where


def _read_range(path: Path, key: str, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the flattened tensor ``key``, reading only covering rows."""
    with safe_open(path, framework="pt") as f:
        view = f.get_slice(key)
        shape = view.get_shape()
        if len(shape) <= 1:
            return view[start:end].reshape(-1)
        row = 1
        for n in shape[1:]:
            row *= n
        first, last = start // row, -(-end // row)
        rows = view[first:last].reshape(-1)
    return rows[start - first * row : end - first * row]


@torch.no_grad()
def load_pretrained(
    model: nn.Module, files: str | os.PathLike | Sequence[str | os.PathLike], *, strict: bool = True
) -> None:
    """Load plain safetensors weights into a model sharded by `zerolite.shard` (any stage).

    Every rank must call. Parameters go into this rank's fp32 master pieces (and from
    there into the parameter storage; stages 1-2 then all-gather), frozen stage-3
    parameters into their shards, buffers and non-sharded parameters whole.

    Args:
        model: the sharded model.
        files: a ``.safetensors`` file, several, or a ``*.safetensors.index.json``.
        strict: every parameter and persistent buffer must be in the files, and every
            tensor in the files must belong to the model.
    Raises:
        zerolite.checkpoint.CheckpointError: on every rank, before anything changes: a
            missing or unexpected name (strict), a shape that differs, an unreadable index,
            or an ambiguous name: in two files, or in a file its index's ``weight_map``
            does not name for it (the map decides; a disagreeing file is an error).
    """
    state = require_state(model, "load_pretrained()", "; call shard() first")
    with phase_events.phase("load", state.group.buffer_device), state.resident(writes=True):
        _load(model, state, files, strict)


def _load(
    model: nn.Module,
    state: ShardState,
    files: str | os.PathLike | Sequence[str | os.PathLike],
    strict: bool,
) -> None:
    with agreed(
        "zerolite.checkpoint.load_pretrained()", state.group.world, peer_error=CheckpointError
    ):
        paths, mapped = _files(files)
        plan, loaded = _plan(model, state, _locate(paths, mapped), strict)
    for target, values in plan:
        if isinstance(target, Piece):  # its master lives on the offload tier
            target.write_master(values.reshape(-1))
        else:
            target.copy_(values.reshape(target.shape))
    state.publish()
    state.mark_loaded(loaded)


def _plan(
    model: nn.Module, state: ShardState, where: dict[str, tuple[Path, list[int]]], strict: bool
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """Read everything this rank needs: (destination, values) pairs and the names loaded.
    Changes nothing."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)

    def source(name: str, tensor: torch.Tensor) -> str | None:
        for candidate in aliases.get(id(tensor), [name]):
            if candidate in where:
                if where[candidate][1] != list(tensor.shape):
                    raise CheckpointError(
                        f"{candidate!r}: shape {where[candidate][1]} in {where[candidate][0]}, "
                        f"model {list(tensor.shape)}"
                    )
                return candidate
        return None

    plan: list[tuple[torch.Tensor | Piece, torch.Tensor]] = []
    missing: list[str] = []
    loaded: list[str] = []
    used: set[str] = set()
    keys: dict[int, list[str | None]] = {}  # id(flat) -> each parameter's key in the files
    for flat in [*state.flats, *state.frozen_flats]:
        keys[id(flat)] = [source(name, p) for name, p in zip(flat.names, flat.params)]
        missing += [name for name, key in zip(flat.names, keys[id(flat)]) if key is None]
        loaded += [name for name, key in zip(flat.names, keys[id(flat)]) if key is not None]
        used.update(key for key in keys[id(flat)] if key is not None)
    destinations = [(p, p.master) for p in state.pieces()]
    destinations += [(p, p.shard) for p in state.frozen_pieces()]
    for piece, dest in destinations:
        key = keys[id(piece.flat)][piece.index]
        if key is not None:
            values = _read_range(where[key][0], key, piece.param_start, piece.param_end)
            # A master owned whole (partition="tensor") has its parameter's shape; an
            # offloaded one is written through its piece.
            offloaded = isinstance(piece, Piece) and piece.master_offloaded
            plan.append((piece if offloaded else dest, values.to(dest.dtype).view(dest.shape)))
    in_state_dict = set(state_dict_names(model))
    for name, tensor in model_only_tensors(model, state).items():
        key = source(name, tensor)
        if key is None:
            if name in in_state_dict:  # a parameter or persistent buffer
                missing.append(name)
            continue
        used.add(key)
        loaded.append(name)
        with safe_open(where[key][0], framework="pt") as f:
            plan.append((tensor, f.get_tensor(key).to(tensor.dtype)))
    if strict and missing:
        raise CheckpointError(f"load_pretrained: not in the files: {sorted(set(missing))[:8]}")
    for names in aliases.values():  # a tied weight's other names in the files: the same tensor
        if used.intersection(names):
            used.update(n for n in names if n in where)
    unexpected = sorted(set(where) - used)
    if strict and unexpected:
        raise CheckpointError(f"load_pretrained: not in the model: {unexpected[:8]}")
    return plan, loaded
