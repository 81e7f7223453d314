"""`save` and `latest`: write a sharded checkpoint atomically.

The sequence, and what a crash at each point leaves behind:

1. Every rank waits for its asynchronous save in flight, if any, and validates (the
   directory name, ``extra`` is JSON, the target does not exist unless ``overwrite``) and
   the ranks agree. Rank 0 then takes the root's save lock, finishes what an earlier
   crashed overwrite left (`zerolite.checkpoint.commit.recover`), removes what earlier
   failed saves left (`zerolite.checkpoint.commit.remove_leftovers`: their files may hold
   the space this one needs) and checks the target again; its verdict is shared --
   nothing is written if any rank objects or another job is saving into the same root.
2. Rank 0 creates a hidden sibling ``.{name}.tmp-{token}``; every rank writes and
   fsyncs its own ``rank-r-of-N.safetensors`` there; rank 0 collects sizes and hashes
   and writes ``index.json`` and then its checksum ``index.json.sha256``. A crash here
   leaves only the hidden directory.
3. Rank 0 puts the directory in place and moves the ``latest`` pointer
   (`zerolite.checkpoint.commit.commit`): at every instant ``latest`` names a complete
   checkpoint, also while an existing one is being replaced.
4. Leftover hidden directories of earlier, interrupted saves in the same root are
   removed (never the one ``latest`` names), and the lock is released.

``save(..., blocking=False)`` copies each rank's tensors into its staging area after
step 1 and runs steps 2-4 in a background thread, the ranks agreeing through marker
files instead of collectives (`zerolite.checkpoint.async_save`).

Every rank must call `save`; ranks learn of each other's failures at each phase, so a
failed rank never leaves the others waiting. With hybrid sharding (`zerolite.comm.hybrid`)
the first replica group writes the files (one per shard rank: its replicas hold the same
shards) and the other ranks only take part in the agreements; "rank 0" above is the
first rank of the whole data-parallel group. Several machines need a shared filesystem
(with working ``flock``; without it the save warns and goes on unlocked).
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerolite._version import __version__
from zerolite.checkpoint.async_save import copy_to_staging, write_and_commit
from zerolite.checkpoint.commit import (
    FAULT_ENV,
    SaveLock,
    commit_checkpoint,
    read_pointer,
    recover,
    remove_leftovers,
)
from zerolite.checkpoint.file_writer import byte_ranges, data_blocks, write_file
from zerolite.checkpoint.format import (
    FORMAT,
    LATEST,
    VERSION,
    CheckpointError,
    checkpoint_name_problem,
    dtype_name,
    read_index,
    to_json_value,
)
from zerolite.checkpoint.json_codec import encode
from zerolite.checkpoint.markers import Markers
from zerolite.checkpoint.pending_save import PendingSave, finish_in_flight, start
from zerolite.checkpoint.rank_file import model_only_tensors, rank_file, state_dict_names
from zerolite.checkpoint.residuals import gather_replica_residuals
from zerolite.checkpoint.schedulers import scheduler_entries
from zerolite.checkpoint.staging import staging_area
from zerolite.comm.collectives import Group
from zerolite.comm.consensus import agreed
from zerolite.comm.small_collectives import all_gather_bytes
from zerolite.optim.multi import class_name
from zerolite.optim.sharded_optimizer import (
    ShardedOptimizer,
    require_model_of,
    require_sharded_optimizer,
)

# model_only_tensors and state_dict_names are imported from here by load, pretrained and
# zerolite.full_state_dict.
__all__ = ["FAULT_ENV", "PendingSave", "latest", "model_only_tensors", "save", "state_dict_names"]


def _index(
    model: nn.Module, opt: ShardedOptimizer, schedulers: Sequence[Any], extra: Any
) -> dict[str, Any]:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    # Every tied name -> the name it is saved under (the first), frozen ones included.
    tied = {alias: names[0] for names in aliases.values() for alias in names[1:]}
    param_group_of = {id(t): g for g, group in enumerate(opt.param_groups) for t in group["params"]}
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
                "group": param_group_of[id(master)] if master is not None else None,
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
            "class": class_name(opt.optimizer),
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
    blocking: bool = True,
) -> Path | PendingSave:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to directory ``path``.

    Every rank must call. Each rank writes its own safetensors file (its fp32 master
    pieces, their optimizer state and its RNG state); rank 0 also writes buffers,
    frozen and non-optimized parameters and the JSON index. The ``latest`` pointer in
    ``path``'s parent is moved last. Loadable at any world size and stage (`load`).

    A save first waits for this process's asynchronous save in flight, if any.

    Args:
        path: the checkpoint directory to create; must not exist unless ``overwrite``.
        model: the sharded model.
        optimizer: its `ShardedOptimizer`.
        schedulers: LR schedulers (any object with ``state_dict()`` returning JSON-able data).
        extra: any JSON-serialisable value, returned by `load` (e.g. the data position).
        overwrite: replace an existing checkpoint at ``path``; ``latest`` names a complete
            copy (the old one, then the new one) at every instant of the replacement.
        blocking: False: copy this rank's tensors into its staging area (host memory,
            one copy of the rank's file, kept for the next save; pinned on CUDA), then
            write, hash, fsync and commit in a background thread while training goes on
            (`zerolite.checkpoint.async_save`). What is written is the state at this call.
    Returns:
        ``path`` as a `Path`; with ``blocking=False`` a `PendingSave` (``wait()`` returns
        ``path`` once ``latest`` names it, ``done()`` polls).
    Raises:
        ValueError: ``path``'s name is not a plain directory name (whitespace around it,
            separators, control characters, a leading '.'), ``extra`` or scheduler state is
            not JSON-serialisable, or ``path`` exists without ``overwrite`` -- before
            anything is written, on every rank.
        TypeError: ``blocking`` is not a bool; ``optimizer`` is not a `ShardedOptimizer`.
        ValueError: ``model`` is not the model ``optimizer`` was sharded with (nor a
            wrapper of it), or the ranks passed different paths -- before anything is
            written, on every rank.
        zerolite.checkpoint.CheckpointError: another job is saving into ``path``'s parent
            (it holds the root's lock) -- before anything is written, on every rank; the
            previous asynchronous save failed and no ``wait()`` reported it (on every rank,
            naming the failed rank and file).
    """
    path = Path(path)
    optimizer = require_sharded_optimizer(optimizer, "zerolite.checkpoint.save()")
    # offload_params: the parked shards in memory while this rank's tensors are read (an
    # asynchronous save has copied them into its staging area when this returns).
    with optimizer.shard_state.resident():
        return _save(path, model, optimizer, schedulers, extra, overwrite, blocking)


