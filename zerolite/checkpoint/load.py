"""`load`: restore a checkpoint at any world size, stage and bucket size.

Each rank reads only the element ranges it owns under the *current* layout, from
whichever files hold them (``get_slice`` reads part of a tensor without loading it).
Everything is read and checked first -- file sizes and hashes (spread over the ranks,
the verdict shared), names, shapes, dtypes, optimizer class, coverage of every range,
param groups by parameter name (`zerolite.checkpoint.param_groups`), the number and classes of
LR schedulers (`zerolite.checkpoint.schedulers`) -- and ranks agree before any model,
optimizer or RNG state changes, so a bad checkpoint fails on every rank together with an
error naming the file, parameter or scheduler. Read ranges are copied into storage of
their own: a safetensors slice is a view of the whole saved tensor. Offloaded pieces are
read twice -- once to check, once to write after the ranks agree -- so that only one of
them is in memory at a time (a load of a larger-than-RAM tier must not hold it all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from zerolite.checkpoint.format import (
    LATEST,
    CheckpointError,
    check_file,
    frozen_key,
    model_key,
    read_index,
)
from zerolite.checkpoint.json_codec import decode
from zerolite.checkpoint.param_groups import (
    check_hyperparameters,
    check_param_groups,
    piece_param_groups,
    saved_param_groups,
)
from zerolite.checkpoint.range_reader import PieceReader, RangeReader
from zerolite.checkpoint.residual_fold import apply_residuals, read_residuals
from zerolite.checkpoint.save import model_only_tensors
from zerolite.checkpoint.schedulers import apply_schedulers, plan_schedulers, restore_schedulers
from zerolite.comm.consensus import agreed
from zerolite.comm.small_collectives import all_gather_bytes
from zerolite.ground import phase_events, runtime
from zerolite.optim.multi import class_name
from zerolite.optim.sharded_optimizer import (
    ShardedOptimizer,
    require_model_of,
    require_sharded_optimizer,
)
from zerolite.state.pieces import Piece

__all__ = ["load"]


def _verify_files(path: Path, index: dict[str, Any], rank: int, world_size: int) -> None:
    """Check size and sha256 of the files assigned to this rank (every world_size-th)."""
    for entry in index["files"][rank::world_size]:
        check_file(path, entry)


def _check_model(index: dict[str, Any], opt: ShardedOptimizer) -> None:
    saved = {p["name"]: p for p in index["params"]}
    current = {name: flat.shapes[i] for flat in opt.flats for i, name in enumerate(flat.names)}
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint parameters do not match the model: missing from the checkpoint "
            f"{missing[:5]}, not in the model {unexpected[:5]}"
        )
    for name, shape in current.items():
        if list(shape) != saved[name]["shape"]:
            raise CheckpointError(
                f"parameter {name!r}: checkpoint shape {saved[name]['shape']}, model shape "
                f"{list(shape)}"
            )
    cls = class_name(opt.optimizer)
    if index["optimizer"]["class"] != cls:
        raise CheckpointError(
            f"checkpoint was saved with optimizer {index['optimizer']['class']}, this one is {cls}"
        )
    if len(index["optimizer"]["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(index['optimizer']['param_groups'])} param groups, the "
            f"optimizer {len(opt.param_groups)}"
        )


@contextlib.contextmanager
def _index_entries(path: Path) -> Iterator[None]:
    """Raise a missing entry of the index (KeyError, IndexError) as the `CheckpointError`
    it means: a hand-edited or foreign index."""
    try:
        yield
    except (KeyError, IndexError) as exc:
        raise CheckpointError(
            f"{path}: the index lacks an entry ({type(exc).__name__}: {exc}); it was edited or "
            "written by another zerolite version"
        ) from None


def _read_rank_state(
    path: Path, index: dict[str, Any], opt: ShardedOptimizer
) -> tuple[list[tuple[Piece, torch.Tensor, dict]], list[Piece], PieceReader]:
    """This rank's master pieces, checked: (resident pieces with their values and state,
    offloaded pieces, their reader). An offloaded piece is read here only to check it and
    read again when written (`_write_offloaded`): holding every one until the ranks agree
    would put the whole offloaded state in memory at once."""
    reader = PieceReader(path, index)
    resident = []
    offloaded = []
    for piece in opt.shard_state.pieces():
        values, state = reader.read(piece)
        if piece.tier is None:
            resident.append((piece, values, state))
        else:
            offloaded.append(piece)
        del values, state  # an offloaded piece's: freed before the next one is read
    return resident, offloaded, reader


def _write_offloaded(pieces: list[Piece], reader: PieceReader) -> None:
    """Read and write the offloaded pieces one at a time (already checked: the files'
    hashes match, so the second read returns what the first did)."""
    for piece in pieces:
        values, state = reader.read(piece)
        piece.write(values, state)  # through the offload tier
        del values, state


class _ModelTensors:
    """Buffers and non-optimized parameters: whole in rank 0's file (``model/NAME``), or,
    for parameters a stage-3 save sharded while frozen, in ranges across the files."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.file = path / index["files"][0]["file"]
        with safe_open(self.file, framework="pt") as f:
            self.whole = {k[len("model/"):] for k in f.keys() if k.startswith("model/")}
        self.ranges = RangeReader(path, index, field="frozen_pieces")
        self.shapes = {t["name"]: t["shape"] for t in index.get("frozen", [])}

    def has(self, name: str) -> bool:
        return name in self.whole or name in self.ranges.ranges

    def read(self, name: str, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor (all of it, in its shape, if None)."""
        if name in self.whole:
            with safe_open(self.file, framework="pt") as f:
                tensor = f.get_tensor(model_key(name))
            return tensor if start is None else tensor.reshape(-1)[start:end]
        if start is None:
            numel = 1
            for n in self.shapes[name]:
                numel *= n
            return self.ranges.read(frozen_key, name, 0, numel).reshape(self.shapes[name])
        return self.ranges.read(frozen_key, name, start, end)


@torch.no_grad()
def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: ShardedOptimizer,
    *,
    schedulers: Sequence[Any] = (),
) -> Any:
    """Restore ``model``, ``optimizer`` and ``schedulers`` from checkpoint ``path``.

    Every rank must call. Works at any world size, stage and bucket size relative to
    the save, hybrid sharding included (`zerolite.comm.hybrid`). RNG states (CPU, and CUDA where
    the save had it and CUDA is available) are restored per rank when the world size is
    unchanged and the save was not hybrid (a hybrid save holds the first replica group's
    states only); otherwise every rank reseeds CPU and CUDA deterministically from the
    saved rank-0 state and its new rank. Loaded
    optimizer state is held in its own storage, exactly as a fresh
    shard's (nothing of the saved files stays referenced).

    Args:
        path: a checkpoint directory (e.g. ``checkpoint.latest(root)``).
        model: the model ``optimizer`` was sharded with.
        optimizer: its `ShardedOptimizer`, with its param groups in the order of the save.
        schedulers: the LR schedulers given to `save`, same number, classes and order.
    Returns:
        The ``extra`` value given to `save`, with its types (int keys, tuples, ...).
    Raises:
        TypeError: ``optimizer`` is not a `ShardedOptimizer`, or ``schedulers`` is not a
            list of schedulers.
        ValueError: ``model`` is not the model ``optimizer`` was sharded with.
        zerolite.checkpoint.CheckpointError: on every rank, before anything changes, if a
            file is missing, truncated or corrupt, or the checkpoint does not fit: other
            parameters, optimizer class or param groups (grouped differently), or other
            schedulers (number or classes) than at save.
    """
    optimizer = require_sharded_optimizer(optimizer, "zerolite.checkpoint.load()")
    # offload_params: the parked shards come in for the load and go back written.
    with phase_events.phase("load", optimizer.group.buffer_device), \
            optimizer.shard_state.resident(writes=True):
        extra = _load(Path(path), model, optimizer, schedulers)
    optimizer.shard_state.mark_loaded(None)
    return extra


def _read_checked_index(path: Path, rank: int, world_size: int) -> dict[str, Any]:
    try:
        index = read_index(path)
    except CheckpointError as exc:
        if (path / LATEST).is_file():  # a root of checkpoints, not one checkpoint
            hint = f"zerolite.checkpoint.latest({str(path)!r})"
            raise CheckpointError(f"{exc}; {path} is a root of checkpoints: load {hint}") from None
        raise
    _verify_files(path, index, rank, world_size)
    return index


@dataclasses.dataclass
class _Read:
    """What a load has read and checked on this rank before it changes anything."""

    extra: Any = None
    hyper: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Resident pieces with their values and state; offloaded pieces, read again to write.
    pieces: list[tuple[Piece, torch.Tensor, dict]] = dataclasses.field(default_factory=list)
    offloaded: list[Piece] = dataclasses.field(default_factory=list)
    piece_reader: PieceReader | None = None
    model_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    frozen: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    same_world: bool = False  # a flat save at this world size: per-rank generator states
    rng: torch.Tensor | None = None
    device_rng: torch.Tensor | None = None  # the model's device's; only at the same world size
    residuals: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    # (scheduler, its state before) of the schedulers loaded: the one thing changed early.
    schedulers: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)


def _load(
    path: Path, model: nn.Module, optimizer: ShardedOptimizer, schedulers: Sequence[Any]
) -> Any:
    """Verify, read and check everything on every rank, agree, then write it all."""
    group = optimizer.group.world  # every rank agrees; hybrid replicas read the same ranges
    index = _verified_index(path, model, optimizer)
    current_groups = _current_groups(optimizer)
    read = _Read()
    try:
        with (
            agreed("zerolite.checkpoint.load() (reading)", group, peer_error=CheckpointError),
            _index_entries(path),
        ):
            _check_model(index, optimizer)
            check_param_groups(saved_param_groups(index), current_groups, path)
            planned_schedulers = plan_schedulers(index, schedulers, path)
            _read_optimizer_side(path, index, optimizer, read)
            _read_model_side(path, index, model, optimizer, read)
            # Last, and undone below if a peer failed: schedulers are the only state a load
            # attempt changes before the ranks agree (a custom one may fail in load_state_dict).
            read.schedulers = apply_schedulers(planned_schedulers)
    except BaseException:
        restore_schedulers(read.schedulers)
        raise
    # Nothing else has changed so far; from here on every read has succeeded on every rank.
    _write(read, model, optimizer, index)
    return read.extra


def _verified_index(path: Path, model: nn.Module, optimizer: ShardedOptimizer) -> dict[str, Any]:
    """The index, its checksum and (spread over the ranks) every file's size and hash
    checked; a peer's failure is raised as `CheckpointError` here too (the documented type)."""
    group = optimizer.group.world
    with agreed("zerolite.checkpoint.load() (verifying files)", group, peer_error=CheckpointError):
        require_model_of(model, optimizer, "zerolite.checkpoint.load()")
        index = _read_checked_index(path, group.rank, group.size)
    return index


def _current_groups(optimizer: ShardedOptimizer) -> dict[str, int]:
    """The optimizer's ``{parameter name: param group}`` over every rank: each rank knows the
    group of only its own pieces."""
    current: dict[str, int] = {}
    payload = json.dumps(piece_param_groups(optimizer)).encode()
    for entry in all_gather_bytes(
        payload, optimizer.group.world, what="checkpoint.load() (param groups)"
    ):
        current.update(json.loads(entry))
    return current


def _read_optimizer_side(
    path: Path, index: dict[str, Any], optimizer: ShardedOptimizer, read: _Read
) -> None:
    """``extra``, the hyperparameters, this rank's pieces and its residuals."""
    try:
        read.extra = decode(index.get("extra"), "extra")
        # Plain JSON decodes to itself; typed entries (a tuple, inf) to their values.
        saved_hyper = index["optimizer"]["param_groups"]
        read.hyper = [decode(g, f"param group {i}") for i, g in enumerate(saved_hyper)]
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    check_hyperparameters(read.hyper, optimizer.param_groups, path)
    read.pieces, read.offloaded, read.piece_reader = _read_rank_state(path, index, optimizer)
    # Exact in the saved layout, folded onto this one elsewhere (the files of every rank's
    # residuals; hybrid: the file of a shard holds every replica's).
    read.residuals = read_residuals(path, index, optimizer)


def _read_model_side(
    path: Path, index: dict[str, Any], model: nn.Module, optimizer: ShardedOptimizer, read: _Read
) -> None:
    """Buffers and unsharded parameters, stage 3's frozen ranges, the generator states."""
    source = _ModelTensors(path, index)
    for name, target in model_only_tensors(model, optimizer.shard_state).items():
        if not source.has(name):
            raise CheckpointError(
                f"{source.file}: no tensor for {name!r} (buffer or non-optimized parameter)"
            )
        tensor = source.read(name)
        if tensor.shape != target.shape:
            raise CheckpointError(
                f"{name!r}: checkpoint shape {list(tensor.shape)}, model {list(target.shape)}"
            )
        read.model_tensors[name] = tensor
    for frozen in optimizer.shard_state.frozen_pieces():
        if not source.has(frozen.name):
            raise CheckpointError(f"{path}: no tensor for frozen parameter {frozen.name!r}")
        values = source.read(frozen.name, frozen.param_start, frozen.param_end)
        read.frozen.append((frozen.shard, values))
    # Each rank's own generator state exists only for a flat save at this world size.
    group = optimizer.group.world
    read.same_world = index["world_size"] == group.size and index.get("replicas", 1) == 1
    rng_file = path / index["files"][group.rank if read.same_world else 0]["file"]
    with safe_open(rng_file, framework="pt") as f:
        read.rng = f.get_tensor("rng/cpu")
        device = optimizer.group.buffer_device
        if read.same_world and runtime.is_accelerator(device) and f"rng/{device.type}" in f.keys():
            read.device_rng = f.get_tensor(f"rng/{device.type}")


def _write(read: _Read, model: nn.Module, optimizer: ShardedOptimizer, index: dict) -> None:
    """Every rank read everything: write it into the state, the model and the generators."""
    for piece, values, state in read.pieces:
        piece.write(values, state)
    if read.piece_reader is not None:
        _write_offloaded(read.offloaded, read.piece_reader)
    for group_dict, saved in zip(optimizer.param_groups, read.hyper):
        for key, value in saved.items():
            current = group_dict.get(key)
            # Plain-JSON indexes hold tuples (betas) as lists.
            legacy_tuple = isinstance(current, tuple) and isinstance(value, list)
            group_dict[key] = tuple(value) if legacy_tuple else value
    targets = model_only_tensors(model, optimizer.shard_state)
    for name, tensor in read.model_tensors.items():
        targets[name].copy_(tensor)
    for shard, values in read.frozen:
        shard.copy_(values)
    apply_residuals(read.residuals)
    optimizer.publish_masters()
    if read.rng is not None:
        if read.same_world:
            torch.set_rng_state(read.rng)
            device = optimizer.group.buffer_device
            if read.device_rng is not None:
                runtime.set_rng_state(device, read.device_rng)  # the model's device's, as saved
        else:  # seeds CPU and every CUDA device
            seed = int.from_bytes(bytes(read.rng[:8].tolist()), "little")
            torch.manual_seed(seed + optimizer.group.world.rank)
    if optimizer.loss_scaler is not None and index.get("loss_scaler") is not None:
        optimizer.loss_scaler.load_state_dict(index["loss_scaler"])
