"""An LR scheduler built on the user's optimizer before ``shard()`` keeps driving it.

Stages 1 and 2 on real gloo groups (world sizes 2 and 4): the learning rates each step
sees are the reference's, a step at lr 0 changes no parameter, and training matches the
reference and DDP (`tests.support.parity`).
"""

from __future__ import annotations

import pytest
import torch
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

ZERO_LR_STEP = 2
SCHED_STEPS = 4


def _lr_factor(epoch: int) -> float:
    return 0.0 if epoch == ZERO_LR_STEP else 1.0 / (1 + epoch)


def _train_scheduled(model, opt, sched, data, *, sliced, record):
    losses = []
    for x, y in data:
        if sliced:
            x, y = parity.local_slice(x), parity.local_slice(y)
        before = parity.snapshot(model)
        loss = model(x, y)
        loss.backward()
        lrs = [g["lr"] for g in opt.param_groups]
        opt.step()
        if record is not None:
            changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
            record.append({"lrs": lrs, "changed": changed, "n_params": len(before)})
        opt.zero_grad()
        sched.step()
        losses.append(parity.mean_over_ranks(loss.item()) if sliced else loss.item())
    return losses


def _scheduler_rank() -> dict:
    report = new_report()
    report["steps"] = {}
    data = parity.batches(SCHED_STEPS)
    name = "SGD"
    ref = parity.make_model()
    ref_opt = parity.make_optimizer(name, ref)
    ref_rec: list[dict] = []
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _lr_factor)
    ref_losses = _train_scheduled(ref, ref_opt, ref_sched, data, sliced=False, record=ref_rec)
    report["steps"]["reference"] = ref_rec
    ddp_model = parity.make_model()
    ddp_opt = parity.make_optimizer(name, ddp_model)
    ddp_sched = torch.optim.lr_scheduler.LambdaLR(ddp_opt, _lr_factor)
    ddp_losses = _train_scheduled(DistributedDataParallel(ddp_model), ddp_opt, ddp_sched, data,
                                  sliced=True, record=None)
    ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
    for stage, bucket_mb in ((1, 25.0), (2, SMALL_BUCKETS_MB)):
        label = f"stage{stage}"
        model = parity.make_model()
        user_opt = parity.make_optimizer(name, model)
        sched = torch.optim.lr_scheduler.LambdaLR(user_opt, _lr_factor)  # before shard()
        config = ZeroConfig(stage=stage, bucket_size_mb=bucket_mb)
        opt = zerolite.shard(model, user_opt, config)
        rec: list[dict] = []
        losses = _train_scheduled(model, opt, sched, data, sliced=True, record=rec)
        record_parity(label, model, losses, ref, ref_losses, ddp_dev, report)
        report["steps"][label] = rec
    return report


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_lr_scheduler_built_before_shard(world_size):
    reports = run_ranks(guarded, world_size, _scheduler_rank, timeout=TIMEOUT)
    check_reports(reports)
    print(f"\n[scheduler ws={world_size}] worst rel error: {reports[0]['worst']}")
    for r, rep in enumerate(reports):
        ref_steps = rep["steps"]["reference"]
        for label in ("stage1", "stage2"):
            for s, (st, ref_st) in enumerate(zip(rep["steps"][label], ref_steps, strict=True)):
                where = f"rank {r} {label} step {s}"
                assert st["lrs"] == ref_st["lrs"], where
                if s == ZERO_LR_STEP:
                    assert st["lrs"] == [0.0, 0.0], where
                    assert st["changed"] == [], f"{where}: lr is 0 but {st['changed']} changed"
                else:
                    assert min(st["lrs"]) > 0, where
                    # Everything the reference's step changed must change here too.
                    assert set(ref_st["changed"]) <= set(st["changed"]), (
                        f"{where}: unchanged although the reference changed them: "
                        f"{sorted(set(ref_st['changed']) - set(st['changed']))}")
                    assert st["changed"], f"{where}: nothing changed"
