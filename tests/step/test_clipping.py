"""``opt.clip_grad_norm_`` clips by the true global norm, as ``torch.nn.utils.clip_grad_norm_``.

Norm types 2 and inf, stages 1 and 2, on real gloo groups (world sizes 2 and 4): the
returned norm equals torch's on the whole batch (1e-6 relative) and the same on every
rank, and training with the clip matches the reference and DDP (`tests.support.parity`).
"""

from __future__ import annotations

import math

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

CLIP_STEPS = 3


def _true_norm(data, norm_type) -> float:
    model = parity.make_model()
    x, y = data[0]
    model(x, y).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type))


def _train_clipped(model, opt, data, max_norm, norm_type, *, sliced, clip):
    losses, norms = [], []
    for x, y in data:
        if sliced:
            x, y = parity.local_slice(x), parity.local_slice(y)
        loss = model(x, y)
        loss.backward()
        norms.append(float(clip(max_norm, norm_type)))
        opt.step()
        opt.zero_grad()
        losses.append(parity.mean_over_ranks(loss.item()) if sliced else loss.item())
    return losses, norms


def _clip_rank() -> dict:
    report = new_report()
    report["norms"] = {}
    data = parity.batches(CLIP_STEPS)
    name = "SGD"
    for norm_type in (2.0, math.inf):
        max_norm = 0.1 * _true_norm(data, norm_type)
        ref = parity.make_model()
        ref_opt = parity.make_optimizer(name, ref)
        ref_losses, ref_norms = _train_clipped(
            ref, ref_opt, data, max_norm, norm_type, sliced=False,
            clip=lambda m, t, ref=ref: torch.nn.utils.clip_grad_norm_(ref.parameters(), m, t))
        ddp_model = parity.make_model()
        ddp = DistributedDataParallel(ddp_model)
        ddp_opt = parity.make_optimizer(name, ddp_model)
        ddp_losses, ddp_norms = _train_clipped(
            ddp, ddp_opt, data, max_norm, norm_type, sliced=True,
            clip=lambda m, t, ddp_model=ddp_model: torch.nn.utils.clip_grad_norm_(
                ddp_model.parameters(), m, t))
        ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
        report["worst"][f"DDP/norm={norm_type}"] = max(ddp_dev.tensors.values())
        for stage, bucket_mb in ((1, 25.0), (2, SMALL_BUCKETS_MB)):
            label = f"stage{stage}/norm={norm_type}"
            model = parity.make_model()
            config = ZeroConfig(stage=stage, bucket_size_mb=bucket_mb)
            opt = zerolite.shard(model, parity.make_optimizer(name, model), config)
            losses, norms = _train_clipped(model, opt, data, max_norm, norm_type, sliced=True,
                                           clip=opt.clip_grad_norm_)
            record_parity(label, model, losses, ref, ref_losses, ddp_dev, report)
            report["norms"][label] = {"max_norm": max_norm, "ref": ref_norms, "ddp": ddp_norms,
                                      "zerolite": norms}
    return report


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clip_grad_norm_matches_torch(world_size):
    reports = run_ranks(guarded, world_size, _clip_rank, timeout=TIMEOUT)
    check_reports(reports)
    print(f"\n[clip ws={world_size}] worst rel error: {reports[0]['worst']}")
    for label in ("stage1/norm=2.0", "stage2/norm=2.0", "stage1/norm=inf", "stage2/norm=inf"):
        norms0 = reports[0]["norms"][label]
        rels = []
        for s, (ref_norm, z) in enumerate(zip(norms0["ref"], norms0["zerolite"], strict=True)):
            # The clip must actually bite for the parameter check to mean anything.
            assert ref_norm > 5 * norms0["max_norm"], f"{label} step {s}: clipping inactive"
            rel = abs(z - ref_norm) / ref_norm
            rels.append(rel)
            assert rel <= 1e-6, f"{label} step {s}: norm {z} vs torch {ref_norm} (rel {rel:.2e})"
        ddp_rels = [abs(d - r) / r for d, r in zip(norms0["ddp"], norms0["ref"], strict=True)]
        print(f"  {label}: max_norm={norms0['max_norm']:.4g} "
              f"ref norms={[f'{v:.6g}' for v in norms0['ref']]} "
              f"rel err zerolite={max(rels):.2e} DDP={max(ddp_rels):.2e}")
        for r, rep in enumerate(reports):
            assert rep["norms"][label]["zerolite"] == norms0["zerolite"], (
                f"{label}: rank {r} saw another norm")