def _save(
    path: Path,
    model: nn.Module,
    optimizer: ShardedOptimizer,
    schedulers: Sequence[Any],
    extra: Any,
    overwrite: bool,
    blocking: bool,
) -> Path | PendingSave:
    group = optimizer.group.world
    with agreed("zerolite.checkpoint.save()", group):
        finish_in_flight()
        require_model_of(model, optimizer, "zerolite.checkpoint.save()")
        _check_arguments(path, optimizer, overwrite=overwrite, blocking=blocking)
        # No json.dumps(extra) check here: _index encodes ``extra`` losslessly (int keys,
        # tuples, Counter...) and its ValueError names the key that cannot be stored.
        index = _index(model, optimizer, schedulers, extra)
        json.dumps(index)
    lock, token = _lock_root(path, overwrite, group)
    tmp = path.parent / f".{path.name}.tmp-{token}"
    try:
        with agreed("zerolite.checkpoint.save() (creating the directory)", group):
            if group.rank == 0:
                tmp.mkdir(parents=True)
        if not blocking:
            pending = _start_async(path, model, optimizer, index, tmp, overwrite, token, lock)
            lock = None  # the background thread releases it
            return pending
        _write_and_commit(path, model, optimizer, index, tmp, overwrite, token)
    finally:
        if lock is not None:
            lock.release()
    return path


def _start_async(
    path: Path,
    model: nn.Module,
    optimizer: ShardedOptimizer,
    index: dict[str, Any],
    tmp: Path,
    overwrite: bool,
    token: str,
    lock: SaveLock | None,
) -> PendingSave:
    """Stage every writing rank's tensors (agreed: the state at this call, on every rank)
    and start the background write (`zerolite.checkpoint.async_save`). Hybrid sharding: the
    first replica group writes, holding the other replicas' residuals, gathered here before
    the call returns (a collective, so never on the background thread); the other ranks
    only wait for the outcome."""
    group = optimizer.group.world
    shards = optimizer.group
    writes = shards.replicas is None or shards.replicas.rank == 0
    file, area = None, None
    # Markers by global rank: every rank reports (a non-writer, no file) and hears rank 0.
    markers = Markers(path, token, group.size, group.timeout.total_seconds())
    with agreed("zerolite.checkpoint.save() (staging)", group):
        # First, before anything that can fail alone: a collective over the replica group.
        others = gather_replica_residuals(optimizer)
        if writes:
            file = rank_file(model, optimizer)
            file.tensors.update(others)  # hybrid: the other replicas' residuals of this shard
            area = staging_area(optimizer)
            copy_to_staging(area, file)
        # While the ranks agree: a full disk later must not silence the markers.
        markers.reserve(group.rank, {} if file is None else file.record(10**20, "0" * 64))
    work = functools.partial(
        # The index as JSON data now: nothing the caller changes later can reach it.
        write_and_commit, path=path, tmp=tmp, area=area, rank_file=file, rank=group.rank,
        index=json.loads(json.dumps(index)),
        overwrite=overwrite, token=token, lock=lock, markers=markers,
    )
    return start(PendingSave(path, work, group.rank, group.size))


