"""Stage 3: memory bound on live full units, communication volume, eval forwards,
footprint = 16Ψ/N, full_state_dict, clipping and schedulers (real gloo groups)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zerolite
from examples.gpt import GPTConfig
from tests.support import parity
from zerolite.memory import footprint, formula
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

FOUR_LAYERS = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)


class LiveUnitMeter:
    """The test's own measurement: bytes of full parameter storage alive, sampled from
    forward pre/post hooks and gradient hooks on every module and parameter."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.peak = 0
        for module in model.modules():
            module.register_forward_pre_hook(lambda *a: self.sample())
            module.register_forward_hook(lambda *a: self.sample())
        for p in self.params:
            if p.requires_grad:
                p.register_hook(lambda g: self.sample())

    def sample(self) -> None:
        seen, total = set(), 0
        for p in self.params:
            storage = p.untyped_storage()
            if storage.nbytes() > p.element_size() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        self.peak = max(self.peak, total)


def _unit_bytes(opt) -> tuple[int, int]:
    """(largest non-root unit, root unit) full-buffer bytes; the root buffer is the last."""
    sizes = [f.layout.padded_numel * f.data.element_size() for f in opt.flats]
    return max(sizes[:-1]), sizes[-1]


def _memory_bound_case(prefetch: int, reshard: bool) -> dict:
    model = parity.make_model(cfg=FOUR_LAYERS)
    opt = zerolite.shard(
        model, parity.make_optimizer("AdamW", model),
        zerolite.ZeroConfig(stage=3, prefetch=prefetch, reshard_after_forward=reshard),
    )
    meter = LiveUnitMeter(model)
    data = parity.batches(3, cfg=FOUR_LAYERS)
    parity.train(model, opt, data, sliced=True)
    largest, root = _unit_bytes(opt)
    return {"peak": meter.peak, "bound": (prefetch + 1) * largest + root, "units": len(opt.flats)}


def _memory_cases() -> list[dict]:
    return [_memory_bound_case(p, r) for p, r in ((1, True), (0, True), (0, False), (1, False))]


def _is_block_linear(module: torch.nn.Module) -> bool:
    """Custom units: every Linear of the blocks (the head is tied to the embedding: root)."""
    return isinstance(module, torch.nn.Linear) and module.out_features != FOUR_LAYERS.vocab_size


