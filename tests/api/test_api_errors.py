"""User mistakes at zerolite's API surface get zerolite's own error naming the fix.

Each case used to surface as an AttributeError, KeyError, a torch shape error or a silently
guessed answer from inside zerolite (the sweep of obscure errors in the reliability issue).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
import zerolite.memory as zm
from zerolite.testing import assert_footprint, run_ranks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _sharded(stage: int):
    model = _model()
    return model, zerolite.shard(
        model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(stage=stage)
    )


def _local_cases():
    plain = torch.optim.AdamW(_model().parameters())
    for call, fn in ((r"footprint\(\)", zm.footprint), (r"assert_footprint\(\)", assert_footprint)):
        with pytest.raises(
            TypeError,
            match=rf"^{call} needs the ShardedOptimizer that zerolite.shard\(\) returned, "
                  rf"got AdamW",
        ):
            fn(plain)
    with pytest.raises(TypeError, match=r"^track\(\) needs the ShardedOptimizer .* got str"):
        with zm.track("opt"):
            pass
    # The estimator used to substitute AdamW for a name it did not know.
    with pytest.raises(
        ValueError, match=r"no state fields known for optimizer 'lion'; use one of \['adagrad'"
    ):
        zm.estimate(1_000_000, world_size=8, optimizer="lion")
    with pytest.raises(ValueError, match=r"no state fields known for optimizer 'lion'"):
        zm.estimate(_model(), world_size=8, optimizer="lion")
    with pytest.raises(ValueError, match=r"no state fields known for optimizer 'adamax'"):
        zm.estimate(1_000_000, world_size=8, optimizer=torch.optim.Adamax(_model().parameters()))
    with pytest.raises(ValueError, match=r"the parameter count must be positive, got -5"):
        zm.estimate(-5, world_size=2)
    with pytest.raises(
        TypeError, match=r"model_or_count must be an nn.Module or a whole number .* got 'x'"
    ):
        zm.estimate("x", world_size=2)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got '2'"):
        zm.estimate(_model(), world_size="2")
    with pytest.raises(TypeError, match=r"^iter_full_state_dict\(\) needs an nn.Module, got str"):
        zerolite.full_state_dict("model")
    # What the estimator accepts still works: a momentum SGD instance counts its buffer.
    momentum = zm.estimate(
        1000, world_size=2, optimizer=torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    )
    assert (
        momentum.optimizer_state
        == zm.formula(1000, world_size=2, stage=2, optimizer="sgd_momentum").optimizer_state
        > 0
    )


def _distributed_cases():
    model, opt = _sharded(stage=3)
    for bad in (2, -1, "0", True):
        with pytest.raises(
            ValueError, match=rf"modifier_rank must be None or a rank in \[0, 2\), got {bad!r}"
        ):
            with zerolite.gathered_parameters(model, modifier_rank=bad):
                pass
    saved = opt.state_dict()
    for broken, named in (
        ({k: v for k, v in saved.items() if k != "state"}, r"lacks \['state'\]"),
        (
            {**saved, "zerolite": {k: v for k, v in saved["zerolite"].items() if k != "masters"}},
            r"lacks \['zerolite.masters'\]",
        ),
        (
            {**saved, "zerolite": {**saved["zerolite"],
                                   "masters": [m[:1] for m in saved["zerolite"]["masters"]]}},
            r"master shard 0 of this state dict is \(1,\), expected",
        ),
    ):
        with pytest.raises(ValueError, match=named):
            opt.load_state_dict(broken)
    _other_ranks_state_dict_refused(opt, saved)
    _offloaded_state_dict_refused()
    # A full state dict into a stage-3 model: refused outside gathered_parameters, kept inside.
    replacement = _model(seed=1).state_dict()
    with pytest.raises(
        RuntimeError,
        match=r"^model.load_state_dict\(\) on a stage-3 model "
              r".*gathered_parameters\(model, modifier_rank=0\)",
    ):
        model.load_state_dict(replacement)
    with zerolite.gathered_parameters(model, modifier_rank=0):
        model.load_state_dict(replacement)
    full = zerolite.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(full[name], value) for name, value in replacement.items())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # the masters took the loaded values too: the step runs from them
    return "ok"


def _masters(opt) -> list[torch.Tensor]:
    return [m.data.clone() for m in opt.masters]


def _other_ranks_state_dict_refused(opt, saved: dict) -> None:
    """Every rank loading its peer's dict is refused, naming both ranks; so is one rank alone
    loading its peer's (the other, loading its own, is refused too: the ranks agree before
    anything changes). The masters stay as they were."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dicts: list = [None] * world
    dist.all_gather_object(dicts, saved)
    other = dicts[(rank + 1) % world]
    before = _masters(opt)
    with pytest.raises(
        ValueError,
        match=rf"this state dict holds rank {(rank + 1) % world}/{world}'s shard but is being "
              rf"loaded on rank {rank}/{world}",
    ):
        opt.load_state_dict(other)
    alone = other if rank == 1 else saved  # rank 1 alone loads its peer's
    with pytest.raises((ValueError, zerolite.RankMismatchError), match=r"rank 0/2's shard"):
        opt.load_state_dict(alone)
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(opt)))
    opt.load_state_dict(saved)  # its own: accepted
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(opt)))


def _offloaded_state_dict_refused() -> None:
    """An offloaded model's in-memory state_dict() and load_state_dict() are refused, naming
    the checkpoint API that reads the tier."""
    model = _model()
    opt = zerolite.shard(model, torch.optim.AdamW(model.parameters()),
                         zerolite.ZeroConfig(stage=2, offload="host"))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"^state_dict\(\) holds the whole state in memory, "
                       r"and this model offloads it \(ZeroConfig.offload\): save with "
                       r"zerolite.checkpoint.save"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) is for in-memory state, and this "
                       r"model offloads it \(ZeroConfig.offload\): load with "
                       r"zerolite.checkpoint.load"):
        opt.load_state_dict({})


def _all_cases():
    _local_cases()
    return _distributed_cases()


def test_api_mistakes_get_zerolite_errors():
    assert run_ranks(_all_cases, 2, timeout=120) == ["ok", "ok"]
