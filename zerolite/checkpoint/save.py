"""`save` and `latest`: write a sharded checkpoint atomically (DESIGN §5).

The sequence, and what a crash at each point leaves behind:

1. Every rank validates (the directory name, ``extra`` is JSON, the target does not
   exist unless ``overwrite``) and the ranks agree. Rank 0 then takes the root's save
   lock, finishes what an earlier crashed overwrite left
   (`zerolite.checkpoint.commit.recover`) and checks the target again; its verdict is
   shared -- nothing is written if any rank objects or another job is saving into the
   same root.
2. Rank 0 creates a hidden sibling ``.{name}.tmp-{token}``; every rank writes and
   fsyncs its own ``rank-r-of-N.safetensors`` there; rank 0 collects sizes and hashes
   and writes ``index.json`` and then its checksum ``index.json.sha256``. A crash here
   leaves only the hidden directory.
3. Rank 0 puts the directory in place and moves the ``latest`` pointer
   (`zerolite.checkpoint.commit.commit`): at every instant ``latest`` names a complete
   checkpoint, also while an existing one is being replaced.
4. Leftover hidden directories of earlier, interrupted saves in the same root are
   removed (never the one ``latest`` names), and the lock is released.

Every rank must call `save`; ranks learn of each other's failures at each phase, so a
failed rank never leaves the others waiting. With hybrid sharding (`zerolite.hybrid`)
the first replica group writes the files (one per shard rank: its replicas hold the same
shards) and the other ranks only take part in the agreements; "rank 0" above is the
first rank of the whole data-parallel group. Several machines need a shared filesystem
(with working ``flock``; without it the save warns and goes on unlocked).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from zerolite._version import __version__
from zerolite.checkpoint.commit import (
    FAULT_ENV,
    SaveLock,
    commit,
    fault_point,
    fsync_dir,
    read_pointer,
    recover,
    remove_leftovers,
    write_atomic,
)
from zerolite.checkpoint.format import (
    FORMAT,
    INDEX,
    INDEX_DIGEST,
    VERSION,
    CheckpointError,
    checkpoint_name_problem,
    dtype_name,
    file_digest,
    frozen_key,
    index_digest_text,
    master_key,
    model_key,
    read_index,
    shard_file,
    state_key,
    to_json_value,
)
from zerolite.checkpoint.groups import piece_groups
from zerolite.checkpoint.json_codec import encode
from zerolite.checkpoint.schedulers import scheduler_entries
from zerolite.collectives import Group, all_gather_bytes
from zerolite.consensus import agreed
from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["FAULT_ENV", "latest", "save"]


def rank_tensors(
    model: nn.Module, opt: ShardedOptimizer
) -> tuple[dict[str, torch.Tensor], list[list], list[list]]:
    """This rank's tensors for its file, and the (name, start, end) master and frozen pieces."""
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[list] = []
    frozen_pieces: list[list] = []
    state = opt.shard_state
    for frozen in state.frozen_pieces():
        name, start, end = frozen.name, frozen.param_start, frozen.param_end
        frozen_pieces.append([name, start, end])
        tensors[frozen_key(name, start, end)] = frozen.shard
    for piece in state.pieces():
        name, start, end = piece.name, piece.param_start, piece.param_end
        pieces.append([name, start, end])
        tensors[master_key(name, start, end)] = piece.master.detach()
        for key, value in piece.state.items():
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


