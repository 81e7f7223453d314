"""Which exchanges `shard()` quantizes, and how (``ZeroConfig.quantize_*``).

`describe_quantization` validates ``quantize_skip`` against the model and returns the
lines every rank must agree on (run inside `shard()`'s agreement, before anything
changes). `buffer_wires` decides, per flat buffer, the int8 formats (`WireFormat`) of the
directions that are quantized: the all-gather (``quantize_gather``, every buffer, frozen
ones included), the reduce-scatter and, with hybrid sharding, the cross-node step
(``quantize_reduce``, trained buffers). `zerolite.comm.exchange.exchange_for` then builds
each buffer's exchange with them. In every format the elements of *raw* parameters travel
unquantized: parameters of fewer than ``quant_block`` elements, and those named in
``quantize_skip``.

Nothing is quantized at world size 1 (nothing travels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from zerolite.comm.codec import ChunkCodec, WireFormat
from zerolite.comm.quantized_replicas import replica_residual_shape
from zerolite.config import ZeroConfig
from zerolite.plan.layout import FlatLayout

__all__ = [
    "Wires",
    "buffer_wires",
    "describe_quantization",
    "raw_ranges",
    "replica_wire",
    "residual_numel",
    "skipped_parameters",
    "wire_format",
]


def describe_quantization(config: ZeroConfig, model: nn.Module) -> list[str]:
    """The quantization settings as agreement lines ([] when nothing is quantized).

    Raises:
        ValueError: a ``quantize_skip`` name is not a parameter of ``model``.
    """
    if not config.quantizes:
        return []
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unknown = [n for n in config.quantize_skip if n not in names]
    if unknown:
        raise ValueError(
            f"ZeroConfig.quantize_skip: {unknown[:5]} are not parameters of the model; use "
            "names as model.named_parameters() spells them (e.g. 'blocks.0.attn.weight')"
        )
    return [
        f"quantize: gather={config.quantize_gather} reduce={config.quantize_reduce} "
        f"block={config.quant_block} error_feedback={config.error_feedback} "
        f"skip={sorted(config.quantize_skip)}"
    ]


@dataclasses.dataclass(frozen=True)
class Wires:
    """How one flat buffer's directions travel: a `WireFormat` each, None for full precision.

    Attributes:
        gather: the all-gather's (raw elements in ``param_dtype``).
        reduce: the reduce-scatter's (raw elements in the gradients' reduce dtype).
        replica: hybrid sharding's cross-node step (`replica_wire`).
        error_feedback: keep residuals of the quantized reduce directions.
    """

    gather: WireFormat | None = None
    reduce: WireFormat | None = None
    replica: WireFormat | None = None
    error_feedback: bool = False


def skipped_parameters(model: nn.Module, config: ZeroConfig) -> set[int]:
    """``id()`` of the parameters ``config.quantize_skip`` names (checked by
    `describe_quantization`)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    return {id(named[n]) for n in config.quantize_skip}


def buffer_wires(
    params: Sequence[nn.Parameter],
    layout: FlatLayout,
    config: ZeroConfig,
    *,
    trained: bool,
    skipped: set[int],
    shard_rank: int,
    replicas: int,
) -> Wires:
    """The int8 formats of one flat buffer's exchange.

    Args:
        params: the buffer's parameters, in buffer order.
        layout: the buffer's layout over the ranks that shard it.
        config: ``quantize_gather``, ``quantize_reduce``, ``quant_block``,
            ``error_feedback``, the dtypes.
        trained: the buffer has gradients (frozen stage-3 buffers only all-gather).
        skipped: `skipped_parameters`.
        shard_rank: this rank in its shard group (the chunk its replica step carries).
        replicas: the replica groups (hybrid sharding), 1 when flat.
    """
    if not config.quantizes or (layout.world_size == 1 and replicas == 1):
        return Wires()
    block = config.quant_block
    raw = {i for i, p in enumerate(params) if p.numel() < block or id(p) in skipped}
    gather = None
    if config.quantize_gather and layout.world_size > 1:
        gather = wire_format(layout, raw, config.param_dtype, block)
    if not (trained and config.quantize_reduce):
        return Wires(gather=gather)
    reduce = None
    if layout.world_size > 1:
        reduce = wire_format(layout, raw, config.grad_dtype, block)
    replica = None
    if replicas > 1:
        replica = replica_wire(layout, shard_rank, replicas, raw, config.grad_dtype, block)
    return Wires(gather, reduce, replica, config.error_feedback)


def wire_format(
    layout: FlatLayout, raw_params: set[int], raw_dtype: torch.dtype, block: int
) -> WireFormat:
    """The messages of ``layout``'s ``N`` chunks, one codec per chunk of its own size.

    Args:
        layout: the flat buffer's layout: ``world_size`` chunks of ``shard_numel``, or,
            with owners (whole-tensor ownership), each rank's owned elements (uneven,
            possibly 0: each owner's message is quantized on its own, see
            `zerolite.comm.quantized_owned`).
        raw_params: indices (in the buffer) of the parameters that travel raw.
        raw_dtype: the dtype they travel in (the buffer's, or the gradients' reduce dtype).
        block: elements per quantization block.
    """
    return WireFormat([
        ChunkCodec(
            layout.shard_size(rank), raw_ranges(layout, rank, raw_params), raw_dtype, block
        )
        for rank in range(layout.world_size)
    ])


def replica_wire(
    layout: FlatLayout,
    shard_rank: int,
    replicas: int,
    raw_params: set[int],
    raw_dtype: torch.dtype,
    block: int,
) -> WireFormat:
    """How chunk ``shard_rank`` of ``layout`` crosses a replica group of ``replicas`` ranks:
    ``replicas`` parts of ``C = ceil(shard_numel / replicas)`` elements, one message each.
    Equal on every rank of the replica group (they hold the same ``shard_rank``)."""
    part = -(-layout.shard_numel // replicas)
    raw = raw_ranges(layout, shard_rank, raw_params)
    chunks = []
    for d in range(replicas):
        lo, hi = d * part, (d + 1) * part
        clipped = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in raw if s < hi and e > lo]
        chunks.append(ChunkCodec(part, clipped, raw_dtype, block))
    return WireFormat(chunks)


def raw_ranges(layout: FlatLayout, rank: int, raw_params: set[int]) -> list[tuple[int, int]]:
    """The element ranges of chunk ``rank`` of ``layout`` (chunk offsets, sorted, merged)
    that belong to the parameters ``raw_params`` (indices in the buffer)."""
    raw = [
        (pc.shard_start, pc.shard_start + pc.numel)
        for pc in layout.spans(rank)
        if pc.index in raw_params
    ]
    return _merged(raw)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def residual_numel(
    shard_numel: int, world_size: int, config: ZeroConfig, replicas: int = 1
) -> int:
    """Elements (fp32) of one bucket's error-feedback residuals (``quantize_reduce`` with
    ``error_feedback``, else 0): ``(N - 1) * shard_numel`` for the exchange within the
    ``N = world_size`` ranks that shard (at N > 1), plus, with hybrid sharding over
    ``replicas`` = R > 1 replica groups, ``R * ceil(shard_numel / R)`` for the cross-node
    step."""
    if not (config.quantize_reduce and config.error_feedback):
        return 0
    within = (world_size - 1) * shard_numel
    rows, part = replica_residual_shape(shard_numel, replicas)
    return within + (rows * part if replicas > 1 else 0)
