"""Hybrid sharding (`zerolite.comm.hybrid`): 4 gloo ranks as 2 "nodes" x 2, k = 2.

Two launches of 4 ranks; the ranks measure and the assertions run here (checkpoints and
bad input: `tests.checkpoint.test_hybrid_checkpoint`).

- Parity: stages 1-3 with gradient accumulation (``no_sync``) and clipping match DDP by
  `tests.support.parity`'s metric in fp32, and the same-recipe bf16 reference
  (`tests.support.mixed_recipe`) in bf16; fp16 with loss scaling and a step skipped for an overflow
  on one rank (stages 2-3) the fp16 recipe. A 2-D ``DeviceMesh`` gives bitwise the results
  of k = 2.
- Links: per step and rank, nothing is sent point-to-point across nodes; the gradient
  all-reduces across replica groups move 2 (R-1)/R Psi/k elements (padding included);
  within a node hybrid moves exactly what the flat stages move at k ranks (the same model
  sharded flat over the node's two ranks). torch's native reduce-scatter and all-gather
  give the results of the point-to-point ones (1e-6), and so does hybrid inside a subgroup
  of the default group (its process groups created by their members only).
- Memory: `estimate` with k equals `footprint` byte for byte at stage 3; `formula` with k
  is 16 Psi/k (fp32, Adam). The environment variable and bad values of the config field.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from tests.support.comm_spy import CommSpy, link_elements
from tests.support.mixed_recipe import POISONED, TENSOR_TOL, mixed_reference, single_thread
from tests.support.parity import loss_deviations
from tests.support.rank_reports import SMALL_BUCKETS_MB, guarded, new_report, record_parity
from zerolite import ZeroConfig
from zerolite.memory import estimate, footprint, formula
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

N, K = 4, 2
R = N // K
STEPS = 3
BATCH = 16  # 4 per rank, two micro-batches of 2
MICRO = 2
TIMEOUT = 150.0
FP16_OVERFLOW = 1  # the step at which rank 1 alone produces an inf gradient (fp16 runs)
INIT_SCALE = 2.0**16


def _max_norm(data) -> float:
    """Half the first step's whole-batch gradient norm: clipping is active."""
    model = parity.make_model()
    x, y = data[0]
    model(x, y).backward()
    return 0.5 * float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))


def _train(model, opt, data, *, clip, no_sync, sliced=True) -> list[float]:
    """Gradient accumulation over MICRO micro-batches (all but the last under no_sync),
    clipping, step; returns the per-step loss averaged over ranks."""
    losses = []
    for x, y in data:
        if sliced:
            x, y = parity.local_slice(x), parity.local_slice(y)
        per = x.shape[0] // MICRO
        total = 0.0
        for m in range(MICRO):
            xs, ys = x[m * per:(m + 1) * per], y[m * per:(m + 1) * per]
            if m < MICRO - 1 and no_sync is not None:
                with no_sync():
                    loss = model(xs, ys)
                    (loss / MICRO).backward()
            else:
                loss = model(xs, ys)
                (loss / MICRO).backward()
            total += loss.item()
        clip()
        opt.step()
        opt.zero_grad()
        losses.append(parity.mean_over_ranks(total / MICRO) if sliced else total / MICRO)
    return losses


def _hybrid(stage, dtype=torch.float32, process_group=None, k=K, reduce_dtype=None,
            collectives="auto"):
    model = parity.make_model()
    config = ZeroConfig(stage=stage, param_dtype=dtype, reduce_dtype=reduce_dtype,
                        bucket_size_mb=SMALL_BUCKETS_MB, collectives=collectives,
                        shard_group_size=k,
                        process_group=process_group)
    return model, zerolite.shard(model, parity.make_optimizer("AdamW", model), config)