def _index(
    model: nn.Module, opt: ShardedOptimizer, schedulers: Sequence[Any], extra: Any
) -> dict[str, Any]:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    # Every tied name -> the name it is saved under (the first), frozen ones included.
    tied = {alias: names[0] for names in aliases.values() for alias in names[1:]}
    group_of = {id(t): g for g, group in enumerate(opt.param_groups) for t in group["params"]}
    # Per flat buffer and parameter index: this rank's master piece (at most one).
    master_of = {(id(pc.flat), pc.index): pc.master for pc in opt.shard_state.pieces()}
    params = []
    for flat in opt.flats:
        for i, (name, p) in enumerate(zip(flat.names, flat.params)):
            master = master_of.get((id(flat), i))
            params.append({
                "name": name,
                "shape": list(flat.shapes[i]),
                "dtype": dtype_name(flat.data.dtype),
                "group": group_of[id(master)] if master is not None else None,
                "aliases": [a for a in aliases[id(p)] if a != name],
            })
    steps = [
        float(v)
        for s in opt.state.values()
        for k, v in s.items()
        if k == "step" and isinstance(v, torch.Tensor)
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "zerolite_version": __version__,
        "world_size": opt.group.size,
        # Hybrid sharding: replica groups at save, each holding all world_size shards.
        "replicas": opt.group.world.size // opt.group.size,
        "stage": opt.config.stage,
        "param_dtype": dtype_name(opt.config.param_dtype),
        "reduce_dtype": None
        if opt.config.reduce_dtype is None
        else dtype_name(opt.config.reduce_dtype),
        "optimizer": {
            "class": f"{type(opt.optimizer).__module__}.{type(opt.optimizer).__qualname__}",
            "param_groups": [
                {
                    k: to_json_value(v, f"param group {g} {k!r}")
                    for k, v in group.items()
                    if k != "params"
                }
                for g, group in enumerate(opt.param_groups)
            ],
        },
        "params": params,
        "frozen": [
            {"name": name, "shape": list(flat.shapes[i]), "dtype": dtype_name(flat.data.dtype)}
            for flat in opt.frozen_flats
            for i, name in enumerate(flat.names)
        ],
        "state_dict_keys": state_dict_names(model),
        "tied": tied,
        "step": int(max(steps)) if steps else None,
        "loss_scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict(),
        # Typed, lossless JSON (json_codec): a Counter, int keys or a tuple come back as such.
        "schedulers": scheduler_entries(schedulers),
        "extra": encode(extra, "extra"),
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
        overwrite: replace an existing checkpoint at ``path``; ``latest`` names a complete
            copy (the old one, then the new one) at every instant of the replacement.
    Returns:
        ``path`` as a `Path`.
    Raises:
        ValueError: ``path``'s name is not a plain directory name (whitespace around it,
            separators, control characters, a leading '.'), ``extra`` or scheduler state is
            not JSON-serialisable, or ``path`` exists without ``overwrite`` -- before
            anything is written, on every rank.
        zerolite.checkpoint.CheckpointError: another job is saving into ``path``'s parent
            (it holds the root's lock) -- before anything is written, on every rank.
    """
    path = Path(path)
    group = optimizer.group.world
    with agreed("zerolite.checkpoint.save()", group):
        problem = checkpoint_name_problem(path.name)
        if problem is not None:
            raise ValueError(
                f"checkpoint path {str(path)!r}: {problem}; use a plain directory name"
            )
        _check_target(path, overwrite)
        # No json.dumps(extra) check here: _index encodes ``extra`` losslessly (int keys,
        # tuples, Counter...) and its ValueError names the key that cannot be stored.
        index = _index(model, optimizer, schedulers, extra)
        json.dumps(index)
    lock, token = _lock_root(path, overwrite, group)
    try:
        tmp = path.parent / f".{path.name}.tmp-{token}"
        _write_and_commit(path, model, optimizer, index, tmp, overwrite, token)
    finally:
        if lock is not None:
            lock.release()
    return path


def _lock_root(path: Path, overwrite: bool, group: Group) -> tuple[SaveLock | None, str]:
    """Rank 0 takes the root's save lock, finishes what an earlier crashed overwrite left
    and checks the target again; every rank gets its verdict and its token for the
    directory name. Every rank calls; if rank 0 failed, all raise (rank 0 its own error,
    the others its type and message). Returns rank 0's lock (None elsewhere) and the token.
    """
    lock: SaveLock | None = None
    error: Exception | None = None
    verdict: dict[str, str] = {"token": uuid.uuid4().hex}
    try:
        if group.rank == 0:
            try:
                lock = SaveLock(path.parent)
                recover(path.parent)
                _check_target(path, overwrite)  # recovery may have put ``path`` back
            except Exception as exc:  # noqa: BLE001 - shared below: no rank waits for the others
                error = exc
                verdict.update(type=type(exc).__name__, message=str(exc))
        shared = json.loads(all_gather_bytes(
            json.dumps(verdict).encode() if group.rank == 0 else b"", group,
            what="checkpoint.save() (taking the root's lock)",
        )[0])
        if error is not None:
            raise error
        if "message" in shared:
            kind = ValueError if shared["type"] == "ValueError" else CheckpointError
            raise kind(shared["message"])
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, shared["token"]


def _check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise ValueError(
            f"checkpoint path {path} already exists; pass overwrite=True to replace it"
        )
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint path {path} exists and is not a directory; not replaced")


def _write_and_commit(
    path: Path,
    model: nn.Module,
    optimizer: ShardedOptimizer,
    index: dict[str, Any],
    tmp: Path,
    overwrite: bool,
    token: str,
) -> None:
    """Phases 2-4 of the module docstring; every rank calls, rank 0 holds the lock."""
    group = optimizer.group.world
    shards = optimizer.group
    # Hybrid: one replica group writes; the others hold the same shards.
    writes = shards.replicas is None or shards.replicas.rank == 0
    with agreed("zerolite.checkpoint.save() (creating the directory)", group):
        if group.rank == 0:
            tmp.mkdir(parents=True)
    record = b""
    with agreed("zerolite.checkpoint.save() (writing shards)", group):
        if writes:
            tensors, pieces, frozen_pieces = rank_tensors(model, optimizer)
            target = tmp / shard_file(shards.rank, shards.size)
            record = _write_file(
                target, tensors, shards.rank, pieces, frozen_pieces, piece_groups(optimizer)
            )
    records = all_gather_bytes(record, group, what="checkpoint.save() (collecting file records)")
    with agreed("zerolite.checkpoint.save() (committing)", group):
        if group.rank == 0:
            files = [json.loads(r) for r in records if r]
            index["files"] = sorted(files, key=lambda f: f["rank"])
            data = json.dumps(index, indent=1).encode()
            write_atomic(tmp / INDEX, data)
            # Last: the checksum seals the index.
            write_atomic(tmp / INDEX_DIGEST, index_digest_text(data).encode())
            fsync_dir(tmp)
            if path.exists() and not overwrite:
                raise ValueError(f"checkpoint path {path} appeared while saving; not replaced")
            commit(tmp, path, token)
            remove_leftovers(path.parent)


def _write_file(
    target: Path,
    tensors: dict[str, torch.Tensor],
    rank: int,
    pieces: list[list],
    frozen_pieces: list[list],
    groups: dict[str, int],
) -> bytes:
    data = safetensors_bytes(tensors, metadata={"format": FORMAT, "rank": str(rank)})
    with open(target, "wb") as f:
        half = len(data) // 2
        f.write(data[:half])
        f.flush()
        fault_point("writing", rank)
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())
    size, sha = file_digest(target)
    return json.dumps(
        {
            "file": target.name,
            "rank": rank,
            "bytes": size,
            "sha256": sha,
            "pieces": pieces,
            "frozen_pieces": frozen_pieces,
            "groups": groups,
        }
    ).encode()


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (what its ``latest`` pointer names).

    The pointer is read exactly as `save` wrote it (names with surrounding whitespace are
    refused at save). After a crash in the middle of ``save(..., overwrite=True)`` it may
    name the old copy ``.NAME.old-…``, a complete checkpoint; the next save in ``root``
    puts it back as ``NAME``. Returns None when ``root`` has no pointer yet. Any rank
    may call; no communication.

    Raises:
        zerolite.checkpoint.CheckpointError: the pointer holds no plain name, or names a
            checkpoint that is not complete (no index or checksum) or whose index is invalid.
    """
    root = Path(root)
    name = read_pointer(root)
    if name is None:
        return None
    target = root / name
    read_index(target)
    return target
