"""Which exchanges `shard()` quantizes, and how (``ZeroConfig.quantize_*``).

`describe_quantization` validates ``quantize_skip`` against the model and returns the
lines every rank must agree on (run inside `shard()`'s agreement, before anything
changes); `install_quantization` gives each flat buffer its gather `WireFormat` and each
gradient bucket its reduce `WireFormat` and error-feedback residual, and with hybrid
sharding the wire and residual of its cross-node step (`zerolite.comm.quantized_replicas`).

Nothing is quantized at world size 1 (nothing travels).
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.comm.codec import WireFormat
from zerolite.comm.collectives import Group
from zerolite.comm.quantized_replicas import replica_residual_shape, replica_wire
from zerolite.config import ZeroConfig
from zerolite.grads.bucket import GradBucket
from zerolite.params.flat_buffer import FlatParamBuffer

__all__ = ["describe_quantization", "install_quantization", "residual_numel"]


def describe_quantization(config: ZeroConfig, model: nn.Module, partition: str) -> list[str]:
    """The quantization settings as agreement lines ([] when nothing is quantized).

    Raises:
        ValueError: a ``quantize_skip`` name is not a parameter of ``model``; whole-tensor
            ownership (``partition == "tensor"``) was asked for too.
    """
    if not config.quantizes:
        return []
    if partition == "tensor":
        # Owned tensors travel in uneven per-owner chunks, which the block codec's
        # equal-chunk messages do not cover.
        raise ValueError(
            "ZeroConfig.quantize_gather / quantize_reduce work with partition='flat' only; "
            "this model uses whole-tensor ownership (partition='tensor', e.g. for Muon or "
            "Adafactor). Turn quantization off, or use an elementwise optimizer"
        )
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


def _raw_params(flat: FlatParamBuffer, config: ZeroConfig, skipped: set[int]) -> set[int]:
    """Indices of ``flat``'s parameters that travel unquantized."""
    return {
        i
        for i, p in enumerate(flat.params)
        if p.numel() < config.quant_block or id(p) in skipped
    }


def install_quantization(
    model: nn.Module,
    config: ZeroConfig,
    group: Group,
    flats: list[FlatParamBuffer],
    buckets: list[GradBucket],
) -> None:
    """Attach wire formats (and residuals) to ``flats`` (every gathered buffer, frozen ones
    included) and ``buckets``: the shard group's exchanges, and with hybrid sharding the
    gradient shards' cross-node step (`zerolite.comm.quantized_replicas`). Local; every rank
    computes the same formats as the ranks it exchanges with."""
    replicas = group.replicas.size if group.replicas is not None else 1
    if not config.quantizes or (group.size == 1 and replicas == 1):
        return
    named = dict(model.named_parameters(remove_duplicate=False))
    skipped = {id(named[n]) for n in config.quantize_skip}
    block = config.quant_block
    if config.quantize_gather and group.size > 1:
        for flat in flats:
            raw = _raw_params(flat, config, skipped)
            flat.gather_wire = WireFormat(flat.layout, raw, flat.data.dtype, block)
    if not config.quantize_reduce:
        return
    for bucket in buckets:
        layout, device = bucket.flat.layout, bucket.flat.data.device
        raw = _raw_params(bucket.flat, config, skipped)
        if group.size > 1:
            bucket.wire = WireFormat(layout, raw, bucket.shard_dtype, block)
            if config.error_feedback:
                bucket.residual = torch.zeros(
                    (group.size - 1, layout.shard_numel), dtype=torch.float32, device=device
                )
        if replicas > 1:
            bucket.replica_wire = replica_wire(
                layout, group.rank, replicas, raw, bucket.shard_dtype, block
            )
            if config.error_feedback:
                bucket.replica_residual = torch.zeros(
                    replica_residual_shape(layout.shard_numel, replicas),
                    dtype=torch.float32, device=device,
                )


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
    rows, piece = replica_residual_shape(shard_numel, replicas)
    return within + (rows * piece if replicas > 1 else 0)
