"""`track`: peak memory by phase (build, load, forward, backward, step, staging).

Inside ``with zerolite.memory.track(opt) as t:`` every forward, backward and optimizer
step is attributed to a phase; ``shard()`` (``"build"``, including a meta-device
model's materialisation), ``zerolite.checkpoint.load`` / ``load_pretrained``
(``"load"``) and an asynchronous ``zerolite.checkpoint.save`` copying the rank's tensors
into its staging area (``"staging"``) announce themselves. ``track()`` without an
optimizer watches those and attaches to the optimizer ``shard()`` returns inside the block.

- ``t.peaks[phase].zerolite``: the largest `footprint(opt)` total seen at the sampling
  points (module forward pre/post-hooks, gradient hooks, around ``step()``, after each
  unit of a build and after a load), i.e. bytes of parameters, gradients, masters,
  optimizer state and transient buffers zerolite knows of;
- ``t.peaks[phase].tensors``: the peak of live tensor bytes on the tracked model's device
  type during the phase (`zerolite.memory.live`): every tensor storage of the process --
  parameters, gradients, optimizer state, zerolite's buffers and the activations autograd
  keeps -- counted as operations make them and free them, so nothing between two hooks is
  missed. ``t.peak`` is the largest over forward, backward and step, what
  `zerolite.memory.predict_peak` predicts and `assert_peak` compares with it
  (``track(opt, tensors=False)`` leaves it out: the dispatch mode costs some time per
  operation, and its bookkeeping -- an entry per live storage -- is in ``process`` on the
  CPU, a few MB for a small model). Backward begins when a gradient reaches the model's
  outputs, so a loss computed outside the model belongs to forward;
- ``t.peaks[phase].process``: what ``t.peaks[phase].kind`` says, decided when the phase
  begins from the device of the tracked model's flat buffers (`zerolite.comm.devices`), never
  from whether CUDA happens to be initialised:

  - ``"CUDA peak allocated"`` (a CUDA model): the most bytes allocated on the model's
    device during the phase. The user's own peak counters are never reset: a phase that
    sets a new high for ``torch.cuda.max_memory_allocated(device)`` reports it exactly;
    otherwise the peak is the largest ``torch.cuda.memory_allocated(device)`` seen at the
    sampling points;
  - ``"RSS growth"`` (a CPU model, or before any model is attached): the peak growth of the
    process RSS over its value when tracking began -- everything the process touched,
    activations, file pages read and allocator caching included. On Linux this is the
    kernel's high-water mark (``VmHWM``, reset at each phase change through
    ``/proc/self/clear_refs``), so nothing between two samples is missed; elsewhere RSS is
    read at the sampling points only.

The staging area of asynchronous saves is host memory held between saves (one copy of
the rank's checkpoint file): ``t.staging`` is the most seen, it counts in the
``"staging"`` phase's ``zerolite`` peak, and ``str(t)`` prints it on a line of its own.

With an offload tier the peaks stay resident bytes; `MemoryTracker.offloaded` (and a
line of ``str(t)``) gives the tier's bytes, "optimizer state on disk".

One tracker at a time per process (the high-water mark is process-wide). Use it for "what
does each phase cost"; byte-exact accounting of zerolite's own tensors is `footprint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils._pytree import tree_leaves

from zerolite.checkpoint.staging import staging_bytes
from zerolite.ground import phase_events, runtime
from zerolite.memory.footprint import footprint, offload_label
from zerolite.memory.live import LiveTensorBytes
from zerolite.optim.sharded_optimizer import ShardedOptimizer, require_sharded_optimizer

__all__ = ["track", "PhasePeak", "MemoryTracker", "latest_peaks", "step_peak"]

PHASES = ("build", "load", "forward", "backward", "step", "staging")
STEP_PHASES = ("forward", "backward", "step")  # a training step: what `MemoryTracker.peak` spans

# The peaks of the latest track() block that tracked each optimizer (for `assert_peak`),
# keyed weakly. The value must not reference the optimizer (a tracker does): a weak key
# its own value holds is never freed.
_latest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def latest_peaks(opt: object) -> dict[str, PhasePeak] | None:
    """The `PhasePeak`s (by phase) of the latest ``track()`` block that tracked ``opt``, or
    None if none did."""
    try:
        return _latest.get(opt)
    except TypeError:  # not weakly referenceable: never tracked
        return None


def step_peak(peaks: dict[str, PhasePeak]) -> tuple[int, str]:
    """The peak of live tensor bytes over a training step's phases, and the phase."""
    phase = max(STEP_PHASES, key=lambda p: peaks[p].tensors)
    return peaks[phase].tensors, phase


