"""Every feature crossed with every other: a pairwise set of configurations, each against the
same run without its features (`tests.support.combination_matrix`: the axes, the refusals, the rule
per feature), on one 4-rank gloo launch.

Each configuration trains parity's tiny GPT with AdamW for 3 steps of 16 rows and is
compared twice:

- with its *bitwise* features (offload, offload_params, async save, whole-tensor ownership on
  point-to-point collectives) removed (`without_bitwise`): the same losses and parameters,
  bit for bit;
- with every feature removed (`base`): by the loosest rule of its features.

Each feature is also seen at work, so that one silently dropped in a combination fails:
the offload tier holds bytes; offload_params leaves no shard in memory between steps; a
quantized run is not its unquantized base bit for bit;
hybrid has replica groups of 2; native collectives are not point-to-point; an asynchronous
save taken after step 1 while steps 2-3 ran loads back equal to the parameters at the
call; clipping clipped.

The pairwise set (15 configurations today) runs in the suite; the full product of accepted
configurations is marked ``slow`` and runs with ``make test-matrix``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from tests.support.combination_matrix import (
    base,
    full_product,
    label,
    pairwise,
    rule,
    without_bitwise,
)
from tests.support.memory_accounting import tier_bytes_held
from tests.support.mixed_recipe import TENSOR_TOL
from tests.support.rank_reports import guarded
from zerolite import checkpoint as ckpt
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

WORLD = 4
STEPS = 3
ROWS = 16  # 4 per rank: 2 micro-batches of 2 when accumulating
CLIP = 0.1  # below the tiny GPT's gradient norm at every step: clipping acts
QUANTIZED_TOL = 1e-2  # the quantized tests' per-step loss bound (docs/hybrid-and-quantized.md)
CHUNK = 24  # configurations per launch of the full product (its bases run once each)


def _zero_config(c: dict, root: Path) -> zerolite.ZeroConfig:
    disk = "disk" in (c["offload"], c["offload_params"])
    if disk:
        (root / f"tier-r{dist.get_rank()}").mkdir(parents=True, exist_ok=True)
    return zerolite.ZeroConfig(
        stage=c["stage"], param_dtype=torch.bfloat16 if c["dtype"] == "bf16" else torch.float32,
        bucket_size_mb=0.01, offload=c["offload"], offload_params=c["offload_params"],
        offload_dir=str(root / f"tier-r{dist.get_rank()}") if disk else None,
        partition=c["partition"], shard_group_size=c["hybrid"],
        quantize_gather=c["quantize"] in ("gather", "both"),
        quantize_reduce=c["quantize"] in ("reduce", "both"), collectives=c["collectives"],
    )


def _build(c: dict, root: Path):
    model = parity.make_model()
    return model, zerolite.shard(model, parity.make_optimizer("AdamW", model),
                                 _zero_config(c, root))


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in zerolite.full_state_dict(model, rank0_only=False).items()}


def _steps(model, opt, c: dict, data, clip) -> tuple[list[float], list[float]]:
    """Train on ``data`` by ``c``'s recipe; (losses, clip norms)."""
    losses, norms, micro = [], [], c["accumulate"]
    for x, y in data:
        x, y = parity.local_slice(x), parity.local_slice(y)
        m, total = x.shape[0] // micro, 0.0
        for k in range(micro):
            loss = model(x[k * m:(k + 1) * m], y[k * m:(k + 1) * m]) / micro
            loss.backward()
            total += loss.item()
        if c["clip"]:
            norms.append(float(clip(CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(parity.mean_over_ranks(total))
    return losses, norms


def _run(c: dict, root: Path) -> dict:
    """Train ``c``; losses, full parameters, and what each feature did."""
    root.mkdir(parents=True, exist_ok=True)
    model, opt = _build(c, root)
    data = parity.batches(STEPS, batch=ROWS)
    saved = None
    if c["async_save"]:
        losses, norms = _steps(model, opt, c, data[:1], opt.clip_grad_norm_)
        at_call = _full(model)
        pending = ckpt.save(root / "ckpt", model, opt, blocking=False)
        more = _steps(model, opt, c, data[1:], opt.clip_grad_norm_)
        losses, norms = losses + more[0], norms + more[1]
        pending.wait()
        fresh, fresh_opt = _build(c, root / "fresh")
        ckpt.load(root / "ckpt", fresh, fresh_opt)
        saved = all(torch.equal(v, at_call[k]) for k, v in _full(fresh).items())
    else:
        losses, norms = _steps(model, opt, c, data, opt.clip_grad_norm_)
    replicas = opt.group.replicas
    return {"losses": losses, "params": _full(model), "saved": saved,
            "clipped": any(n > CLIP for n in norms), "tier": tier_bytes_held(model),
            "replicas": None if replicas is None else replicas.size,
            "point_to_point": opt.group.point_to_point, "parked": _parked(model)}


def _parked(model) -> bool:
    """offload_params: between steps the tier holds every shard and memory none."""
    tier = state_of(model).params_tier
    if tier is None:
        return False
    tier.drain()
    return tier.capacity > 0 and tier.resident_bytes == 0


def _ddp_bound(c: dict) -> float:
    """`parity.loss_bound` of DDP's own per-step loss deviation between summation orders
    (rotated slices; micro-batches under ``no_sync``) on ``c``'s data and clipping."""
    data = parity.batches(STEPS, batch=ROWS)
    runs = {}
    for order in ("plain", "rotated", "micro2"):
        model = parity.make_model()
        ddp = DistributedDataParallel(model)
        opt = parity.make_optimizer("AdamW", model)
        clip = (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) if c[
            "clip"] else None
        runs[order] = parity.train_ddp(ddp, opt, data, order, before_step=clip)
    deviations = [d for order in ("rotated", "micro2")
                  for d in parity.loss_deviations(runs[order], runs["plain"])]
    return parity.loss_bound(deviations)


def _problems(c: dict, got: dict, bases: dict, bounds: dict) -> list[str]:
    """What is wrong with ``got`` (``c``'s run) against its bases, by `RULES`."""
    out = []
    near = without_bitwise(c)
    if near != c:
        ref = bases[label(near)]
        if got["losses"] != ref["losses"] or any(
                not torch.equal(v, ref["params"][k]) for k, v in got["params"].items()):
            out.append(f"not bitwise {label(near)}")
    ref = bases[label(base(c))]
    how = rule(c)
    if how == "order":
        tol = bounds[c["clip"]] if c["dtype"] == "fp32" else TENSOR_TOL
    else:
        tol = 0.0 if how == "bitwise" else QUANTIZED_TOL
    devs = parity.loss_deviations(got["losses"], ref["losses"])
    if not all(d <= tol for d in devs):  # NaN fails
        out.append(f"{how}: loss deviations {devs} beyond {tol:.2e} of {label(base(c))}")
    out += _features_at_work(c, got, ref)
    return out


def _features_at_work(c: dict, got: dict, ref: dict) -> list[str]:
    checks = {
        "tier holds no bytes": c["offload"] is not None and not got["tier"] > 0,
        "parameter shards not parked": c["offload_params"] is not None and not got["parked"],
        "quantized run is bitwise unquantized": c["quantize"] is not None and all(
            torch.equal(v, ref["params"][k]) for k, v in got["params"].items()),
        "no replica groups of 2": c["hybrid"] is not None and got["replicas"] != 2,
        "native collectives ran point-to-point": c["collectives"] == "native" and got[
            "point_to_point"],
        "async save did not load the state at the call": c["async_save"] and not got["saved"],
        "clipping never acted": c["clip"] and not got["clipped"],
        "not finite": not all(math.isfinite(x) for x in got["losses"]),
    }
    return [what for what, bad in checks.items() if bad]


def _matrix_rank(configs: list[dict], root: str) -> dict:
    """Every configuration, its bases and DDP's bounds: per configuration, its problems."""
    runs: dict[str, dict] = {}

    def run(c: dict) -> dict:
        name = label(c)
        if name not in runs:
            runs[name] = _run(c, Path(root) / str(len(runs)))
        return runs[name]

    bounds = {clip: _ddp_bound({"clip": clip}) for clip in (False, True)}
    out = {}
    for c in configs:
        got = run(c)
        run(base(c))
        run(without_bitwise(c))
        out[label(c)] = _problems(c, got, runs, bounds)
    return {"problems": out, "bounds": bounds}


def _check(configs: list[dict], root: Path) -> None:
    reports = run_ranks(guarded, WORLD, _matrix_rank, configs, str(root), timeout=600)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        bad = {name: p for name, p in rep["problems"].items() if p}
        assert not bad, (r, bad)
    assert len(reports[0]["problems"]) == len(configs)


PAIRWISE = pairwise()


def test_pairwise_combinations_match_the_run_without_their_features(tmp_path):
    """Every pair of accepted values, in ~20 configurations (`pairwise`)."""
    assert 12 <= len(PAIRWISE) <= 30, len(PAIRWISE)
    _check(PAIRWISE, tmp_path)


_PRODUCT = list(full_product())


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(0, len(_PRODUCT), CHUNK))
def test_full_product(tmp_path, chunk):
    """`make test-matrix`: every accepted configuration, `CHUNK` per launch."""
    _check(_PRODUCT[chunk:chunk + CHUNK], tmp_path)
