"""Resume across any change: a checkpoint saved under one accepted setup loads under any
other (`tests.support.resume_matrix`: the axes -- world size 1/2/4, stage, partition, shard
groups, offload on/off/fraction, quantization, parameter dtype, bucket size -- and the
pairs).

For each (save, load) pair, parity's tiny GPT trains 2 AdamW steps under the save setup
and is saved, then 2 more steps (the uninterrupted run). Under the load setup a fresh
model loads it, is saved again at once, and trains the same 2 steps. Then, reading both
checkpoints' files (`tests.support.checkpoint_contents`):

- the fp32 masters and every optimizer state tensor, reassembled whole per parameter, are
  equal bit for bit (AdamW's state is per element: both setups hold every element);
- where both sides reduce quantized at more than one rank, the error-feedback residuals
  owe the mean gradient the same per element (up to fp32 rounding): nothing is reset;
- the resumed losses are within the pair's rule (`tests.support.resume_matrix.loss_rule`).

The whole matrix runs on one 4-rank launch: a setup at world size 1 or 2 runs on a process
group of the first ranks (``ZeroConfig.process_group``), the others wait.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.support import parity
from tests.support.checkpoint_contents import full_state, residual_mass
from tests.support.mixed_recipe import TENSOR_TOL
from tests.support.rank_reports import guarded
from tests.support.resume_matrix import AXES, label, loss_rule, pairs, setups
from zerolite import checkpoint as ckpt
from zerolite.testing import run_ranks

BEFORE, AFTER = 2, 2
TOLERANCE = {
    "bitwise": 0.0,
    # another world size: fp32 sums in another order (DDP's own deviation between orders
    # on this model is ~1e-7); bf16 takes the mixed-precision rule as in the combination matrix
    "order": 1e-5,
    "dtype": TENSOR_TOL,  # the mixed-precision rule
    "quantized": 1e-2,  # the quantized tests' per-step bound
}


def _config(setup: dict, tier: Path, group) -> zerolite.ZeroConfig:
    where, _, fraction = (setup["offload"] or "").partition(":")
    if where == "disk":
        tier.mkdir(parents=True, exist_ok=True)
    return zerolite.ZeroConfig(
        stage=setup["stage"], partition=setup["partition"],
        param_dtype=torch.bfloat16 if setup["dtype"] == "bf16" else torch.float32,
        bucket_size_mb=setup["bucket"], shard_group_size=setup["hybrid"],
        offload=where or None, offload_fraction=float(fraction or 1.0),
        offload_dir=str(tier) if where == "disk" else None,
        quantize_gather=setup["quantize"] == "both",
        quantize_reduce=setup["quantize"] in ("reduce", "both"), process_group=group,
    )


def _train(model, opt, data, group) -> list[float]:
    """`parity.train` over ``group``: this rank's rows of each batch, the mean loss."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for x, y in data:
        per = x.shape[0] // world
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses


def _rank(chosen: list[tuple[dict, dict]], root: str) -> dict:
    """Every pair: saved by the first ``save["world"]`` ranks (a group of that size), then
    loaded by the first ``load["world"]``; the losses after the save (uninterrupted) and
    after the load (resumed), by pair index, on rank 0."""
    groups = {w: dist.new_group(list(range(w))) for w in (1, 2)} | {4: dist.group.WORLD}
    data = parity.batches(BEFORE + AFTER)
    rank, out = dist.get_rank(), {"straight": {}, "resumed": {}}
    for i, (setup, _) in enumerate(chosen):
        if rank < setup["world"]:
            group = groups[setup["world"]]
            model = parity.make_model()
            opt = zerolite.shard(model, parity.make_optimizer("AdamW", model),
                                 _config(setup, Path(root) / f"tier{i}-save-r{rank}", group))
            _train(model, opt, data[:BEFORE], group)
            ckpt.save(Path(root) / str(i) / "saved", model, opt)
            out["straight"][i] = _train(model, opt, data[BEFORE:], group)
    dist.barrier()  # every save complete before any load
    for i, (_, setup) in enumerate(chosen):
        if rank < setup["world"]:
            group = groups[setup["world"]]
            model = parity.make_model()
            opt = zerolite.shard(model, parity.make_optimizer("AdamW", model),
                                 _config(setup, Path(root) / f"tier{i}-load-r{rank}", group))
            ckpt.load(Path(root) / str(i) / "saved", model, opt)
            ckpt.save(Path(root) / str(i) / "resaved", model, opt)
            out["resumed"][i] = _train(model, opt, data[BEFORE:], group)
    return out


