"""Phases only zerolite can see from inside, announced to `zerolite.memory.track`.

Forward, backward and step are visible to hooks on the model and optimizer. Building
(`zerolite.shard`, which materialises a meta-device model) and loading
(`zerolite.checkpoint.load`, `zerolite.checkpoint.load_pretrained`) are not, so they
announce themselves here, and sample memory at the points where it peaks (after each
unit is initialised). With no tracker active every call is a loop over an empty list.

Observers are objects handed in for the length of a ``with`` block (`observe`), never
functions of a higher layer parked in a module global: the memory tools build a sharded
model through `zerolite.assemble`, which is below them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = ["Observer", "built", "observe", "phase", "sample"]


class Observer(Protocol):
    def enter(self, phase: str, device: torch.device | None = None) -> None: ...

    def sample(self, held_bytes: int | None = None) -> None: ...

    def built(self, opt: Any) -> None: ...


_observers: list[Observer] = []


@contextlib.contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Send phase changes and samples to ``observer`` inside the ``with`` block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


@contextlib.contextmanager
def phase(name: str, device: torch.device | None = None) -> Iterator[None]:
    """Everything inside is attributed to phase ``name`` (``"build"`` or ``"load"``);
    ``device``: where the model's flat buffers live (or will), when known."""
    for observer in list(_observers):
        observer.enter(name, device)
    try:
        yield
    finally:
        sample()


def sample(held_bytes: int | None = None) -> None:
    """A point where memory may peak; ``held_bytes``: zerolite's own bytes, if known."""
    for observer in list(_observers):
        observer.sample(held_bytes)


def built(opt: Any) -> None:
    """`shard()` returned ``opt`` (a ShardedOptimizer): trackers may hook its model."""
    for observer in list(_observers):
        observer.built(opt)

