"""Parameter and gradient shards on a slower tier (``ZeroConfig(offload_params=...)``).

Real gloo ranks, real files, real safetensors. One 2-rank launch trains the same model,
seed and batches with and without ``offload_params`` and requires them bitwise equal
(losses, every parameter and fp32 master through `full_state_dict`, and every tensor of the
checkpoint each rank saves: its masters, optimizer state and RNG states):

- fp32, bf16 and fp16 (its overflow check walks the parked shards), disk and host, each
  also with the optimizer state offloaded (``offload``);
- hybrid sharding (``shard_group_size=1``: shard groups of one, replicated);
- gradient accumulation over two micro-steps (the gradient shard read back and added to);
- ``clip_grad_norm_`` and ``clip_grad_value_`` every step (they walk the parked shards);
- a meta-device build, materialised unit by unit onto the tier;
- ``reshard_after_forward=False`` with activation checkpointing;
- a loop as users write it: an LR scheduler built before ``shard()``, ``model.zero_grad()``
  on every other step, and one batch whose gradients are thrown away (``model.zero_grad()``
  after its backward, no step);
- before training, every run edits its parameters on rank 0 inside
  ``gathered_parameters(modifier_rank=0)`` and runs a forward without gradients.

Each offloaded run also shows that the shards really left memory: between steps no
parameter or gradient shard is resident, and during backward no more than the units the
scheduler holds are. A second launch covers checkpoints (saved with and without
``offload_params`` at 2 ranks, loaded both ways at 3, training on alike) and the bad
inputs (each a clear error before anything changes).
"""

from __future__ import annotations

import os
import resource

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zerolite
from examples.gpt import GPT
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.memory import checkpoint_blocks, footprint
from zerolite.memory.estimate import estimate_sharded
from zerolite.state.param_tier import reserve_param_tier
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 3
CASES = {  # name -> ZeroConfig keywords beyond stage 3 (the in-memory twin drops offload_params)
    "fp32-disk": dict(param_dtype=torch.float32, offload_params="disk"),
    "fp32-host+opt": dict(param_dtype=torch.float32, offload_params="host", offload="host"),
    "bf16-host": dict(param_dtype=torch.bfloat16, offload_params="host"),
    "fp16-disk": dict(param_dtype=torch.float16, offload_params="disk"),  # overflow checks
    "bf16-disk+opt": dict(param_dtype=torch.bfloat16, offload_params="disk", offload="disk"),
    "bf16-disk-hybrid": dict(param_dtype=torch.bfloat16, offload_params="disk",
                             shard_group_size=1),
    "fp32-disk-meta": dict(param_dtype=torch.float32, offload_params="disk", meta=True),
    "bf16-disk-kept-checkpointed": dict(param_dtype=torch.bfloat16, offload_params="disk",
                                        reshard_after_forward=False, checkpointed=True),
}


def _config(where: str, **kw) -> zerolite.ZeroConfig:
    needs_dir = "disk" in (kw.get("offload"), kw.get("offload_params"))
    return zerolite.ZeroConfig(stage=3, bucket_size_mb=0.01,
                               offload_dir=where if needs_dir else None, **kw)


def _resident_during_backward(model) -> list[int]:
    """Hooks that record the params tier's resident bytes whenever a gradient arrives."""
    tier = state_of(model).params_tier
    seen: list[int] = []
    if tier is not None:
        for p in model.parameters():
            p.register_hook(lambda g: seen.append(tier.resident_bytes) or g)
    return seen