def _prefetch_and_units_case() -> dict:
    """prefetch=2 and custom ``unit_modules`` (a callable): trained 3 steps, live full bytes
    measured by `LiveUnitMeter`, parameters against DDP and the single-process reference;
    prefetch=2 bitwise prefetch=1 (only when gathers start changes)."""
    n = dist.get_world_size()
    data = parity.batches(3, cfg=FOUR_LAYERS)
    ref = parity.make_model(cfg=FOUR_LAYERS)
    ref_losses = parity.train(ref, parity.make_optimizer("AdamW", ref), data, sliced=False)
    ddp_model = parity.make_model(cfg=FOUR_LAYERS)
    ddp_losses = parity.train(torch.nn.parallel.DistributedDataParallel(ddp_model),
                              parity.make_optimizer("AdamW", ddp_model), data, sliced=True)
    ddp = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
    out: dict = {"failures": []}
    finals = {}
    for name, units, prefetch in (("blocks", None, 1), ("blocks", None, 2),
                                  ("linears", _is_block_linear, 1)):
        model = parity.make_model(cfg=FOUR_LAYERS)
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(
            stage=3, prefetch=prefetch, unit_modules=units))
        meter = LiveUnitMeter(model)
        losses = parity.train(model, opt, data, sliced=True)
        try:
            parity.check_parity(f"{name} prefetch={prefetch}", model, losses, ref, ref_losses,
                                ddp)
        except AssertionError as exc:
            out["failures"].append(str(exc))
        finals[name, prefetch] = zerolite.full_state_dict(model, rank0_only=False)
        out[name, prefetch] = meter.peak
    out["prefetch_bitwise"] = all(torch.equal(v, finals["blocks", 2][k])
                                  for k, v in finals["blocks", 1].items())
    # Full bytes of each kind of unit, from the modules' own parameter sizes (padded to a
    # multiple of N, as any flat buffer of them is): a block, its largest Linear, and the
    # root's share with either kind of unit.
    model = parity.make_model(cfg=FOUR_LAYERS)

    def full_bytes(params) -> int:
        return 4 * -(-sum(p.numel() for p in params) // n) * n

    block = full_bytes(model.blocks[0].parameters())
    linear = max(full_bytes(m.parameters()) for m in model.modules() if _is_block_linear(m))
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    in_linears = {id(p) for m in model.modules() if _is_block_linear(m) for p in m.parameters()}
    out["sizes"] = {
        "block": block, "linear": linear,
        "root_blocks": full_bytes(p for p in model.parameters() if id(p) not in in_blocks),
        "root_linears": full_bytes(p for p in model.parameters() if id(p) not in in_linears),
    }
    return out


def test_prefetch_two_and_custom_unit_modules():
    """prefetch=2: at most 3 blocks and the root are full at once, and more than prefetch=1
    allows (so the third gather did start early); training bitwise that of prefetch=1.
    unit_modules picking each block's Linear layers: at most 2 of them and the root (which
    now holds the layer norms) are full at once, far below one block (so the blocks were
    not the units). Both within `tests.support.parity`'s rule of single-process training."""
    for rank, r in enumerate(run_ranks(_prefetch_and_units_case, 2, timeout=120)):
        assert not r["failures"], (rank, r["failures"])
        sizes = r["sizes"]
        p1, p2, linears = r["blocks", 1], r["blocks", 2], r["linears", 1]
        assert p2 <= 3 * sizes["block"] + sizes["root_blocks"], (rank, p2, sizes)
        assert p2 > 2 * sizes["block"] + sizes["root_blocks"] >= p1, (rank, p1, p2, sizes)
        assert r["prefetch_bitwise"], rank
        assert linears <= 2 * sizes["linear"] + sizes["root_linears"] < sizes["block"], (
            rank, linears, sizes)


@pytest.mark.parametrize("world_size", [2, 4])
def test_live_units_stay_within_the_prefetch_bound(world_size):
    results = run_ranks(_memory_cases, world_size, timeout=120)[0]
    (p1, p0, p0_keep, p1_keep) = results
    assert p1["units"] == 5  # four blocks and the root
    assert p1["peak"] <= p1["bound"], p1
    assert p0["peak"] <= p0["bound"], p0
    # Without resharding after forward every block stays gathered until its backward:
    # the same bound is exceeded, so the measurement can tell.
    assert p0_keep["peak"] > p0_keep["bound"], p0_keep
    assert p1_keep["peak"] > p1_keep["bound"], p1_keep


class IsendSpy:
    """Pass-through spy on torch.distributed point-to-point sends (gloo path)."""

    def __init__(self) -> None:
        self.elements = 0
        self._original = dist.isend

    def __enter__(self):
        def spy(tensor, *args, **kwargs):
            self.elements += tensor.numel()
            return self._original(tensor, *args, **kwargs)

        dist.isend = spy
        return self

    def __exit__(self, *exc):
        dist.isend = self._original


def _communication_case() -> dict:
    n = dist.get_world_size()
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    data = parity.batches(2)
    parity.train(model, opt, data[:1], sliced=True)  # first step records the unit order
    with IsendSpy() as spy:
        parity.train(model, opt, data[1:], sliced=True)
    shards = [(n - 1) * f.layout.shard_numel for f in opt.flats]
    root = shards[-1]  # the root unit stays gathered from forward into backward
    expected = {"all_gather": 2 * sum(shards) - root, "reduce_scatter": sum(shards)}
    psi = sum(p.numel() for p in model.parameters())
    return {"sent": spy.elements, "expected": sum(expected.values()), "psi": psi,
            "root_numel": opt.flats[-1].numel,
            "padding": sum(f.layout.padding for f in opt.flats), **expected}


@pytest.mark.parametrize("world_size", [2, 4])
def test_communication_volume(world_size):
    r = run_ranks(_communication_case, world_size, timeout=60)[0]
    n = world_size
    assert r["sent"] == r["expected"], r
    # In logical elements: all-gather 2Ψ(N-1)/N minus the root unit's second gather,
    # reduce-scatter Ψ(N-1)/N, each up to padding (<= N-1 elements per buffer).
    slack = r["padding"] * (n - 1) / n
    assert abs(r["all_gather"] - (2 * r["psi"] - r["root_numel"]) * (n - 1) / n) <= 2 * slack, r
    assert abs(r["reduce_scatter"] - r["psi"] * (n - 1) / n) <= slack, r


def _eval_and_state_case() -> dict:
    reference = parity.make_model()
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("SGD", model), zerolite.ZeroConfig(stage=3))
    x, y = parity.batches(1)[0]
    spy = IsendSpy()
    model.eval()
    reference.eval()
    with torch.no_grad():
        with spy:
            out = model(x)
        expected = reference(x)
    assert torch.equal(out, expected)
    # No gradient buffers, no reduce-scatter, everything freed again.
    assert all(b.full is None for b in opt.buckets)
    gathered_only = sum((dist.get_world_size() - 1) * f.layout.shard_numel for f in opt.flats)
    assert spy.elements == gathered_only
    assert not any(f.unsharded for f in opt.flats)
    # model.state_dict() on every rank gathers unit by unit to the CPU, as full_state_dict
    # does; keep_vars=True (whose entries would be the freed parameters) is refused.
    ref_sd = reference.state_dict()
    plain = model.state_dict()
    assert list(plain) == list(ref_sd)
    for k in ref_sd:
        assert plain[k].device.type == "cpu" and torch.equal(plain[k], ref_sd[k]), k
    assert not any(f.unsharded for f in opt.flats)  # each unit freed again
    with pytest.raises(RuntimeError, match="keep_vars=True"):
        model.state_dict(keep_vars=True)
    with pytest.raises(RuntimeError, match="one stage-3 unit on its own"):
        model.blocks[0].state_dict()
    full = zerolite.full_state_dict(model, rank0_only=False)
    assert list(full) == list(ref_sd)
    for k in ref_sd:
        assert torch.equal(full[k], ref_sd[k]), k
    assert full["head.weight"] is full["wte.weight"]  # tied: one tensor under both names
    assert zerolite.full_state_dict(model) == {} or dist.get_rank() == 0
    # Outside a gather a parameter keeps its shape and reads as NaN, never stale values.
    w = model.blocks[0].qkv.weight
    assert w.shape == (96, 32) and w.isnan().all()
    return "ok"


