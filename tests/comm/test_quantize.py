"""The block quantizer, the wire format and the quantization settings, in one process.

- Round trip: every element of a finite block comes back within max|block| / 254 (half a
  step of the int8 grid; fp32 rounding allowed for), whatever the block's magnitude.
- Zeros come back as exact zeros; a block holding a NaN or an infinity comes back as NaN
  in every element (never finite: a non-finite gradient cannot vanish), its neighbours
  unaffected.
- The wire format: skipped parameters travel raw and exact, the message sizes are what
  the format says, and every chunk's message has the same size.
- `ZeroConfig`'s fields, environment variables and refusals; the formula's residual bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerolite import ZeroConfig
from zerolite.comm.codec import ChunkCodec, dequantize_blocks, quantize_blocks
from zerolite.memory import formula
from zerolite.plan.layout import FlatLayout
from zerolite.plan.quantization import wire_format

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

BLOCK = 64


def _round_trip(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    codes, scales = quantize_blocks(x, block)
    assert codes.dtype == torch.int8 and codes.numel() == x.numel()
    assert scales.dtype == torch.float32 and scales.numel() == -(-x.numel() // block)
    return dequantize_blocks(codes, scales, block)


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_half_a_step_per_block(numel: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(numel)
    # Blocks of very different magnitudes: each must be bounded by its own maximum.
    x = torch.randn(numel, generator=g)
    x *= 10.0 ** torch.randint(-6, 4, (numel,), generator=g).repeat_interleave(BLOCK)[:numel]
    x = x.to(dtype)
    back = _round_trip(x)
    for start in range(0, numel, BLOCK):
        block = x[start : start + BLOCK].float()
        # Half a step, plus fp32's rounding of x / s and of codes * s at max|x|.
        bound = block.abs().max().item() * (1 / 254 + 4 * 2.0**-24)
        err = (back[start : start + BLOCK] - block).abs().max().item()
        assert err <= bound, (start, err, bound)
    if numel > 2:  # the test means something: elements other than the extremes move
        assert (back != x.float()).any()


def test_extremes_of_a_block_are_exact() -> None:
    x = torch.tensor([3.0, -3.0, 1.5, 0.0])
    assert _round_trip(x)[[0, 1, 3]].tolist() == [3.0, -3.0, 0.0]


def test_zeros_come_back_as_zeros() -> None:
    x = torch.zeros(3 * BLOCK)
    x[2 * BLOCK + 5] = 1.0
    codes, scales = quantize_blocks(x, BLOCK)
    assert scales[:2].tolist() == [0.0, 0.0]
    back = dequantize_blocks(codes, scales, BLOCK)
    assert torch.equal(back[: 2 * BLOCK], torch.zeros(2 * BLOCK))
    assert back[2 * BLOCK + 5].item() == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_makes_its_whole_block_nan(bad: float) -> None:
    x = torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(1))
    x[BLOCK + 7] = bad
    back = _round_trip(x)
    assert torch.isnan(back[BLOCK : 2 * BLOCK]).all()
    # Neighbouring blocks are unaffected.
    assert torch.isfinite(back[:BLOCK]).all() and torch.isfinite(back[2 * BLOCK :]).all()
    assert (back[:BLOCK] - x[:BLOCK]).abs().max() <= x[:BLOCK].abs().max() * (1 / 254 + 1e-6)


def test_dequantize_writes_into_a_16_bit_output() -> None:
    x = torch.randn(100)
    codes, scales = quantize_blocks(x, BLOCK)
    out = torch.empty(100, dtype=torch.bfloat16)
    dequantize_blocks(codes, scales, BLOCK, out=out)
    assert torch.equal(out, dequantize_blocks(codes, scales, BLOCK).bfloat16())


def test_chunk_codec_sends_raw_ranges_exactly() -> None:
    codec = ChunkCodec(300, [(10, 20), (250, 300)], torch.bfloat16, BLOCK)
    assert codec.quantized == [(0, 10), (20, 250)]
    assert codec.codes_numel == 240 and codec.blocks == 4
    assert codec.nbytes == 4 * 4 + 60 * 2 + 240
    chunk = torch.randn(300).bfloat16()
    message = torch.empty(codec.nbytes, dtype=torch.uint8)
    codec.encode(chunk, message)
    out = torch.empty(300, dtype=torch.bfloat16)
    codec.decode(message, out)
    assert torch.equal(out[10:20], chunk[10:20]) and torch.equal(out[250:], chunk[250:])
    quantized = torch.cat([chunk[:10], chunk[20:250]]).float()
    back = torch.cat([out[:10], out[20:250]]).float()
    assert (back - quantized).abs().max() <= quantized.abs().max() / 254 * 1.01 + 1e-2


def test_wire_format_skips_small_parameters_and_pads_messages_equally() -> None:
    # Params of 500, 10 (raw: under a block) and 300 elements over 2 ranks: shards of 405.
    layout = FlatLayout((500, 10, 300), 2)
    wire = wire_format(layout, {1}, torch.float32, BLOCK)
    first, second = wire.chunks
    assert first.raw == [] and second.raw == [(95, 105)]
    assert first.nbytes == 4 * 7 + 405
    assert second.nbytes == 4 * 7 + 10 * 4 + 395
    assert wire.message_bytes == 4 * 7 + 10 * 4 + 395 + 1  # rounded up to 4 bytes
    assert wire.messages(torch.device("cpu")).shape == (2, wire.message_bytes)


def test_config_fields_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ZeroConfig()
    assert (config.quantize_gather, config.quantize_reduce, config.quant_block) == (
        False, False, 256
    )
    assert config.quantize_skip == () and config.error_feedback is True
    assert not config.quantizes
    monkeypatch.setenv("ZEROLITE_QUANTIZE_GATHER", "1")
    monkeypatch.setenv("ZEROLITE_QUANTIZE_REDUCE", "true")
    monkeypatch.setenv("ZEROLITE_QUANT_BLOCK", "128")
    monkeypatch.setenv("ZEROLITE_QUANTIZE_SKIP", "head.weight, blocks.0.ln1.weight")
    monkeypatch.setenv("ZEROLITE_ERROR_FEEDBACK", "0")
    config = ZeroConfig()
    assert config.quantize_gather and config.quantize_reduce and config.quantizes
    assert config.quant_block == 128 and config.error_feedback is False
    assert config.quantize_skip == ("head.weight", "blocks.0.ln1.weight")
    assert ZeroConfig(quant_block=512).quant_block == 512  # an argument beats the variable


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"quant_block": 8}, "quant_block"),
        ({"quant_block": 64.0}, "quant_block"),
        ({"quant_block": True}, "quant_block"),
        ({"quantize_gather": 1}, "quantize_gather"),
        ({"quantize_reduce": "yes"}, "quantize_reduce"),
        ({"error_feedback": None}, "error_feedback"),
        ({"quantize_skip": "head.weight"}, "quantize_skip"),
        ({"quantize_skip": ("",)}, "quantize_skip"),
        ({"quantize_gather": True, "param_dtype": torch.float16}, "quantize_gather"),
        ({"quantize_reduce": True, "param_dtype": torch.float16}, "quantize_reduce"),
        ({"quantize_reduce": True, "reduce_dtype": torch.float16}, "quantize_reduce"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"ZeroConfig.{field}"):
        ZeroConfig(**kwargs)


def test_bad_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROLITE_QUANTIZE_GATHER", "maybe")
    with pytest.raises(ValueError, match="ZeroConfig.quantize_gather"):
        ZeroConfig()


def test_formula_counts_the_residual_and_the_fp32_master_copy() -> None:
    plain = formula(1000, world_size=4, stage=2)
    fed = formula(1000, world_size=4, stage=2, error_feedback=True)
    assert fed.residual == 4 * 1000 * 3 // 4 and plain.residual == 0
    assert fed.model_states == plain.model_states + fed.residual
    assert formula(1000, world_size=4, stage=2, quantize_gather=True).master == 1000
    assert formula(1000, world_size=4, stage=3, quantize_gather=True).master == 0


def test_formula_counts_the_cross_node_residual_of_hybrid_sharding() -> None:
    # k = 2 of 4: 4 (k-1)/k within the shard group, 4/k for the cross-node step.
    hybrid = formula(1000, world_size=4, stage=2, error_feedback=True, shard_group_size=2)
    assert hybrid.residual == 4 * 1000 // 2 + 4 * 1000 // 2
    # k = 1: nothing within, the whole gradient crosses; k = N: no cross-node step.
    assert formula(1000, world_size=4, stage=2, error_feedback=True,
                   shard_group_size=1).residual == 4 * 1000
    assert formula(1000, world_size=4, stage=2, error_feedback=True,
                   shard_group_size=4).residual == 4 * 1000 * 3 // 4
    assert formula(1000, world_size=4, stage=2, quantize_gather=True,
                   shard_group_size=2).master == 4 * 1000 // 2
    assert formula(1000, world_size=4, stage=2, quantize_gather=True,
                   shard_group_size=1).master == 0


def test_a_chunk_of_raw_elements_only_travels_exactly() -> None:
    codec = ChunkCodec(10, [(0, 10)], torch.float32, BLOCK)
    assert codec.blocks == 0 and codec.nbytes == 40
    chunk, out = torch.randn(10), torch.empty(10)
    message = torch.empty(codec.nbytes, dtype=torch.uint8)
    codec.encode(chunk, message)
    codec.decode(message, out)
    assert torch.equal(out, chunk)
