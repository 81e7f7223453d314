"""fp16 training with dynamic loss scaling: skipped steps, unscaling, parity.

On real gloo groups (world sizes 2 and 4), stages 1, 2 and 3, one launch per world size (a
module-scoped fixture); the ranks return raw measurements and the assertions run here.

- An inf gradient made on one rank only skips the step on every rank, leaves parameters,
  masters and optimizer state unchanged, and halves the scale (`ShardedOptimizer.loss_scaler`).
- With that skipped step, training matches the hand-written fp16 recipe
  (`tests.support.mixed_recipe.mixed_reference`: unscaled in fp32, clipped, skipped on overflow):
  stages 1-2 by `tests.support.mixed_recipe.check_parity`, stage 3 by the same criteria
  (`tests.support.recipe_checks.stage_failures`).
- Unscaling happens after the fp32 upcast: a gradient below fp16's range reaches the
  optimizer intact (world size 1).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
from tests.support import parity
from tests.support.mixed_recipe import (
    POISONED,
    check_parity,
    make_sharded,
    mixed_reference,
    single_thread,
)
from tests.support.recipe_checks import stage_failures
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

WORLD_SIZES = [2, 4]
OVERFLOW_STEP = 3  # the step at which rank 1 alone produces an inf gradient
MAX_NORM = 1.0  # the runs call clip_grad_norm_ (the tiny GPT's norms stay below it)
INIT_SCALE = 2.0**16


def _poison(grad: torch.Tensor) -> torch.Tensor:
    """Tensor hook: the same gradient with element 0 set to inf."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def _state_snapshot(opt) -> dict:
    return {(g, i, k): v.detach().clone()
            for g, group in enumerate(opt.param_groups) for i, t in enumerate(group["params"])
            for k, v in opt.state.get(t, {}).items() if isinstance(v, torch.Tensor)}


