"""A checkpoint written by zerolite 0.1.0 before its reorganisation into folders loads bit for
bit with today's code.

``tests/data/old_checkpoint`` was written by ``tests/data/make_old_checkpoint.py`` at commit
201468d: stage 2 on 2 ranks, AdamW in two param groups, a MultiStepLR scheduler, a typed
``extra``. It is loaded here at the same world size (and trained one step further, which
must give the parameters the old code gave) and at another (3 ranks), and every rank's
master pieces and optimizer state, the full state dict, the scheduler, the hyperparameters
and ``extra`` are compared with what the old code held when it saved: tensors bitwise.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerolite
from tests.data.make_old_checkpoint import CHECKPOINT, STEPS, build, train_step
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
        after = {k[len("after/"):]: v for k, v in expected.items() if k.startswith("after/")}
        now = zerolite.full_state_dict(model, rank0_only=False)
        out["problems"] += [f"after one more step: {p}" for p in _differences(after, now)]
    return out


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
