"""Offload with whole-tensor ownership (``partition="tensor"`` with ``offload="host" | "disk"``).

One 2-rank launch, stage 2, a chunk of 4 kB (so the streamed step cuts the tier at tensor
boundaries and some tensors are larger than a chunk):

1. Muon (blocks' matrices) + Adafactor (embeddings: factored state of a 2-D tensor) +
   AdamW (the rest), fp32 on the host tier and bf16 (masters offloaded too) on disk:
   losses, every parameter and the
   optimizer's state are bitwise those of the in-memory ``"tensor"`` run; the tier holds
   Adafactor's row and column factors in their own shapes;
2. Muon + AdamW in bf16 with half the owned tensors offloaded (``offload_fraction=0.5``):
   bitwise too, and `footprint` equals `estimate` (which has no formula for Adafactor);
3. a checkpoint saved offloaded (disk) loads into the in-memory run and into an offloaded
   one (host): masters and state equal to the saving run's, and one more step stays
   bitwise alike.
"""

from __future__ import annotations

import math

import pytest
import torch

import zerolite
from tests.step.test_tensor_ownership import BUILDERS
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.testing import FootprintMismatch, assert_footprint, run_ranks

STEPS = 3
CHUNK_BYTES = 4096
TIMEOUT = 240.0


def _build(name: str, dtype: torch.dtype, **config) -> tuple[torch.nn.Module, object]:
    model = parity.make_model()
    optimizers = BUILDERS[name](model)
    arg = optimizers if len(optimizers) > 1 else optimizers[0]
    opt = zerolite.shard(model, arg, zerolite.ZeroConfig(
        stage=2, partition="tensor", param_dtype=dtype, bucket_size_mb=0.01, **config
    ))
    if opt.shard_state.offload is not None:
        opt.shard_state.offload.chunk_bytes = CHUNK_BYTES
    return model, opt


def _snapshot(model: torch.nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every parameter, and every piece's master and (offloaded or not) state."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for piece in opt.shard_state.pieces():
        out[f"master/{piece.name}"] = piece.read_master().reshape(-1).clone()
        for key, value in piece.read_state().items():
            if isinstance(value, torch.Tensor):
                out[f"state/{piece.name}/{key}"] = value.detach().clone()
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ (bitwise, shapes included), or exist in one only."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].shape != b[k].shape
                  or not torch.equal(a[k], b[k]))


def _train(name, dtype, data, **config) -> dict:
    model, opt = _build(name, dtype, **config)
    losses = parity.train(model, opt, data, sliced=True)
    out = {"losses": losses, "snapshot": _snapshot(model, opt)}
    tier = opt.shard_state.offload
    if tier is not None:
        slots = tier.plan.slots
        out["slots"] = len(slots)
        out["pieces"] = len(list(opt.shard_state.pieces()))
        out["larger_than_chunk"] = sum(s.nbytes > CHUNK_BYTES for s in slots)
        # State sized other than the tensor (Adafactor's row and column factors).
        out["factored"] = sorted({
            (key, tier.field_shape(i, key)) for i, slot in enumerate(slots)
            for key in tier.state_keys(i) if math.prod(tier.field_shape(i, key)) != slot.numel
        })
        if "adafactor" not in name:
            try:
                assert_footprint(opt)
                out["footprint"] = "ok"
            except FootprintMismatch as exc:
                out["footprint"] = str(exc)
    return out


def _parity_cases(where: str) -> dict:
    data = parity.batches(STEPS)
    out: dict = {}
    name = "muon+adafactor+adamw"
    for dtype, tier in ((torch.float32, "host"), (torch.bfloat16, "disk")):
        base = _train(name, dtype, data)
        run = _train(name, dtype, data, offload=tier, offload_dir=where)
        out[f"{name} {dtype} {tier}"] = {
            "losses_equal": run["losses"] == base["losses"],
            "differ": _equal(run["snapshot"], base["snapshot"]),
            **{k: run[k] for k in ("slots", "larger_than_chunk", "factored")},
        }
    name = "muon+adamw"
    base = _train(name, torch.bfloat16, data)
    half = _train(name, torch.bfloat16, data, offload="host", offload_fraction=0.5)
    out["half"] = {"differ": _equal(half["snapshot"], base["snapshot"]),
                   "slots": half["slots"], "pieces": half["pieces"],
                   "footprint": half["footprint"]}
    return out


def _checkpoint_case(where: str, root: str) -> dict:
    data = parity.batches(STEPS + 1)
    name, dtype = "muon+adafactor+adamw", torch.bfloat16
    model, opt = _build(name, dtype, offload="disk", offload_dir=where)
    parity.train(model, opt, data[:STEPS], sliced=True)
    ckpt.save(f"{root}/offloaded", model, opt)
    saved = _snapshot(model, opt)
    loaded_model, loaded_opt = _build(name, dtype)
    ckpt.load(f"{root}/offloaded", loaded_model, loaded_opt)
    restored = _snapshot(loaded_model, loaded_opt)
    # And into a fresh offloaded run (host): the tier written from the file.
    host_model, host_opt = _build(name, dtype, offload="host")
    ckpt.load(f"{root}/offloaded", host_model, host_opt)
    restored_host = _snapshot(host_model, host_opt)
    after = [parity.train(m, o, data[STEPS:], sliced=True)
             for m, o in ((model, opt), (loaded_model, loaded_opt), (host_model, host_opt))]
    final = [_snapshot(m, o) for m, o in
             ((model, opt), (loaded_model, loaded_opt), (host_model, host_opt))]
    return {"restored_differ": _equal(saved, restored) + _equal(saved, restored_host),
            "next_loss_equal": after[0] == after[1] == after[2],
            "next_differ": _equal(final[0], final[1]) + _equal(final[0], final[2])}


def _rank(where: str, root: str) -> dict:
    return {"parity": _parity_cases(where), "checkpoint": _checkpoint_case(where, root)}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    where = str(tmp_path_factory.mktemp("tier"))
    root = str(tmp_path_factory.mktemp("ckpt"))
    return run_ranks(_rank, 2, where, root, timeout=TIMEOUT)


def test_offloaded_owned_tensors_step_bitwise_as_in_memory(reports) -> None:
    for rank, r in enumerate(reports):
        cases = dict(r["parity"])
        half = cases.pop("half")
        for label, c in cases.items():
            assert c["losses_equal"] and c["differ"] == [], (rank, label, c)
            assert c["slots"] > 0 and c["larger_than_chunk"] > 0, (rank, label, c)
        assert half["differ"] == [] and half["footprint"] == "ok", (rank, half)
        assert 0 < half["slots"] < half["pieces"], (rank, half)
    # Adafactor's row and column factors (on the embeddings' owners), held in their shapes.
    for label in reports[0]["parity"]:
        if label != "half":
            assert any(r["parity"][label]["factored"] for r in reports), label


def test_checkpoint_of_offloaded_owned_tensors_loads_in_memory_and_offloaded(reports) -> None:
    for rank, r in enumerate(reports):
        c = r["checkpoint"]
        assert c["restored_differ"] == [], (rank, c)
        assert c["next_loss_equal"] and c["next_differ"] == [], (rank, c)