def _train(model, opt, scheduler, where: str, label: str) -> dict:
    tier = state_of(model).params_tier
    seen = _resident_during_backward(model)
    losses, between = [], []
    for step, (x, y) in enumerate(parity.batches(STEPS)):
        x, y = parity.local_slice(x), parity.local_slice(y)
        half = x.shape[0] // 2
        if step == 1:  # a batch the loop throws away (a bad one): its gradients must go
            model(x[:half], y[:half]).mul(3.0).backward()
            model.zero_grad()
        for part in (slice(0, half), slice(half, None)):  # accumulation: two micro-steps
            loss = model(x[part], y[part]) / 2
            loss.backward()
        opt.clip_grad_value_(0.05)
        opt.clip_grad_norm_(0.5)
        opt.step()
        scheduler.step()
        model.zero_grad() if step % 2 else opt.zero_grad()  # users' loops do either
        losses.append(parity.mean_over_ranks(loss.item()))
        if tier is not None:
            tier.drain()
            between.append(tier.resident_bytes)
    # Gradients zeroed and none since: a parked shard is not read back stale.
    model(x[:half], y[:half]).backward()
    opt.zero_grad()
    norm_after_zero = float(opt.clip_grad_norm_(1.0))
    if tier is not None:  # a shard's write in flight still holds its memory until it lands
        tier.drain()
    measured, estimated = footprint(opt), estimate_sharded(opt)
    full = zerolite.full_state_dict(model, rank0_only=False, masters=True)
    saved = ckpt.save(os.path.join(where, label), model, opt)
    dist.barrier()
    state = {f.name: load_file(f) for f in sorted(saved.glob("*.safetensors"))}
    return {"losses": losses, "full": full, "state": state, "between": between,
            "norm_after_zero": norm_after_zero,
            "most_in_backward": max(seen, default=0),
            "capacity": 0 if tier is None else tier.capacity,
            "measured": measured, "estimated": estimated}


