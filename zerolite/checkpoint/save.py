"""`save` and `latest`: write a sharded checkpoint atomically (DESIGN §5).

The sequence, and what a crash at each point leaves behind:

1. Every rank validates (``extra`` is JSON, the target does not exist unless
   ``overwrite``), and the ranks agree -- nothing is written if any rank objects.
2. Rank 0 creates a hidden sibling ``.{name}.tmp-{token}``; every rank writes and
   fsyncs its own ``rank-r-of-N.safetensors`` there; rank 0 collects sizes and hashes
   and writes ``index.json`` last.  A crash here leaves only the hidden directory.
3. Rank 0 renames the directory into place, fsyncs the parent, then replaces the
   ``latest`` pointer (``os.replace``).  A crash between the two leaves a complete
   checkpoint that ``latest`` does not name yet; the previous one is still named.
4. Leftover hidden directories of earlier, interrupted saves in the same root are
   removed.

Every rank must call `save`; ranks learn of each other's failures at each phase, so a
failed rank never leaves the others waiting. Several machines need a shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from zerolite._version import __version__
from zerolite.checkpoint.format import (
    FORMAT,
    INDEX,
    LATEST,
    VERSION,
    dtype_name,
    file_digest,
    frozen_key,
    master_key,
    model_key,
    read_index,
    shard_file,
    state_key,
    to_json_value,
)
from zerolite.collectives import all_gather_bytes
from zerolite.consensus import agree
from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["save", "latest", "FAULT_ENV"]

# Test-only fault injection: "PHASE:RANK" makes that rank SIGKILL itself at PHASE
# ("writing", "before_rename" or "before_latest").
FAULT_ENV = "ZEROLITE_CHECKPOINT_FAULT"


def _fault_point(phase: str, rank: int) -> None:
    if os.environ.get(FAULT_ENV) == f"{phase}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_tensors(model: nn.Module, opt: ShardedOptimizer) -> tuple[dict[str, torch.Tensor], list[list], list[list]]:
    """This rank's tensors for its file, and the (name, start, end) master and frozen pieces."""
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[list] = []
    frozen_pieces: list[list] = []
    for flat in opt.frozen_flats:
        for piece in flat.pieces:
            name = flat.names[piece.index]
            start, end = piece.param_start, piece.param_end
            frozen_pieces.append([name, start, end])
            tensors[frozen_key(name, start, end)] = flat.shard[piece.shard_start : piece.shard_start + piece.numel]
    for flat, master in zip(opt.flats, opt.masters):
        for piece, tensor in zip(flat.pieces, master.pieces):
            name = flat.names[piece.index]
            start, end = piece.param_start, piece.param_end
            pieces.append([name, start, end])
            tensors[master_key(name, start, end)] = tensor.detach()
            for key, value in opt.state.get(tensor, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[state_key(key, name, start, end)] = value.detach()
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    if opt.group.rank == 0:
        for name, tensor in model_only_tensors(model, opt).items():
            tensors[model_key(name)] = tensor.detach()
    return {k: v.contiguous().cpu() for k, v in tensors.items()}, pieces, frozen_pieces


def model_only_tensors(model: nn.Module, opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """Buffers and the parameters zerolite does not shard (outside the optimizer; frozen
    ones in stages 1-2), by state-dict name: saved whole by rank 0."""
    managed = {id(p) for flat in [*opt.flats, *opt.frozen_flats] for p in flat.params}
    out = {}
    for name, p in model.named_parameters():
        if id(p) not in managed:
            out[name] = p
    for name, b in model.named_buffers():
        out[name] = b
    return out


def state_dict_names(model: nn.Module) -> list[str]:
    """The keys ``model.state_dict()`` has, in its order, without reading any tensor."""
    names = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names += [dot + n for n, p in module._parameters.items() if p is not None]
        names += [
            dot + n for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
    return names


def _index(model: nn.Module, opt: ShardedOptimizer, schedulers: Sequence[Any], extra: Any) -> dict[str, Any]:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    group_of = {id(t): g for g, group in enumerate(opt.param_groups) for t in group["params"]}
    params = []
    for flat, master in zip(opt.flats, opt.masters):
        for i, (name, p) in enumerate(zip(flat.names, flat.params)):
            piece_tensors = [t for pc, t in zip(flat.pieces, master.pieces) if pc.index == i]
            params.append({
                "name": name,
                "shape": list(flat.shapes[i]),
                "dtype": dtype_name(flat.data.dtype),
                "group": group_of[id(piece_tensors[0])] if piece_tensors else None,
                "aliases": [a for a in aliases[id(p)] if a != name],
            })
    steps = [
        float(v) for s in opt.state.values() for k, v in s.items() if k == "step" and isinstance(v, torch.Tensor)
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "zerolite_version": __version__,
        "world_size": opt.group.size,
        "stage": opt.config.stage,
        "param_dtype": dtype_name(opt.config.param_dtype),
        "reduce_dtype": None if opt.config.reduce_dtype is None else dtype_name(opt.config.reduce_dtype),
        "optimizer": {
            "class": f"{type(opt.optimizer).__module__}.{type(opt.optimizer).__qualname__}",
            "param_groups": [
                {k: to_json_value(v, f"param group {g} {k!r}") for k, v in group.items() if k != "params"}
                for g, group in enumerate(opt.param_groups)
            ],
        },
        "params": params,
        "frozen": [
            {"name": name, "shape": list(flat.shapes[i]), "dtype": dtype_name(flat.data.dtype)}
            for flat in opt.frozen_flats for i, name in enumerate(flat.names)
        ],
        "state_dict_keys": state_dict_names(model),
        "step": int(max(steps)) if steps else None,
        "loss_scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict(),
        "schedulers": [to_json_value(s.state_dict(), f"scheduler {i}") for i, s in enumerate(schedulers)],
        "extra": extra,
        "files": [],
    }


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: ShardedOptimizer,
    *,
    schedulers: Sequence[Any] = (),
    extra: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to directory ``path``.

    Every rank must call. Each rank writes its own safetensors file (its fp32 master
    pieces, their optimizer state and its RNG state); rank 0 also writes buffers,
    frozen and non-optimized parameters and the JSON index. The ``latest`` pointer in
    ``path``'s parent is moved last. Loadable at any world size and stage (`load`).

    Args:
        path: the checkpoint directory to create; must not exist unless ``overwrite``.
        model: the sharded model.
        optimizer: its `ShardedOptimizer`.
        schedulers: LR schedulers (any object with ``state_dict()`` returning JSON-able data).
        extra: any JSON-serialisable value, returned by `load` (e.g. the data position).
        overwrite: replace an existing checkpoint at ``path`` (its old copy survives under
            a hidden name until the new one is in place).
    Returns:
        ``path`` as a `Path`.
    Raises:
        ValueError: ``extra`` or scheduler state is not JSON-serialisable, or ``path``
            exists without ``overwrite`` -- before anything is written, on every rank.
    """
    path = Path(path)
    group = optimizer.group
    error: BaseException | None = None
    index: dict[str, Any] = {}
    try:
        if path.exists() and not overwrite:
            raise ValueError(f"checkpoint path {path} already exists; pass overwrite=True to replace it")
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"extra must be JSON-serialisable: {exc}") from None
        index = _index(model, optimizer, schedulers, extra)
        json.dumps(index)
    except Exception as exc:
        error = exc
    agree("zerolite.checkpoint.save()", [], error, group)
    # Phase 2: write into a hidden sibling named by rank 0's token.
    token = all_gather_bytes(
        uuid.uuid4().hex.encode() if group.rank == 0 else b"", group, what="checkpoint.save() (naming the directory)"
    )[0].decode()
    tmp = path.parent / f".{path.name}.tmp-{token}"
    error = None
    record = b""
    try:
        if group.rank == 0:
            tmp.mkdir(parents=True)
    except Exception as exc:
        error = exc
    agree("zerolite.checkpoint.save() (creating the directory)", [], error, group)
    try:
        tensors, pieces, frozen_pieces = rank_tensors(model, optimizer)
        record = _write_file(tmp / shard_file(group.rank, group.size), tensors, group.rank, pieces, frozen_pieces)
    except Exception as exc:
        error = exc
    records = all_gather_bytes(record, group, what="checkpoint.save() (collecting file records)")
    agree("zerolite.checkpoint.save() (writing shards)", [], error, group)
    error = None
    try:
        if group.rank == 0:
            index["files"] = [json.loads(r) for r in records]
            _write_atomic(tmp / INDEX, json.dumps(index, indent=1).encode())
            _fsync_dir(tmp)
            _fault_point("before_rename", 0)
            _commit(tmp, path, overwrite)
            _fault_point("before_latest", 0)
            _write_atomic(path.parent / LATEST, path.name.encode())
            _remove_leftovers(path.parent)
    except Exception as exc:
        error = exc
    agree("zerolite.checkpoint.save() (committing)", [], error, group)
    return path


def _write_file(
    target: Path, tensors: dict[str, torch.Tensor], rank: int, pieces: list[list], frozen_pieces: list[list]
) -> bytes:
    data = safetensors_bytes(tensors, metadata={"format": FORMAT, "rank": str(rank)})
    with open(target, "wb") as f:
        half = len(data) // 2
        f.write(data[:half])
        f.flush()
        _fault_point("writing", rank)
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())
    size, sha = file_digest(target)
    return json.dumps({"file": target.name, "rank": rank, "bytes": size, "sha256": sha, "pieces": pieces,
                       "frozen_pieces": frozen_pieces}).encode()


def _write_atomic(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def _commit(tmp: Path, path: Path, overwrite: bool) -> None:
    old = None
    if path.exists():
        if not overwrite:
            raise ValueError(f"checkpoint path {path} appeared while saving; not replaced")
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    for entry in root.iterdir():
        if entry.name.startswith(".") and (".tmp-" in entry.name or ".old-" in entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (what its ``latest`` pointer names).

    Returns None when ``root`` has no pointer yet. Any rank may call; no communication.

    Raises:
        zerolite.checkpoint.CheckpointError: the pointer names a checkpoint that is not
            complete (its index is missing).
    """
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    target = Path(root) / pointer.read_text().strip()
    read_index(target)
    return target
