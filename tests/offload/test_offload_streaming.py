"""Checkpoints of offloaded state stream it: at most one piece's values in memory at once.

A 2-rank launch (real gloo group, disk tier, bf16 parameters so masters are offloaded too)
trains, saves synchronously and asynchronously, and loads both into a fresh offloaded
model. While the synchronous save runs, every tensor the tier reads is counted until it
is freed; while the load runs, every tensor written into the tier, from when it is
written until it is freed (a load that read every piece before writing any would hold
them all by its last write). The peaks are compared with the largest piece and the whole
tier, and the loads must restore masters and tier contents bitwise.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

import zerolite
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

STEPS = 2


class _Held:
    """Bytes of CPU tensor storages registered and not yet freed; ``peak`` is the most."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0

    def register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))


def _build(where: str):
    config = zerolite.ZeroConfig(
        stage=2, param_dtype=torch.bfloat16, bucket_size_mb=0.01, offload="disk",
        offload_dir=where,
    )
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    return model, opt


def _tier_contents(model) -> list[torch.Tensor]:
    tier = state_of(model).offload
    return [
        tier.read(i, field, 0, slot.numel)
        for i, slot in enumerate(tier.plan.slots) for field, _, _ in slot.fields
    ]


def _masters(opt) -> list[torch.Tensor]:
    return [p.read_master().clone() for p in opt.shard_state.pieces()]


def _rank(where: str, root: str) -> dict:
    model, opt = _build(where)
    parity.train(model, opt, parity.batches(STEPS), sliced=True)
    tier = state_of(model).offload
    saved_tier, saved_masters = _tier_contents(model), _masters(opt)

    held_save = _Held()
    read = tier.arena.read

    def counted_read(offset: int, out: torch.Tensor) -> None:
        read(offset, out)
        held_save.register(out)

    tier.arena.read = counted_read
    ckpt.save(Path(root) / "sync", model, opt)
    del tier.arena.read
    ckpt.save(Path(root) / "async", model, opt, blocking=False).wait()

    out = {
        "save_peak": held_save.peak,
        "largest_piece": max(s.numel * s.bytes_per_element for s in tier.plan.slots),
        "tier_bytes": tier.plan.nbytes,
        "pieces": len(tier.plan.slots),
    }
    for label in ("sync", "async"):
        fresh, fresh_opt = _build(where)
        fresh_tier = state_of(fresh).offload
        held_load = _Held()
        write = fresh_tier.arena.write

        def counted_write(offset: int, src: torch.Tensor, write=write, held=held_load) -> None:
            held.register(src)
            write(offset, src)

        fresh_tier.arena.write = counted_write
        ckpt.load(Path(root) / label, fresh, fresh_opt)
        del fresh_tier.arena.write
        out[f"load_peak_{label}"] = held_load.peak
        out[f"equal_{label}"] = all(
            torch.equal(a, b) for a, b in zip(saved_tier, _tier_contents(fresh), strict=True)
        ) and all(
            torch.equal(a, b) for a, b in zip(saved_masters, _masters(fresh_opt), strict=True)
        )
    return out


def test_offloaded_checkpoint_streams_one_piece_at_a_time(tmp_path):
    where, root = tmp_path / "tier", tmp_path / "ckpt"
    where.mkdir()
    for r in run_ranks(_rank, 2, str(where), str(root), timeout=180):
        # The bound means something: the tier holds many pieces, far more than one.
        assert r["pieces"] >= 4 and r["tier_bytes"] >= 3 * r["largest_piece"], r
        assert 0 < r["save_peak"] <= r["largest_piece"], r
        for label in ("sync", "async"):
            assert 0 < r[f"load_peak_{label}"] <= r["largest_piece"], r
            assert r[f"equal_{label}"], (label, r)
