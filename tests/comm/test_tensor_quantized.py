"""Quantized collectives with whole-tensor ownership (``partition="tensor"`` with
``quantize_gather`` / ``quantize_reduce``), on real gloo groups of 2 ranks.

1. The exchanges themselves (`zerolite.comm.quantized_owned`), both collectives paths, for
   uneven owned chunks and for a rank that owns nothing: the gather leaves every rank, the
   owner included, with the same values, each within its block's bound (the flat bound:
   half a quantization step, `tests.comm.test_quantized_collectives._bound`), raw parameters
   exact; the reduce is within the bound of the exact mean, and error feedback makes the
   mean of repeated exchanges converge to it. On the point-to-point path every message
   is its owner's own size: ``4 ceil(q / B)`` scale bytes, ``4 r`` raw bytes and ``q``
   code bytes for ``q`` quantized and ``r`` raw fp32 elements, counted here from the
   chunk sizes alone, and nothing travels to or from an owner of nothing.
2. Training Muon + AdamW at stage 2 for 6 steps, fp32 and bf16, both switches on: within 1e-2 of the
   unquantized ``"tensor"`` run's per-step loss (as flat); each gather and reduce sends
   uint8 messages within the flat test's share of the unquantized bytes; residuals are
   non-zero and saved per parameter range (``residual/{name}/{start}-{end}``, each a
   whole tensor the other rank owns); every rank holds the same parameters; measured
   memory equals the estimate.
3. A checkpoint resume with the residuals continues bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.comm.test_quantized_collectives import _bound, _wire_ratio_bound
from tests.step.test_tensor_ownership import BUILDERS
from tests.support import parity
from tests.support.comm_spy import CommSpy, exchanges
from tests.support.loss_checks import worst_deviation
from zerolite import checkpoint as ckpt
from zerolite.checkpoint.residuals import residual_tensors
from zerolite.comm.collectives import Group
from zerolite.comm.quantized_owned import quantized_gather_from_owners, quantized_reduce_to_owners
from zerolite.plan.layout import FlatLayout
from zerolite.plan.quantization import wire_format
from zerolite.state.shard_state import state_of
from zerolite.testing import FootprintMismatch, assert_footprint, run_ranks

BLOCK = 64
TIMEOUT = 120.0
STEPS = 6
NUMELS = (700, 20, 300)  # the 20-element parameter travels raw (under a block)


def _message_bytes(q: int, raw: int) -> int:
    """A message of an owner's chunk: fp32 block scales, raw fp32 elements, int8 codes."""
    return 4 * -(-q // BLOCK) + 4 * raw + q if q + raw else 0


def _expected_bytes(owners: tuple[int, ...], rank: int) -> dict[str, int]:
    """What rank ``rank`` sends (point-to-point), from the chunk sizes alone: its own chunk
    to the other rank (gather), the other rank's chunk to its owner (reduce)."""
    q, raw = [0, 0], [0, 0]
    for numel, owner in zip(NUMELS, owners):
        if numel < BLOCK:
            raw[owner] += numel
        else:
            q[owner] += numel
    other = 1 - rank
    return {"gather": _message_bytes(q[rank], raw[rank]),
            "reduce": _message_bytes(q[other], raw[other])}


def _exchange_case(owners: tuple[int, ...], group: Group, out: dict) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    layout = FlatLayout(NUMELS, n, owners)
    sizes = list(layout.chunk_sizes)
    g = torch.Generator().manual_seed(rank)
    label = f"owners {owners}"
    wire = wire_format(layout, {1}, torch.float32, BLOCK)
    lo, hi = layout.shard_range(rank)
    full = torch.zeros(layout.numel)
    mine = torch.randn(hi - lo, generator=g) * (rank + 1)
    full[lo:hi] = mine
    with CommSpy() as spy:
        quantized_gather_from_owners(full, sizes, wire, group, key=1, what="gather").wait()
    sent = {"gather": spy.nbytes(name="isend")}
    copies = [torch.empty_like(full) for _ in range(n)]
    dist.all_gather(copies, full)
    raw_lo, raw_hi = layout.param_range(1)
    out[label] = {
        "identical": all(torch.equal(c, full) for c in copies),
        "within": bool(((full[lo:hi] - mine).abs() <= _bound(mine, wire.chunks[rank])).all())
        if hi > lo else True,
        "raw_exact": owners[1] != rank or torch.equal(
            full[raw_lo:raw_hi], mine[raw_lo - lo : raw_hi - lo]),
    }
    contribution = torch.randn(layout.numel, generator=g) * (rank + 1)
    everyone = [torch.empty_like(contribution) for _ in range(n)]
    dist.all_gather(everyone, contribution)
    exact = torch.stack(everyone).mean(dim=0)[lo:hi]
    codec = wire.chunks[rank]
    bound = sum(_bound(c[lo:hi], codec) for r, c in enumerate(everyone) if r != rank) / n \
        if hi > lo else torch.zeros(0)
    errors = {}
    for feedback in (False, True):
        residual = torch.zeros(n - 1, max(sizes)) if feedback else None
        total = torch.zeros(hi - lo)
        for step in range(20):
            got = torch.empty(hi - lo)
            with CommSpy() as spy:
                quantized_reduce_to_owners(
                    contribution, got, sizes, wire, residual, group, key=2, what="reduce"
                ).wait()
            sent["reduce"] = spy.nbytes(name="isend")
            out[label]["reduce_within"] = out[label].get("reduce_within", True) and bool(
                ((got - exact).abs() <= 2 * bound).all())
            total += got
        errors[feedback] = ((total / 20) - exact).abs().max().item() if hi > lo else None
    out[label]["errors"] = errors
    out[label]["sent"] = sent
    out[label]["expected"] = _expected_bytes(owners, rank)


def _exchanges(collectives: str) -> dict:
    group = Group(collectives=collectives)
    out: dict = {}
    for owners in ((0, 0, 1), (1, 1, 1)):  # uneven chunks; rank 0 owning nothing
        _exchange_case(owners, group, out)
    return out


def _rank(root: str) -> dict:
    """Everything, in one launch (each launch costs a process start)."""
    return {"exchanges": {c: _exchanges(c) for c in ("point_to_point", "native")},
            "training": _training(), "resume": _resume(root)}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    return run_ranks(_rank, 2, root, timeout=3 * TIMEOUT)


@pytest.mark.parametrize("collectives", ["point_to_point", "native"])
def test_quantized_owned_exchanges(reports, collectives: str) -> None:
    for rank, r in enumerate(reports):
        for label, c in r["exchanges"][collectives].items():
            assert c["identical"] and c["within"] and c["raw_exact"], (rank, label, c)
            assert c["reduce_within"], (rank, label, c)
            without, with_feedback = c["errors"][False], c["errors"][True]
            if without is not None:  # this rank owns something
                assert without > 0 and with_feedback < 0.2 * without, (rank, label, c)
            if collectives == "point_to_point":
                assert c["sent"] == c["expected"], (rank, label, c)


def _train(dtype: torch.dtype, **quantize) -> tuple[list[float], object, object, dict]:
    model = parity.make_model()
    config = zerolite.ZeroConfig(stage=2, partition="tensor", param_dtype=dtype,
                                 bucket_size_mb=0.01, quant_block=BLOCK, **quantize)
    opt = zerolite.shard(model, BUILDERS["muon+adamw"](model), config)
    with CommSpy() as spy:
        losses = parity.train(model, opt, parity.batches(STEPS), sliced=True)
    return losses, model, opt, exchanges(spy.events, dist.get_world_size())


def _residual_keys(opt) -> dict:
    """Whether every saved residual range is a whole parameter the other rank owns."""
    keys = residual_tensors(opt)
    other: dict[str, bool] = {}
    shapes = {n: p.numel() for f in opt.flats for n, p in zip(f.names, f.params)}
    mine = {piece.name for piece in opt.shard_state.pieces()}
    for key in keys:
        match = re.fullmatch(r"residual/(.+)/(\d+)-(\d+)", key)
        assert match is not None, key
        name, start, end = match.group(1), int(match.group(2)), int(match.group(3))
        other[name] = (start, end) == (0, shapes[name]) and name not in mine
    return {"count": len(keys), "whole_and_not_mine": all(other.values()),
            "covers_others": set(other) == set(shapes) - mine}


def _training() -> dict:
    out: dict = {"loss_rel": {}, "identical": {}, "footprint": {}, "wire": {}, "residuals": {}}
    for dtype in (torch.float32, torch.bfloat16):
        label = str(dtype)
        base, _, _, plain = _train(dtype)
        losses, model, opt, wire = _train(dtype, quantize_gather=True, quantize_reduce=True)
        out["loss_rel"][label] = worst_deviation(losses, base)
        out["wire"][label] = {"quantized": wire, "unquantized": plain}
        out["residuals"][label] = any(bool(f.exchange.residual.any()) for f in opt.flats
                                      if f.exchange.residual is not None)
        out["keys"] = _residual_keys(opt)
        flats = state_of(model).flats
        with zerolite.gathered_parameters(model):
            full = torch.cat([f.data.float() for f in flats])
        copies = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, full)
        out["identical"][label] = all(torch.equal(c, full) for c in copies)
        try:
            assert_footprint(opt)
            out["footprint"][label] = "ok"
        except FootprintMismatch as exc:
            out["footprint"][label] = str(exc)
    return out


