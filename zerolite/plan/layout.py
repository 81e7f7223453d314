"""Index math of a padded flat buffer: pure Python, no tensors, no torch.distributed.

A flat buffer packs parameters end to end, then pads the total up to a multiple of the
world size ``N`` so that it splits into ``N`` equal, contiguous shards::

    |  p0  |    p1    | p2 |pad|          padded_numel = N * shard_numel
    |  rank 0 shard  |  rank 1 shard |     padding <= N - 1 elements

With ``owners`` (``ZeroConfig.partition="tensor"``, see `zerolite.plan.owners`; at stage 3
the buffer is a unit's) each parameter lies whole in its owner's shard instead: parameters
are ordered by owner, shard ``r`` is exactly rank ``r``'s parameters (uneven, possibly
empty), and nothing is padded::

    |  p0 (rank 0)  | p1 (rank 0) |  p2 (rank 2)  |     rank 1's shard is empty

Everything that must agree across ranks (which elements a rank owns, which piece of
which parameter that is) is computed here, once, from sizes alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["FlatLayout", "Span", "size_partition"]


@dataclasses.dataclass(frozen=True)
class Span:
    """Where a piece lies: the part of one parameter that falls into one rank's shard.

    Attributes:
        index: the parameter's position in the layout.
        param_start: first element of the piece in the flattened parameter.
        shard_start: where the piece starts inside the rank's shard.
        numel: number of elements (> 0).
    """

    index: int
    param_start: int
    shard_start: int
    numel: int

    @property
    def param_end(self) -> int:
        return self.param_start + self.numel


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Offsets of parameters of the given sizes in a flat buffer padded for ``world_size``.

    Args:
        numels: element count of each parameter, in buffer order (each >= 1).
        world_size: number of shards ``N`` (>= 1).
        owners: per parameter, the rank whose shard holds it whole (non-decreasing);
            None for equal, padded shards.
    """

    numels: tuple[int, ...]
    world_size: int
    owners: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if any(n < 1 for n in self.numels):
            raise ValueError(f"every parameter needs >= 1 element, got numels={self.numels}")
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)
        if self.owners is not None:
            owners = self.owners
            if len(owners) != len(self.numels) or any(
                not 0 <= o < self.world_size for o in owners
            ) or list(owners) != sorted(owners):
                raise ValueError(
                    f"owners must give each of {len(self.numels)} parameters a rank in "
                    f"[0, {self.world_size}), in non-decreasing order; got {owners}"
                )
            sizes = [0] * self.world_size
            for o, n in zip(owners, self.numels):
                sizes[o] += n
            object.__setattr__(self, "chunk_sizes", tuple(sizes))

    offsets: tuple[int, ...] = dataclasses.field(init=False)
    numel: int = dataclasses.field(init=False)  # sum of numels, without padding
    # With owners: elements of each rank's shard; None for equal shards.
    chunk_sizes: tuple[int, ...] | None = dataclasses.field(init=False, default=None)

    @property
    def shard_numel(self) -> int:
        """Elements per rank: ceil(numel / N); with owners, the largest rank's."""
        if self.chunk_sizes is not None:
            return max(self.chunk_sizes)
        return -(-self.numel // self.world_size)

    def shard_size(self, rank: int) -> int:
        """Elements of ``rank``'s shard."""
        lo, hi = self.shard_range(rank)
        return hi - lo

    @property
    def padded_numel(self) -> int:
        if self.chunk_sizes is not None:
            return self.numel
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        """Padding elements at the end of the buffer, 0 <= padding <= N - 1."""
        return self.padded_numel - self.numel

    def param_range(self, index: int) -> tuple[int, int]:
        """[start, end) of parameter ``index`` in the buffer."""
        start = self.offsets[index]
        return start, start + self.numels[index]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of ``rank``'s shard in the buffer (it may cover padding)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        if self.chunk_sizes is not None:
            start = sum(self.chunk_sizes[:rank])
            return start, start + self.chunk_sizes[rank]
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def spans(self, rank: int) -> list[Span]:
        """The span of every piece of ``rank``'s shard (each non-empty intersection of a
        parameter with it), in buffer order."""
        lo, hi = self.shard_range(rank)
        out = []
        for index, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(lo, offset), min(hi, offset + n)
            if start < end:
                out.append(Span(index, start - offset, start - lo, end - start))
        return out


def size_partition(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Split item indices, in order, into consecutive runs of total size <= ``capacity``.

    An item larger than ``capacity`` gets a run of its own; no run is empty.

    Args:
        sizes: size of each item (bytes, elements: any unit shared with ``capacity``).
        capacity: the most a run may hold (> 0).
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    runs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size > capacity:
            runs.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        runs.append(current)
    return runs
