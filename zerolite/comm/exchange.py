"""The exchange of one flat buffer: how its bytes cross ranks, in both directions.

[Note: exchanges] Every flat buffer gets one exchange object at `shard()`
(`exchange_for`), and the choice is never made again: the gradient bucket calls its
`Exchange.reduce_scatter` (each rank's full gradient buffer in, this rank's averaged chunk
out) and the flat buffer its `Exchange.all_gather` (this rank's chunk in, every rank's
chunks out). A variant is a class, not a branch at the call sites:

- `Exchange`: equal chunks in full precision (`zerolite.comm.collectives`);
- `OwnedExchange`: uneven chunks, each the parameters one rank owns whole
  (``partition="tensor"``, `zerolite.comm.owned`);
- `QuantizedExchange`: int8 blocks in either direction or both (`zerolite.comm.quantized`),
  holding the reduce direction's error-feedback residual;
- `QuantizedOwnedExchange`: the same for uneven owned chunks, one message per owner
  (`zerolite.comm.quantized_owned`);
- `ReplicaStep`: hybrid sharding. It wraps the shard group's exchange and, once that
  reduce-scatter lands, averages this rank's chunk across its replica group
  (`zerolite.comm.hybrid`); `QuantizedReplicaStep` does so in int8 blocks
  (`zerolite.comm.quantized_replicas`), holding that step's own residual.

Each exchange also holds its tag keys ([Note: lockstep] in `zerolite.comm.collectives`):
``2 * index`` for the reduce-scatter (and its replica step), ``2 * index + 1`` for the
all-gather, so that ranks out of step can only pair messages of the same buffer and
direction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerolite.comm.codec import WireFormat
from zerolite.comm.collectives import Group, Pending, all_gather_inplace, reduce_scatter_avg
from zerolite.comm.hybrid import average_across_replicas
from zerolite.comm.owned import gather_from_owners, reduce_to_owners
from zerolite.comm.quantized import quantized_all_gather, quantized_reduce_scatter_avg
from zerolite.comm.quantized_owned import quantized_gather_from_owners, quantized_reduce_to_owners
from zerolite.comm.quantized_replicas import quantized_average_across_replicas

__all__ = [
    "Exchange",
    "OwnedExchange",
    "QuantizedExchange",
    "QuantizedOwnedExchange",
    "QuantizedReplicaStep",
    "ReplicaStep",
    "exchange_for",
]


class Exchange:
    """How flat buffer ``index`` travels over ``group``: equal chunks, full precision.

    Every rank of ``group`` calls each method with equally sized buffers, in the same order
    relative to zerolite's other exchanges; both launch and return a `Pending`.

    Attributes:
        group: the group that shards the buffer.
        index: the buffer's index among the model's flat buffers.
        reduce_key, gather_key: the tag keys of the two directions.
        residual: the reduce-scatter's error-feedback residual (`QuantizedExchange`), else
            None.
        replica_residual: the replica step's (`QuantizedReplicaStep`), else None.
    """

    residual: torch.Tensor | None = None
    replica_residual: torch.Tensor | None = None

    def __init__(self, group: Group, index: int) -> None:
        self.group = group
        self.index = index
        self.reduce_key = 2 * index
        self.gather_key = 2 * index + 1

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, *, what: str) -> Pending:
        """Launch: ``out`` (1-D, this rank's chunk) = the mean over ranks of their ``full``'s
        chunk ``rank`` (see `zerolite.comm.collectives.reduce_scatter_avg`)."""
        return reduce_scatter_avg(full, out, self.group, key=self.reduce_key, what=what)

    def all_gather(self, full: torch.Tensor, *, what: str) -> Pending:
        """Launch: every rank's chunk ``rank`` of ``full`` into all ranks' ``full`` (see
        `zerolite.comm.collectives.all_gather_inplace`)."""
        return all_gather_inplace(full, self.group, key=self.gather_key, what=what)

    @property
    def residuals(self) -> list[torch.Tensor]:
        """Every error-feedback residual this exchange keeps (fp32): the reduce-scatter's,
        then the replica step's."""
        return [r for r in (self.residual, self.replica_residual) if r is not None]


class OwnedExchange(Exchange):
    """Uneven chunks: chunk ``r`` is what rank ``r`` owns whole (``sizes[r]`` elements,
    possibly 0), reduced to and gathered from its owner (`zerolite.comm.owned`)."""

    def __init__(self, group: Group, index: int, sizes: Sequence[int]) -> None:
        super().__init__(group, index)
        self.sizes = tuple(sizes)

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, *, what: str) -> Pending:
        return reduce_to_owners(full, out, self.sizes, self.group, key=self.reduce_key, what=what)

    def all_gather(self, full: torch.Tensor, *, what: str) -> Pending:
        return gather_from_owners(full, self.sizes, self.group, key=self.gather_key, what=what)


