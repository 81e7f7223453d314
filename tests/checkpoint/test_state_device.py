"""Loaded optimizer state goes where torch's own ``load_state_dict`` puts it.

A 0-dim ``step`` stays on the CPU unless its group is fused or capturable (a ``step`` on a
GPU costs a host sync per piece at every step of a resumed run); everything else goes to
the master's device. The rule is checked with a master on the ``meta`` device (which a
CPU machine can place tensors on), the plumbing (each piece knows its param group) and a
real checkpoint round trip on 2 gloo ranks. On a GPU, ``tests/gpu/test_cuda.py`` checks
``step`` after a load.
"""

from __future__ import annotations

import torch

import zerolite
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.state.shard_state import state_of
from zerolite.state.state_device import loaded_state, state_device
from zerolite.testing import run_ranks

META = torch.device("meta")


def test_step_stays_on_the_cpu_unless_fused_or_capturable():
    state = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "note": 1}
    plain = loaded_state(state, META, {"lr": 1e-3})
    assert plain["step"].device.type == "cpu" and plain["step"].item() == 3.0
    assert plain["exp_avg"].is_meta and plain["note"] == 1
    assert loaded_state(state, META, None)["step"].device.type == "cpu"
    for flag in ("fused", "capturable"):
        assert loaded_state(state, META, {flag: True})["step"].is_meta, flag
        assert state_device("step", state["step"], META, {flag: False}).type == "cpu"


def _round_trip(root: str) -> dict:
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model))
    for x, y in parity.batches(2):
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
    ckpt.save(f"{root}/ck", model, opt)
    fresh = parity.make_model(seed=1)
    fresh_opt = zerolite.shard(fresh, parity.make_optimizer("AdamW", fresh))
    ckpt.load(f"{root}/ck", fresh, fresh_opt)
    pieces = list(state_of(fresh).pieces())
    groups = fresh_opt.param_groups
    return {
        "grouped": all(
            any(p.param_group is g and any(t is p.master for t in g["params"]) for g in groups)
            for p in pieces
        ),
        "steps": {(str(p.state["step"].device), p.state["step"].item()) for p in pieces},
        "moments": {str(p.state["exp_avg"].device) for p in pieces},
    }


def test_loaded_pieces_keep_step_on_the_cpu(tmp_path):
    for rank, out in enumerate(run_ranks(_round_trip, 2, str(tmp_path), timeout=120)):
        assert out["grouped"], rank
        assert out["steps"] == {("cpu", 2.0)} and out["moments"] == {"cpu"}, (rank, out)
