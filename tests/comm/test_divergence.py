"""Ranks that diverge get an error on every rank, never a hang or a silent wrong result.

- ``shard()`` compares every parameter (sharded or not) and every buffer across ranks: an
  extra buffer or frozen parameter on one rank, or one of another dtype or shape, is
  named before anything changes; and, as DDP, every rank then holds rank 0's unsharded
  parameters and buffers.
- A rank that skips ``step()``, or raises in a forward and skips the iteration, or saves
  alone: every rank raises (`RankMismatchError` or `CollectiveTimeout`) within
  ``ZeroConfig.timeout_s`` (not gloo's timeout: the launch would time out first), naming
  the operation and the step; no rank finishes its loop.
- Stage 3's ``model.state_dict()`` gathers every unit: a rank that calls it alone raises
  `CollectiveTimeout` naming the call after ``timeout_s``, before any unit is gathered.
- Parameters appended to an optimizer group after ``shard()`` are refused at ``step()``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
from tests.support import parity
from zerolite.testing import run_ranks

TIMEOUT_S = 3.0  # zerolite's bound on each wait in these tests


class Tiny(nn.Module):
    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(4, 2)
        if extra == "buffer":
            self.register_buffer("extra", torch.zeros(3))
        elif extra == "frozen_param":
            self.more = nn.Parameter(torch.zeros(3), requires_grad=False)
        elif extra == "buffer_dtype":
            self.norm.running_mean = self.norm.running_mean.double()
        elif extra == "buffer_shape":
            self.norm.register_buffer("running_mean", torch.zeros(5))

    def forward(self, x):
        return self.b(self.frozen(self.norm(self.a(x))))


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _shard_mismatch_rank(extra: str) -> dict:
    torch.manual_seed(0)
    model = Tiny(extra if dist.get_rank() == 1 else "")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = torch.optim.AdamW(_trainable(model), lr=0.1)
    try:
        zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2, timeout_s=TIMEOUT_S))
        return {"error": None}
    except zerolite.RankMismatchError as exc:
        unchanged = all(torch.equal(before[n], t) for n, t in model.state_dict().items())
        return {"error": str(exc), "unchanged": unchanged}


@pytest.mark.parametrize(
    "extra, named",
    [
        ("buffer", "extra"),
        ("frozen_param", "more"),
        ("buffer_dtype", "float64"),
        ("buffer_shape", "(5,)"),
    ],
)
def test_shard_names_a_buffer_or_frozen_parameter_that_differs(extra, named):
    for rank, result in enumerate(run_ranks(_shard_mismatch_rank, 2, extra, timeout=60)):
        assert result["error"] is not None, (
            f"rank {rank}: shard() accepted a model that differs ({extra})"
        )
        assert named in result["error"], result["error"]
        assert result["unchanged"], f"rank {rank}: the model changed before the error"


def _rank0_values_rank(stage: int) -> dict:
    """Per-rank different unsharded parameters and buffers: after shard(), rank 0's, as DDP."""
    torch.manual_seed(dist.get_rank())  # every rank builds different values
    model = Tiny()
    model.norm.running_mean.normal_()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(reference)  # DDP's construction broadcast
    zerolite.shard(
        model, torch.optim.AdamW(_trainable(model), lr=0.1), zerolite.ZeroConfig(stage=stage)
    )
    full = zerolite.full_state_dict(model, rank0_only=False)
    expected = ddp.module.state_dict()
    return {"differ": [n for n, t in expected.items() if not torch.equal(full[n], t)]}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_rank_holds_rank0_unsharded_parameters_and_buffers(stage):
    for rank, result in enumerate(run_ranks(_rank0_values_rank, 2, stage, timeout=60)):
        assert result["differ"] == [], (
            f"rank {rank}: differs from DDP's broadcast: {result['differ']}"
        )


# --------------------------------------------------------------------------------------
# Loops that diverge.
# --------------------------------------------------------------------------------------

class BadSample(RuntimeError):
    pass


def _raise_bad_sample(module, args, output):
    raise BadSample("bad sample")


