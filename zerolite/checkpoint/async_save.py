"""The background half of ``save(..., blocking=False)``: write, hash, fsync, commit.

`zerolite.checkpoint.save` does everything that needs the training group on the calling
thread -- validation, rank 0's lock, the hidden directory, `stage` (each rank's tensors
copied into its `StagingArea`) and `Markers.reserve` (each rank's markers, created so that
a full disk cannot stop them later) -- and then returns a `PendingSave` whose thread runs
`write_and_commit`:

1. every writing rank writes its staged bytes to ``.NAME.tmp-T/rank-R-of-N.safetensors``,
   hashing while it writes, fsyncs, and leaves its completion marker (`Markers`, by global
   rank); under hybrid sharding only the first replica group writes (the others staged
   nothing: their residuals went to it at the call) and the other ranks leave an empty one;
2. rank 0 waits for every rank's marker, writes ``index.json`` and its checksum, commits
   (`zerolite.checkpoint.commit.commit_checkpoint`, the same protocol as a synchronous
   save) and tells the others the outcome; they wait for it, so ``wait()`` returns on any
   rank only once ``latest`` names the checkpoint.

No collective runs on the background thread (`zerolite.checkpoint.markers` says why). A
failure on any rank reaches every rank's ``wait()`` naming the rank and its file; rank 0
commits nothing then, so the previous checkpoint stays ``latest``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerolite.checkpoint.commit import SaveLock, commit_checkpoint
from zerolite.checkpoint.file_writer import write_file
from zerolite.checkpoint.format import CheckpointError
from zerolite.checkpoint.markers import Markers
from zerolite.checkpoint.rank_file import RankFile
from zerolite.checkpoint.staging import StagingArea
from zerolite.ground import phase_events

__all__ = ["copy_to_staging", "write_and_commit"]


def copy_to_staging(area: StagingArea, rank_file: RankFile) -> None:
    """Copy ``rank_file``'s tensors into ``area`` (the memory tracker's ``"staging"`` phase);
    ``rank_file.tensors`` is emptied: the bytes to write are ``area``'s."""
    with phase_events.phase("staging"):
        area.copy_in(rank_file.tensors)
    rank_file.tensors = {}  # the live tensors are not needed (nor kept alive) any more


def write_and_commit(
    *,
    path: Path,
    tmp: Path,
    area: StagingArea | None,
    rank_file: RankFile | None,
    rank: int,
    index: dict[str, Any],
    overwrite: bool,
    token: str,
    lock: SaveLock | None,
    markers: Markers,
) -> None:
    """The background thread's work on one rank (module docstring): global rank ``rank``
    writes ``rank_file``'s bytes staged in ``area``, or no file when both are None (hybrid
    sharding: a replica outside the first replica group). Rank 0 holds ``lock`` and
    releases it when done."""
    try:
        target = tmp / rank_file.file if rank_file is not None else tmp
        try:
            record: dict[str, Any] = {}
            if rank_file is not None and area is not None:
                size, sha = write_file(
                    target, area.ranges, [area.data], rank_file.rank, rank_file.metadata
                )
                record = rank_file.record(size, sha)
            markers.done(rank, record)
        except Exception as exc:
            message = f"writing {target}: {type(exc).__name__}: {exc}"
            if rank == 0:
                markers.announce(f"rank 0: {message}")  # nobody waits for the timeout
            else:
                markers.failed(rank, message)
            raise CheckpointError(f"rank {rank}: {message}") from exc
        if rank != 0:
            markers.verdict(rank)
            return
        try:
            # Non-writers report {}; the files by their rank in the shard group.
            records = sorted((r for r in markers.collect() if r), key=lambda f: f["rank"])
        except CheckpointError as exc:  # names the ranks
            markers.announce(str(exc))
            raise
        try:
            commit_checkpoint(path, tmp, index, records, overwrite, token)
        except Exception as exc:
            message = f"rank 0: committing {path}: {type(exc).__name__}: {exc}"
            markers.announce(message)
            raise CheckpointError(message) from exc
        markers.announce(None)
    finally:
        if lock is not None:
            lock.release()