def test_eval_no_grad_forward_and_full_state_dict():
    assert run_ranks(_eval_and_state_case, 2, timeout=60) == ["ok", "ok"]


def _footprint_case(dtype_name: str) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    n = dist.get_world_size()
    model = parity.make_model()
    opt = zerolite.shard(
        model,
        parity.make_optimizer("AdamW", model),
        zerolite.ZeroConfig(stage=3, param_dtype=dtype),
    )
    parity.train(model, opt, parity.batches(2), sliced=True)
    fp = footprint(opt)
    psi = sum(p.numel() for p in model.parameters())
    ref = formula(psi, world_size=n, stage=3, param_dtype=dtype)
    shard_elems = sum(f.layout.shard_numel for f in opt.flats)
    pad = shard_elems - psi / n  # per-rank padding elements in every sharded category
    size = torch.empty(0, dtype=dtype).element_size()
    master = 0 if dtype == torch.float32 else 4
    steps = sum(
        1 for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() == 0
    )
    expected = ref.model_states + (2 * size + master + 8) * pad + 4 * steps
    return {"measured": fp.model_states, "expected": expected, "transient": fp.transient}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_footprint_is_sixteen_psi_over_n(world_size, dtype):
    r = run_ranks(_footprint_case, world_size, dtype, timeout=60)[0]
    assert r["measured"] == r["expected"], r
    assert r["transient"] < 1000, r  # nothing gathered between steps (only flag bookkeeping)


def _clip_and_schedule_case() -> dict:
    data = parity.batches(4)
    # Clipping: the true global norm, 10x above max_norm, vs torch on the whole batch.
    reference = parity.make_model()
    ref_opt = parity.make_optimizer("AdamW", reference)
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    norms = []
    for x, y in data:
        reference(x, y).backward()
        true = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf)  # measure only
        max_norm = 0.1 * float(
            torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        )
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        norm = opt.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
        norms.append((norm.item(), ref_norm.item(), true.item()))
    # DDP with torch's clipping (its gradients are the averaged full ones) sets the bar.
    ddp_model = parity.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = parity.make_optimizer("AdamW", ddp_model)
    ddp_norms = []
    for (x, y), (_, ref_norm, _) in zip(data, norms):
        ddp(parity.local_slice(x), parity.local_slice(y)).backward()
        ddp_norms.append(  # the same max_norm
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 0.1 * ref_norm).item())
        ddp_opt.step()
        ddp_opt.zero_grad()
    ddp_errors = parity.tensor_errors(ddp_model, reference)
    errors = parity.tensor_errors(model, reference)
    bad = {
        k: (e, ddp_errors[k]) for k, e in errors.items() if not e <= max(2 * ddp_errors[k], 1e-6)
    }
    # Scheduler built on the user's optimizer before shard(): lr = 0 at step 2.
    model2 = parity.make_model()
    sgd = torch.optim.SGD(model2.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.0 if step == 2 else 1.0)
    opt2 = zerolite.shard(model2, sgd, zerolite.ZeroConfig(stage=3))
    changed = []
    for x, y in data:
        before = zerolite.full_state_dict(model2, rank0_only=False)
        model2(parity.local_slice(x), parity.local_slice(y)).backward()
        opt2.step()
        opt2.zero_grad()
        sched.step()
        after = zerolite.full_state_dict(model2, rank0_only=False)
        changed.append(any(not torch.equal(before[k], after[k]) for k in before))
    return {"norms": norms, "ddp_norms": ddp_norms, "bad": bad, "changed": changed}


def test_clipping_and_scheduler_in_stage_3():
    r = run_ranks(_clip_and_schedule_case, 2, timeout=60)[0]
    # Per step within twice DDP's deviation from the reference's norm, or a few fp32
    # roundings of a norm (1e-6 relative): the same gradient's norm summed in another order.
    assert len(r["norms"]) == len(r["ddp_norms"]) == 4
    for (norm, ref, _), ddp_norm in zip(r["norms"], r["ddp_norms"]):
        assert abs(norm - ref) <= max(2 * abs(ddp_norm - ref), 1e-6 * ref), r
    assert r["bad"] == {}, r["bad"]
    assert r["changed"] == [True, True, False, True]