def _values(model, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter's full values (stage 3 gathers them; every rank calls), by name."""
    if stage < 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    full = zerolite.full_state_dict(model, rank0_only=False)
    return {n: full[n].clone() for n, _ in model.named_parameters()}


def _fp16_rank(data, stages) -> dict:
    rank = dist.get_rank()
    out = {}
    for stage in stages:
        model, opt = make_sharded(stage, torch.float16)
        if stage < 3:
            target = opt.flats[0].params[0]
            assert opt.flats[0].names[0] == POISONED
            # Element 0 of flat buffer 0 lies in rank 0's shard: rank 1, where the inf is
            # made, holds only finite reduced gradients and must learn of the overflow from
            # the others.
            assert opt.flats[0].layout.shard_range(0)[0] == 0
        else:  # the root unit's buffer (the last) holds it
            target = dict(model.named_parameters())[POISONED]
        rec: dict = {"skipped": [], "scales": [], "norms": [], "losses": [], "unchanged": None}
        for step, (x, y) in enumerate(data):
            inject = step == OVERFLOW_STEP and rank == 1
            # Stages 2-3 drop param.grad during backward: a tensor hook poisons it on the way in.
            handle = target.register_hook(_poison) if inject and stage >= 2 else None
            loss = model(parity.local_slice(x), parity.local_slice(y))
            rec["scales"].append(opt.loss_scaler.scale)
            opt.scale_loss(loss).backward()
            if handle is not None:
                handle.remove()
            if inject and stage == 1:
                # Stage 1: param.grad is this rank's local gradient (a view of its buffer).
                with torch.no_grad():
                    target.grad.view(-1)[0] = float("inf")
            if step == OVERFLOW_STEP:
                params_before = _values(model, stage)
                state_before = _state_snapshot(opt)
                masters_before = [m.data.clone() for m in opt.masters]
            norm = opt.clip_grad_norm_(MAX_NORM)
            opt.step()
            if step == OVERFLOW_STEP:
                state_after = _state_snapshot(opt)
                rec["unchanged"] = {
                    "params": all(torch.equal(p, params_before[n])
                                  for n, p in _values(model, stage).items()),
                    "state_keys": state_after.keys() == state_before.keys(),
                    "state": all(k in state_after and torch.equal(v, state_after[k])
                                 for k, v in state_before.items()),
                    "n_state_tensors": len(state_before),
                    "masters": all(torch.equal(a, m.data)
                                   for a, m in zip(masters_before, opt.masters)),
                }
            rec["skipped"].append(opt.step_was_skipped)
            opt.zero_grad(set_to_none=True)
            rec["norms"].append(norm.item())
            rec["losses"].append(parity.mean_over_ranks(loss.item()))
        rec["scale"] = opt.loss_scaler.scale
        rec["scaler_state"] = dict(opt.loss_scaler.state_dict())
        rec["state_dict_scaler"] = opt.state_dict()["zerolite"]["loss_scaler"]
        rec["params"] = _values(model, stage)
        rec["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        out[stage] = rec
    return out


@pytest.fixture(scope="module")
def data():
    return parity.batches()


@pytest.fixture(scope="module")
def references(data):
    with single_thread():
        return {("fp16", slices): mixed_reference(torch.float16, data, slices=slices,
                                                  loss_scale=INIT_SCALE,
                                                  overflow_step=OVERFLOW_STEP, max_norm=MAX_NORM)
                for slices in (1, *WORLD_SIZES)}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def fp16_run(request, data):
    return request.param, run_ranks(_fp16_rank, request.param, data, (1, 2, 3), timeout=120)


def test_fp16_overflow_on_one_rank_skips_everywhere(fp16_run, references):
    """An inf on one rank skips the step on every rank, changes nothing, halves the scale."""
    n, results = fp16_run
    ref = references["fp16", n]
    steps = len(ref["losses"])
    expected_skips = [s == OVERFLOW_STEP for s in range(steps)]
    assert ref["skipped"] == expected_skips  # no natural overflow in the reference either
    expected_scaler = {"scale": INIT_SCALE / 2, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000, "good_steps": steps - 1 - OVERFLOW_STEP}
    for stage in (1, 2, 3):
        for rank, res in enumerate(results):
            r = res[stage]
            where = f"N={n} stage {stage} rank {rank}"
            assert r["param_dtypes"] == ["torch.float16"], where
            assert r["skipped"] == expected_skips, (where, r["skipped"])
            u = r["unchanged"]
            assert u["n_state_tensors"] > 0, where  # state existed before the skipped step
            assert u["params"] and u["masters"] and u["state_keys"] and u["state"], (where, u)
            assert r["scales"][OVERFLOW_STEP] == INIT_SCALE, (where, r["scales"])
            assert r["scales"][OVERFLOW_STEP + 1] == INIT_SCALE / 2 == r["scale"], (
                where, r["scales"])
            assert r["scales"] == ref["scales"], (where, r["scales"], ref["scales"])
            assert math.isinf(r["norms"][OVERFLOW_STEP]), (where, r["norms"])
            for s, (a, b) in enumerate(zip(r["norms"], ref["norms"], strict=True)):
                if s != OVERFLOW_STEP:  # the true global norm of the unscaled gradient
                    assert math.isfinite(a) and abs(a - b) <= 1e-2 * b, (where, s, a, b)
            assert r["scaler_state"] == expected_scaler, (where, r["scaler_state"])
            assert r["state_dict_scaler"] == expected_scaler, (where, r["state_dict_scaler"])
    r0 = results[0][1]
    print(f"\nN={n}: skipped {r0['skipped'].index(True)}, scales {r0['scales']}, "
          f"norms {[f'{x:.3g}' for x in r0['norms']]}")


def test_fp16_parity_with_same_recipe_reference(fp16_run, references):
    """With the skipped step, training matches the fp16 recipe (unscaled in fp32)."""
    n, results = fp16_run
    failures = check_parity("fp16", n, results, references["fp16", n], references["fp16", 1], None)
    assert not failures, "\n".join(failures)


def test_fp16_stage3_parity_with_same_recipe_reference(fp16_run, references):
    """Stage 3, with the skipped step: the fp16 recipe by the criteria stages 1-2 meet."""
    n, results = fp16_run
    failures = stage_failures(f"N={n} stage 3 fp16", [res[3] for res in results],
                              references["fp16", n], references["fp16", 1], None)
    assert not failures, "\n".join(failures)


class _TinyGrad(nn.Module):
    """d loss / d w = 1e-8: representable in fp16 only after loss scaling (fp16's smallest
    subnormal is 6e-8), which is what loss scaling is for."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self) -> torch.Tensor:
        return (self.w.float() * 1e-8).sum()


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_unscaling_keeps_gradients_below_fp16_range(stage):
    """The fp32 gradient handed to the optimizer is the unscaled one.

    The scaled gradient (65536 x 1e-8 = 6.6e-4) is a normal fp16 number; unscaled, 1e-8
    is not representable in fp16, so unscaling must happen after the upcast to fp32 (as
    torch's GradScaler and DeepSpeed do). World size 1: the same code path, no launch.
    """
    model = _TinyGrad()
    opt = zerolite.shard(model, torch.optim.Adam(model.parameters(), lr=0.1),
                         zerolite.ZeroConfig(stage=stage, param_dtype=torch.float16))
    seen: list[torch.Tensor] = []
    opt.optimizer.register_step_pre_hook(
        lambda o, args, kwargs: seen.extend(p.grad.clone()
                                            for g in o.param_groups for p in g["params"]))
    opt.scale_loss(model()).backward()
    opt.step()
    assert not opt.step_was_skipped
    grad = torch.cat(seen)
    assert grad.dtype == torch.float32
    # Exact up to rounding the scaled gradient to fp16 (2^-11 relative).
    assert torch.allclose(grad, torch.full_like(grad, 1e-8), rtol=1e-3, atol=0), grad
    # Adam's first step is lr * g / (|g| + eps) = 0.1 * 1e-8 / 2e-8: w moves from 1 to ~0.95.
    assert torch.allclose(model.w.float(), torch.full((8,), 0.95), atol=1e-3), model.w
