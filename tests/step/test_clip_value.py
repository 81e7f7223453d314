"""Clipping by value on the reduced shards, and Accelerate's scaler-based methods.

- ``opt.clip_grad_value_(v)`` is ``torch.nn.utils.clip_grad_value_(params, v)`` on the
  whole batch's gradients: at 2 gloo ranks, stages 1-3, training with the clip matches the
  one-process reference within max(2 x DDP's own error, 1e-6) per tensor (`tests.support.parity`),
  with ``v`` small enough that the clamp bites at every step.
- `ZeroAccelerator` in Accelerate's fp16 mode (``native_amp`` and ``mixed_precision="fp16"``,
  as a GPU run sets them; Accelerate refuses fp16 on a CPU, so the test sets that state
  itself after ``prepare``): Accelerate's own ``unscale_gradients`` calls
  ``accelerator.scaler.unscale_`` and fails (the scaler is None: zerolite scales the loss);
  zerolite's ``unscale_gradients`` and ``clip_grad_value_`` work, and the bound applies to
  the unscaled gradients (SGD with lr 1 moves each fp32 master by exactly the clamped
  gradient, so the largest move is the bound).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from tests.support.rank_reports import (
    SMALL_BUCKETS_MB,
    TIMEOUT,
    check_reports,
    guarded,
    new_report,
    record_parity,
)
from zerolite import ZeroConfig
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 3


def _bound(data) -> float:
    """The 90th percentile of |gradient| of the reference's first step: the clamp bites."""
    model = parity.make_model()
    x, y = data[0]
    model(x, y).backward()
    grads = torch.cat([p.grad.abs().flatten() for p in model.parameters()])
    return grads.quantile(0.9).item()


def _train(model, opt, data, *, sliced: bool, clip) -> tuple[list[float], list[int]]:
    losses, clamped = [], []
    for x, y in data:
        if sliced:
            x, y = parity.local_slice(x), parity.local_slice(y)
        loss = model(x, y)
        loss.backward()
        clamped.append(clip())
        opt.step()
        opt.zero_grad()
        losses.append(parity.mean_over_ranks(loss.item()) if sliced else loss.item())
    return losses, clamped


def _torch_clip(model, bound: float):
    def clip() -> int:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        hit = sum(int((g.abs() > bound).sum()) for g in grads)
        torch.nn.utils.clip_grad_value_(model.parameters(), bound)
        return hit

    return clip


def _value_rank() -> dict:
    report = new_report()
    data = parity.batches(STEPS)
    bound = _bound(data)
    ref = parity.make_model()
    ref_losses, report["clamped"] = _train(
        ref, parity.make_optimizer("AdamW", ref), data, sliced=False, clip=_torch_clip(ref, bound)
    )
    ddp_model = parity.make_model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_losses, _ = _train(ddp, parity.make_optimizer("AdamW", ddp_model), data, sliced=True,
                           clip=_torch_clip(ddp_model, bound))
    ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
    report["worst"]["DDP"] = max(ddp_dev.tensors.values())
    for stage, bucket_mb in ((1, 25.0), (2, SMALL_BUCKETS_MB), (3, 25.0)):
        model = parity.make_model()
        config = ZeroConfig(stage=stage, bucket_size_mb=bucket_mb)
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
        losses, _ = _train(model, opt, data, sliced=True,
                           clip=lambda opt=opt: opt.clip_grad_value_(bound))
        record_parity(f"stage{stage}", model, losses, ref, ref_losses, ddp_dev, report)
    return report


def test_clip_grad_value_matches_torch():
    reports = run_ranks(guarded, 2, _value_rank, timeout=TIMEOUT)
    check_reports(reports)
    assert all(n > 0 for n in reports[0]["clamped"]), reports[0]["clamped"]
    print(f"\n[clip value ws=2] worst rel error: {reports[0]['worst']}")


def _accelerate_fp16_rank() -> dict:
    os.environ["ACCELERATE_USE_CPU"] = "1"
    from accelerate import Accelerator

    from zerolite.accelerate import ZeroAccelerator

    data = parity.batches(1)
    bound = _bound(data)
    accelerator = ZeroAccelerator(zero_config=ZeroConfig(stage=2, param_dtype=torch.float16))
    model = parity.make_model()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    accelerator.native_amp = True  # what Accelerate sets for fp16 on a GPU
    accelerator.state._mixed_precision = "fp16"
    sharded = opt.optimizer
    sharded.loss_scaler.scale = 2.0**10  # scaled fp16 gradients stay finite
    before = [m.data.clone() for m in sharded.masters]
    x, y = data[0]
    accelerator.backward(model(parity.local_slice(x), parity.local_slice(y)))
    try:
        Accelerator.unscale_gradients(accelerator)
        stock = "no error"
    except AttributeError as exc:
        stock = str(exc)
    accelerator.unscale_gradients()
    accelerator.clip_grad_value_(model.parameters(), bound)
    opt.step()
    moved = max(float((m.data - b).abs().max()) for m, b in zip(sharded.masters, before))
    return {"stock": stock, "skipped": sharded.step_was_skipped, "bound": bound, "moved": moved}


def test_accelerate_fp16_clip_value_and_unscale_do_not_need_a_scaler():
    for rank, out in enumerate(run_ranks(guarded, 2, _accelerate_fp16_rank, timeout=TIMEOUT)):
        assert "error" not in out, out.get("error")
        assert "unscale_" in out["stock"], (rank, out)  # stock Accelerate needs the scaler
        assert not out["skipped"], (rank, out)
        # Clamped in unscaled units: each rank's largest move of a master element is the
        # bound itself (within fp16's rounding of the scaled bound).
        assert abs(out["moved"] - out["bound"]) <= 1e-3 * out["bound"], (rank, out)
