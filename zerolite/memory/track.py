"""`track`: peak memory by training phase (forward, backward, step).

Inside ``with zerolite.memory.track(opt) as t:`` every forward, backward and optimizer
step is attributed to a phase, and memory is sampled at each module's forward
pre/post-hook, each parameter's gradient hook and around ``step()``:

- ``t.peaks[phase].zerolite``: the largest `footprint(opt)` total seen (bytes of
  parameters, gradients, masters, optimizer state and transient buffers zerolite
  knows of -- gathered stage-3 units and gradient buckets included);
- ``t.peaks[phase].process``: on CUDA, the allocator's peak allocated bytes during the
  phase (``torch.cuda.max_memory_allocated``, reset at each phase change); on CPU, the
  largest growth of the process RSS (psutil) over its value when tracking began --
  everything the process touched, activations and allocator caching included, sampled
  at the hook points only.

Samples are taken from hooks, so a short-lived allocation between two hooks is not
seen on CPU (the CUDA number does see it). Use it for "what does each phase cost",
not for byte-exact accounting (that is `footprint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import psutil
import torch

from zerolite.memory.footprint import footprint
from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["track", "PhasePeak", "MemoryTracker"]

PHASES = ("forward", "backward", "step")


@dataclasses.dataclass
class PhasePeak:
    """Peak bytes in one phase: zerolite's tensors, and the process (RSS growth or CUDA)."""

    zerolite: int = 0
    process: int = 0


class MemoryTracker:
    """Collects `PhasePeak`s; see `track`."""

    def __init__(self, opt: ShardedOptimizer) -> None:
        self.opt = opt
        self.peaks = {phase: PhasePeak() for phase in PHASES}
        self.phase: str | None = None
        self.cuda = any(f.data.device.type == "cuda" for f in opt.flats)
        self._proc = psutil.Process()
        self._rss0 = self._proc.memory_info().rss

    def enter(self, phase: str) -> None:
        if phase == self.phase:
            return
        self.sample()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.phase = phase
        self.sample()

    def sample(self) -> None:
        if self.phase is None:
            return
        peak = self.peaks[self.phase]
        peak.zerolite = max(peak.zerolite, footprint(self.opt).total)
        if self.cuda:
            peak.process = max(peak.process, torch.cuda.max_memory_allocated())
        else:
            peak.process = max(peak.process, self._proc.memory_info().rss - self._rss0)

    def on_gradient(self, param: torch.Tensor) -> None:
        self.enter("backward")
        self.sample()

    def __str__(self) -> str:
        kind = "CUDA peak allocated" if self.cuda else "RSS growth"
        rows = [f"{'phase':10s} {'zerolite MB':>12s} {kind + ' MB':>24s}"]
        for phase, p in self.peaks.items():
            rows.append(f"{phase:10s} {p.zerolite / 1e6:12.2f} {p.process / 1e6:24.2f}")
        return "\n".join(rows)


@contextlib.contextmanager
def track(opt: ShardedOptimizer) -> Iterator[MemoryTracker]:
    """Record peak memory per phase (forward, backward, step) of ``opt``'s model.

    Local to this rank (no communication). Example::

        with zerolite.memory.track(opt) as t:
            loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        print(t)  # peaks per phase
    """
    tracker = MemoryTracker(opt)
    model = opt.model
    handles: list[Any] = []
    if model is not None:
        # Forwards recomputed inside backward (activation checkpointing) stay in backward.
        handles.append(model.register_forward_pre_hook(
            lambda *a: None if torch._C._current_graph_task_id() != -1 else tracker.enter("forward")))
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(lambda *a: tracker.sample()))
            handles.append(module.register_forward_hook(lambda *a: tracker.sample()))
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(tracker.on_gradient))
    handles.append(opt.register_step_pre_hook(lambda *a: tracker.enter("step")))
    handles.append(opt.register_step_post_hook(lambda *a: tracker.sample()))
    try:
        yield tracker
    finally:
        tracker.sample()
        for handle in handles:
            handle.remove()
