"""Completion markers: how the ranks of an asynchronous save agree, through files.

Before rank 0 commits, every rank's shard file must be complete; after it commits (or
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
  done, and a rank that fails says why at once in its error marker;
- the cost is polling (a few ms) and, for a rank that died without a word, a timeout:
  the group's ``ZeroConfig.timeout_s``.

Files, named after the save's directory ``NAME`` and token ``T`` (all written atomically):

- ``.NAME.T.rR.done``: rank R's file record (JSON), once its shard file is fsynced;
- ``.NAME.T.rR.error``: rank R's failure instead, naming its file;
- ``.NAME.T.rR.verdict``: rank 0's outcome for rank R, empty when committed, else the error.

Rank 0 removes the ``done``/``error`` markers it read, rank R its verdict; what a crash
leaves is removed by the next save (`zerolite.checkpoint.commit.remove_leftovers`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from zerolite.checkpoint.commit import write_atomic
from zerolite.checkpoint.format import CheckpointError

__all__ = ["Markers"]


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

    def done(self, rank: int, record: dict[str, Any]) -> None:
        """Rank ``rank``'s shard file is complete; ``record`` is its entry of the index."""
        write_atomic(self._file(rank, "done"), json.dumps(record).encode())

    def failed(self, rank: int, message: str) -> None:
        """Rank ``rank`` could not write its file (best effort: the root may be unwritable)."""
        try:
            write_atomic(self._file(rank, "error"), message.encode())
        except OSError:
            pass  # rank 0 then reports this rank as silent, after the timeout

    def collect(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's record, by rank, once all are done (markers removed).

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
                if (error := _read(self._file(rank, "error"))) is not None:
                    errors[rank] = error.decode(errors="replace")
                elif (done := _read(self._file(rank, "done"))) is not None:
                    records[rank] = json.loads(done)
            if errors or len(records) == self.world_size:
                break
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world_size) if r not in records]
                raise CheckpointError(
                    f"rank(s) {silent} did not report their shard files within "
                    f"{self.timeout_s:g}s (ZeroConfig.timeout_s); did they die?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        for rank in range(self.world_size):
            self._file(rank, "done").unlink(missing_ok=True)
            self._file(rank, "error").unlink(missing_ok=True)
        if errors:
            raise CheckpointError("; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))
        return [records[r] for r in range(self.world_size)]

    def announce(self, error: str | None) -> None:
        """Rank 0: tell every other rank the outcome (None: committed)."""
        for rank in range(1, self.world_size):
            try:
                write_atomic(self._file(rank, "verdict"), (error or "").encode())
            except OSError:
                pass  # that rank times out, naming rank 0

    def verdict(self, rank: int) -> None:
        """Rank ``rank`` > 0: wait for rank 0's outcome; raise `CheckpointError` if it failed."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while (text := _read(self._file(rank, "verdict"))) is None:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank 0 did not commit or report within {self.timeout_s:g}s "
                    "(ZeroConfig.timeout_s); did it die?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._file(rank, "verdict").unlink(missing_ok=True)
        if text:
            raise CheckpointError(text.decode(errors="replace"))


def _read(file: Path) -> bytes | None:
    try:
        return file.read_bytes()
    except FileNotFoundError:
        return None
