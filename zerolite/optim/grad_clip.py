"""The true global gradient norm over all ranks' shards, and clipping by it.

Each rank holds only its shard of the reduced gradients, so a local norm (what
``torch.nn.utils.clip_grad_norm_(model.parameters())`` computes) is wrong under
sharding. Every element lives in exactly one rank's shard (tied parameters are stored
once, padding is not read), so the ranks' partial sums of ``|g|^p`` make the norm of the
full gradient. They are added in one order fixed by the parameters alone ([Note: norm
tree] in `zerolite.plan.norm_tree`), so the norm, and the clipped step, are bitwise the
same at every stage, bucket size and partition; the ``inf`` norm is a maximum, exact in
any order. One small all-gather per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from zerolite.comm.collectives import Group
from zerolite.comm.small_collectives import small_collective
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.plan.norm_tree import (
    RADIX,
    CombineProgram,
    Level,
    LocalProgram,
    PieceRange,
    norm_programs,
)

__all__ = ["GradNorm", "clip_coefficient"]

_WHAT = "clip_grad_norm_'s all-gather of the norm's partial sums"


class GradNorm:
    """The global gradient norm of one sharded model's buckets.

    Args:
        flats: the trained flat buffers, in bucket order (their layouts over ``group``).
        group: the group that shards them; every rank of it must call `__call__` together.
    """

    def __init__(self, flats: Sequence[FlatParamBuffer], group: Group) -> None:
        self.group = group
        names = sorted({name for flat in flats for name in flat.names})
        canonical = {name: q for q, name in enumerate(names)}
        numels = [0] * len(names)
        ranks: list[list[list[PieceRange]]] = [[] for _ in range(group.size)]
        for flat in flats:
            for i, name in enumerate(flat.names):
                numels[canonical[name]] = flat.layout.numels[i]
            for r in range(group.size):
                ranks[r].append([
                    PieceRange(canonical[flat.names[s.index]], flat.layout.numels[s.index],
                               s.param_start, s.param_end, s.shard_start)
                    for s in flat.layout.spans(r)
                ])
        programs, self.combine = norm_programs(ranks, numels)
        self.local: LocalProgram = programs[group.rank]

    def __call__(self, shards: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of every rank's ``shards`` together.

        Args:
            shards: this rank's reduced gradient shard of each bucket, in bucket order
                (1-D, any float dtype).
            norm_type: p > 0, or ``math.inf``.
        Returns:
            0-dim fp32 tensor on the CPU, the same on every rank.
        """
        p = float(norm_type)
        if len(shards) != len(self.local.first):
            raise RuntimeError(
                f"{self.group.prefix()} the gradient norm got {len(shards)} shards for "
                f"{len(self.local.first)} buckets"
            )
        if not (p > 0):
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
        device = shards[0].device if shards else torch.device("cpu")
        if math.isinf(p):
            local = torch.zeros((), dtype=torch.float32, device=device)
            for s in shards:
                if s.numel():
                    local = torch.maximum(local, s.detach().abs().max().float())
            return small_collective(local, self.group, "max", what=_WHAT)
        sent = _local_sums(self.local, shards, p, device)
        wire = torch.zeros(self.combine.width, dtype=torch.float32, device=device)
        wire[: sent.numel()] = sent
        gathered = small_collective(wire, self.group, "all_gather", what=_WHAT)
        return _combine(self.combine, gathered.reshape(-1)) ** (1.0 / p)


def _local_sums(
    program: LocalProgram, shards: Sequence[torch.Tensor], p: float, device: torch.device
) -> torch.Tensor:
    """The values this rank sends (`LocalProgram.nodes` order), fp32 on ``device``."""
    out: list[torch.Tensor] = []
    totals = []
    for level, shard in zip(program.first, shards):
        workspace = _fill(level, shard.detach(), device)
        if p == 2.0:
            workspace.mul_(workspace)
        else:
            workspace.abs_().pow_(p)
        totals.append(_halve(workspace, level, out))
    source = torch.cat(totals) if totals else torch.zeros(0, device=device)
    for level in program.upper:
        out.append(source[list(level.roots)])
        source = _halve(_fill(level, source, device), level, out)
    return torch.cat(out) if out else torch.zeros(0, device=device)


def _fill(level: Level, source: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``(rows, RADIX)`` fp32: the level's values where its copies put them, zero elsewhere."""
    workspace = torch.empty((level.rows, RADIX), dtype=torch.float32, device=device)
    flat = workspace.view(-1)
    for start, end in level.gaps:
        flat[start:end].zero_()
    for start, at, count in level.copies:
        flat[at : at + count].copy_(source[start : start + count])
    return workspace


def _halve(workspace: torch.Tensor, level: Level, out: list[torch.Tensor]) -> torch.Tensor:
    """Halve the rows 8 times, sending the level's picks on the way; the row totals."""
    current = workspace
    for picks in level.picks:
        if picks:
            out.append(current.reshape(-1)[list(picks)])
        current = current[:, 0::2] + current[:, 1::2]
    return current.reshape(-1)


def _combine(program: CombineProgram, gathered: torch.Tensor) -> torch.Tensor:
    """The sum of every parameter's tree from the gathered values (CPU), then the pairwise
    sum of the roots: 0-dim fp32."""
    table = torch.zeros(program.size, dtype=torch.float32)
    table[: gathered.numel()] = gathered
    for dst, left, right in program.adds:
        table[list(dst)] = table[list(left)] + table[list(right)]
    roots = table[list(program.roots)]
    width = 1
    while width < roots.numel():
        width *= 2
    current = torch.zeros(width, dtype=torch.float32)
    current[: roots.numel()] = roots
    while current.numel() > 1:
        current = current[0::2] + current[1::2]
    return current.reshape(())


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
