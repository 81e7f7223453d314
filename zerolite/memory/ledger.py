"""The ledger of a simulated step: every storage allocated, resized and freed, by category.

`zerolite.memory.fake_step` hands the ledger each storage an operation returns; the ledger
keeps a weak reference to it (its callback records the free) and logs one event per
allocation, resize and free. The live total after each event is what the rank would hold
at that moment, so the peak of a phase is the largest total seen in it, and what it was
made of is found by replaying the log up to that event (`StorageLedger.breakdown_at`).

[Note: categories] Each storage gets a category when it appears, from the code that
allocated it: the innermost frame of zerolite (its folder says what the bytes are for),
of ``torch.optim`` (the optimizer's temporaries) or of ``torch.utils.checkpoint``
(recomputed activations); with none of those, the phase decides (the forward's
allocations are activations, the backward's are its temporaries). Storages that outlive
the simulation are then named by what holds them (`StorageLedger.rename`): the
parameters, gradient buffers, masters and optimizer state of the sharded model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from collections.abc import Iterable
from types import CodeType

import torch

__all__ = ["CATEGORIES", "PHASES", "LimitPassed", "StorageLedger"]

CATEGORIES: dict[str, str] = {
    "params": "parameter storage: flat buffers or their shards, other parameters, buffers",
    "grads": "gradients kept between steps: stage 1's full buffers, gradient shards",
    "master": "fp32 master shards (16-bit parameters)",
    "optimizer_state": "the optimizer's state (moments, step counters)",
    "residual": "error-feedback residuals of quantized reduce-scatters",
    "activations": "what the forward allocates and keeps for backward (recomputed ones too)",
    "backward": "what backward allocates: gradients of activations, and of parameters "
    "before zerolite moves them into a bucket",
    "gathered": "stage 3's gathered units (full parameters)",
    "buckets": "gradients on their way into this rank's shard",
    "communication": "receive buffers, quantized wires and small collectives",
    "clipping": "gradient clipping and loss-scaling temporaries",
    "optimizer_temporaries": "the optimizer's own temporaries, and 16-bit gradients upcast "
    "to fp32 for it",
    "offload": "the streamed step's staging buffers, and a host tier's arena",
    "inputs": "the batch",
    "other": "anything else",
}
"""The categories of `PeakPrediction.breakdown`: name -> what its bytes are."""

# The phases of a training step, in order; "build" (making the model and shard()) is logged
# too but is not part of a step.
PHASES = ("forward", "backward", "step")


class LimitPassed(BaseException):
    """The live bytes passed the ledger's ``stop_above`` in a step phase ([Note: stopped
    simulation] in `zerolite.memory.predict`). A `BaseException`, so that no ``except
    Exception`` of the code simulated turns it into an error of its own."""


_PHASE_CATEGORY = {
    "build": "params", "inputs": "inputs", "forward": "activations", "backward": "backward",
}

_ARENA = "arena"  # a host tier's arena: "offload", or not counted for a disk tier

# Innermost-first rules for frames in zerolite's own files (paths relative to the
# package); the first prefix that matches names the category. None: look further out.
_ZEROLITE_RULES: tuple[tuple[str, str | None], ...] = (
    ("memory/", None),  # the simulation itself
    ("comm/", "communication"),
    ("grads/", "buckets"),
    ("params/unit_scheduler.py", "gathered"),
    ("gathered.py", "gathered"),
    ("params/", "params"),
    ("state/master.py", "master"),
    ("state/arena.py", _ARENA),
    ("state/", "offload"),
    ("optim/streamed_step.py", "offload"),
    ("optim/grad_clip.py", "clipping"),
    ("optim/loss_scale.py", "clipping"),
    ("optim/", "optimizer_temporaries"),
)
_TORCH_RULES: tuple[tuple[str, str], ...] = (
    ("optim/", "optimizer_temporaries"),
    ("utils/checkpoint.py", "activations"),
)
_ZEROLITE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_USER = "user"  # a frame outside torch and zerolite: the phase decides


def _frame_rule(code: CodeType) -> str | None:
    """The category a frame of ``code`` gives, `_USER`, or None (look further out)."""
    path = os.path.abspath(code.co_filename)
    for root, rules in ((_ZEROLITE, _ZEROLITE_RULES), (_TORCH, _TORCH_RULES)):
        if path.startswith(root):
            relative = path[len(root):].replace(os.sep, "/")
            return next((c for prefix, c in rules if relative.startswith(prefix)), None)
    return _USER


@dataclasses.dataclass
class _Record:
    nbytes: int
    category: str
    storage: weakref.ref


class StorageLedger:
    """Live storages of one simulated run on one device type (`fake_step` feeds it).

    Args:
        device_type: the compute device's type; storages elsewhere are not counted.
        arena_resident: whether an offload tier's arena is memory of this device (a host
            tier of a CPU model); a disk tier is simulated by a host arena that is not.
        granularity: each storage counts its bytes rounded up to a multiple of this (the
            CUDA caching allocator hands out multiples of 512 bytes).
        stop_above: bytes; an allocation that takes the live total above it in a phase of
            `PHASES` raises `LimitPassed` once it is logged (None: never).
    """

    def __init__(
        self, device_type: str, *, arena_resident: bool = True, granularity: int = 1,
        stop_above: int | None = None,
    ) -> None:
        self.device_type = device_type
        self.arena_resident = arena_resident
        self.granularity = granularity
        self.stop_above = stop_above
        self.phase = "build"
        self.total = 0
        # Per phase: (largest total, index of the event that reached it).
        self.peaks: dict[str, tuple[int, int]] = {}
        # Activations alone: their live bytes and the most of them at once (what `plan`
        # uses as a floor for other configurations: [Note: activation floor]).
        self.activations = 0
        self.activations_peak = 0
        # (serial, bytes, category, opened) in order; a serial is one storage at one size.
        self.events: list[tuple[int, int, str, bool]] = []
        self._records: dict[int, _Record] = {}  # serial -> live record
        self._serial_of: dict[int, int] = {}  # storage._cdata -> serial, while alive
        self._rule_of: dict[CodeType, str | None] = {}

    def enter(self, phase: str) -> None:
        """The simulated step enters ``phase`` (``"forward"``, ``"backward"``, ``"step"``)."""
        self.phase = phase

    # -- what fake_step reports --------------------------------------------------------
    def saw(self, tensor: torch.Tensor) -> None:
        """``tensor`` came out of an operation: count its storage if it is new."""
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        if storage._cdata in self._serial_of:
            return
        self._open(storage, self._site())

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place (stage 3 frees and regrows gathered units)."""
        serial = self._serial_of.get(storage._cdata)
        if serial is None:
            return
        old = self._records.pop(serial)
        self._log(serial, old.nbytes, old.category, opened=False)
        del self._serial_of[storage._cdata]
        # Growing back is a unit being gathered, whatever code called resize_.
        self._open(storage, "gathered" if storage.nbytes() else old.category)

    def _open(self, storage: torch.UntypedStorage, category: str) -> None:
        if category == _ARENA:
            if not self.arena_resident:
                return
            category = "offload"
        serial = len(self.events)
        cdata = storage._cdata
        nbytes = -(-storage.nbytes() // self.granularity) * self.granularity

        def freed(_: object, serial: int = serial, cdata: int = cdata) -> None:
            record = self._records.pop(serial, None)
            if record is not None:
                self._serial_of.pop(cdata, None)
                self._log(serial, record.nbytes, record.category, opened=False)

        self._records[serial] = _Record(nbytes, category, weakref.ref(storage, freed))
        self._serial_of[cdata] = serial
        self._log(serial, nbytes, category, opened=True)

    def _log(self, serial: int, nbytes: int, category: str, *, opened: bool) -> None:
        self.events.append((serial, nbytes, category, opened))
        self.total += nbytes if opened else -nbytes
        if category == "activations":
            self.activations += nbytes if opened else -nbytes
            self.activations_peak = max(self.activations_peak, self.activations)
        best = self.peaks.get(self.phase)
        if best is None or self.total > best[0]:
            self.peaks[self.phase] = (self.total, len(self.events) - 1)
            if (opened and self.stop_above is not None and self.total > self.stop_above
                    and self.phase in PHASES):
                raise LimitPassed

    def _site(self) -> str:
        """[Note: categories]: the category of an allocation made now."""
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            rule = self._rule_of.get(code, "?")
            if rule == "?":
                rule = self._rule_of[code] = _frame_rule(code)
            if rule == _USER:
                break
            if rule is not None:
                return rule
            frame = frame.f_back
        return _PHASE_CATEGORY.get(self.phase, "other")

    # -- reading it back ---------------------------------------------------------------
    def rename(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        """Storages of ``tensors`` still alive now belong to ``category`` (the events stay:
        `breakdown_at` applies the names)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                serial = self._serial_of.get(t.untyped_storage()._cdata)
                if serial is not None:
                    self._records[serial].category = category

    def breakdown_at(self, index: int) -> dict[str, int]:
        """Bytes per category alive right after event ``index``; they sum to the total then."""
        live: dict[int, tuple[int, str]] = {}
        for serial, nbytes, category, opened in self.events[: index + 1]:
            if opened:
                live[serial] = (nbytes, category)
            else:
                live.pop(serial, None)
        out: dict[str, int] = {}
        for serial, (nbytes, category) in live.items():
            record = self._records.get(serial)  # renamed if it is still alive
            name = record.category if record is not None else category
            out[name] = out.get(name, 0) + nbytes
        return {c: out[c] for c in CATEGORIES if out.get(c)}
