"""Sharded safetensors checkpoints: complete, topology-agnostic, atomic, verified.

- `save(path, model, optimizer, *, schedulers=(), extra=None, overwrite=False, blocking=True)`;
  ``blocking=False`` returns a `PendingSave` and writes in the background
- `prepare_async_save(model, optimizer)`: the staging area of asynchronous saves allocated
  ahead of the first one, so that it blocks as little as later ones
- `load(path, model, optimizer, *, schedulers=())` -> extra, at any world size or stage
- `latest(root)` -> the newest complete checkpoint under ``root``
- `consolidate(path, out_file, dtype=None)` -> one plain safetensors file
- `verify(path)`, `inspect(path)`
- `load_pretrained(model, files, *, strict=True)`: plain safetensors weights into shards

The format is described in `zerolite.checkpoint.format`.

Its place among the layers (what it may import): docs/design.md, "Layers".
"""

from zerolite.checkpoint.consolidate import consolidate, inspect, verify
from zerolite.checkpoint.format import CheckpointError
from zerolite.checkpoint.load import load
from zerolite.checkpoint.pending_save import PendingSave
from zerolite.checkpoint.prepare import prepare_async_save
from zerolite.checkpoint.pretrained import load_pretrained
from zerolite.checkpoint.save import latest, save

__all__ = [
    "CheckpointError",
    "PendingSave",
    "consolidate",
    "inspect",
    "latest",
    "load",
    "load_pretrained",
    "prepare_async_save",
    "save",
    "verify",
]
