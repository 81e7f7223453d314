"""A pass-through spy on ``torch.distributed``: counts communication without mocking it.

`CommSpy` records each call (name, elements, calling zerolite collective, phase) and
calls the real function, so the ranks still communicate over their real gloo groups.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from typing_extensions import Self

__all__ = ["CommSpy"]

_SPIED = (
    "isend", "irecv", "send", "recv", "batch_isend_irecv",
    "all_reduce", "broadcast", "reduce", "barrier",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "gather", "scatter", "broadcast_object_list",
)


def _origin(frame) -> str:
    first = frame.f_code.co_name
    for _ in range(8):
        if frame is None:
            break
        name = frame.f_code.co_name
        for kind in ("reduce_scatter", "all_gather"):
            if kind in name:
                return kind
        frame = frame.f_back
    return first


class CommSpy:
    """Wraps ``torch.distributed`` functions with recorders that call straight through.

    Each event is ``(name, elements, caller, phase, nbytes)``: ``nbytes`` is what the call
    carries on the wire (elements times their size; a quantized exchange's uint8 message
    counts its bytes). ``caller`` says which collective a
    call belongs to: on gloo zerolite builds reduce-scatter and all-gather from
    ``isend``/``irecv``, so for those the stack is searched for the nearest function whose
    name contains ``reduce_scatter`` or ``all_gather`` (``"reduce_scatter"`` /
    ``"all_gather"``); otherwise it is the name of the function that called into
    ``torch.distributed``. ``phase`` is whatever the test set in ``spy.phase`` at the time.

    zerolite's gloo path looks these up on the module at call time (``dist.isend``), so
    the wrappers see every call. (The NCCL path binds ``reduce_scatter_single`` at import
    and would not be seen; these tests run on gloo.)
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str, object, int]] = []
        self.phase: object = None
        self._saved: dict[str, object] = {}

    def __enter__(self) -> Self:
        for name in _SPIED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            caller = _origin(sys._getframe(1))
            t = args[0] if args else kwargs.get("tensor")
            numel = t.numel() if isinstance(t, torch.Tensor) else 0
            nbytes = numel * t.element_size() if isinstance(t, torch.Tensor) else 0
            self.events.append((name, numel, caller, self.phase, nbytes))
            return fn(*args, **kwargs)

        return spy

    def select(self, name=None, caller=None, phase=None, since=0):
        return [
            e for e in self.events[since:]
            if (name is None or e[0] == name) and (caller is None or e[2] == caller)
            and (phase is None or e[3] == phase)
        ]

    def calls(self, **kw) -> int:
        return len(self.select(**kw))

    def elements(self, **kw) -> int:
        return sum(e[1] for e in self.select(**kw))

    def nbytes(self, **kw) -> int:
        """Bytes the selected calls carry (their first tensor's)."""
        return sum(e[4] for e in self.select(**kw))

