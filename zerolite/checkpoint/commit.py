"""How a finished checkpoint directory takes its place in a root: rank 0's part of `save`.

A root holds checkpoint directories and the pointer file ``latest`` naming the newest.
Invariant: **at every instant, ``latest`` names a complete checkpoint directory** (once
one exists), so a crash (SIGKILL, power loss after the fsyncs) anywhere below leaves
something `load` accepts, and nothing ever deletes the only complete copy of a checkpoint.

A new name: the complete hidden ``.NAME.tmp-T`` is renamed to ``NAME``, then ``latest``
is replaced (``os.replace``). Replacing an existing ``NAME`` (``overwrite=True``):

1. ``NAME`` is copied to ``.NAME.old-T`` by hard links (the files are never modified in
   place, so sharing them is safe; one link per file, not a data copy);
2. if ``latest`` names ``NAME``, it is pointed at ``.NAME.old-T``;
3. ``NAME`` is renamed to ``.NAME.gone-T``, and 4. ``.NAME.tmp-T`` to ``NAME``;
5. ``latest`` is pointed at ``NAME``; 6. the old copies are removed.

`recover` runs at the start of the next save in the root, under the save lock: an old
copy whose ``NAME`` is missing (crash between 3 and 4) is put back as ``NAME`` (by
hard-link copy and rename when ``latest`` names the copy, so the pointer never dangles);
``latest`` naming an old copy whose ``NAME`` exists is pointed back at ``NAME`` (complete:
it only ever appears by renaming a complete directory). Leftover temporaries (and an
asynchronous save's markers) are removed at the start of the next save -- a failed save's
partial directory may hold the space the new one needs -- and after each commit, except
what ``latest`` names.

Two jobs saving into one root would remove each other's temporaries, so a save holds an
advisory lock (`SaveLock`) on ``ROOT/.zerolite-save.lock`` from before anything is written
until it has cleaned up. Only rank 0 takes it: only rank 0 creates, renames and removes
directories, and every other rank writes only into the directory rank 0 names.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from zerolite.checkpoint.format import (
    INDEX,
    INDEX_DIGEST,
    LATEST,
    CheckpointError,
    checkpoint_name_problem,
    index_digest_text,
)

__all__ = [
    "FAULT_ENV",
    "HOLD_ENV",
    "LOCK_FILE",
    "MARKER",
    "SaveLock",
    "commit",
    "commit_checkpoint",
    "fault_point",
    "fsync_dir",
    "hold_point",
    "read_pointer",
    "recover",
    "remove_leftovers",
    "write_atomic",
]

# Test-only fault injection: "PHASE:RANK" (or "PHASE:RANK,RANK...") makes those ranks SIGKILL
# themselves at PHASE. Phases: "writing" (half of a rank file written), "before_rename" (the
# new directory complete), the overwrite steps "overwrite_copied", "overwrite_pointed_to_copy",
# "overwrite_moved_aside", "before_latest" (renamed into place), "before_cleanup" (pointer
# moved), and recovery's "restore_copied", "restore_renamed".
FAULT_ENV = "ZEROLITE_CHECKPOINT_FAULT"
# Test-only: "PHASE:FILE" makes every rank wait at PHASE ("writing": before a rank file is
# opened) until FILE exists, so a test can act while an asynchronous save is in flight.
HOLD_ENV = "ZEROLITE_CHECKPOINT_HOLD"
LOCK_FILE = ".zerolite-save.lock"
_OLD = re.compile(r"\.(.+)\.old-[0-9a-f]{32}")
_POINTER_TMP = f".{LATEST}.tmp"  # write_atomic's sibling of the pointer
_TEMPORARY = re.compile(r"\..+\.(tmp|old|gone)-[0-9a-f]{32}")
# An asynchronous save's completion markers (`zerolite.checkpoint.markers`; done/error
# and the write_atomic temporaries are the names of earlier releases).
MARKER = re.compile(r"\.+.+\.[0-9a-f]{32}\.r\d+\.(report|verdict|done|error)(\.tmp)?")


def fault_point(phase: str, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    name, _, ranks = spec.partition(":")
    if name == phase and str(rank) in ranks.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def hold_point(phase: str) -> None:
    name, _, release = os.environ.get(HOLD_ENV, "").partition(":")
    while name == phase and not os.path.exists(release):
        time.sleep(0.01)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, data: bytes) -> None:
    """Replace ``target`` with ``data``: written to a sibling, fsynced, renamed over it."""
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)


def read_pointer(root: Path) -> str | None:
    """The name ``ROOT/latest`` holds, exactly as written (None without a pointer).

    Raises:
        CheckpointError: the pointer holds something that is not a checkpoint name.
    """
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer}: unreadable pointer ({exc})") from None
    problem = None if _OLD.fullmatch(name) else checkpoint_name_problem(name)
    if problem is not None:
        raise CheckpointError(f"{pointer}: does not name a checkpoint in {root}: {problem}")
    return name


def _named(root: Path) -> str | None:
    """What ``latest`` names, for the save's own bookkeeping: a pointer that names nothing
    valid (edited by hand) counts as none -- the save replaces it -- rather than blocking
    every later save in the root."""
    try:
        return read_pointer(root)
    except CheckpointError:
        return None


def _point(root: Path, name: str) -> None:
    write_atomic(root / LATEST, name.encode())


def _link_copy(source: Path, target: Path) -> None:
    """A complete copy of directory ``source`` at ``target``: hard links where the
    filesystem allows them (no data copied), else real copies; fsynced."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)
    fsync_dir(target)
    fsync_dir(target.parent)


