"""Bad input to shard(): a clear error on every rank, no hang, nothing modified."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

import zerolite
from zerolite import RankMismatchError, ZeroConfig
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks


def _model(seed=0, widths=(6, 8, 4), names=None):
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])]
    if names is None:
        return nn.Sequential(*layers)
    return nn.Sequential(OrderedDict(zip(names, layers)))


def _snapshot(model, opt):
    return {
        "values": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ptrs": {n: p.data_ptr() for n, p in model.named_parameters()},
        "groups": [[id(p) for p in g["params"]] for g in opt.param_groups],
        "state": {id(k): dict(v) for k, v in opt.state.items()},
    }


def _assert_untouched(model, opt, before):
    after = _snapshot(model, opt)
    assert after["ptrs"] == before["ptrs"]
    assert after["groups"] == before["groups"]
    assert after["state"].keys() == before["state"].keys()
    for n, v in before["values"].items():
        if v.device.type != "meta":
            assert torch.equal(after["values"][n], v), n
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    assert "no_sync" not in vars(model)
    assert state_of(model) is None


class MyAdamW(torch.optim.AdamW):
    pass


def _refused_optimizers():
    cases = {
        "LBFGS": lambda m: torch.optim.LBFGS(m.parameters()),
        "Adafactor": lambda m: torch.optim.Adafactor(m.parameters()),
        "Muon": lambda m: torch.optim.Muon([p for p in m.parameters() if p.dim() == 2]),
        "SparseAdam": lambda m: torch.optim.SparseAdam(m.parameters()),
        "MyAdamW": lambda m: MyAdamW(m.parameters()),
    }
    for name, build in cases.items():
        model = _model()
        opt = build(model)
        before = _snapshot(model, opt)
        # The flat partition's allow-list; "auto" (the default) would own Adafactor, Muon and
        # MyAdamW whole instead (tests/step/test_tensor_ownership.py).
        with pytest.raises(TypeError, match=type(opt).__name__) as info:
            zerolite.shard(model, opt, ZeroConfig(stage=2, partition="flat"))
        _assert_untouched(model, opt, before)
        if name == "MyAdamW":
            assert "elementwise_optimizers" in str(info.value)
    # Declared elementwise by the user: accepted.
    model = _model()
    zerolite.shard(
        model, MyAdamW(model.parameters()), ZeroConfig(stage=2, elementwise_optimizers=(MyAdamW,))
    )


def _foreign_parameter():
    model = _model()
    stranger = nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([*model.parameters(), stranger])
    before = _snapshot(model, opt)
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[4\] \(shape \(3,\)\) "
              r"is not a parameter of the model",
    ):
        zerolite.shard(model, opt)
    _assert_untouched(model, opt, before)


def _mixed_devices():
    model = _model()
    model[1].to("meta")
    opt = torch.optim.AdamW(model.parameters())
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="mixed devices.*'0.weight' on cpu.*on meta"):
        zerolite.shard(model, opt)
    _assert_untouched(model, opt, before)


def _twice():
    model = _model()
    opt = zerolite.shard(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="already a ShardedOptimizer"):
        zerolite.shard(model, opt)
    with pytest.raises(RuntimeError, match="already sharded"):
        zerolite.shard(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def _stage_zero():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="stage=0"):
        zerolite.shard(model, opt, ZeroConfig(stage=0))


def _conversions_after_shard():
    model = _model()
    opt = zerolite.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    for convert in (
        lambda: model.double(),
        lambda: model.half(),
        lambda: model[0].to(torch.bfloat16),
        lambda: model.to_empty(device="cpu"),
    ):
        with pytest.raises(RuntimeError, match="cannot be converted after zerolite.shard"):
            convert()
        assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before
    model.to("cpu")  # same device: a no-op, allowed
    model.float()
    model[0].weight.data = torch.zeros(8, 6)  # detaches it from the flat buffer
    model(torch.ones(2, 6)).sum().backward()
    with pytest.raises(
        RuntimeError, match=r"\['0.weight'\] no longer live in zerolite's flat buffers"
    ):
        opt.step()


def _sparse_embedding():
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(
            OrderedDict(tok=nn.Embedding(10, 4, sparse=True), head=nn.Linear(4, 2))
        )
        opt = torch.optim.AdamW(model.parameters())
        before = _snapshot(model, opt)
        with pytest.raises(ValueError, match=r"^tok \(Embedding\) has sparse=True"):
            zerolite.shard(model, opt, ZeroConfig(stage=stage))
        _assert_untouched(model, opt, before)


def _all_bad_input_cases():
    for case in (
        _refused_optimizers,
        _foreign_parameter,
        _mixed_devices,
        _twice,
        _stage_zero,
        _conversions_after_shard,
        _sparse_embedding,
    ):
        case()
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input_raises_clearly_and_changes_nothing(world_size):
    assert run_ranks(_all_bad_input_cases, world_size, timeout=120) == ["ok"] * world_size


# -- divergence guard: ranks that built different things -------------------------------
def _diverging(case):
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = ZeroConfig(stage=2)
    if case == "shapes":
        model = _model(widths=(6, 8, 4) if rank == 0 else (6, 9, 4))
    elif case == "order":  # same names and shapes, registered in another order
        children = [("0", nn.Linear(4, 4)), ("1", nn.Linear(4, 4))]
        model = nn.Sequential(OrderedDict(children if rank == 0 else children[::-1]))
    elif case == "names":
        model = _model(names=["a", "b"] if rank == 0 else ["a", "c"])
    elif case == "bucket":
        model = _model()
        cfg = ZeroConfig(stage=2, bucket_size_mb=25.0 if rank == 0 else 0.0001)
    elif case == "stage":
        model = _model()
        cfg = ZeroConfig(stage=1 if rank == 0 else 2)
    elif case == "one_rank_bad_optimizer":
        model = _model()
        opt = (
            torch.optim.AdamW(model.parameters())
            if rank == 0
            else torch.optim.LBFGS(model.parameters())
        )
        before = _snapshot(model, opt)
        expected = RankMismatchError if rank == 0 else TypeError
        with pytest.raises(expected) as info:
            zerolite.shard(model, opt, cfg)
        _assert_untouched(model, opt, before)
        return str(info.value)
    opt = torch.optim.AdamW(model.parameters())
    before = _snapshot(model, opt)
    with pytest.raises(RankMismatchError) as info:
        zerolite.shard(model, opt, cfg)
    _assert_untouched(model, opt, before)
    return str(info.value)


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "shapes",
            r"Rank 0 has 'param 0.weight: shape=\(8, 6\)"
            r".*rank 1 has 'param 0.weight: shape=\(9, 6\)",
        ),
        (
            "order",
            r"Rank 0 has 'param 0.weight: shape=\(4, 4\)"
            r".*where rank 1 has 'param 1.weight: shape=\(4, 4\)",
        ),
        ("names", r"param a.weight|param b|param c"),
        ("bucket", r"bucket_size_mb=25.0.*bucket_size_mb=0.0001"),
        ("stage", r"stage=1.*stage=2"),
        ("one_rank_bad_optimizer", r"failed on rank 1: TypeError: .*LBFGS"),
    ],
)
def test_ranks_that_disagree_all_raise(case, expected):
    import re

    messages = run_ranks(_diverging, 2, case, timeout=60)
    if case == "one_rank_bad_optimizer":
        assert re.search(expected, messages[0]), messages[0]
        assert "LBFGS" in messages[1]
    else:
        for message in messages:
            assert re.search(expected, message), message