def _diverging_loop_rank(stage: int, how: str, root: str) -> dict:
    rank = dist.get_rank()
    model = parity.make_model()
    config = zerolite.ZeroConfig(stage=stage, timeout_s=TIMEOUT_S)
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    data = parity.batches(steps=6)
    start = time.monotonic()
    try:
        for step, (x, y) in enumerate(data):
            x, y = parity.local_slice(x), parity.local_slice(y)
            deviant = rank == 1 and step == 2
            if deviant and how == "forward_raises":
                handle = model.blocks[1].register_forward_hook(_raise_bad_sample)
                try:
                    model(x, y)
                except BadSample:
                    continue
                finally:
                    handle.remove()
            loss = model(x, y)
            loss.backward()
            if deviant and how == "skip_step":
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            if deviant and how == "save_alone":
                zerolite.checkpoint.save(f"{root}/alone", model, opt)
        return {"finished": True, "seconds": time.monotonic() - start}
    except (zerolite.RankMismatchError, zerolite.CollectiveTimeout) as exc:
        return {
            "finished": False,
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.monotonic() - start,
        }


LAUNCH_S = 60.0  # run_ranks' deadline, which is also the process group's (gloo's) timeout


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["skip_step", "forward_raises", "save_alone"])
def test_a_diverging_rank_raises_on_every_rank(stage, how, tmp_path):
    """Every rank raises a zerolite error naming the step, instead of finishing its loop or
    hanging. Bounded by timeout_s, event-based: a wait that ignored ZeroConfig.timeout_s
    (3 s) would end only at gloo's own timeout, which run_ranks sets to the launch's
    deadline (60 s) and which starts later than the launch, so the launch would end in a
    RankTimeout instead of these reports. A rank that timed out did wait its timeout_s
    first (a lower bound, which load cannot break). On a loaded machine the ranks do not
    time out together: a rank whose peer gave up first sees the exchange fail ("Connection
    closed by peer"), which is also a CollectiveTimeout naming the step; at least one rank
    then timed out by the bound."""
    results = run_ranks(_diverging_loop_rank, 2, stage, how, str(tmp_path), timeout=LAUNCH_S)
    bounded = f"timeout_s={TIMEOUT_S:g}s"
    for rank, result in enumerate(results):
        assert not result["finished"], f"rank {rank} finished its loop ({how}, stage {stage})"
        assert "step" in result["error"], result["error"]
        if result["error"].startswith("CollectiveTimeout"):
            assert bounded in result["error"] or " failed (" in result["error"], result["error"]
            if bounded in result["error"]:
                assert result["seconds"] >= TIMEOUT_S, result
    timeouts = [r["error"] for r in results if r["error"].startswith("CollectiveTimeout")]
    assert not timeouts or any(bounded in e for e in timeouts), timeouts
    if how == "save_alone":
        assert any("checkpoint.save()" in r["error"] for r in results), results


def _state_dict_alone_rank(root: str) -> dict:
    """Rank 0 takes the stage-3 state dict; rank 1 does not, and waits until rank 0 is done."""
    model = parity.make_model()
    zerolite.shard(model, parity.make_optimizer("AdamW", model),
                   zerolite.ZeroConfig(stage=3, timeout_s=TIMEOUT_S))
    done = Path(root) / "rank0-done"
    if dist.get_rank() == 1:
        deadline = time.monotonic() + LAUNCH_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"error": None}
    start = time.monotonic()
    try:
        model.state_dict()
        return {"error": None}
    except zerolite.CollectiveTimeout as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    finally:
        done.touch()


def test_a_stage3_state_dict_taken_alone_raises_naming_the_call(tmp_path):
    rank0, _ = run_ranks(_state_dict_alone_rank, 2, str(tmp_path), timeout=LAUNCH_S)
    assert rank0["error"] is not None, "model.state_dict() finished without rank 1"
    assert "model.state_dict()" in rank0["error"], rank0["error"]
    assert f"timeout_s={TIMEOUT_S:g}s" in rank0["error"], rank0["error"]
    assert rank0["seconds"] >= TIMEOUT_S, rank0


def _appended_param_rank() -> dict:
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=2))
    x, y = parity.local_slice(parity.batches(1)[0][0]), parity.local_slice(parity.batches(1)[0][1])
    model(x, y).backward()
    opt.param_groups[1]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    try:
        opt.step()
        return {"error": None}
    except (ValueError, RuntimeError) as exc:
        return {"error": str(exc)}


def test_a_parameter_appended_to_a_group_is_refused_at_step():
    for result in run_ranks(_appended_param_rank, 2, timeout=60):
        assert result["error"] is not None and "group 1" in result["error"], result
