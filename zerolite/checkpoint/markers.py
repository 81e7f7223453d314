"""Completion markers: how the ranks of an asynchronous save agree, through files.

Before rank 0 commits, every rank's rank file must be complete; after it commits (or
fails), every rank must learn the outcome. A synchronous save agrees with collectives on
the training group. An asynchronous save cannot: its background threads would run those
collectives at unpredictable points between the training step's own, on the same
communicator, and pair them with the wrong peers (a hang or silent corruption). The ranks
talk through small files in the checkpoint root instead, which the checkpoint already
requires to be shared by all ranks:

- no extra communicator (a second gloo group would be another set of connections to set
  up at a collective point, and would be gone at interpreter exit when a save in flight
  must still finish -- files work after ``destroy_process_group``);
- no ordering constraint between ranks: each rank writes its marker when its own file is
  done, and a rank that fails says why at once;
- the cost is polling (a few ms) and, for a rank that died without a word, a timeout:
  the group's ``ZeroConfig.timeout_s``.

Files, named after the save's directory ``NAME`` and token ``T``:

- ``.NAME.T.rR.report``: rank R's file record (JSON) once its rank file is fsynced, or
  its failure instead, naming its file;
- ``.NAME.T.rR.verdict`` (R > 0): rank 0's outcome for rank R, committed or the error.

[Note: reserved markers] The failure the markers report most often is a full disk (or a
quota), which would stop a marker written then as surely as the rank file: the other ranks
would wait ``timeout_s`` and guess that the failing rank died. So every rank creates its
markers at the ``save`` call (`Markers.reserve`, while the ranks still agree: a root too
full for them fails the call on every rank), filled with zeros and fsynced, so their blocks
are allocated. A marker is later written in place (``pwrite`` at offset 0, fsync): no new
block, nor a new directory entry. The bytes are ``ZLM1``, a kind byte (``D`` record, ``E``
error, ``C`` committed), the payload's length and CRC-32, then the payload: a reader takes
a file that does not start so, or whose CRC does not match yet, for a reservation still
unwritten. An error longer than its marker is cut short. (A copy-on-write file system may
still need new blocks for an overwrite; no file-level reservation helps there.)

Rank 0 removes the reports once it has read them (a rank that reports later finds its
marker gone and skips it: rank 0 has decided), rank R its verdict; what a failed or crashed
save leaves is removed by the next save (`zerolite.checkpoint.commit.remove_leftovers`).
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from zerolite.checkpoint.commit import fsync_dir
from zerolite.checkpoint.format import CheckpointError

__all__ = ["Markers", "read_marker"]

_MAGIC = b"ZLM1"
_HEADER = struct.Struct("<4scII")  # magic, kind, payload length, payload CRC-32
# Bytes reserved per marker, at least: an error message (paths and all) fits easily.
_MIN_BYTES = 4096
_CUT = " ... (cut short)"


class Markers:
    """The markers of one asynchronous save of ``path`` (token ``token``) by ``world_size``
    ranks; waits give up after ``timeout_s`` seconds."""

    def __init__(self, path: Path, token: str, world_size: int, timeout_s: float) -> None:
        self.root = path.parent
        self.stem = f".{path.name}.{token}"
        self.world_size = world_size
        self.timeout_s = timeout_s

    def _file(self, rank: int, kind: str) -> Path:
        return self.root / f"{self.stem}.r{rank}.{kind}"

    def reserve(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank``, at the call: create its report, with room for ``record`` (its
        future record, with the largest size and hash: ``done``'s must fit) and, rank > 0,
        its verdict, zero-filled and fsynced ([Note: reserved markers]).

        Raises:
            CheckpointError: no room (or no permission) in the root for them.
        """
        record_bytes = len(json.dumps(record).encode())
        files = [(self._file(rank, "report"), max(_MIN_BYTES, _HEADER.size + record_bytes))]
        if rank > 0:
            files.append((self._file(rank, "verdict"), _MIN_BYTES))
        for file, size in files:
            try:
                fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                try:
                    _pwrite_all(fd, bytes(size))  # real zeros: fallocate is not on every fs
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot reserve {size} bytes at {file} for the asynchronous save's "
                    f"marker ({exc}); nothing was written: free space in {self.root}"
                ) from exc
        fsync_dir(self.root)

    def done(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank``'s rank file is complete; ``record`` is its entry of the index."""
        _write(self._file(rank, "report"), b"D", json.dumps(record).encode(), cut=False)

    def failed(self, rank: int, message: str) -> None:
        """Rank ``rank`` could not write its file (best effort: if even its reserved
        marker cannot be written, rank 0 reports this rank as silent, after the timeout)."""
        try:
            _write(self._file(rank, "report"), b"E", message.encode(), cut=True)
        except OSError:
            pass

    def collect(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's record, by rank, once all are done (reports removed).

        Raises:
            CheckpointError: a rank failed (its message), or some rank wrote nothing
                within the timeout (named, with the file it owed).
        """
        records: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while len(records) + len(errors) < self.world_size:
            for rank in range(self.world_size):
                if rank in records or rank in errors:
                    continue
                report = read_marker(self._file(rank, "report"))
                if report is not None and report[0] == b"E":
                    errors[rank] = report[1].decode(errors="replace")
                elif report is not None:
                    records[rank] = json.loads(report[1])
            if errors or len(records) == self.world_size:
                break
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world_size) if r not in records]
                raise CheckpointError(
                    f"rank(s) {silent} did not report their rank files within "
                    f"{self.timeout_s:g}s (ZeroConfig.timeout_s); did they die?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        for rank in range(self.world_size):
            self._file(rank, "report").unlink(missing_ok=True)
        if errors:
            raise CheckpointError("; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))
        return [records[r] for r in range(self.world_size)]

    def announce(self, error: str | None) -> None:
        """Rank 0: tell every other rank the outcome (None: committed)."""
        kind, payload = (b"C", b"") if error is None else (b"E", error.encode())
        for rank in range(1, self.world_size):
            try:
                _write(self._file(rank, "verdict"), kind, payload, cut=True)
            except OSError:
                pass  # that rank times out, naming rank 0

    def verdict(self, rank: int) -> None:
        """Rank ``rank`` > 0: wait for rank 0's outcome; raise `CheckpointError` if it failed."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while (verdict := read_marker(self._file(rank, "verdict"))) is None:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank 0 did not commit or report within {self.timeout_s:g}s "
                    "(ZeroConfig.timeout_s); did it die?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._file(rank, "verdict").unlink(missing_ok=True)
        if verdict[0] == b"E":
            raise CheckpointError(verdict[1].decode(errors="replace"))


def read_marker(file: Path) -> tuple[bytes, bytes] | None:
    """A written marker's (kind, payload); None while it is missing or only reserved."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, kind, length, crc = _HEADER.unpack_from(data)
    payload = data[_HEADER.size : _HEADER.size + length]
    if magic != _MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
        return None  # reserved, or being written: the next poll sees it whole
    return kind, payload


def _write(file: Path, kind: bytes, payload: bytes, *, cut: bool) -> None:
    """Write a marker into its reservation, in place. A missing reservation is skipped:
    rank 0 removes the reports once it has decided, so nobody reads this one any more."""
    try:
        fd = os.open(file, os.O_WRONLY)  # not O_CREAT: a new file would need space
    except FileNotFoundError:
        return
    try:
        room = os.fstat(fd).st_size - _HEADER.size
        if len(payload) > room:
            if not cut:
                raise ValueError(f"{file}: a {len(payload)}-byte marker exceeds its "
                                 f"{room}-byte reservation")
            payload = payload[: max(room - len(_CUT), 0)] + _CUT.encode()
        _pwrite_all(fd, _HEADER.pack(_MAGIC, kind, len(payload), zlib.crc32(payload)) + payload)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)
