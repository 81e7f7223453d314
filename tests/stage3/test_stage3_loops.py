"""Stage 3 in real loops: activation checkpointing, a unit called twice, weights tied
across units, accumulation, frozen blocks, gathered_parameters (real gloo groups)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import zerolite
from examples.gpt import GPT
from tests.stage3.test_stage3 import LiveUnitMeter, _unit_bytes
from tests.support import parity
from zerolite.memory import footprint
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels


class VariantGPT(GPT):
    """The tiny GPT with the variations real models have."""

    def __init__(self, variant: str) -> None:
        super().__init__(parity.TINY)
        self.variant = variant
        if variant == "tied_units":  # one weight used by two different units
            self.blocks[1].fc.weight = self.blocks[0].fc.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=False)
                if self.variant == "checkpoint"
                else block(x)
            )
        if self.variant == "twice":
            x = self.blocks[0](x)  # the same unit again, later in the same forward
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _make(variant: str) -> GPT:
    torch.manual_seed(0)
    return VariantGPT(variant)


def _variant_case(variant: str) -> dict:
    data = parity.batches(4)
    reference = _make(variant)
    ref_losses = parity.train(
        reference, parity.make_optimizer("AdamW", reference), data, sliced=False
    )
    ddp_model = _make(variant)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_losses = parity.train(ddp, parity.make_optimizer("AdamW", ddp_model), data, sliced=True)
    ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, reference, ref_losses)
    model = _make(variant)
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    meter = LiveUnitMeter(model)
    losses = parity.train(model, opt, data, sliced=True)
    worst = parity.check_parity(variant, model, losses, reference, ref_losses, ddp_dev)
    largest, root = _unit_bytes(opt)
    return {"worst": worst, "peak": meter.peak, "bound": 2 * largest + root}


def _accumulation_case(use_no_sync: bool) -> dict:
    micro = [parity.batches(4, batch=12)[i] for i in range(4)]
    big = (torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
    reference = parity.make_model()
    ref_opt = parity.make_optimizer("AdamW", reference)
    reference(*big).backward()
    ref_opt.step()
    ddp_model = parity.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = parity.make_optimizer("AdamW", ddp_model)
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    meter = LiveUnitMeter(model)
    for k, (x, y) in enumerate(micro):
        x, y = parity.local_slice(x), parity.local_slice(y)
        last = k == len(micro) - 1
        with (model.no_sync() if use_no_sync and not last else torch.enable_grad()):
            (model(x, y) / len(micro)).backward()
        with (ddp.no_sync() if not last else torch.enable_grad()):
            (ddp(x, y) / len(micro)).backward()
    opt.step()
    ddp_opt.step()
    ddp_errors = parity.tensor_errors(ddp_model, reference)
    errors = parity.tensor_errors(model, reference)
    bad = {
        k: (e, ddp_errors[k]) for k, e in errors.items() if not e <= max(2 * ddp_errors[k], 1e-6)
    }
    largest, root = _unit_bytes(opt)
    return {"bad": bad, "peak": meter.peak, "bound": 2 * largest + root}


def _frozen_model() -> GPT:
    model = parity.make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.blocks[1].parameters():
        p.requires_grad_(True)
    return model


def _trainable_adamw(model: GPT) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _frozen_case() -> dict:
    data = parity.batches(3)
    reference = _frozen_model()
    ref_losses = parity.train(reference, _trainable_adamw(reference), data, sliced=False)
    ddp_model = _frozen_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_losses = parity.train(ddp, _trainable_adamw(ddp_model), data, sliced=True)
    model = _frozen_model()
    opt = zerolite.shard(model, _trainable_adamw(model), zerolite.ZeroConfig(stage=3))
    meter = LiveUnitMeter(model)
    losses = parity.train(model, opt, data, sliced=True)
    parity.check_parity(
        "frozen", model, losses, reference, ref_losses,
        parity.ddp_deviation(ddp_model, ddp_losses, reference, ref_losses),
    )
    trainable = sum(p.numel() for p in model.blocks[1].parameters())
    n = dist.get_world_size()
    fp = footprint(opt)
    frozen_grads = [
        n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    total = sum(p.numel() for p in model.parameters())
    unit_sizes = [
        max(f.layout.padded_numel * 4 for f in fs) for fs in state_of(model).scheduler.flats if fs
    ]
    return {
        "peak": meter.peak,
        "bound": 2 * max(unit_sizes[:-1]) + 2 * unit_sizes[-1],
        "grads": fp.grads,
        "state": fp.optimizer_state,
        "params": fp.params,
        "trainable": trainable,
        "n": n,
        "total": total,
        "frozen_grads": frozen_grads,
        "managed": [name for f in opt.flats for name in f.names],
        "frozen_sharded": sorted(name for f in opt.frozen_flats for name in f.names),
    }


def _gathered_case() -> dict:
    rank = dist.get_rank()
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("SGD", model), zerolite.ZeroConfig(stage=3))
    parity.train(model, opt, parity.batches(1), sliced=True)
    with zerolite.gathered_parameters(model, modifier_rank=1):
        w = model.blocks[0].fc.weight
        seen_full = not w.isnan().any().item()
        if rank == 1:
            with torch.no_grad():
                w.fill_(0.5)
    assert model.blocks[0].fc.weight.isnan().all()  # resharded again
    full = zerolite.full_state_dict(model, rank0_only=False)
    edited = bool((full["blocks.0.fc.weight"] == 0.5).all())
    # The edit reached the fp32 master that the optimizer steps: training continues from it.
    parity.train(model, opt, parity.batches(1), sliced=True)
    after = zerolite.full_state_dict(model, rank0_only=False)["blocks.0.fc.weight"]
    streamed = dict(zerolite.iter_full_state_dict(model))
    same = all(
        torch.equal(streamed[k], v)
        for k, v in zerolite.full_state_dict(model, rank0_only=False).items()
    )
    return {
        "seen_full": seen_full,
        "edited": edited,
        "moved_from_edit": float((after - 0.5).abs().max()),
        "streamed_equal": same,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpointing_reuse_and_tied_units(world_size):
    def check(results):
        for r in results:
            assert r["peak"] <= r["bound"], r
    for variant in ("checkpoint", "twice", "tied_units"):
        check(run_ranks(_variant_case, world_size, variant, timeout=120))


@pytest.mark.parametrize("world_size", [2, 4])
def test_accumulation_of_four_micro_steps(world_size):
    for use_no_sync in (False, True):
        for r in run_ranks(_accumulation_case, world_size, use_no_sync, timeout=120):
            assert r["bad"] == {}, r
            assert r["peak"] <= r["bound"], r


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_blocks_are_sharded_without_gradients_or_state(world_size):
    for r in run_ranks(_frozen_case, world_size, timeout=60):
        assert all(name.startswith("blocks.1.") for name in r["managed"])
        assert r["frozen_grads"] == []
        # Gradients and AdamW moments only for the trainable block's shard (+ padding, step).
        assert r["grads"] <= 4 * (r["trainable"] // r["n"] + 8)
        assert r["state"] <= 8 * (r["trainable"] // r["n"] + 8) + 4 * 16
        # The frozen base is sharded too: each rank holds 1/N of all parameters, not all of them.
        assert "wte.weight" in r["frozen_sharded"] and "blocks.0.fc.weight" in r["frozen_sharded"]
        assert r["params"] <= 4 * (r["total"] // r["n"] + 8 * 8)
        assert r["peak"] <= r["bound"], r


def test_gathered_parameters_broadcasts_one_ranks_edit():
    for r in run_ranks(_gathered_case, 2, timeout=60):
        assert r["seen_full"] and r["edited"], r
        assert 0 < r["moved_from_edit"] < 0.5, r
        assert r["streamed_equal"], r


def _fp16_case(stage: int) -> dict:
    rank = dist.get_rank()
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model),
                         zerolite.ZeroConfig(stage=stage, param_dtype=torch.float16))
    skipped, scales = [], []
    for step, (x, y) in enumerate(parity.batches(4)):
        loss = model(parity.local_slice(x), parity.local_slice(y))
        if step == 2 and rank == 1:
            loss = loss * float("inf")  # overflow on one rank only
        opt.scale_loss(loss).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
        scales.append(opt.loss_scaler.scale)
    return {
        "skipped": skipped,
        "scales": scales,
        "state": zerolite.full_state_dict(model, rank0_only=False),
    }


def test_fp16_loss_scaling_in_stage_3_matches_stage_2():
    stage3 = run_ranks(_fp16_case, 2, 3, timeout=60)
    stage2 = run_ranks(_fp16_case, 2, 2, timeout=60)
    for r in stage3:
        assert r["skipped"] == [False, False, True, False]  # every rank skipped the overflow step
        assert r["scales"] == [65536.0, 65536.0, 32768.0, 32768.0]
    for k, v in stage2[0]["state"].items():
        assert torch.equal(stage3[0]["state"][k], v), k
