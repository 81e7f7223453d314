"""The gradient norm's one summation order, whatever the layout: which partial sums each rank
computes and how every rank combines them.

[Note: norm tree] ``clip_grad_norm_`` sums ``|g|^p`` over every gradient element. How the
elements are split across ranks depends on the layout (the stage, the bucket size, the
partition, the world size), and a sum of local sums rounds differently for every split:
stage 3 and stage 1 clipped by coefficients one ulp apart, and so trained apart. Here the
order of the sum is fixed by the parameters alone:

- Each parameter's ``L`` elements (flattened, ``|g|^p`` in fp32) are the leaves of a binary
  tree of height ``8 * levels(L)``, padded with zeros: node ``(H, i)`` is the sum of
  elements ``[i * 2**H, (i + 1) * 2**H)``, computed as ``node(H-1, 2i) + node(H-1, 2i+1)``
  (a zero node adds nothing: ``x + 0 == x`` exactly). Its root is the parameter's sum.
- The total is the same pairwise sum over the parameters' roots, in the order of their
  names, padded with zeros to a power of two.

A rank computes every node whose elements it holds, 8 heights at a time: rows of 256 values
halved 8 times (``row[0::2] + row[1::2]``), which is that tree. Where a parameter is cut
between ranks, the rank sends its largest nodes below the cut (at most 8 per cut and per 8
heights) and every rank adds them up the tree in the same order after one small all-gather.
Every addition is the tree's, in the tree's order, so the norm is bitwise the same for
every layout of the same gradients; `LocalProgram` and `CombineProgram` say, from sizes
alone, what each rank computes and how the results are combined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["CombineProgram", "Level", "LocalProgram", "PieceRange", "RADIX", "norm_programs"]

RADIX_BITS = 8
RADIX = 1 << RADIX_BITS  # values per row: one row is halved RADIX_BITS times

Node = tuple[int, int, int]  # (parameter, height, index)


@dataclasses.dataclass(frozen=True)
class PieceRange:
    """A rank's piece of one parameter, as the norm sees it.

    Attributes:
        param: the parameter's position in the canonical (name) order.
        numel: elements of the whole parameter.
        start, end: the piece's element range in the flattened parameter.
        offset: where the piece starts in the rank's gradient shard of its bucket.
    """

    param: int
    numel: int
    start: int
    end: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Level:
    """8 heights of a rank's local work: ``rows`` rows of `RADIX` values, halved 8 times.

    Attributes:
        rows: rows of the workspace.
        copies: ``(source start, workspace start, count)``: values copied from the source
            vector (level 0: the bucket's gradient shard; above: the previous level's row
            totals) into the flattened workspace.
        gaps: ``(start, end)`` of the flattened workspace that no copy writes: zeros.
        roots: source indices whose values are whole parameters' roots (sent as they are).
        picks: per halving step ``h`` (0..7), flat indices into the ``(rows, RADIX >> h)``
            tensor whose values are sent: nodes below a cut.
    """

    rows: int
    copies: tuple[tuple[int, int, int], ...]
    gaps: tuple[tuple[int, int], ...]
    roots: tuple[int, ...]
    picks: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class LocalProgram:
    """What one rank computes: `Level` 0 per bucket (source: its gradient shard), then the
    levels above over every bucket at once (source: the level-0 row totals of every bucket,
    concatenated in bucket order). ``nodes`` names each value sent, in the order produced:
    per level, its roots, then its picks by ``h``."""

    first: tuple[Level, ...]
    upper: tuple[Level, ...]
    nodes: tuple[Node, ...]


@dataclasses.dataclass(frozen=True)
class CombineProgram:
    """How every rank turns the gathered values into the total, identically.

    The value table is every rank's payload (each padded to ``width``), rank after rank,
    then one zero, then the nodes computed here.

    Attributes:
        width: the payload length (the longest rank's).
        size: entries in the value table.
        adds: per height, ascending: ``(destinations, left, right)`` table indices.
        roots: the table index of each parameter's root, in canonical order.
    """

    width: int
    size: int
    adds: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    roots: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Walk:
    """A piece's local nodes at one level: ``[a, b)`` of the level's ``n`` nodes, the first at
    ``src`` in the level's source vector."""

    param: int
    n: int
    a: int
    b: int
    src: int


def levels(numel: int) -> int:
    """Radix levels of a parameter's tree (at least 1): its root is at height 8 * levels."""
    count, cap = 1, RADIX
    while cap < numel:
        cap, count = cap * RADIX, count + 1
    return count


def _dyadic(c0: int, c1: int) -> list[tuple[int, int]]:
    """``[c0, c1)`` as the largest aligned blocks: ``(h, p)`` covers ``[p << h, (p + 1) << h)``."""
    out, x = [], c0
    while x < c1:
        h = 0
        while h < RADIX_BITS and x % (2 << h) == 0 and x + (2 << h) <= c1:
            h += 1
        out.append((h, x >> h))
        x += 1 << h
    return out


def _level(walks: list[_Walk], height: int) -> tuple[Level, list[Node], list[_Walk]]:
    """One level of local work over ``walks`` at ``height`` (a multiple of 8)."""
    rows, copies, gaps, roots, root_nodes = 0, [], [], [], []
    picks: list[list[int]] = [[] for _ in range(RADIX_BITS)]
    pick_nodes: list[list[Node]] = [[] for _ in range(RADIX_BITS)]
    upward = []
    for w in walks:
        if height and w.n == 1:  # the whole parameter is here: its root
            roots.append(w.src)
            root_nodes.append((w.param, height, 0))
            continue
        j0, j1 = w.a // RADIX, -(-w.b // RADIX)
        at = rows * RADIX + w.a - j0 * RADIX
        copies.append((w.src, at, w.b - w.a))
        gaps += [(rows * RADIX, at), (at + w.b - w.a, (rows + j1 - j0) * RADIX)]
        full = []
        for j in sorted({j0, j1 - 1}):  # only the first and last rows can be cut
            c0 = max(w.a - j * RADIX, 0)
            c1 = RADIX if w.b == w.n and j == j1 - 1 else min(w.b - j * RADIX, RADIX)
            if c0 == 0 and c1 == RADIX:
                full.append(j)
                continue
            row = rows + j - j0
            for h, p in _dyadic(c0, c1):
                picks[h].append(row * (RADIX >> h) + p)
                pick_nodes[h].append((w.param, height + h, j * (RADIX >> h) + p))
        first = j0 if j0 in full else j0 + 1
        last = j1 - 1 if j1 - 1 in full else j1 - 2
        if first <= last:
            upward.append(_Walk(w.param, -(-w.n // RADIX), first, last + 1, rows + first - j0))
        rows += j1 - j0
    level = Level(
        rows, tuple(copies), tuple((a, b) for a, b in gaps if a < b), tuple(roots),
        tuple(tuple(p) for p in picks),
    )
    return level, root_nodes + [n for ns in pick_nodes for n in ns], upward


def local_program(buckets: Sequence[Sequence[PieceRange]]) -> LocalProgram:
    """What a rank holding ``buckets`` (per bucket, its pieces) computes and sends."""
    first, nodes, walks, base = [], [], [], 0
    for pieces in buckets:
        level, sent, up = _level(
            [_Walk(p.param, p.numel, p.start, p.end, p.offset) for p in pieces], 0
        )
        first.append(level)
        nodes += sent
        walks += [dataclasses.replace(w, src=w.src + base) for w in up]
        base += level.rows
    upper, height = [], RADIX_BITS
    while walks:
        level, sent, walks = _level(walks, height)
        upper.append(level)
        nodes += sent
        height += RADIX_BITS
    return LocalProgram(tuple(first), tuple(upper), tuple(nodes))


def combine_program(sent: Sequence[Sequence[Node]], numels: Sequence[int]) -> CombineProgram:
    """How the values ``sent`` by each rank (`LocalProgram.nodes`) make every parameter's root.

    Args:
        sent: per rank, the nodes it sends, in order.
        numels: elements of each parameter, in canonical order.
    """
    width = max((len(s) for s in sent), default=0)
    found = {node: r * width + k for r, nodes in enumerate(sent) for k, node in enumerate(nodes)}
    zero = len(sent) * width
    size = zero + 1
    adds: dict[int, list[tuple[int, int, int]]] = {}

    def node(q: int, h: int, i: int) -> int:
        nonlocal size
        if i << h >= numels[q]:
            return zero
        hit = found.get((q, h, i))
        if hit is not None:
            return hit
        if h == 0:
            raise RuntimeError(f"the norm tree misses element {i} of parameter {q}")
        left, right = node(q, h - 1, 2 * i), node(q, h - 1, 2 * i + 1)
        size += 1
        adds.setdefault(h, []).append((size - 1, left, right))
        return size - 1

    roots = tuple(node(q, RADIX_BITS * levels(n), 0) for q, n in enumerate(numels))
    by_height = tuple(
        tuple(tuple(column) for column in zip(*adds[h])) for h in sorted(adds)
    )
    return CombineProgram(width, size, by_height, roots)  # type: ignore[arg-type]


def norm_programs(
    ranks: Sequence[Sequence[Sequence[PieceRange]]], numels: Sequence[int]
) -> tuple[list[LocalProgram], CombineProgram]:
    """Every rank's `LocalProgram` and the shared `CombineProgram`.

    Args:
        ranks: per rank of the group that shards, per bucket, its pieces.
        numels: elements of each parameter, in canonical order.
    """
    local = [local_program(buckets) for buckets in ranks]
    return local, combine_program([p.nodes for p in local], numels)
