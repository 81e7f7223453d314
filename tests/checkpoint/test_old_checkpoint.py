"""A checkpoint written by zerolite 0.1.0 before its reorganisation into folders loads bit for
bit with today's code.

``tests/data/old_checkpoint`` was written by ``tests/data/make_old_checkpoint.py`` at commit
201468d: stage 2 on 2 ranks, AdamW in two param groups, a MultiStepLR scheduler, a typed
``extra``. It is loaded here at the same world size and at another (3 ranks), and every
rank's master pieces and optimizer state, the full state dict, the scheduler, the
hyperparameters and ``extra`` are compared with what the old code held when it saved:
tensors bitwise. What was saved is the same on every CPU, so those comparisons hold anywhere.

At the same world size the loaded run also trains one step further. That step's numbers
depend on the CPU's kernels (AMX, AVX-512 and AVX2 round a matmul differently), so they are
compared with plain PyTorch computed here, in the same run: DDP over the same ranks, started
from the saved full state (parameters, AdamW moments, step, learning rates), bit for bit, as
2-rank fp32 DDP and zerolite sum alike. The fixture's ``after/`` tensors, computed on the CPU
that wrote it, are kept as written but not compared.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.data.make_old_checkpoint import CHECKPOINT, STEPS, OldModel, build, train_step
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

DATA = Path(__file__).resolve().parents[1] / "data" / "old_checkpoint"


def _differences(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing from ``got`` or whose tensors are not bitwise equal (dtype included)."""
    out = []
    for key, want in expected.items():
        have = got.get(key)
        if have is None:
            out.append(f"{key}: missing")
        elif have.dtype != want.dtype or have.shape != want.shape or not torch.equal(have, want):
            out.append(f"{key}: differs")
    return out


def _load_rank(path: str, continue_training: bool) -> dict:
    model, opt, sched = build()
    extra = zerolite.checkpoint.load(path, model, opt, schedulers=[sched])
    expected = load_file(str(DATA / "expected.safetensors"))
    problems = []
    # This rank's pieces against the saved full masters and state, range by range.
    for piece in state_of(model).pieces():
        lo, hi = piece.param_start, piece.param_end
        got = {f"master/{piece.name}": piece.read_master().reshape(-1)}
        for key, value in piece.read_state().items():
            got[f"state/{key}/{piece.name}"] = value.reshape(-1) if value.dim() else value
        want = {
            key: tensor if tensor.dim() == 0 else tensor[lo:hi]
            for key, tensor in expected.items()
            if key.startswith(("master/", "state/")) and key.endswith(f"/{piece.name}")
        }
        assert want, f"no expected values for {piece.name}"
        problems += [f"{p} [{lo}:{hi}]" for p in _differences(want, got)]
    full = zerolite.full_state_dict(model, rank0_only=False)
    saved = {k[len("model/"):]: v for k, v in expected.items() if k.startswith("model/")}
    problems += _differences(saved, full)
    out = {
        "problems": problems,
        "extra": extra,
        "hyper": [
            {k: v for k, v in g.items() if k not in ("params", "betas")} for g in opt.param_groups
        ],
        "betas": [g["betas"] for g in opt.param_groups],
        "scheduler": {"last_epoch": sched.last_epoch, "last_lr": sched.get_last_lr(),
                      "milestones": sched.milestones},
    }
    if continue_training:
        train_step(model, opt, sched, STEPS)
        after = _ddp_step_from(expected, json.loads((DATA / "expected.json").read_text()))
        now = zerolite.full_state_dict(model, rank0_only=False)
        out["problems"] += [f"after one more step: {p}" for p in _differences(after, now)]
    return out


def _ddp_step_from(expected: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """The full state dict after step ``STEPS`` taken by plain DDP + AdamW from the saved
    state: parameters from ``model/``, moments and step from ``state/``, learning rates and
    hyperparameters from ``expected.json``."""
    model = OldModel()
    model.load_state_dict({k[len("model/"):]: v for k, v in expected.items()
                           if k.startswith("model/")})
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2]},
        {"params": [p for p in trained if p.dim() < 2]},
    ]
    for group, hyper in zip(groups, meta["hyper"]):
        group.update({k: v for k, v in hyper.items() if k != "initial_lr"})
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    for name, param in model.named_parameters():
        if param.requires_grad:
            opt.state[param] = {
                key: expected[f"state/{key}/{name}"].clone().reshape(
                    () if key == "step" else param.shape)
                for key in ("step", "exp_avg", "exp_avg_sq")
            }
    ddp = DistributedDataParallel(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # keeps the saved lr
    train_step(ddp, opt, sched, STEPS)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_checkpoint_of_the_previous_layout_loads_bit_for_bit(world_size):
    expected = json.loads((DATA / "expected.json").read_text())
    same_world = world_size == expected["world_size"]
    results = run_ranks(_load_rank, world_size, str(DATA / CHECKPOINT), same_world)
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: {result['problems']}"
        assert result["extra"] == {"data_position": 3, "note": (1, 2)}
        assert result["hyper"] == expected["hyper"]
        assert result["betas"] == [(0.9, 0.95)] * 2
        assert result["scheduler"] == {
            **expected["scheduler"], "milestones": Counter({2: 1, 4: 1})
        }
