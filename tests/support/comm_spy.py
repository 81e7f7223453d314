"""A pass-through spy on ``torch.distributed``: counts communication without mocking it.

`CommSpy` records each call (name, elements, calling zerolite collective, phase, peers)
and calls the real function, so the ranks still communicate over their real gloo groups.
`link_elements` (`link_bytes`) splits what a rank sends by link (within its node, across
nodes).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from typing_extensions import Self

__all__ = ["CommSpy", "exchanges", "link_bytes", "link_elements", "peers"]

_SPIED = (
    "isend", "irecv", "send", "recv", "batch_isend_irecv",
    "all_reduce", "broadcast", "reduce", "barrier",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "gather", "scatter", "broadcast_object_list",
)


_P2P = ("isend", "irecv", "send", "recv")


def peers(name: str, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The global ranks a call talks to: the peer of a point-to-point call, else every rank
    of its group (the default group when none is given)."""
    if name in _P2P:
        peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
        return (int(peer),) if peer is not None else ()
    group = kwargs.get("group")
    if group is None and name in ("all_reduce", "broadcast") and len(args) > 2:
        group = args[2]  # (tensor, op or src, group, ...)
    if not dist.is_initialized():
        return ()
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def link_elements(events, node_size: int) -> dict[str, float]:
    """Elements this rank sends, by link: ``"within"`` its node (global ranks in blocks of
    ``node_size``) and ``"across"`` nodes, plus ``"control"`` for all-reduces of integer
    flags (the step's agreement). A point-to-point send counts its elements on its link; an
    all-reduce of n elements over R ranks counts 2 (R-1)/R n (what a ring sends per rank),
    across nodes when its group spans more than one node."""
    return _by_link(events, node_size, 1)


def link_bytes(events, node_size: int) -> dict[str, float]:
    """`link_elements` in bytes on the wire (a quantized message counts its bytes)."""
    return _by_link(events, node_size, 6)


def _by_link(events, node_size: int, field: int) -> dict[str, float]:
    me = dist.get_rank()
    node = me // node_size
    out = {"within": 0.0, "across": 0.0, "control": 0.0}
    for event in events:
        name, ranks, dtype, amount = event[0], event[4], event[5], event[field]
        if name == "isend":
            out["within" if ranks[0] // node_size == node else "across"] += amount
        elif name == "all_reduce" and len(ranks) > 1:
            sent = 2 * (len(ranks) - 1) / len(ranks) * amount
            if dtype is not None and not dtype.is_floating_point:
                out["control"] += sent
            else:
                out["across" if {p // node_size for p in ranks} != {node} else "within"] += sent
    return out


def exchanges(events, node_size: int) -> dict[str, dict]:
    """What this rank sent, by ``"caller/link"`` (``link`` is ``within`` or ``across`` nodes of
    ``node_size`` consecutive global ranks): ``{"bytes": bytes on the wire, "dtypes": sorted
    dtype names}``. ``caller`` is `CommSpy`'s (zerolite's own all-reduces are ``all_reduce``,
    a test's are named by the test's function). Point-to-point sends count by their peer's
    node; float all-reduces of more than one rank count their tensor's bytes once, by whether
    their group spans nodes (integer all-reduces are control flags and are left out). With
    ``node_size`` = the world size everything is ``within``."""
    me = dist.get_rank() // node_size
    out: dict[str, dict] = {}
    for name, _, caller, _, ranks, dtype, nbytes in events:
        if name == "isend" and ranks:
            link = "within" if ranks[0] // node_size == me else "across"
        elif name == "all_reduce" and len(ranks) > 1 and dtype is not None and (
            dtype.is_floating_point
        ):
            link = "within" if {p // node_size for p in ranks} == {me} else "across"
        else:
            continue
        entry = out.setdefault(f"{caller}/{link}", {"bytes": 0, "dtypes": set()})
        entry["bytes"] += nbytes
        entry["dtypes"].add(str(dtype).removeprefix("torch."))
    return {k: {"bytes": v["bytes"], "dtypes": sorted(v["dtypes"])} for k, v in out.items()}


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

    Each event is ``(name, elements, caller, phase, peers, dtype, nbytes)``: ``peers`` as
    `peers`, ``dtype`` the tensor's (None for a call without one), ``nbytes`` what the call
    carries on the wire (elements times their size; a quantized exchange's uint8 message
    counts its bytes). ``caller`` says which
    collective a call belongs to: on gloo zerolite builds reduce-scatter and all-gather from
    ``isend``/``irecv``, so for those the stack is searched for the nearest function whose
    name contains ``reduce_scatter`` or ``all_gather`` (``"reduce_scatter"`` /
    ``"all_gather"``); otherwise it is the name of the function that called into
    ``torch.distributed``. ``phase`` is whatever the test set in ``spy.phase`` at the time.

    zerolite's gloo path looks these up on the module at call time (``dist.isend``), so
    the wrappers see every call. (The NCCL path binds ``reduce_scatter_single`` at import
    and would not be seen; these tests run on gloo.)
    """

    def __init__(self) -> None:
        self.events: list[tuple] = []
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
            dtype = t.dtype if isinstance(t, torch.Tensor) else None
            nbytes = numel * t.element_size() if isinstance(t, torch.Tensor) else 0
            self.events.append(
                (name, numel, caller, self.phase, peers(name, args, kwargs), dtype, nbytes)
            )
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
        return sum(e[6] for e in self.select(**kw))

