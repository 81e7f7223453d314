"""Gradient accumulation: 4 micro-steps of batch b == 1 step of batch 4b (stages 1 and 2).

With and without ``model.no_sync()``, against a one-process reference on the whole batch
and DDP (`tests.support.parity`), on real gloo groups (world sizes 2 and 4). DDP's yardstick is the
envelope of its two ways of running this loop, with ``no_sync()`` (one all-reduce of the
accumulated gradient) and without (an all-reduce per micro-step): they add the same numbers
in another order, and zerolite's stage 2 reduces per micro-step whichever the user picks.
Communication is counted with `tests.support.comm_spy.CommSpy`: nothing inside ``no_sync()``,
stage 2 reduce-scatters every bucket exactly once per synced backward, stage 1 only at
the step boundary.
"""

from __future__ import annotations

import contextlib

import pytest
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from tests.support.comm_spy import CommSpy
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

MICRO = 4
ACC_BATCH = 16  # global batch of one optimizer step: 4 micro-steps of 16 / (4 N) rows per rank
ACC_STEPS = 2


def _micro_batches(x, y):
    x, y = parity.local_slice(x), parity.local_slice(y)
    per = x.shape[0] // MICRO
    return [(x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]) for i in range(MICRO)]


def _accumulate_step(model, x, y, sync_ctx, spy=None, counts=None):
    total = 0.0
    for i, (xm, ym) in enumerate(_micro_batches(x, y)):
        ctx = sync_ctx() if (sync_ctx is not None and i < MICRO - 1) else contextlib.nullcontext()
        since = len(spy.events) if spy else 0
        with ctx:
            loss = model(xm, ym) / MICRO
            loss.backward()
        total += loss.item()
        if spy is not None:
            counts.append({
                "no_sync": sync_ctx is not None and i < MICRO - 1,
                "rs_isends": spy.calls(name="isend", caller="reduce_scatter", since=since),
                "all_calls": len(spy.events) - since,
            })
    return total


def _accumulation_rank() -> dict:
    report = new_report()
    data = parity.batches(ACC_STEPS, batch=ACC_BATCH)
    name = "AdamW"
    ref = parity.make_model()
    ref_opt = parity.make_optimizer(name, ref)
    ref_losses = parity.train(ref, ref_opt, data, sliced=False)

    ddp_dev = None
    for use_no_sync in (True, False):
        ddp_model = parity.make_model()
        ddp = DistributedDataParallel(ddp_model)
        ddp_opt = parity.make_optimizer(name, ddp_model)
        ddp_losses = []
        for x, y in data:
            sync_ctx = ddp.no_sync if use_no_sync else None
            ddp_losses.append(parity.mean_over_ranks(_accumulate_step(ddp, x, y, sync_ctx)))
            ddp_opt.step()
            ddp_opt.zero_grad()
        sample = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
        ddp_dev = sample if ddp_dev is None else ddp_dev.widen(sample)
    report["worst"]["DDP"] = max(ddp_dev.tensors.values())

    report["comm"] = {}
    for stage, bucket_mb in ((1, 25.0), (2, SMALL_BUCKETS_MB)):
        for use_no_sync in (False, True):
            label = f"stage{stage}/no_sync={use_no_sync}"
            model = parity.make_model()
            config = ZeroConfig(stage=stage, bucket_size_mb=bucket_mb)
            opt = zerolite.shard(model, parity.make_optimizer(name, model), config)
            losses, steps = [], []
            with CommSpy() as spy:
                for x, y in data:
                    counts: list[dict] = []
                    sync_ctx = model.no_sync if use_no_sync else None
                    loss = _accumulate_step(model, x, y, sync_ctx, spy, counts)
                    since = len(spy.events)
                    opt.step()
                    steps.append({
                        "micro": counts,
                        "step_rs_isends": spy.calls(name="isend", caller="reduce_scatter",
                                                    since=since),
                        "step_ag_isends": spy.calls(name="isend", caller="all_gather", since=since),
                    })
                    opt.zero_grad()
                    losses.append(parity.mean_over_ranks(loss))
            record_parity(label, model, losses, ref, ref_losses, ddp_dev, report)
            report["comm"][label] = {"buckets": len(opt.flats), "steps": steps}
    return report


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_accumulation_matches_big_batch(world_size):
    reports = run_ranks(guarded, world_size, _accumulation_rank, timeout=TIMEOUT)
    check_reports(reports)
    print(f"\n[accumulation ws={world_size}] worst rel error: {reports[0]['worst']}")
    n = world_size
    for r, rep in enumerate(reports):
        assert set(rep["comm"]) == {f"stage{s}/no_sync={b}" for s in (1, 2) for b in (False, True)}
        for label, comm in rep["comm"].items():
            stage2 = label.startswith("stage2")
            buckets = comm["buckets"]
            if stage2:
                assert buckets >= 4, label
            per_bucket = buckets * (n - 1)  # isend calls of one reduce-scatter of every bucket
            for s, st in enumerate(comm["steps"]):
                where = f"rank {r} {label} step {s}"
                for i, m in enumerate(st["micro"]):
                    if m["no_sync"]:
                        assert m["all_calls"] == 0, (
                            f"{where} micro {i}: communication inside no_sync: {m}")
                    elif stage2:
                        assert m["rs_isends"] == per_bucket, (
                            f"{where} micro {i}: {m['rs_isends']} reduce-scatter isends, expected "
                            f"{buckets} buckets x {n - 1}")
                    else:  # stage 1 reduces at the step boundary only
                        assert m["all_calls"] == 0, (
                            f"{where} micro {i}: stage 1 communicated in backward")
                expected_step_rs = 0 if stage2 else per_bucket
                assert st["step_rs_isends"] == expected_step_rs, f"{where}: {st}"
                assert st["step_ag_isends"] == per_bucket, f"{where}: {st}"