class QuantizedExchange(Exchange):
    """Equal chunks as int8 blocks (`zerolite.comm.codec`) in the directions that have a
    wire, in full precision in the other.

    Args:
        group, index: as `Exchange`.
        gather_wire: how the all-gather's chunks travel (raw elements in the buffer's dtype),
            or None.
        reduce_wire: how the reduce-scatter's chunks travel (raw elements in the gradients'
            reduce dtype), or None.
        error_feedback: keep the reduce-scatter's residual, ``(N - 1, S)`` fp32 on
            ``device``, ``S`` the largest chunk (row order:
            `zerolite.comm.quantized.residual_chunks`).
    """

    def __init__(
        self,
        group: Group,
        index: int,
        *,
        gather_wire: WireFormat | None,
        reduce_wire: WireFormat | None,
        error_feedback: bool,
        device: torch.device,
    ) -> None:
        super().__init__(group, index)
        self.gather_wire = gather_wire
        self.reduce_wire = reduce_wire
        if reduce_wire is not None and error_feedback:
            shard = max(c.numel for c in reduce_wire.chunks)
            self.residual = torch.zeros(
                (group.size - 1, shard), dtype=torch.float32, device=device
            )

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, *, what: str) -> Pending:
        if self.reduce_wire is None:
            return super().reduce_scatter(full, out, what=what)
        return quantized_reduce_scatter_avg(
            full, out, self.reduce_wire, self.residual, self.group, key=self.reduce_key,
            what=what,
        )

    def all_gather(self, full: torch.Tensor, *, what: str) -> Pending:
        if self.gather_wire is None:
            return super().all_gather(full, what=what)
        return quantized_all_gather(
            full, self.gather_wire, self.group, key=self.gather_key, what=what
        )


class QuantizedOwnedExchange(QuantizedExchange):
    """Uneven owned chunks (``sizes[r]`` elements each, as `OwnedExchange`) as int8 blocks,
    one message per owner, in the directions that have a wire (`zerolite.comm.quantized_owned`);
    each wire has one codec of ``sizes[r]`` elements per rank."""

    def __init__(self, group: Group, index: int, sizes: Sequence[int], **wires) -> None:
        super().__init__(group, index, **wires)
        self.sizes = tuple(sizes)

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, *, what: str) -> Pending:
        if self.reduce_wire is None:
            return reduce_to_owners(
                full, out, self.sizes, self.group, key=self.reduce_key, what=what
            )
        return quantized_reduce_to_owners(
            full, out, self.sizes, self.reduce_wire, self.residual, self.group,
            key=self.reduce_key, what=what,
        )

    def all_gather(self, full: torch.Tensor, *, what: str) -> Pending:
        if self.gather_wire is None:
            return gather_from_owners(
                full, self.sizes, self.group, key=self.gather_key, what=what
            )
        return quantized_gather_from_owners(
            full, self.sizes, self.gather_wire, self.group, key=self.gather_key, what=what
        )


class ReplicaStep(Exchange):
    """Hybrid sharding: ``inner`` (the shard group's exchange), then the mean of this rank's
    reduced chunk across ``inner.group.replicas``; all-gathers stay within the shard group."""

    def __init__(self, inner: Exchange) -> None:
        super().__init__(inner.group, inner.index)
        self.inner = inner

    @property
    def residual(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.inner.residual

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, *, what: str) -> Pending:
        inner = self.inner.reduce_scatter(full, out, what=what)
        return average_across_replicas(inner, out, self.group, key=self.reduce_key, what=what)

    def all_gather(self, full: torch.Tensor, *, what: str) -> Pending:
        return self.inner.all_gather(full, what=what)


class QuantizedReplicaStep(ReplicaStep):
    """`ReplicaStep` whose mean across replicas travels as int8 blocks in two phases.

    Args:
        inner: the shard group's exchange.
        wire: how this rank's shard crosses the replica group, in ``R`` parts
            (`zerolite.plan.quantization.replica_wire`).
        error_feedback: keep the step's residual, ``(R, C)`` fp32 on ``device`` (row
            order: `zerolite.comm.quantized_replicas.replica_residual_rows`).
    """

    def __init__(
        self, inner: Exchange, wire: WireFormat, *, error_feedback: bool, device: torch.device
    ) -> None:
        super().__init__(inner)
        self.wire = wire
        if error_feedback:
            rows, part = len(wire.chunks), wire.chunks[0].numel
            self.replica_residual = torch.zeros(
                (rows, part), dtype=torch.float32, device=device
            )

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, *, what: str) -> Pending:
        inner = self.inner.reduce_scatter(full, out, what=what)
        return quantized_average_across_replicas(
            inner, out, self.wire, self.replica_residual, self.group, key=self.reduce_key,
            what=what,
        )


def exchange_for(
    group: Group,
    index: int,
    *,
    device: torch.device,
    owner_sizes: Sequence[int] | None = None,
    gather_wire: WireFormat | None = None,
    reduce_wire: WireFormat | None = None,
    replica_wire: WireFormat | None = None,
    error_feedback: bool = False,
) -> Exchange:
    """The exchange of flat buffer ``index``, chosen once (by `zerolite.shard`).

    Args:
        group: the group that shards the buffer (with its replica group, when hybrid).
        index: the buffer's index.
        device: where the buffer (and so any residual) lives.
        owner_sizes: per rank, the elements it owns whole (``partition="tensor"``); None for
            equal chunks.
        gather_wire, reduce_wire, replica_wire: the int8 formats of the directions that are
            quantized (`zerolite.plan.quantization.buffer_wires`); None: full precision.
        error_feedback: keep the quantized reduce directions' residuals.
    """
    exchange: Exchange
    quantized = gather_wire is not None or reduce_wire is not None
    wires = dict(gather_wire=gather_wire, reduce_wire=reduce_wire,
                 error_feedback=error_feedback, device=device)
    if owner_sizes is not None and quantized:
        exchange = QuantizedOwnedExchange(group, index, owner_sizes, **wires)
    elif owner_sizes is not None:
        exchange = OwnedExchange(group, index, owner_sizes)
    elif quantized:
        exchange = QuantizedExchange(group, index, **wires)
    else:
        exchange = Exchange(group, index)
    if group.replicas is None or group.replicas.size == 1:
        return exchange
    if replica_wire is not None:
        return QuantizedReplicaStep(
            exchange, replica_wire, error_feedback=error_feedback, device=device
        )
    return ReplicaStep(exchange)
