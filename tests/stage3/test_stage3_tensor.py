"""Whole-tensor ownership at stage 3 (``stage=3, partition="tensor"``), one 2-rank launch.

Each unit's flat buffer is ordered by owner: rank ``r``'s shard of it is exactly the
parameters it owns whole (uneven, possibly empty), gathered from their owners before the
unit runs and reduced to them after backward, so Muon and Adafactor step whole matrices on
their owner while every rank holds only its owned share between uses. Checked against the
stage-2 ``"tensor"`` run of the same launch, which has the same owners' arithmetic
(every gradient element summed in rank order, each tensor stepped whole):

1. Muon + AdamW with clipping, in fp32 and bf16, with ``prefetch=2`` and with
   ``reshard_after_forward=False``, and Muon + Adafactor + AdamW: bit for bit the stage-2
   run's parameters and losses;
2. memory: between steps each rank holds its owned chunk of every unit (the full buffers
   freed), live full units stay within ``(prefetch + 1)`` blocks plus the root, a census
   of every live tensor equals ``footprint``'s total (but for each freed buffer's NaN
   placeholder, as with ``"flat"``), and ``estimate`` equals
   ``footprint`` byte for byte, imbalance included;
3. a meta-device build equals the normal one; an edit inside
   ``gathered_parameters(modifier_rank=0)`` reaches the master of a tensor that rank 1
   owns;
4. a checkpoint saved at stage 3 loads at stage 2 and at stage 3, parameters and every
   optimizer state (Muon's momentum, Adafactor's factored rows and columns) bit for bit,
   and both resumed runs continue alike.

Across world sizes (stage 2 at 2 ranks to stage 3 at 4): tests/checkpoint/test_tensor_checkpoint.py;
AdamW at 4 ranks, bitwise across stages 1-3: tests/step/test_same_arithmetic.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import zerolite
from examples.gpt import GPTConfig
from tests.checkpoint.test_tensor_checkpoint import gathered_state
from tests.stage3.test_stage3 import LiveUnitMeter
from tests.step.test_tensor_ownership import BUILDERS, shard
from tests.support import parity
from tests.support.memory_accounting import census_vs_footprint, live_tensors, storage_key
from zerolite import checkpoint as ckpt
from zerolite.memory import estimate, footprint
from zerolite.optim.multi import MultiOptimizer
from zerolite.testing import run_ranks

STEPS = 2  # Muon keeps momentum: the second step steps from state
CLIP = 0.5
FOUR_LAYERS = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)


def _train(model, opt, data, clip: bool = True) -> list[float]:
    before = (lambda: opt.clip_grad_norm_(CLIP)) if clip else None
    return parity.train(model, opt, data, sliced=True, before_step=before)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(name: str, stage: int, cfg: GPTConfig = parity.TINY, **config):
    """Train ``name``'s optimizers at ``stage`` under ``"tensor"``; (final parameters,
    losses, optimizer)."""
    model = parity.make_model(cfg=cfg)
    opt = shard(name, model, stage=stage, partition="tensor", bucket_size_mb=0.01, **config)
    losses = _train(model, opt, parity.batches(STEPS, cfg=cfg))
    return zerolite.full_state_dict(model, rank0_only=False), losses, opt


def _bitwise_cases() -> dict:
    """Per variant: stage 3 equals stage 2 bit for bit (parameters and losses)."""
    out = {}
    for label, name, config in (
        ("muon+adamw fp32", "muon+adamw", {}),
        ("muon+adamw bf16", "muon+adamw", {"param_dtype": torch.bfloat16}),
        ("muon+adafactor+adamw", "muon+adafactor+adamw", {}),
    ):
        two, losses2, _ = _run(name, 2, **config)
        three, losses3, _ = _run(name, 3, **config)
        out[label] = _same(two, three) and losses2 == losses3
    two, losses2, _ = _run("muon+adamw", 2, cfg=FOUR_LAYERS)
    for label, config in (("prefetch=2", {"prefetch": 2}),
                          ("reshard_after_forward=False", {"reshard_after_forward": False})):
        three, losses3, _ = _run("muon+adamw", 3, cfg=FOUR_LAYERS, **config)
        out[label] = _same(two, three) and losses2 == losses3
    return out


def _memory_case() -> dict:
    """Owned share between steps, live units within the prefetch bound, estimate ==
    footprint."""
    rank, world = dist.get_rank(), dist.get_world_size()
    exclude = {storage_key(t) for t in live_tensors()}  # what lived before the model
    model = parity.make_model(cfg=FOUR_LAYERS)
    opt = shard("muon+adamw", model, stage=3, partition="tensor")
    meter = LiveUnitMeter(model)
    _train(model, opt, parity.batches(2, cfg=FOUR_LAYERS))
    census = census_vs_footprint(opt, exclude)  # every live tensor of the rank, counted
    flats = opt.flats
    sizes = [4 * f.layout.numel for f in flats]  # owned chunks: no padding to gather
    fresh = parity.make_model(cfg=FOUR_LAYERS)
    estimated = estimate(
        fresh, world_size=world, optimizer=MultiOptimizer(BUILDERS["muon+adamw"](fresh)),
        config=zerolite.ZeroConfig(stage=3, partition="tensor"), rank=rank,
    )
    held = footprint(opt)
    chunks = [f.layout.chunk_sizes for f in flats]
    return {
        "owned_share": all(
            not f.unsharded and f.shard.numel() == f.layout.chunk_sizes[rank] for f in flats
        ),
        "uneven": any(len(set(c)) > 1 for c in chunks),
        "peak": meter.peak, "bound": 2 * max(sizes[:-1]) + sizes[-1],
        "measured": (held.model_states, held.ownership_imbalance),
        "estimated": (estimated.model_states, estimated.ownership_imbalance),
        "imbalance": held.ownership_imbalance,
        # footprint leaves out the one-element NaN each freed buffer keeps for its placeholders
        # ([Note: freed parameters] in zerolite.params.flat_buffer), as at stage 3 "flat".
        "census": (census["census"] - census["footprint"]["total"],
                   4 * len([*flats, *opt.frozen_flats]), census["missed"]),
    }


def _meta_and_edit_case() -> dict:
    """A meta build equals the normal build; an edit by rank 0 reaches rank 1's master."""
    from tests.stage3.test_meta_init import _build

    finals = []
    for meta in (False, True):
        model = _build(meta)
        opt = shard("muon+adamw", model, stage=3, partition="tensor", bucket_size_mb=0.01)
        finals.append(_train(model, opt, parity.batches(2), clip=False))
        finals.append(zerolite.full_state_dict(model, rank0_only=False))
    meta_equal = finals[0] == finals[2] and _same(finals[1], finals[3])
    model = parity.make_model()
    opt = shard("muon+adamw", model, stage=3, partition="tensor")
    # A tensor rank 1 owns: rank 0's edit must travel to its owner's master.
    names = [next(iter(opt.shard_state.pieces())).name if dist.get_rank() == 1 else None]
    dist.broadcast_object_list(names, src=1)
    target = dict(model.named_parameters())[names[0]]
    with zerolite.gathered_parameters(model, modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                target.fill_(0.25)
    edited = True
    if dist.get_rank() == 1:
        piece = next(p for p in opt.shard_state.pieces() if p.name == names[0])
        edited = bool((piece.read_master() == 0.25).all())
    full = zerolite.full_state_dict(model, rank0_only=False)[names[0]]
    return {"meta_equal": meta_equal, "edited": edited and bool((full == 0.25).all())}


def _checkpoint_case() -> dict:
    """Save at stage 3 after 2 steps; load at stages 2 and 3; both continue a step."""
    name = "muon+adafactor+adamw"
    data = parity.batches(3)
    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    folder = str(Path(root[0]) / "ckpt")
    model = parity.make_model()
    opt = shard(name, model, stage=3, partition="tensor", bucket_size_mb=0.01)
    parity.train(model, opt, data[:2], sliced=True)
    ckpt.save(folder, model, opt)
    saved = (zerolite.full_state_dict(model, rank0_only=False), gathered_state(opt))
    out: dict = {}
    for stage in (2, 3):
        twin = parity.make_model(seed=5)
        twin_opt = shard(name, twin, stage=stage, partition="tensor", bucket_size_mb=0.01)
        ckpt.load(folder, twin, twin_opt)
        state = gathered_state(twin_opt)
        out[f"stage{stage}_loaded"] = _same(
            saved[0], zerolite.full_state_dict(twin, rank0_only=False)
        ) and saved[1].keys() == state.keys() and all(
            _same(saved[1][n], state[n]) for n in state
        )
        out[f"stage{stage}_losses"] = parity.train(twin, twin_opt, data[2:], sliced=True)
    return out


def _all_cases() -> dict:
    return {
        "bitwise": _bitwise_cases(),
        "memory": _memory_case(),
        "meta_edit": _meta_and_edit_case(),
        "checkpoint": _checkpoint_case(),
    }


def test_stage3_tensor_ownership() -> None:
    ranks = run_ranks(_all_cases, 2, timeout=300)
    for r in ranks:
        assert all(r["bitwise"].values()), r["bitwise"]
        mem = r["memory"]
        assert mem["owned_share"] and mem["uneven"], mem
        assert mem["peak"] <= mem["bound"], mem
        assert mem["measured"] == mem["estimated"], mem
        assert mem["census"][0] == mem["census"][1], mem["census"]
        assert mem["imbalance"] >= 1.0, mem
        assert r["meta_edit"]["meta_equal"] and r["meta_edit"]["edited"], r["meta_edit"]
        c = r["checkpoint"]
        assert c["stage2_loaded"] and c["stage3_loaded"], c
        assert c["stage2_losses"] == c["stage3_losses"], c