class _ResidentPeak:
    """This process's peak RSS since the last `reset` (Linux), else its current RSS."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._status = Path("/proc/self/status")
        self.exact = self._reset_high_water_mark()

    def _reset_high_water_mark(self) -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS
            return "VmHWM" in self._status.read_text()
        except OSError:
            return False

    def reset(self) -> None:
        if self.exact:
            self._reset_high_water_mark()

    def read(self) -> int:
        if self.exact:
            match = re.search(r"VmHWM:\s+(\d+) kB", self._status.read_text())
            if match:
                return int(match.group(1)) * 1024
        return self._proc.memory_info().rss


RSS_GROWTH = "RSS growth"
CUDA_PEAK = "CUDA peak allocated"


@dataclasses.dataclass
class PhasePeak:
    """Peak bytes in one phase: zerolite's tensors, the process (``kind``: RSS growth, or
    CUDA peak allocated on the model's device), and every live tensor storage on the
    model's device type (``tensors``: 0 when not measured)."""

    zerolite: int = 0
    process: int = 0
    kind: str = RSS_GROWTH
    tensors: int = 0


class MemoryTracker:
    """Collects `PhasePeak`s; see `track`."""

    def __init__(self, opt: ShardedOptimizer | None, *, tensors: bool = True) -> None:
        self.opt: ShardedOptimizer | None = None
        # Live tensor bytes (`zerolite.memory.live`), entered by `track`; None: not measured.
        self.live: LiveTensorBytes | None = LiveTensorBytes() if tensors else None
        self.peaks = {phase: PhasePeak() for phase in PHASES}
        self.phase: str | None = None
        self.staging = 0  # bytes of checkpoint staging areas (host), the most seen
        # The tracked model's buffer device (None until attached: RSS is measured).
        self.device: torch.device | None = None
        self._phase_device: torch.device | None = None  # the accelerator this phase measures
        self._device_high = 0  # max_memory_allocated(device) when this phase began
        self._resident = _ResidentPeak()
        self._rss0 = psutil.Process().memory_info().rss
        self._handles: list[Any] = []
        if opt is not None:
            self.attach(opt)

    def attach(self, opt: ShardedOptimizer) -> None:
        """Attribute ``opt``'s model's forwards and backwards and ``opt``'s steps."""
        require_sharded_optimizer(opt, "track()")
        self.opt = opt
        _latest[opt] = self.peaks
        self.device = opt.group.buffer_device
        model = opt.model
        hooks = self._handles
        if model is not None:
            # Forwards recomputed inside backward (activation checkpointing) stay in backward.
            # First among the model's hooks: stage 3's gather of the root unit is forward.
            hooks.append(
                model.register_forward_pre_hook(
                    lambda *a: (
                        None if torch._C._current_graph_task_id() != -1 else self.enter("forward")
                    ),
                    prepend=True,
                )
            )
            hooks.append(model.register_forward_hook(self._watch_outputs))
            for module in model.modules():
                hooks.append(module.register_forward_pre_hook(lambda *a: self.sample()))
                hooks.append(module.register_forward_hook(lambda *a: self.sample()))
            for p in model.parameters():
                if p.requires_grad:
                    hooks.append(p.register_post_accumulate_grad_hook(self.on_gradient))
        hooks.append(opt.register_step_pre_hook(lambda *a: self.enter("step")))
        hooks.append(opt.register_step_post_hook(lambda *a: self.sample()))

    def _watch_outputs(self, module: torch.nn.Module, args: object, output: object) -> None:
        """Backward begins when a gradient reaches the model's outputs."""
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        self.enter("backward")

    def built(self, opt: ShardedOptimizer) -> None:
        if self.opt is None:
            self.attach(opt)

    @property
    def on_accelerator(self) -> bool:
        """Whether the tracked model lives on an accelerator such as a CUDA GPU (its phases
        measure the device's allocator)."""
        return self.device is not None and runtime.is_accelerator(self.device)

    def enter(self, phase: str, device: torch.device | None = None) -> None:
        """Begin ``phase``; ``device``: the buffers' device of the model it concerns, used
        until a model is attached (a build or load announced by zerolite)."""
        if phase == self.phase:
            return
        self.sample()
        measured = self.device if self.device is not None else device
        on_device = measured is not None and runtime.is_accelerator(measured)
        self._phase_device = measured if on_device else None
        if self._phase_device is not None:  # the user's peak counters are left alone
            self._device_high = runtime.max_memory_allocated(self._phase_device)
        else:
            self._resident.reset()
        self.phase = phase
        self.peaks[phase].kind = CUDA_PEAK if self._phase_device is not None else RSS_GROWTH
        if self.live is not None:
            self.live.reset_peak()
        self.sample()

    def sample(self, held_bytes: int | None = None) -> None:
        if self.phase is None:
            return
        peak = self.peaks[self.phase]
        if held_bytes is None and self.opt is not None:
            held_bytes = footprint(self.opt).total
        staged = staging_bytes()
        self.staging = max(self.staging, staged)
        if self.phase == "staging":
            held_bytes = (held_bytes or 0) + staged
        peak.zerolite = max(peak.zerolite, held_bytes or 0)
        if self.live is not None:
            peak.tensors = max(peak.tensors, self.live.peak(self.device_type))
        device = self._phase_device
        if device is not None:
            high = runtime.max_memory_allocated(device)
            now = runtime.memory_allocated(device)
            peak.process = max(peak.process, now, high if high > self._device_high else 0)
        else:
            peak.process = max(peak.process, self._resident.read() - self._rss0)

    def on_gradient(self, param: torch.Tensor) -> None:
        self.enter("backward")
        self.sample()

    @property
    def device_type(self) -> str:
        """The device type whose live tensors are measured: the tracked model's (CPU before
        a model is attached)."""
        return "cpu" if self.device is None else self.device.type

    @property
    def peak(self) -> int:
        """The peak of live tensor bytes over the training phases (forward, backward,
        step); 0 when tensors are not measured."""
        return step_peak(self.peaks)[0]

    @property
    def peak_phase(self) -> str:
        """The training phase where `peak` was reached."""
        return step_peak(self.peaks)[1]

    @property
    def offloaded(self) -> int:
        """Bytes the attached optimizer keeps on its offload tier (0 without one)."""
        tier = None if self.opt is None else self.opt.shard_state.offload
        return 0 if tier is None else tier.arena_bytes

    def close(self) -> None:
        self.sample()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __str__(self) -> str:
        rows = [
            f"{'phase':10s} {'zerolite MB':>12s} {'tensors MB':>12s} {'process MB':>12s}  "
            "process measured as"
        ]
        for phase, p in self.peaks.items():
            rows.append(
                f"{phase:10s} {p.zerolite / 1e6:12.2f} {p.tensors / 1e6:12.2f} "
                f"{p.process / 1e6:12.2f}  {p.kind}"
            )
        if self.staging:
            rows.append(f"checkpoint staging area (host, held between saves): "
                        f"{self.staging / 1e6:.2f} MB")
        tier = None if self.opt is None else self.opt.shard_state.offload
        if tier is not None:
            rows.append(f"{offload_label(tier.plan.tier)}: {self.offloaded / 1e6:.2f} MB")
        return "\n".join(rows)


@contextlib.contextmanager
def track(opt: ShardedOptimizer | None = None, *, tensors: bool = True) -> Iterator[MemoryTracker]:
    """Record this rank's peak memory per phase (see the module docstring).

    Local to this rank (no communication). ``tensors=False``: no live tensor bytes (no
    dispatch mode in the block). Examples::

        with zerolite.memory.track(opt) as t:
            loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        print(t)  # peaks per phase

        with zerolite.memory.track() as t:  # building and loading
            opt = zerolite.shard(meta_model, opt, ZeroConfig(stage=3))
            zerolite.checkpoint.load_pretrained(meta_model, "model.safetensors")
        t.peaks["build"].process, t.peaks["load"].process
    """
    tracker = MemoryTracker(opt, tensors=tensors)
    try:
        with phase_events.observe(tracker), tracker.live or contextlib.nullcontext():
            yield tracker
    finally:
        tracker.close()
