"""Parameters some step does not use: ``DistributedDataParallel(find_unused_parameters=True)``
semantics.

A second head is used on every rank in some steps, and on rank 0 only in another
(stages 1 and 2, one and many buckets, world sizes 2 and 4): training matches the
reference and DDP (`tests.support.parity`), and in a step where no rank used the head, its
parameters, master pieces *and* optimizer state are untouched.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from tests.support.rank_reports import (
    SMALL_BUCKETS_MB,
    TIMEOUT,
    WORLD_SIZES,
    check_reports,
    guarded,
    new_report,
    record_parity,
)
from zerolite import ZeroConfig
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels


class TwoHeadGPT(nn.Module):
    """The tiny GPT plus a second head ``head_b`` applied only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = parity.make_model()
        torch.manual_seed(1)
        v = parity.TINY.vocab_size
        self.head_b = nn.Linear(v, v)

    def forward(self, idx, targets, use_b: bool):
        logits = self.gpt(idx)
        if use_b:
            logits = logits + self.head_b(logits)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


UNUSED_STEPS = 4
# Per schedule, per step: which ranks use head_b (a function of rank and world size).
SCHEDULES = {
    "even_steps_all_ranks": lambda step, rank, n: step % 2 == 0,
    "rank0_only_on_step_2": lambda step, rank, n: step == 0 or (step == 2 and rank == 0),
}


def _uses(schedule: str, step: int, rank: int, n: int) -> bool:
    return SCHEDULES[schedule](step, rank, n)


def _ref_loss(model, x, y, schedule, step, n):
    flags = [_uses(schedule, step, r, n) for r in range(n)]
    if all(f == flags[0] for f in flags):
        return model(x, y, flags[0])
    per = x.shape[0] // n
    rows = [slice(r * per, (r + 1) * per) for r in range(n)]
    return sum(model(x[rows[r]], y[rows[r]], flags[r]) for r in range(n)) / n


def _head_b_pieces(model, opt):
    """This rank's master pieces of head_b's parameters and their optimizer state."""
    ids = {id(model.head_b.weight), id(model.head_b.bias)}
    out = []
    for flat, master in zip(opt.flats, opt.masters):
        for pc, t in zip(flat.spans, master.views):
            if id(flat.params[pc.index]) in ids:
                out.append(t)
    return out


def _state_clone(opt, t):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in opt.state.get(t, {}).items()}


def _states_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
               for k in a)


def _unused_rank() -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    report = new_report()
    report["checks"], report["vs_ddp"] = {}, {}
    data = parity.batches(UNUSED_STEPS)
    name = "AdamW"
    for schedule in SCHEDULES:
        ref = TwoHeadGPT()
        ref_opt = parity.make_optimizer(name, ref)
        ref_losses = []
        for s, (x, y) in enumerate(data):
            loss = _ref_loss(ref, x, y, schedule, s, n)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())
        ddp_model = TwoHeadGPT()
        ddp = DistributedDataParallel(ddp_model, find_unused_parameters=True)
        ddp_opt = parity.make_optimizer(name, ddp_model)
        ddp_losses = []
        for s, (x, y) in enumerate(data):
            use_b = _uses(schedule, s, rank, n)
            loss = ddp(parity.local_slice(x), parity.local_slice(y), use_b)
            loss.backward()
            ddp_opt.step()
            ddp_opt.zero_grad()
            ddp_losses.append(parity.mean_over_ranks(loss.item()))
        ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
        report["worst"][f"{schedule}/DDP"] = max(ddp_dev.tensors.values())
        for stage, bucket_mb in ((1, 25.0), (2, 25.0), (2, SMALL_BUCKETS_MB)):
            label = f"{schedule}/stage{stage}/bucket_mb={bucket_mb}"
            model = TwoHeadGPT()
            config = ZeroConfig(stage=stage, bucket_size_mb=bucket_mb)
            opt = zerolite.shard(model, parity.make_optimizer(name, model), config)
            pieces = _head_b_pieces(model, opt)
            losses, checks = [], []
            for s, (x, y) in enumerate(data):
                used_anywhere = any(_uses(schedule, s, r, n) for r in range(n))
                head_before = parity.snapshot(model.head_b)
                trunk_before = parity.snapshot(model.gpt)
                pieces_before = [t.detach().clone() for t in pieces]
                states_before = [_state_clone(opt, t) for t in pieces]
                use_b = _uses(schedule, s, rank, n)
                loss = model(parity.local_slice(x), parity.local_slice(y), use_b)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(parity.mean_over_ranks(loss.item()))
                checks.append({
                    "used_anywhere": used_anywhere,
                    "head_unchanged": all(torch.equal(p, head_before[k])
                                          for k, p in model.head_b.named_parameters()),
                    "trunk_changed": any(not torch.equal(p, trunk_before[k])
                                         for k, p in model.gpt.named_parameters()),
                    "pieces": len(pieces),
                    "pieces_unchanged": all(torch.equal(t, b)
                                            for t, b in zip(pieces, pieces_before)),
                    "states_unchanged": all(_states_equal(_state_clone(opt, t), b)
                                            for t, b in zip(pieces, states_before)),
                    "states_present": sum(bool(opt.state.get(t)) for t in pieces),
                })
            record_parity(label, model, losses, ref, ref_losses, ddp_dev, report)
            # Against DDP directly as well (reported; the assertion is the parity metric above).
            errs = parity.tensor_errors(model, ddp_model)
            head_b = max(e for k, e in errs.items() if k.startswith("head_b."))
            report["vs_ddp"][label] = {"all": max(errs.values()), "head_b": head_b}
            report["checks"][label] = checks
    return report


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unused_parameters_like_ddp(world_size):
    reports = run_ranks(guarded, world_size, _unused_rank, timeout=TIMEOUT)
    check_reports(reports)
    print(f"\n[unused ws={world_size}] worst rel error vs reference: {reports[0]['worst']}")
    print(f"[unused ws={world_size}] rel error vs DDP directly: {reports[0]['vs_ddp']}")
    total_pieces = {}
    for r, rep in enumerate(reports):
        for label, checks in rep["checks"].items():
            total_pieces[label] = total_pieces.get(label, 0) + checks[0]["pieces"]
            for s, c in enumerate(checks):
                where = f"rank {r} {label} step {s}"
                assert c["trunk_changed"], where
                if c["used_anywhere"]:
                    assert not c["head_unchanged"], f"{where}: head_b was used but did not change"
                    if c["pieces"]:
                        assert not c["pieces_unchanged"], where
                        assert c["states_present"] == c["pieces"], where
                else:
                    assert c["head_unchanged"], f"{where}: head_b unused on every rank but changed"
                    assert c["pieces_unchanged"], f"{where}: head_b master pieces changed"
                    assert c["states_unchanged"], f"{where}: head_b optimizer state changed"
                    assert c["states_present"] == c["pieces"], f"{where}: state lost"
    for label, total in total_pieces.items():
        assert total >= 2, f"{label}: head_b's pieces not found on any rank"
