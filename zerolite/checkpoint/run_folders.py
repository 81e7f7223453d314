"""Which folders of ``save_state`` a run may replace: a marker naming the run in each.

Stock Accelerate's ``save_state(dir)`` replaces whatever ``dir`` holds, and transformers'
``run_clm_no_trainer.py`` relies on it: under gradient accumulation it saves ``step_N``
on two consecutive micro-steps. zerolite refuses to replace another run's checkpoint
silently, so it must know which folders are this run's: rank 0 writes ``RUN_FILE`` (the
run's id) into each folder before anything else, and a folder is replaceable when it is
missing, empty, or marked with this run's id -- or with the id of the run that
``load_state`` resumed from, which this run continues. A folder holding files without
the marker (another run, stock Accelerate, a hand-made folder) is not.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from zerolite.checkpoint.commit import fsync_dir, write_atomic

__all__ = ["RUN_FILE", "RunFolders", "accelerate_staging", "move_into"]

RUN_FILE = "zerolite_run.json"
"""The marker rank 0 writes into every ``save_state`` folder: ``{"run": <hex id>}``."""


class RunFolders:
    """Which ``save_state`` folders this run may replace (the module docstring).

    ``run`` is rank 0's id for this run: new at construction, replaced by the id found in
    a folder that `adopt` loads. Only rank 0 reads and writes markers; the ranks agree on
    its verdict (`zerolite.accelerate`).
    """

    def __init__(self) -> None:
        self.run = uuid.uuid4().hex

    def owner(self, folder: Path) -> str | None:
        """The run id in ``folder``'s marker (None without a readable one)."""
        try:
            return str(json.loads((folder / RUN_FILE).read_text())["run"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def replaceable(self, folder: Path) -> bool:
        """Whether ``folder`` is missing, empty, or this run's."""
        if not folder.is_dir() or not any(folder.iterdir()):
            return True
        return self.owner(folder) == self.run

    def claim(self, folder: Path) -> None:
        """Rank 0: mark ``folder`` as this run's (atomically, before anything else is written)."""
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / RUN_FILE, json.dumps({"run": self.run}).encode())

    def adopt(self, folder: Path) -> None:
        """Rank 0, after a load: this run continues the run that wrote ``folder``."""
        found = self.owner(folder)
        if found is not None:
            self.run = found


def accelerate_staging(target: Path, rank: int) -> Path:
    """A new hidden folder in ``target`` where rank ``rank`` stages Accelerate's own files
    before `move_into` ``target``. Its name is unlike a checkpoint's temporaries: rank 0's
    asynchronous save commits into ``target`` while the other ranks stage, and then
    removes those (`zerolite.checkpoint.commit.remove_leftovers`)."""
    return target / f".accelerate-{rank}-staging-{uuid.uuid4().hex}"


def move_into(staging: Path, target: Path) -> None:
    """Move every file of ``staging`` into ``target``, each by one atomic rename (a crash
    leaves each file old or new, never partial), then remove ``staging``."""
    for entry in sorted(staging.iterdir()):
        os.replace(entry, target / entry.name)
    fsync_dir(target)
    staging.rmdir()