def _lock_root(path: Path, overwrite: bool, group: Group) -> tuple[SaveLock | None, str]:
    """Rank 0 takes the root's save lock, finishes what an earlier crashed overwrite left
    and checks the target again; every rank gets its verdict and its token for the
    directory name, and checks that every rank passed the same path. Every rank calls; if
    rank 0 failed, all raise (rank 0 its own error, the others its type and message).
    Returns rank 0's lock (None elsewhere) and the token.
    """
    lock: SaveLock | None = None
    error: Exception | None = None
    # Every rank's path rides along: ranks writing into different directories would each
    # wait for the others' files (an asynchronous save for timeout_s) instead of failing.
    verdict: dict[str, str] = {"token": uuid.uuid4().hex, "path": os.path.abspath(path)}
    try:
        if group.rank == 0:
            try:
                lock = SaveLock(path.parent)
                recover(path.parent)
                remove_leftovers(path.parent)  # after recover: it may restore an old copy
                _check_target(path, overwrite)  # recovery may have put ``path`` back
            except Exception as exc:  # noqa: BLE001 - shared below: no rank waits for the others
                error = exc
                verdict.update(type=type(exc).__name__, message=str(exc))
        everyone = [json.loads(entry) for entry in all_gather_bytes(
            json.dumps(verdict if group.rank == 0 else {"path": verdict["path"]}).encode(),
            group, what="checkpoint.save() (taking the root's lock)",
        )]
        shared = everyone[0]
        if error is not None:
            raise error
        _check_same_path([entry["path"] for entry in everyone])
        if "message" in shared:
            kind = ValueError if shared["type"] == "ValueError" else CheckpointError
            raise kind(shared["message"])
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, shared["token"]


def _check_same_path(paths: list[str]) -> None:
    """Raise `ValueError` (on every rank: each has every path) unless all ranks passed the
    same path, compared as absolute paths."""
    if len(set(paths)) > 1:
        listed = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
        raise ValueError(
            f"checkpoint.save(): the ranks passed different paths ({listed}); every rank must "
            "pass the same checkpoint path"
        )


def _check_arguments(
    path: Path, optimizer: ShardedOptimizer, *, overwrite: bool, blocking: bool
) -> None:
    """`save`'s refusals before anything is written (see its Raises)."""
    if not isinstance(blocking, bool):
        raise TypeError(f"checkpoint.save(): blocking must be a bool, got {blocking!r}")
    problem = checkpoint_name_problem(path.name)
    if problem is not None:
        raise ValueError(f"checkpoint path {str(path)!r}: {problem}; use a plain directory name")
    _check_target(path, overwrite)


def _check_target(path: Path, overwrite: bool) -> None:
    pointer = path.parent / LATEST
    if pointer.exists() and not pointer.is_file():
        raise ValueError(
            f"{pointer} exists and is not a file: zerolite keeps its pointer to the newest "
            "checkpoint there; move it, or save into another directory"
        )
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
    """Phases 2-4 of the module docstring after the directory exists; every rank calls,
    rank 0 holds the lock. Hybrid sharding: the first replica group writes (its replicas
    hold the same shards); the others only agree."""
    group = optimizer.group.world
    shards = optimizer.group
    writes = shards.replicas is None or shards.replicas.rank == 0
    record = b""
    with agreed("zerolite.checkpoint.save() (writing shards)", group):
        # First, before anything that can fail alone: a collective over the replica group.
        others = gather_replica_residuals(optimizer)
        if writes:
            file = rank_file(model, optimizer)
            file.tensors.update(others)  # hybrid: the other replicas' residuals of this shard
            ranges = byte_ranges(file.tensors)
            # One tensor at a time: offloaded values are read from their tier as written.
            size, sha = write_file(
                tmp / file.file, ranges, data_blocks(ranges, file.tensors), file.rank,
                file.metadata,
            )
            file.tensors = {}
            record = json.dumps(file.record(size, sha)).encode()
    records = all_gather_bytes(record, group, what="checkpoint.save() (collecting file records)")
    with agreed("zerolite.checkpoint.save() (committing)", group):
        if group.rank == 0:
            files = sorted((json.loads(r) for r in records if r), key=lambda f: f["rank"])
            commit_checkpoint(path, tmp, index, files, overwrite, token)


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
