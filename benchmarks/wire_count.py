"""What a rank sends per step, counted by pass-through wrappers on torch.distributed.

`CommSpy` counts, per call kind, the elements one rank sends as a ring would (all-reduce
2(N-1)/N of the buffer, all-gather and reduce-scatter (N-1)/N, point-to-point what is
sent; received point-to-point elements are listed under ``irecv`` but are not bytes this
rank sends), the bytes those elements take (int8 blocks of a quantized exchange count one
byte each), and both split by link: ``"within"`` a node of ``node_size`` consecutive
ranks, or ``"across"`` nodes (a collective whose group spans nodes counts across in full:
an upper bound). Used by `step_time.py` and `quantized_accuracy.py`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from tests.support.comm_spy import peers

__all__ = ["CommSpy"]

SPIED = ("isend", "irecv", "all_reduce", "broadcast", "all_gather", "reduce_scatter_single",
         "all_gather_single", "reduce_scatter_tensor", "all_gather_into_tensor",
         "all_to_all_single")


def _sent(name: str, numel: int, n: int) -> float:
    """Elements one rank sends for a call whose first tensor has ``numel`` elements, over a
    group of ``n`` ranks, as a ring would (so that point-to-point and collective counts
    compare)."""
    if name == "all_reduce":
        return 2 * numel * (n - 1) / n
    # first arg: the output
    if name in ("all_gather", "all_gather_single", "all_gather_into_tensor",
                "all_to_all_single"):
        return numel * (n - 1) / n
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # first arg: this rank's output
        return numel * (n - 1)
    return numel  # isend, irecv (received), broadcast (per call)


class CommSpy:
    """Pass-through wrappers on torch.distributed functions counting elements per call kind,
    bytes on the wire (elements times their size: int8 blocks of a quantized exchange count
    one byte each), and elements per link (``"within"`` a node of ``node_size`` ranks,
    ``"across"`` nodes)."""

    def __init__(self, node_size: int) -> None:
        self.elements: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)
        self.links: dict[str, float] = {"within": 0.0, "across": 0.0}
        self.link_bytes: dict[str, float] = {"within": 0.0, "across": 0.0}
        self.node_size = node_size
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CommSpy:
        for name in SPIED:
            original = getattr(dist, name)
            self._saved[name] = original

            def spy(*args, _original=original, _name=name, **kwargs):
                tensor = args[0] if args else next(iter(kwargs.values()))
                if isinstance(tensor, torch.Tensor):
                    ranks = peers(_name, args, kwargs)
                    n = dist.get_world_size() if _name in ("isend", "irecv") else len(ranks)
                    sent = _sent(_name, tensor.numel(), n)
                    self.elements[_name] += sent
                    if _name != "irecv":  # what this rank sends (a receive is another's send)
                        self.bytes[_name] += sent * tensor.element_size()
                        nodes = {r // self.node_size for r in ranks}
                        mine = dist.get_rank() // self.node_size
                        link = "within" if nodes == {mine} else "across"
                        self.links[link] += sent
                        self.link_bytes[link] += sent * tensor.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
