"""Error-feedback residuals at load: exact in the saved setup, folded onto any other.

What a residual is, per parameter element ``x``: every data-parallel rank that sends its
contribution to ``x``'s owner quantized holds what quantization lost of it
(`zerolite.comm.quantized`), and adds it to its next contribution. The owner divides the
sum of the ``W`` contributions by ``W``, so what is still owed to the mean gradient at
``x`` -- the only thing the optimizer ever sees -- is ``M(x) = sum_r w * e_r(x)``, each
residual weighted by how its exchange scales it: ``1/W`` for the shard group's
reduce-scatter (flat or hybrid: a hybrid shard group's mean is averaged again across the
``R`` replicas), ``1/R`` for phase 1 of hybrid's cross-node step (a mean over replicas),
``1`` for phase 2 (every replica decodes the reduced part itself;
`zerolite.comm.quantized_replicas`).

The rule. Each saved residual is keyed by its element range and by the data-parallel rank
``s`` that held it (file ``r``, replica ``q``: ``s = q k + r``). At load, rank ``t`` of
``W'`` ranks fills each residual range it holds from the saved ranks *linked* to it:
``s = t (mod m)`` with ``m = min(W, W')``, each saved rank's share split evenly over the
ranks it is linked to (one when the world shrinks: ranks fold onto ``s mod W'``; several
when it grows: ``s`` is repeated on ``s + W``, ``s + 2W``, ...). A value moves from one
weight to another (``1/W`` to ``1/W'``, a cross-node part to the shard group's
reduce-scatter) scaled so that its share of ``M(x)`` is unchanged. A rank that owns ``x``
in a flat partition sends it exact and holds no residual for it: its share goes to the next
rank of its shard group. So every saved residual lands, scaled, in exactly one range per
share, and ``M(x)`` is the saved one up to fp32 rounding of the sums (accumulated in
fp64, rounded once).

What is kept exactly: at the saved setup every range is filled from its own rank with
factor 1 and nothing else lands there, so a resumed run continues bit for bit; at the
same world size under another bucket size, stage or partition, every rank keeps its own
residuals wherever it still sends ``x`` (only the ranges whose owner changed gain the
new owner's). What is redistributed: across world sizes and shard groups, the ranks'
residuals are summed or repeated as above. Nothing is dropped while the new setup has a
quantized reduce with error feedback; at world size 1, or with ``quantize_reduce`` off,
nothing is exchanged quantized any more and there is nowhere to carry ``M(x)``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zerolite.checkpoint.residuals import ResidualRange, replica_of, residual_ranges
from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["apply_residuals", "links", "read_residuals"]

# residual/{name}/{a}-{b}, residual@replica{q}/{name}/{a}-{b},
# residual-across@replica{q}/{send|gather}/{name}/{a}-{b}
_KEY = re.compile(
    r"^(?:residual/|residual@replica(?P<q>\d+)/|"
    r"residual-across@replica(?P<qa>\d+)/(?P<phase>send|gather)/)"
    r"(?P<name>.+)/(?P<start>\d+)-(?P<end>\d+)$"
)


def links(target: int, world: int, saved_world: int) -> list[tuple[int, Fraction]]:
    """(saved data-parallel rank, share of its residuals) that rank ``target`` of ``world``
    receives from a save at ``saved_world`` ranks (the rule in the module docstring)."""
    m = min(world, saved_world)
    return [
        (s, Fraction(1, len(range(s % m, world, m)))) for s in range(target % m, saved_world, m)
    ]


class _Setup:
    """The weights of a setup's residual kinds in the mean gradient."""

    def __init__(self, shard_size: int, replicas: int) -> None:
        self.world = shard_size * replicas
        self.weights = {
            "inner": Fraction(1, self.world), "send": Fraction(1, replicas), "gather": Fraction(1)
        }


class _SavedResiduals:
    """A checkpoint's residual ranges, by (saved data-parallel rank, parameter name)."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        shard_size = index["world_size"]
        self.setup = _Setup(shard_size, index.get("replicas", 1))
        self.ranges: dict[tuple[int, str], list[tuple[str, int, int, Path, str]]] = (
            defaultdict(list)
        )
        for entry in index["files"]:
            file = path / entry["file"]
            with safe_open(file, framework="pt") as f:
                keys = list(f.keys())
            for key in keys:
                if (match := _KEY.match(key)) is None:
                    continue
                replica = int(match["q"] or match["qa"] or 0)
                kind = match["phase"] or "inner"
                source = replica * shard_size + entry["rank"]
                start, end = int(match["start"]), int(match["end"])
                self.ranges[(source, match["name"])].append((kind, start, end, file, key))

    def add_into(
        self, out: torch.Tensor, source: int, held: ResidualRange, scale: Fraction, weight: Fraction
    ) -> None:
        """``out`` (fp64, the range's length) += ``source``'s saved residuals on the range's
        elements, each times ``scale`` and its kind's weight over ``weight`` (the range's)."""
        for kind, start, end, file, key in self.ranges.get((source, held.name), ()):
            lo, hi = max(held.start, start), min(held.end, end)
            if lo >= hi:
                continue
            factor = float(scale * self.setup.weights[kind] / weight)
            with safe_open(file, framework="pt") as f:
                values = f.get_slice(key)[lo - start : hi - start]
            out[lo - held.start : hi - held.start].add_(values.double(), alpha=factor)


def read_residuals(
    path: Path, index: dict[str, Any], opt: ShardedOptimizer
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target view, values) for every residual range of ``opt`` on this rank, from the
    checkpoint at ``path`` under any setup (the rule in the module docstring; zeros where
    the checkpoint holds none, e.g. saved without ``quantize_reduce``). Reads only."""
    mine = list(residual_ranges(opt, replica_of(opt)))
    if not mine:
        return []
    saved = _SavedResiduals(path, index)
    group = opt.group
    world, rank = group.world.size, group.world.rank
    here = _Setup(group.size, world // group.size)
    first = rank - group.rank  # the world rank of this shard group's rank 0
    pairs = []
    for held in mine:
        holders = [rank]
        owner_next = (held.chunk + 1) % group.size == group.rank
        if held.kind == "inner" and not held.crossed and owner_next:
            holders.append(first + held.chunk)  # the owner holds none for its own chunk
        out = torch.zeros(held.end - held.start, dtype=torch.float64)
        for holder in holders:
            for source, share in links(holder, world, saved.setup.world):
                saved.add_into(out, source, held, share, here.weights[held.kind])
        pairs.append((held.view, out.float()))
    return pairs


def apply_residuals(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write what `read_residuals` returned (after every rank has read successfully)."""
    for target, values in pairs:
        target.copy_(values)