def commit(tmp: Path, path: Path, token: str) -> None:
    """Put the complete directory ``tmp`` in place as ``path`` and name it in ``latest``
    (the module docstring's sequence); ``token`` names the temporaries."""
    root = path.parent
    if not path.exists():
        fault_point("before_rename", 0)
        os.rename(tmp, path)
        fsync_dir(root)
        fault_point("before_latest", 0)
        _point(root, path.name)
        fault_point("before_cleanup", 0)
        return
    fault_point("before_rename", 0)
    old, gone = root / f".{path.name}.old-{token}", root / f".{path.name}.gone-{token}"
    _link_copy(path, old)
    fault_point("overwrite_copied", 0)
    if _named(root) == path.name:
        _point(root, old.name)
    fault_point("overwrite_pointed_to_copy", 0)
    os.rename(path, gone)
    fsync_dir(root)
    fault_point("overwrite_moved_aside", 0)
    os.rename(tmp, path)
    fsync_dir(root)
    fault_point("before_latest", 0)
    _point(root, path.name)
    fault_point("before_cleanup", 0)
    shutil.rmtree(gone, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def commit_checkpoint(
    path: Path, tmp: Path, index: dict[str, Any], records: list[dict[str, Any]],
    overwrite: bool, token: str,
) -> None:
    """Rank 0, every rank file in ``tmp`` complete: write ``index`` with ``records`` (every
    rank's file entry, by rank) and its checksum (last: it seals the index), put ``tmp``
    in place as ``path`` (`commit`) and remove leftovers of earlier saves."""
    index["files"] = records
    data = json.dumps(index, indent=1).encode()
    write_atomic(tmp / INDEX, data)
    write_atomic(tmp / INDEX_DIGEST, index_digest_text(data).encode())
    fsync_dir(tmp)
    if path.exists() and not overwrite:
        raise ValueError(f"checkpoint path {path} appeared while saving; not replaced")
    commit(tmp, path, token)
    remove_leftovers(path.parent, token)


def recover(root: Path) -> None:
    """Finish what an overwrite interrupted by a crash left in ``root`` (module docstring):
    every old copy whose checkpoint is missing is put back, and ``latest`` names a plain
    checkpoint directory again. Rank 0, under the save lock."""
    if not root.is_dir():
        return
    for old in sorted(root.iterdir()):
        match = _OLD.fullmatch(old.name)
        if match is None or not old.is_dir():
            continue
        target = root / match.group(1)
        named = _named(root) == old.name
        if not target.exists():
            if named:  # copy first: renaming the copy itself would leave the pointer dangling
                restored = root / f".{target.name}.tmp-{uuid.uuid4().hex}"
                _link_copy(old, restored)
                fault_point("restore_copied", 0)
            else:
                restored = old
            os.rename(restored, target)
            fsync_dir(root)
            fault_point("restore_renamed", 0)
        if named:
            _point(root, target.name)


def remove_leftovers(root: Path, token: str | None = None) -> None:
    """Remove what earlier saves in ``root`` left: hidden temporary directories (a failed
    save's partial one), except what ``latest`` names, the pointer's write_atomic temporary,
    and the markers of failed or crashed asynchronous saves (each is read before the next
    save of its job starts, so any found here is stale), except the markers of the save
    ``token`` (committed, still to announce it through them). Rank 0, under the save lock:
    at the start of a save (a failed save's files may hold the space the next one needs)
    and after its commit."""
    keep = _named(root)
    for entry in root.iterdir():
        name = entry.name
        if _TEMPORARY.fullmatch(name) and name != keep and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif (
            MARKER.fullmatch(name) and f".{token}." not in name or name == _POINTER_TMP
        ) and entry.is_file():
            with contextlib.suppress(OSError):  # a stale file must not block the save
                entry.unlink()


class SaveLock:
    """An advisory exclusive lock on a checkpoint root, held by the saving job's rank 0.

    ``flock`` on ``ROOT/.zerolite-save.lock`` (the file stays; removing a lock file races
    with the next locker). The kernel drops the lock when its holder dies, so a crashed
    save never blocks the next one. On a filesystem without locks the save goes on
    unlocked, with a warning.
    """

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / LOCK_FILE
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = (
                    os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
                )
                self.release()
                raise CheckpointError(
                    f"checkpoint root {root} is locked by another save in progress ({holder}); two "
                    "jobs saving into one root would remove each other's files. Wait for it to "
                    "finish, or save into another directory."
                ) from None
            warnings.warn(
                f"{self.path}: cannot lock ({exc}); saving without the lock", stacklevel=3
            )
            return
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)

    def release(self) -> None:
        """Unlock (closing the descriptor drops the lock). Idempotent."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
