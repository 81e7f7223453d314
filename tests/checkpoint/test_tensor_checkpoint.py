"""Checkpoints under whole-tensor ownership and with several optimizers (real files, gloo).

Each case trains with gradient clipping and one LR scheduler per inner optimizer, saves,
and resumes in a fresh launch at another world size and/or partition. Right after the
load, every parameter and every parameter's optimizer state (reassembled whole, by name)
equal the saved ones bit for bit, and each param group's LR is the saved one:

- Muon + Adafactor + AdamW (Adafactor's factored row/column state of the embeddings
  included), ``"tensor"`` at stage 2 and 2 ranks -> ``"tensor"`` at stage 3 and 4 ranks
  (owners reassigned, each unit's buffer ordered by owner);
- AdamW ``"flat"`` at 4 -> ``"tensor"`` at 2 (allowed: AdamW is elementwise);
- AdamW ``"tensor"`` at 2 -> ``"flat"`` at 3.

The in-memory state dict of the three optimizers round-trips into a twin at the same layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.step.test_tensor_ownership import shard
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

SAVE_AT, TOTAL = 3, 5


def schedulers_for(opt: zerolite.ShardedOptimizer) -> list:
    """One LR scheduler per inner optimizer (each keeps working after shard())."""
    inner = getattr(opt.optimizer, "optimizers", [opt.optimizer])
    scheds: list = [torch.optim.lr_scheduler.StepLR(inner[0], step_size=2, gamma=0.5)]
    scheds += [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in inner[1:]]
    return scheds


def gathered_state(opt: zerolite.ShardedOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's optimizer state, whole, by name (all ranks call)."""
    mine = [
        (p.name, p.param_start, tuple(p.flat.shapes[p.index]), p.master.numel(),
         {k: v.clone() for k, v in p.state.items() if isinstance(v, torch.Tensor)})
        for p in opt.shard_state.pieces()
    ]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    parts: dict[str, list] = {}
    for rank_pieces in every:
        for piece in rank_pieces:
            parts.setdefault(piece[0], []).append(piece)
    out = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[1])
        shape, state = pieces[0][2], {}
        for key, value in pieces[0][4].items():
            if value.dim() and value.numel() == pieces[0][3]:  # per element: reassemble
                whole = torch.cat([p[4][key].reshape(-1) for p in pieces])
                state[key] = whole.view(shape)
            else:
                state[key] = value
        out[name] = state
    return out


def _run(
    name: str, partition: str, steps: range, load_from: str | None, save_to: str | None,
    stage: int = 2,
) -> dict:
    """Load ``load_from`` (if given), train ``steps`` of the global batches with clipping and
    schedulers at ``stage``, save to ``save_to`` (if given); report what the comparison
    needs."""
    data = parity.batches(TOTAL)
    model = parity.make_model()
    opt = shard(name, model, stage=stage, bucket_size_mb=0.01, partition=partition)
    scheds = schedulers_for(opt)
    out: dict = {"initial_lrs": [g["lr"] for g in opt.param_groups]}  # before any load
    if load_from is not None:
        ckpt.load(load_from, model, opt, schedulers=scheds)
        out["loaded_params"] = zerolite.full_state_dict(model, rank0_only=False)
        out["loaded_state"] = gathered_state(opt)
        out["loaded_lrs"] = [g["lr"] for g in opt.param_groups]
    losses = []
    for s in steps:
        x, y = (parity.local_slice(t) for t in data[s])
        loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        for sched in scheds:
            sched.step()
        losses.append(parity.mean_over_ranks(loss.item()))
    out["losses"] = losses
    if save_to is not None:
        ckpt.save(save_to, model, opt, schedulers=scheds)
        out["params"] = zerolite.full_state_dict(model, rank0_only=False)
        out["state"] = gathered_state(opt)
        out["lrs"] = [g["lr"] for g in opt.param_groups]
        # The in-memory state dict round-trips into a twin at the same layout.
        twin = parity.make_model()
        twin_opt = shard(name, twin, stage=stage, bucket_size_mb=0.01, partition=partition)
        twin_opt.load_state_dict(opt.state_dict())
        twin_state = gathered_state(twin_opt)
        out["state_dict_round_trip"] = all(
            torch.equal(twin_state[n][k], v) for n, s in out["state"].items() for k, v in s.items()
        ) and [g["lr"] for g in twin_opt.param_groups] == out["lrs"]
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """(save report, load report) per resumption; the AdamW runs form one chain (flat at 4
    -> tensor at 2 -> flat at 3), so each launch both loads and saves where it can."""
    root = Path(tmp_path_factory.mktemp("tensor_ckpt"))
    three = "muon+adafactor+adamw"
    out = {}
    saved = run_ranks(_run, 2, three, "tensor", range(SAVE_AT), None, str(root / "a"))
    loaded = run_ranks(_run, 4, three, "tensor", range(SAVE_AT, TOTAL), str(root / "a"), None,
                       3)
    out[(three, "tensor@2", "stage 3 tensor@4")] = (saved[0], loaded[0])
    flat4 = run_ranks(_run, 4, "adamw", "flat", range(SAVE_AT), None, str(root / "b"))
    tensor2 = run_ranks(_run, 2, "adamw", "tensor", range(SAVE_AT, 4), str(root / "b"),
                        str(root / "c"))
    flat3 = run_ranks(_run, 3, "adamw", "flat", range(4, TOTAL), str(root / "c"), None)
    out[("adamw", "flat@4", "tensor@2")] = (flat4[0], tensor2[0])
    out[("adamw", "tensor@2", "flat@3")] = (tensor2[0], flat3[0])
    return out


def test_checkpoints_resume_across_world_sizes_and_partitions(resumed) -> None:
    for case, (saved, loaded) in resumed.items():
        for n, v in saved["params"].items():
            assert torch.equal(loaded["loaded_params"][n], v), (case, n)
        assert saved["state"].keys() == loaded["loaded_state"].keys(), case
        for n, state in saved["state"].items():
            for k, v in state.items():
                assert torch.equal(loaded["loaded_state"][n][k], v), (case, n, k)
        assert loaded["loaded_lrs"] == saved["lrs"], case
        if "loaded_lrs" not in saved:  # trained from step 0: the first inner optimizer's
            # StepLR (step 2, gamma 0.5) moved the sharded groups after SAVE_AT steps
            assert saved["lrs"][0] == pytest.approx(0.5 * saved["initial_lrs"][0]), case
        # and training goes on from there
        assert loaded["losses"] and all(torch.isfinite(torch.tensor(loaded["losses"]))), case


def test_several_optimizers_state_dict_round_trips(resumed) -> None:
    for case, (saved, _) in resumed.items():
        assert saved["state_dict_round_trip"], case