def test_quantized_tensor_training_stays_close_and_consistent(reports) -> None:
    for r in (rep["training"] for rep in reports):
        assert max(r["loss_rel"].values()) <= 1e-2, r["loss_rel"]  # NaN fails
        assert all(r["identical"].values()), r["identical"]
        assert set(r["footprint"].values()) == {"ok"}, r["footprint"]
        assert all(r["residuals"].values()), r["residuals"]
        keys = r["keys"]
        assert keys["count"] > 0 and keys["whole_and_not_mine"] and keys["covers_others"], keys
        for label, wire in r["wire"].items():
            itemsize = 4 if "float32" in label else 2
            for exchange in ("all_gather/within", "reduce_scatter/within"):
                q, u = wire["quantized"].get(exchange), wire["unquantized"].get(exchange)
                assert q is not None and u is not None and q["dtypes"] == ["uint8"], (
                    label, exchange, q, u)
                assert q["bytes"] / u["bytes"] <= _wire_ratio_bound(itemsize), (
                    label, exchange, q, u)


def _resume(root: str) -> dict:
    data = parity.batches(4)

    def build():
        model = parity.make_model()
        config = zerolite.ZeroConfig(stage=2, partition="tensor", bucket_size_mb=0.01,
                                     quant_block=BLOCK, quantize_reduce=True)
        return model, zerolite.shard(model, BUILDERS["muon+adamw"](model), config)

    model, opt = build()
    parity.train(model, opt, data[:2], sliced=True)
    ckpt.save(f"{root}/run", model, opt)
    straight = parity.train(model, opt, data[2:], sliced=True)
    model, opt = build()
    ckpt.load(f"{root}/run", model, opt)
    resumed = parity.train(model, opt, data[2:], sliced=True)
    return {"equal": straight == resumed, "straight": straight, "resumed": resumed}


def test_checkpoint_resume_with_owned_residuals_is_exact(reports) -> None:
    for r in (rep["resume"] for rep in reports):
        assert r["equal"], r