def _run(chosen: list[tuple[dict, dict]], root: Path) -> tuple[dict, dict]:
    """Every pair saved and loaded on one 4-rank launch; (straight, resumed) by index."""
    report = run_ranks(guarded, 4, _rank, chosen, str(root), timeout=600)[0]
    assert "error" not in report, report["error"]
    assert len(report["resumed"]) == len(chosen), (sorted(report["resumed"]), len(chosen))
    return report["straight"], report["resumed"]


def _problems(save: dict, load: dict, saved: Path, resaved: Path, straight: list[float],
              resumed: list[float]) -> list[str]:
    out = []
    before, after = full_state(saved), full_state(resaved)
    if before.keys() != after.keys():
        out.append(f"state keys differ: {sorted(before.keys() ^ after.keys())[:4]}")
    out += [f"{key} not bitwise" for key in sorted(before.keys() & after.keys())
            if not torch.equal(before[key], after[key])]
    if all(x["quantize"] in ("reduce", "both") and x["world"] > 1 for x in (save, load)):
        owed, kept = residual_mass(saved), residual_mass(resaved)
        scale = max(v.abs().max().item() for v in owed.values())
        worst = max((owed[k] - kept[k]).abs().max().item() for k in owed)
        if not (scale > 0 and worst <= 1e-6 * scale and owed.keys() == kept.keys()):
            out.append(f"residual mass not kept: {worst:.3e} of {scale:.3e}")
    how = loss_rule(save, load)
    bf16 = "bf16" in (save["dtype"], load["dtype"])
    tol = TENSOR_TOL if how == "order" and bf16 else TOLERANCE[how]
    devs = parity.loss_deviations(resumed, straight)
    if not all(d <= tol for d in devs):  # NaN fails
        out.append(f"{how}: loss deviations {devs} beyond {tol:.0e}")
    return out


def _check(chosen: list[tuple[dict, dict]], root: Path) -> None:
    straight, resumed = _run(chosen, root)
    bad = {}
    for i, (save, load) in enumerate(chosen):
        problems = _problems(save, load, root / str(i) / "saved", root / str(i) / "resaved",
                             straight[i], resumed[i])
        if problems:
            bad[f"{label(save)} -> {label(load)}"] = problems
    assert not bad, bad
    assert all(math.isfinite(x) for losses in resumed.values() for x in losses)


PAIRS = pairs()


def test_a_checkpoint_loads_under_any_other_setup(tmp_path):
    """Every value of every axis saved from and loaded into
    (`tests.support.resume_matrix.pairs`)."""
    assert 8 <= len(PAIRS) <= 16, len(PAIRS)
    for side in (0, 1):
        for axis, values in AXES.items():
            held = {pair[side][axis] for pair in PAIRS}
            assert held == set(values), (side, axis, held)
    _check(PAIRS, tmp_path)


@pytest.mark.slow
def test_more_pairs(tmp_path):
    """`make test-matrix`: the same setups, each also loaded three and four further along."""
    chosen = setups()
    n = len(chosen)
    _check([(chosen[i], chosen[(i + k) % n]) for k in (3, 4) for i in range(n)], tmp_path)


def _shaped_state_rank(root: str) -> dict:
    """Adafactor saved under "tensor" (row and column factors of each matrix), loaded where
    the matrices are cut into flat pieces (Adafactor declared elementwise to get there)."""
    def build(partition: str):
        model = parity.make_model()
        config = zerolite.ZeroConfig(partition=partition,
                                     elementwise_optimizers=(torch.optim.Adafactor,))
        return model, zerolite.shard(model, torch.optim.Adafactor(model.parameters()), config)

    model, opt = build("tensor")
    parity.train(model, opt, parity.batches(2), sliced=True)
    ckpt.save(Path(root) / "tensor", model, opt)
    model, opt = build("flat")
    before = {k: v.clone() for k, v in zerolite.full_state_dict(model, rank0_only=False).items()}
    try:
        ckpt.load(Path(root) / "tensor", model, opt)
        message = "loaded"
    except ckpt.CheckpointError as exc:
        message = str(exc)
    after = zerolite.full_state_dict(model, rank0_only=False)
    return {"message": message, "unchanged": all(torch.equal(v, after[k])
                                                 for k, v in before.items())}


def test_state_without_per_element_meaning_is_refused_with_what_to_do(tmp_path):
    for r in run_ranks(guarded, 2, _shaped_state_rank, str(tmp_path), timeout=300):
        assert "error" not in r, r["error"]
        message = r["message"]
        assert "no per-element meaning" in message and "partition='tensor'" in message, message
        assert "load_pretrained" in message and r["unchanged"], r