def _poison(grad: torch.Tensor) -> torch.Tensor:
    """Tensor hook: the same gradient with element 0 set to inf."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def _fp16_run(stage: int, k: int | None, data, max_norm: float) -> dict:
    """fp16 with zerolite's loss scaling, clipping, no accumulation; at FP16_OVERFLOW rank 1
    alone gets an inf in `POISONED`'s gradient (the recipe's slice 1)."""
    model, opt = _hybrid(stage, torch.float16, k=k)
    target = dict(model.named_parameters())[POISONED]
    out: dict = {"skipped": [], "scales": [], "losses": []}
    for step, (x, y) in enumerate(data):
        handle = (target.register_hook(_poison)
                  if step == FP16_OVERFLOW and dist.get_rank() == 1 else None)
        loss = model(parity.local_slice(x), parity.local_slice(y))
        out["scales"].append(opt.loss_scaler.scale)
        opt.scale_loss(loss).backward()
        if handle is not None:
            handle.remove()
        opt.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
        out["skipped"].append(opt.step_was_skipped)
        out["losses"].append(parity.mean_over_ranks(loss.item()))
    full = zerolite.full_state_dict(model, rank0_only=False)
    out["params"] = {n: full[n].clone() for n, _ in model.named_parameters()}
    out["across"] = opt.group.replicas is not None and opt.group.replicas.size == R
    return out


def _parity_rank(data, max_norm) -> dict:
    report = new_report()
    ref = parity.make_model()
    ref_opt = parity.make_optimizer("AdamW", ref)
    ref_losses = _train(ref, ref_opt, data, sliced=False, no_sync=None,
                        clip=lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    ddp_model = parity.make_model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_losses = _train(
        ddp, parity.make_optimizer("AdamW", ddp_model), data, no_sync=ddp.no_sync,
        clip=lambda: torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm))
    ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
    report["bf16"] = {}
    finals = {}
    kinds = ((torch.float32, K), (torch.bfloat16, K), (torch.bfloat16, None))
    runs = [(stage, dtype, k, None) for dtype, k in kinds for stage in (1, 2, 3)]
    runs += [(2, torch.bfloat16, k, torch.float32) for k in (K, None)]
    for stage, dtype, k, reduce_dtype in runs:
        model, opt = _hybrid(stage, dtype, k=k, reduce_dtype=reduce_dtype)
        losses = _train(model, opt, data, no_sync=model.no_sync,
                        clip=lambda opt=opt: opt.clip_grad_norm_(max_norm))
        label = f"hybrid k={K} stage {stage} {dtype}"
        full = zerolite.full_state_dict(model, rank0_only=False)
        if dtype == torch.float32:
            record_parity(label, model, losses, ref, ref_losses, ddp_dev, report)
            finals[stage] = full
        else:
            report["bf16"][stage, k, reduce_dtype] = {"losses": losses, "params": full}
    report["fp16"] = {(stage, k): _fp16_run(stage, k, data, max_norm)
                      for stage in (2, 3) for k in (K, None)}
    # The same layout named by a 2-D mesh (replicate x shard): bitwise the results of k=2.
    mesh = init_device_mesh("cpu", (R, K), mesh_dim_names=("replicate", "shard"))
    model, opt = _hybrid(2, process_group=mesh)
    _train(model, opt, data, no_sync=model.no_sync,
           clip=lambda: opt.clip_grad_norm_(max_norm))
    full = zerolite.full_state_dict(model, rank0_only=False)
    report["mesh_equal"] = all(torch.equal(full[n], finals[2][n]) for n in full)
    report["mesh_group"] = (opt.group.size, opt.group.replicas.size)
    return report


@pytest.fixture(scope="module")
def parity_run():
    data = parity.batches(STEPS, batch=BATCH)
    max_norm = _max_norm(data)
    reports = run_ranks(guarded, N, _parity_rank, data, max_norm, timeout=TIMEOUT)
    return data, max_norm, reports


def test_parity_with_ddp_fp32_stages_1_to_3(parity_run):
    """GA + clipping, fp32: every tensor within max(2 x DDP's error, 1e-6) of the reference,
    losses within 1e-5; a 2-D mesh gives bitwise the same parameters as k=2."""
    _, _, reports = parity_run
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        assert not rep["failures"], f"rank {r}: " + "\n".join(rep["failures"])
        assert rep["mesh_equal"], f"rank {r}: the mesh run differs from k={K}"
        assert rep["mesh_group"] == (K, R), rep["mesh_group"]
    print(f"\nhybrid fp32 worst tensor error vs reference: {reports[0]['worst']}")


def _floor_problems(label: str, flat: dict, sliced: dict, whole: dict) -> list[str]:
    """The flat stage's own error, which bounds hybrid's below, is itself bounded: per tensor
    within max(2 x the recipe's own data-parallel noise, TENSOR_TOL) of the recipe run on the
    whole batch at once (the noise: the sliced recipe against the whole-batch one)."""
    noise = {n: parity.rel_err(p, whole["params"][n]) for n, p in sliced["params"].items()}
    errors = {n: parity.rel_err(flat["params"][n], p) for n, p in whole["params"].items()}
    bad = {n: (e, noise[n]) for n, e in errors.items() if not e <= max(2 * noise[n], TENSOR_TOL)}
    return [f"{label}: the flat stage beyond max(2 x the recipe's noise, {TENSOR_TOL}) of the "
            f"whole-batch recipe: {bad}"] if bad else []


def test_parity_bf16_stages_1_to_3(parity_run):
    """bf16 with fp32 masters, GA + clipping, against the hand-written recipe (gradient =
    the mean of every micro-batch's, added in fp32 and rounded once to bf16; no DDP holds
    fp32 masters).

    - With a bf16 reduce dtype, hybrid rounds the reduced gradient twice (after the
      reduce-scatter, and in the bf16 all-reduce across replica groups, as any bf16 ring
      does), the flat stages once: per tensor within max(2 x the flat stage's own error,
      2 x TENSOR_TOL) of the recipe (flat stages: 2 x DDP's). Accumulating micro-batches
      in bf16 perturbs gradients that are rounding noise (attention key biases) and Adam
      turns noise into lr-sized steps, so flat and hybrid both sit far from the recipe
      there; the flat stage's error is the floor, and it is bounded here in turn, at every
      stage (`_floor_problems`).
    - With ``reduce_dtype=torch.float32`` the same rule. Not bitwise: hybrid adds the four
      ranks' fp32 gradients as (a + b) + (c + d), the flat stage in its owner's order. Sums
      of a few bf16 values are mostly exact in fp32, so the two often agree to the bit, but
      not where the CPU's bf16 kernels (oneDNN: AVX2, AVX-512 or AMX) give wider exponents.
    - Losses within TENSOR_TOL of the recipe; every rank holds the same parameters."""
    data, max_norm, reports = parity_run
    with single_thread():
        recipe = mixed_reference(torch.bfloat16, data, slices=N * MICRO, max_norm=max_norm)
        whole = mixed_reference(torch.bfloat16, data, slices=1, max_norm=max_norm)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
    runs = reports[0]["bf16"]
    for stage in (1, 2, 3):
        ours, flat = runs[stage, K, None], runs[stage, None, None]
        for rep in reports[1:]:
            for name, p in rep["bf16"][stage, K, None]["params"].items():
                assert torch.equal(p, ours["params"][name]), (stage, name)
        problems = _floor_problems(f"stage {stage}", flat, recipe, whole)
        assert not problems, problems
        errors = {n: parity.rel_err(ours["params"][n], p) for n, p in recipe["params"].items()}
        floor = {n: parity.rel_err(flat["params"][n], p) for n, p in recipe["params"].items()}
        tol = {n: max(2 * floor[n], 2 * TENSOR_TOL) for n in floor}
        bad = {n: (e, floor[n]) for n, e in errors.items() if not e <= tol[n]}
        vs_recipe = loss_deviations(ours["losses"], recipe["losses"])
        print(f"\nhybrid bf16 stage {stage}: worst tensor vs recipe {max(errors.values()):.2e} "
              f"(flat: {max(floor.values()):.2e}), loss {max(vs_recipe):.2e}")
        assert not bad, bad
        assert all(d <= TENSOR_TOL for d in vs_recipe), vs_recipe
    fp32_reduce = runs[2, K, torch.float32]["params"]
    flat = runs[2, None, torch.float32]["params"]
    errors = {n: parity.rel_err(fp32_reduce[n], p) for n, p in recipe["params"].items()}
    floor = {n: parity.rel_err(flat[n], p) for n, p in recipe["params"].items()}
    bad = {n: (e, floor[n]) for n, e in errors.items() if e > max(2 * floor[n], 2 * TENSOR_TOL)}
    assert not bad, bad


def test_fp16_loss_scaling_with_hybrid(parity_run):
    """fp16 parameters with zerolite's loss scaling, stages 2-3, hybrid (k = 2 of 4) and flat,
    an inf on rank 1 alone at FP16_OVERFLOW: the step is skipped on every rank and the scale
    halves, as in the hand-written fp16 recipe (`tests.support.mixed_recipe.mixed_reference`:
    unscaled in fp32, clipped, skipped on overflow); every rank holds the same parameters.
    Per tensor within max(2 x the recipe's own data-parallel noise, TENSOR_TOL) of the
    recipe (the noise: the recipe over N slices against the recipe over the whole batch; it
    is large exactly where Adam amplifies rounding, the attention key biases whose true
    gradient is 0): hybrid rounds the reduced gradient to fp16 twice (within the node, then
    across), another rounding of the same sum, as another summation order is; the flat
    stages sum the clipping norm in zerolite's fixed order (`zerolite.plan.norm_tree`, the
    same at every stage) and the recipe as torch does, so their clip coefficients differ in
    the last bits. Losses within TENSOR_TOL of the recipe's."""
    data, max_norm, reports = parity_run
    with single_thread():
        recipe, whole = (mixed_reference(torch.float16, data, slices=slices,
                                         loss_scale=INIT_SCALE, overflow_step=FP16_OVERFLOW,
                                         max_norm=max_norm) for slices in (N, 1))
    noise = {n: parity.rel_err(p, whole["params"][n]) for n, p in recipe["params"].items()}
    expected = [s == FP16_OVERFLOW for s in range(len(data))]
    assert recipe["skipped"] == expected
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        for (stage, k), got in rep["fp16"].items():
            where = (r, stage, k)
            assert got["skipped"] == expected and got["scales"] == recipe["scales"], (where, got)
            assert got["across"] == (k == K), where  # hybrid ran with R replica groups
            assert all(torch.equal(p, reports[0]["fp16"][stage, k]["params"][n])
                       for n, p in got["params"].items()), where
    for stage in (2, 3):
        flat, ours = reports[0]["fp16"][stage, None], reports[0]["fp16"][stage, K]
        floor = {n: parity.rel_err(flat["params"][n], p) for n, p in recipe["params"].items()}
        errors = {n: parity.rel_err(ours["params"][n], p) for n, p in recipe["params"].items()}
        print(f"\nfp16 stage {stage}: worst tensor vs recipe hybrid {max(errors.values()):.2e}, "
              f"flat {max(floor.values()):.2e}")
        for which, got in (("flat", floor), ("hybrid", errors)):
            bad = {n: (e, noise[n]) for n, e in got.items()
                   if not e <= max(2 * noise[n], TENSOR_TOL)}
            assert not bad, (stage, which, "(error, the recipe's noise)", bad)
        for run in (flat, ours):
            deviations = loss_deviations(run["losses"], recipe["losses"])
            assert all(d <= TENSOR_TOL for d in deviations), (stage, deviations)


# -- bytes on each link ------------------------------------------------------------------


def _per_step(model, opt, data) -> list[tuple[dict, int, int]]:
    """Per step: elements by link, and the count and elements of the float point-to-point
    sends to this rank's replicas (the gradient shards' mean across replica groups: a
    reduce-scatter and an all-gather of R parts, so that each element is summed in replica
    order wherever it lies)."""
    out = []
    for x, y in data:
        with CommSpy() as spy:
            model(parity.local_slice(x), parity.local_slice(y)).backward()
            opt.step()
        opt.zero_grad()
        replicas = opt.group.replicas
        members = () if replicas is None else tuple(
            dist.get_process_group_ranks(replicas.pg))
        grads = [e for e in spy.events if e[0] == "isend" and e[4][0] in members
                 and e[5] is not None and e[5].is_floating_point]
        out.append((link_elements(spy.events, K), len(grads), sum(e[1] for e in grads)))
    return out


def _links_rank() -> dict:
    data = parity.batches(2, batch=8)
    node = dist.get_rank() // K
    # The flat stages on this node's K ranks: what hybrid must move within a node.
    node_groups = [dist.new_group(list(range(i, i + K))) for i in range(0, N, K)]
    out = {}
    for stage in (1, 2, 3):
        model, opt = _hybrid(stage)
        out["hybrid", stage] = {
            "steps": _per_step(model, opt, data),
            "shard_numel": sum(f.layout.shard_numel for f in opt.flats),
            # Each shard crosses in R parts, the last one padded.
            "parts": sum(-(-f.layout.shard_numel // R) for f in opt.flats),
            "psi": sum(f.layout.numel for f in opt.flats),
            "buffers": len(opt.flats),
        }
        if stage == 3:
            fp = footprint(opt)
            fresh = parity.make_model()
            est = estimate(fresh, world_size=N, rank=dist.get_rank(),
                           optimizer=parity.make_optimizer("AdamW", fresh),
                           config=ZeroConfig(stage=3, bucket_size_mb=SMALL_BUCKETS_MB,
                                             shard_group_size=K))
            out["memory"] = [(getattr(fp, f), getattr(est, f))
                             for f in ("params", "grads", "master", "optimizer_state")]
        model, opt = _hybrid(stage, process_group=node_groups[node], k=None)
        out["flat_k", stage] = _per_step(model, opt, data)
        model, opt = _hybrid(stage, k=None)
        out["flat_n", stage] = _per_step(model, opt, data)
    # torch.distributed's own reduce-scatter and all-gather (what NCCL runs) within groups.
    finals = []
    for collectives in ("point_to_point", "native"):
        model, opt = _hybrid(2, collectives=collectives)
        _train_steps(model, opt)
        finals.append(zerolite.full_state_dict(model, rank0_only=False))
    out["native_vs_p2p"] = max(parity.rel_err(finals[1][n], p) for n, p in finals[0].items())
    # Hybrid inside a subgroup (k=1 within each node: DDP there), whose groups only their
    # members create: the same parameters as the flat stage on the node.
    finals = []
    for k in (1, None):
        model, opt = _hybrid(2, process_group=node_groups[node], k=k)
        _train_steps(model, opt)
        finals.append(zerolite.full_state_dict(model, rank0_only=False))
    out["subgroup_vs_flat"] = max(parity.rel_err(finals[0][n], p) for n, p in finals[1].items())
    return out


def test_elements_per_link_equal_the_formula():
    reports = run_ranks(guarded, N, _links_rank, timeout=TIMEOUT)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        for stage in (1, 2, 3):
            h = rep["hybrid", stage]
            # 2 (R-1)/R Psi/k, with the padding that makes Psi split into k equal shards and
            # each shard into R equal parts.
            expected = 2 * (R - 1) * h["parts"]
            assert h["shard_numel"] * K >= h["psi"] > (h["shard_numel"] - h["buffers"]) * K
            assert R * h["parts"] < h["shard_numel"] + R * h["buffers"]
            for s, (links, calls, grad_elements) in enumerate(h["steps"]):
                where = f"rank {r} stage {stage} step {s}"
                assert links["across"] == expected, (where, links, expected)
                # Once per bucket: R - 1 parts out in the reduce-scatter, R - 1 in the gather.
                assert (calls, grad_elements) == (2 * (R - 1) * h["buffers"], expected), where
                flat_k = rep["flat_k", stage][s][0]
                assert flat_k["across"] == 0, where
                assert links["within"] == flat_k["within"], (where, links, flat_k)
            flat_n = rep["flat_n", stage][0][0]
            if r == 0:
                print(f"\nstage {stage} rank 0 elements/step: hybrid k={K} within "
                      f"{links['within']:.0f} across {links['across']:.0f} "
                      f"(2(R-1)/R Psi/k, Psi={h['psi']}); flat N={N} within "
                      f"{flat_n['within']:.0f} across {flat_n['across']:.0f}")
            assert flat_n["across"] > K * links["across"] * 0.9, (r, stage, flat_n, links)
        for fp, est in rep["memory"]:
            assert fp == est, rep["memory"]
        assert rep["native_vs_p2p"] <= 1e-6, rep["native_vs_p2p"]
        assert rep["subgroup_vs_flat"] <= 1e-6, rep["subgroup_vs_flat"]


def test_formula_takes_k():
    psi = 7_500_000_000
    hybrid = formula(psi, world_size=64, stage=3, shard_group_size=8)
    assert hybrid == formula(psi, world_size=8, stage=3)
    assert hybrid.model_states == 16 * psi // 8  # 16 Psi / k, fp32 Adam
    assert estimate(psi, world_size=64, config=ZeroConfig(stage=3, shard_group_size=8)) == hybrid
    with pytest.raises(ValueError, match="got 3"):
        formula(psi, world_size=64, stage=3, shard_group_size=3)


def _train_steps(model, opt, steps=2):
    for x, y in parity.batches(steps, batch=8):
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        opt.step()
        opt.zero_grad()


def test_config_shard_group_size(monkeypatch):
    monkeypatch.setenv("ZEROLITE_SHARD_GROUP_SIZE", "2")
    assert ZeroConfig().shard_group_size == 2
    monkeypatch.setenv("ZEROLITE_SHARD_GROUP_SIZE", "node")
    assert ZeroConfig().shard_group_size == "node"
    monkeypatch.setenv("ZEROLITE_SHARD_GROUP_SIZE", "none")
    assert ZeroConfig().shard_group_size is None
    assert ZeroConfig(shard_group_size=4).shard_group_size == 4
    monkeypatch.setenv("ZEROLITE_SHARD_GROUP_SIZE", "two")
    with pytest.raises(ValueError, match="'two'"):
        ZeroConfig()
    monkeypatch.delenv("ZEROLITE_SHARD_GROUP_SIZE")
    for bad in (0, -2, 1.5, True, "nodes"):
        with pytest.raises(ValueError, match="ZeroConfig.shard_group_size"):
            ZeroConfig(shard_group_size=bad)