def _run(config: zerolite.ZeroConfig, meta: bool, checkpointed: bool, where: str,
         label: str) -> dict:
    if meta:  # materialised by shard(), unit by unit (onto the tier with offload_params)
        with torch.device("meta"):
            model = parity.make_model()
    else:
        model = parity.make_model()
    if checkpointed:
        checkpoint_blocks(model)
    inner = parity.make_optimizer("AdamW", model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))
    opt = zerolite.shard(model, inner, config)
    # An edit on rank 0 inside gathered_parameters reaches every rank's (parked) shard.
    with zerolite.gathered_parameters(model, modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            for p in model.parameters():
                p.mul_(0.5)
    with torch.no_grad():  # a forward without gradients (generation's), before training
        model(*[parity.local_slice(t) for t in parity.batches(1)[0]])
    return _train(model, opt, scheduler, where, label)


def _parity(where: str) -> dict:
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        meta, checkpointed = kw.pop("meta", False), kw.pop("checkpointed", False)
        if meta:
            kw["init_fn"] = GPT.init_weights
        twin = {k: v for k, v in kw.items() if k != "offload_params"}
        out[name] = tuple(
            _run(_config(where, **c), meta, checkpointed, where, f"{name}-{tag}")
            for c, tag in ((kw, "tiered"), (twin, "plain")))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    where = str(tmp_path_factory.mktemp("offload-params"))
    return run_ranks(_parity, 2, where, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_bitwise_with_and_without_offload_params(parity_runs, name):
    for rank, runs in enumerate(parity_runs):
        tiered, plain = runs[name]
        assert tiered["losses"] == plain["losses"], (rank, tiered["losses"], plain["losses"])
        assert tiered["norm_after_zero"] == plain["norm_after_zero"] == 0.0, rank
        assert _same(tiered["full"], plain["full"]), rank
        assert _same(tiered["state"], plain["state"]), rank
        assert len(tiered["state"]) > 0


@pytest.mark.parametrize("name", list(CASES))
def test_shards_are_parked_between_uses(parity_runs, name):
    for runs in parity_runs:
        tiered, _ = runs[name]
        assert tiered["capacity"] > 0
        assert tiered["between"] == [0] * STEPS  # nothing resident between steps
        # In backward only the units in use are resident: well under the whole shard.
        assert 0 < tiered["most_in_backward"] < tiered["capacity"] / 2, tiered


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_and_footprint_count_the_parked_shards(parity_runs, name):
    """The model states `footprint` measures equal `estimate`'s, byte for byte, with the
    parameter and gradient shards moved from memory to ``offloaded``: exactly the bytes the
    in-memory twin holds as params and grads (other than parameters zerolite does not
    manage), plus the arena's alignment."""
    for runs in parity_runs:
        tiered, plain = runs[name]
        m, e, twin = tiered["measured"], tiered["estimated"], plain["measured"]
        assert (m.params, m.grads, m.master, m.optimizer_state) == (
            e.params, e.grads, e.master, e.optimizer_state)
        assert m.offloaded == e.offloaded
        moved = (twin.params - m.params) + (twin.grads - m.grads)
        assert moved > 0 and m.offloaded - twin.offloaded >= moved
        assert m.offloaded - twin.offloaded - moved < 64 * 3 * 20  # alignment only


# -- checkpoints: saved with and without offload_params, loaded both ways elsewhere ----------
def _tiered(where: str, tiered: bool) -> zerolite.ZeroConfig:
    kw = dict(offload_params="disk") if tiered else {}
    return _config(where, param_dtype=torch.bfloat16, offload="disk", **kw)


def _sharded_with_scheduler(where: str, tiered: bool, seed: int = 0):
    model = parity.make_model(seed=seed)
    inner = parity.make_optimizer("AdamW", model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))
    return model, zerolite.shard(model, inner, _tiered(where, tiered)), scheduler


def _save_at_two(where: str) -> None:
    for tiered in (True, False):
        model, opt, scheduler = _sharded_with_scheduler(where, tiered)
        parity.train(model, opt, parity.batches(2), sliced=True, before_step=scheduler.step)
        blocking = not tiered  # the tiered one saves asynchronously
        pending = ckpt.save(os.path.join(where, f"saved-{tiered}"), model, opt,
                            schedulers=[scheduler], blocking=blocking)
        if not blocking:
            pending.wait()


def _load_at_three(where: str) -> dict:
    out = {}
    for saved in (True, False):
        for tiered in (True, False):
            # Other values (seed 7): the load must replace them, the scheduler's position too.
            model, opt, scheduler = _sharded_with_scheduler(where, tiered, seed=7)
            ckpt.load(os.path.join(where, f"saved-{saved}"), model, opt, schedulers=[scheduler])
            assert scheduler.last_epoch == 2, scheduler.last_epoch
            losses = parity.train(model, opt, parity.batches(4)[2:], sliced=True,
                                  before_step=scheduler.step)
            out[(saved, tiered)] = (losses, zerolite.full_state_dict(model, rank0_only=False))
    return out


def test_checkpoints_move_between_tiered_and_resident_at_another_world_size(tmp_path):
    run_ranks(_save_at_two, 2, str(tmp_path), timeout=300)
    results = run_ranks(_load_at_three, 3, str(tmp_path), timeout=300)
    for rank, runs in enumerate(results):
        reference = runs[(False, False)]
        for key, run in runs.items():
            assert run[0] == reference[0], (rank, key)
            assert _same(run[1], reference[1]), (rank, key)


# -- bad input: a clear error before anything changes ----------------------------------------
def test_offload_params_needs_stage_3_and_a_directory():
    for stage in (1, 2):
        with pytest.raises(ValueError, match=r"offload_params: 'disk' needs stage=3"):
            zerolite.ZeroConfig(stage=stage, offload_params="disk", offload_dir="/tmp")
    with pytest.raises(ValueError, match=r"offload_params='disk' needs a directory"):
        zerolite.ZeroConfig(stage=3, offload_params="disk")
    with pytest.raises(ValueError, match=r"ZeroConfig.offload_params: got 'nvme'"):
        zerolite.ZeroConfig(stage=3, offload_params="nvme")


def _refused(where: str, limit: int | None) -> dict:
    model = parity.make_model()
    opt = parity.make_optimizer("AdamW", model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit is not None and dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        zerolite.shard(model, opt, _config(where, offload_params="disk"))
        error = None
    except (ValueError, zerolite.RankMismatchError) as exc:
        error = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    untouched = state_of(model) is None and not opt.state and ptrs == {
        n: p.data_ptr() for n, p in model.named_parameters()}
    return {"error": error, "untouched": untouched}


def test_a_tier_that_cannot_be_made_or_reserved_refuses_shard(tmp_path):
    unwritable = run_ranks(_refused, 2, "/sys/zerolite-params", None, timeout=120)
    too_small = run_ranks(_refused, 2, str(tmp_path), 4096, timeout=120)
    for rank in range(2):
        assert "cannot be created in '/sys'" in unwritable[rank]["error"], unwritable[rank]
        assert "cannot reserve" in too_small[rank]["error"], too_small[rank]
        assert unwritable[rank]["untouched"] and too_small[rank]["untouched"], rank
    assert not os.listdir(tmp_path) or all(
        not name.startswith("zerolite-offload") for name in os.listdir(tmp_path))


def test_a_full_disk_is_refused_naming_the_shards(tmp_path):
    config = zerolite.ZeroConfig(stage=3, offload_params="disk", offload_dir=str(tmp_path / "new"))
    with pytest.raises(ValueError, match=r"bytes free; offloading this rank's parameter and"):
        reserve_param_tier(config, 1 << 62, rank=0)
    assert not (tmp_path / "new").exists()  # made for the check, removed with the refusal
