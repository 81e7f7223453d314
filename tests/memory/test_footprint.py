"""Memory: zerolite's footprint equals the ZeRO formula, and every live tensor is counted.

On real gloo groups (world sizes 2 and 4), for stages 1 and 2 in fp32, bf16 and bf16 with
fp32 reduction, on the tiny GPT and an odd-width variant with padded flat buffers; one
launch per world size (a module-scoped fixture), the assertions run here.

- The measured footprint (`zerolite.memory.footprint`) equals the formula of docs/design.md
  (`zerolite.memory.formula`) plus padding computed by the test from the flat-buffer
  layouts plus Adam's 0-dim ``step`` tensors, field by field.
- Independently of zerolite's own bookkeeping, a census of every live tensor of a rank
  (``gc.get_objects()``, `tests.support.memory_accounting`) equals ``footprint(opt).total``, and
  nothing of a model and its optimizer survives once the user drops them.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.support import parity
from tests.support.memory_accounting import (
    census_vs_footprint,
    fields,
    layout_sums,
    live_tensors,
    scalar_state_bytes,
    settled_census,
    storage_key,
)
from tests.support.mixed_recipe import ODD, make_sharded
from zerolite.memory import MemoryBreakdown, footprint, formula
from zerolite.testing import run_ranks

WORLD_SIZES = [2, 4]
FIELDS = ("params", "grads", "master", "optimizer_state")
CONFIGS = {"tiny": parity.TINY, "odd": ODD}


def _backward(model, opt, step: int) -> float:
    """Forward/backward on this rank's slice of global batch ``step``; no tensor made here
    survives the call (so a census right after sees only model, optimizer and zerolite)."""
    x, y = parity.random_batch(model.cfg, parity.GLOBAL_BATCH, seed=1000 + step)
    loss = model(parity.local_slice(x), parity.local_slice(y))
    loss.backward()
    return loss.item()


def _buckets_at_rest(opt) -> bool:
    """Between steps: stage 1 holds no reduced shard, stage 2 no full-size gradient bucket."""
    if opt.config.stage == 1:
        return all(b.shard is None for b in opt.buckets)
    return all(b.full is None for b in opt.buckets)


def _memory_case(cfg_name: str, stage: int, param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype | None, exclude: set[tuple[str, int]]) -> dict:
    model, opt = make_sharded(stage, param_dtype, reduce_dtype, cfg=CONFIGS[cfg_name])
    assert list(model.buffers()) == [], "the census assumes a model without module buffers"
    rec: dict = {"psi": sum(p.numel() for p in model.parameters()), "layout": layout_sums(opt)}
    rec["after_shard"] = fields(footprint(opt))
    rec["census_after_shard"] = census_vs_footprint(opt, exclude)
    for step in range(2):
        _backward(model, opt, step)
        if step == 1:  # gradients reduced (stage 2) or accumulated (stage 1), not yet stepped
            rec["after_backward"] = fields(footprint(opt))
            rec["census_after_backward"] = census_vs_footprint(opt, exclude)
        opt.step()
        if step == 1:
            rec["after_steps"] = fields(footprint(opt))
            rec["buckets_at_rest"] = {"after_steps": _buckets_at_rest(opt)}
        opt.zero_grad(set_to_none=True)
    rec["after_zero_grad"] = fields(footprint(opt))
    rec["buckets_at_rest"]["after_zero_grad"] = _buckets_at_rest(opt)
    rec["census_after_zero_grad"] = census_vs_footprint(opt, exclude)
    rec["scalar_state_bytes"] = scalar_state_bytes(opt)
    rec["n_state_entries"] = len(opt.state)
    # A tensor the user puts into the optimizer's state is counted, once, as optimizer state.
    piece = opt.param_groups[0]["params"][0]
    opt.state[piece]["leak"] = torch.zeros(1000)
    rec["with_leak"] = fields(footprint(opt))
    del opt.state[piece]["leak"]
    rec["leak_removed"] = fields(footprint(opt))
    return rec


def _memory_rank(cases) -> list[dict]:
    pinned = live_tensors()  # kept alive: their addresses cannot be reused by what follows
    exclude = {storage_key(t) for t in pinned}
    gc.freeze()
    out = []
    try:
        for case in cases:
            rec = _memory_case(*case, exclude)
            # The case's model and optimizer went out of scope with _memory_case's frame.
            left_bytes, left_storages = settled_census(exclude, 0)
            rec["left_behind"] = (left_bytes, sorted(left_storages.values()))
            left = live_tensors()
            pinned += left
            exclude |= {storage_key(t) for t in left}
            gc.freeze()
            out.append(rec)
    finally:
        gc.unfreeze()
    return out


MEMORY_CASES = [  # (model, stage, param_dtype, reduce_dtype)
    ("tiny", 1, torch.float32, None),
    ("tiny", 1, torch.bfloat16, None),
    ("tiny", 2, torch.float32, None),
    ("tiny", 2, torch.bfloat16, None),
    ("tiny", 2, torch.bfloat16, torch.float32),
    ("odd", 1, torch.bfloat16, None),  # padded full-size params and grads
    ("odd", 2, torch.float32, None),  # padded fp32 gradient shards
    ("odd", 2, torch.bfloat16, torch.float32),  # padded masters and fp32 shards under bf16
]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def memory_run(request):
    return request.param, run_ranks(_memory_rank, request.param, MEMORY_CASES, timeout=120)


def _case_name(case) -> str:
    model, stage, pd, rd = case
    name = f"{model}/stage{stage}/{str(pd).removeprefix('torch.')}"
    return name + (f"/reduce={str(rd).removeprefix('torch.')}" if rd is not None else "")


def _expected(case, rec, n: int) -> tuple[dict, MemoryBreakdown]:
    """formula() plus the padding the layouts imply, per field, plus scalar state."""
    _, stage, param_dtype, reduce_dtype = case
    psi, lay = rec["psi"], rec["layout"]
    f = formula(psi, world_size=n, stage=stage, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    p_bytes = torch.empty(0, dtype=param_dtype).element_size()
    g_bytes = torch.empty(0, dtype=reduce_dtype or param_dtype).element_size()
    assert psi % n == 0  # formula's sharded terms are exact integers here
    full_pad = lay["padding"]  # full-size categories: Σ padded_numel - Ψ elements
    shard_pad = lay["shard_numel"] - psi // n  # sharded categories: Σ shard_numel - Ψ/N elements
    exp = {
        "params": f.params + p_bytes * full_pad,
        "grads": f.grads + (p_bytes * full_pad if stage == 1 else g_bytes * shard_pad),
        "master": f.master + (0 if param_dtype == torch.float32 else 4 * shard_pad),
        # Per-piece state covers this rank's parameter elements only (no padding): below
        # 8Ψ/N on a rank whose shard ends in padding, and exactly 8Ψ over all ranks.
        "optimizer_state": (f.optimizer_state + 8 * (lay["piece_numel"] - psi // n)
                            + rec["scalar_state_bytes"]),
    }
    return exp, f


def test_footprint_equals_formula_plus_padding(memory_run):
    """Each field == formula + layout padding (+ 4 B per `step`), at any time."""
    n, results = memory_run
    for c, case in enumerate(MEMORY_CASES):
        name = _case_name(case)
        for rank, res in enumerate(results):
            rec = res[c]
            where = f"N={n} {name} rank {rank}"
            exp, f = _expected(case, rec, n)
            # AdamW's `step`:
            assert rec["scalar_state_bytes"] == 4 * rec["n_state_entries"] > 0, where
            got = rec["after_steps"]
            for k in FIELDS:
                assert got[k] == exp[k], (where, k, got[k], exp[k], rec["layout"])
            assert sum(got[k] for k in FIELDS) == sum(exp[k] for k in FIELDS), where
            # Between steps no transient buffer is alive: stage 1 has dropped the reduced shards,
            # stage 2 every full-size bucket (checked directly), and what footprint calls
            # transient is at most a few bytes of bookkeeping (not `== 0`, which would forbid
            # counting zerolite's bool tensors there, see the census test).
            assert rec["buckets_at_rest"] == {"after_steps": True, "after_zero_grad": True}, where
            for when in ("after_steps", "after_zero_grad"):
                assert rec[when]["transient"] <= sum(got[k] for k in FIELDS) // 100, (
                    where, when, rec[when])
            # The same model states after backward and after zero_grad(set_to_none=True);
            # right after shard() the same, but for the optimizer state torch creates lazily.
            for when in ("after_backward", "after_zero_grad"):
                for k in FIELDS:
                    assert rec[when][k] == got[k], (where, when, k, rec[when][k], got[k])
            for k in ("params", "grads", "master"):
                assert rec["after_shard"][k] == got[k], (where, "after_shard", k)
            assert rec["after_shard"]["optimizer_state"] == 0, where
            if rank in (0, n - 1):
                pad = sum(exp[k] for k in FIELDS) - f.model_states - rec["scalar_state_bytes"]
                print(f"\nN={n} {name:28s} rank {rank}: " + ", ".join(
                    f"{k} {got[k]} (formula {getattr(f, k)})" for k in FIELDS)
                    + f"; model_states {sum(got[k] for k in FIELDS)} = formula {f.model_states} "
                    f"+ padding {pad} + scalar {rec['scalar_state_bytes']}")
        # Across ranks the per-piece state covers every parameter element exactly once.
        assert sum(res[c]["layout"]["piece_numel"] for res in results) == results[0][c]["psi"], name


def test_census_of_live_tensors_equals_footprint_total(memory_run):
    """Every live tensor of a rank is accounted for by footprint(opt).total."""
    n, results = memory_run
    mismatches = []
    for c, case in enumerate(MEMORY_CASES):
        for rank, res in enumerate(results):
            rec = res[c]
            for when in ("after_shard", "after_backward", "after_zero_grad"):
                got = rec[f"census_{when}"]
                total = got["footprint"]["total"]
                assert total == rec[when]["total"]
                if got["census"] != total:
                    mismatches.append(
                        f"{_case_name(case)} rank {rank} {when}: live tensors {got['census']} B, "
                        f"footprint total {total} B (+{got['census'] - total} B); footprint does "
                        f"not read "
                        f"{got['missed_summary']}: {got['missed']}")
    assert not mismatches, (f"N={n}: {len(mismatches)} censuses differ; first ones:\n"
                            + "\n".join(mismatches[:4]))


def test_tensor_added_to_optimizer_state_is_counted(memory_run):
    """1000 fp32 elements put into opt.state grow optimizer_state by exactly 4000 B."""
    n, results = memory_run
    for c, case in enumerate(MEMORY_CASES):
        for rank, res in enumerate(results):
            rec = res[c]
            where = f"N={n} {_case_name(case)} rank {rank}"
            leak, base = rec["with_leak"], rec["after_zero_grad"]
            assert leak["optimizer_state"] - base["optimizer_state"] == 4000, where
            for k in ("params", "grads", "master", "transient"):
                assert leak[k] == base[k], (where, k)
            assert leak["total"] == base["total"] + 4000, where
            assert rec["leak_removed"] == base, where


def test_dropped_model_and_optimizer_are_freed(memory_run):
    """The census's corollary: once the user drops model and optimizer, zerolite keeps no tensor."""
    n, results = memory_run
    for c, case in enumerate(MEMORY_CASES):
        for rank, res in enumerate(results):
            left, tensors = res[c]["left_behind"]
            assert left == 0, (
                f"N={n} {_case_name(case)} rank {rank}: {left} B of tensors survive the model and "
                f"optimizer (gc.collect() run): {tensors}")


def test_formula_reproduces_zero_paper_example():
    """7.5e9 params, N=64, bf16: 120, 31.4, 16.6, 1.88 GB (the ZeRO paper's example)."""
    psi, n = 7_500_000_000, 64
    mp = {s: formula(psi, world_size=n, stage=s, param_dtype=torch.bfloat16) for s in range(4)}
    got = [f"{mp[s].model_states / 1e9:.3g}" for s in range(4)]
    assert got == ["120", "31.4", "16.6", "1.88"]
    # docs/design.md's table ("Memory per rank"), term by term (Ψ divisible by N, so exact).
    assert mp[0] == MemoryBreakdown(params=2 * psi, grads=2 * psi, master=4 * psi,
                                    optimizer_state=8 * psi)
    assert mp[1] == MemoryBreakdown(params=2 * psi, grads=2 * psi, master=4 * psi // n,
                                    optimizer_state=8 * psi // n)
    assert mp[2] == MemoryBreakdown(params=2 * psi, grads=2 * psi // n, master=4 * psi // n,
                                    optimizer_state=8 * psi // n)
    assert mp[3] == MemoryBreakdown(params=2 * psi // n, grads=2 * psi // n, master=4 * psi // n,
                                    optimizer_state=8 * psi // n)
    fp32 = {s: formula(psi, world_size=n, stage=s).model_states for s in range(4)}
    assert fp32 == {0: 16 * psi, 1: 8 * psi + 8 * psi // n, 2: 4 * psi + 12 * psi // n,
                    3: 16 * psi // n}
    wide = formula(psi, world_size=n, stage=2, param_dtype=torch.bfloat16,
                   reduce_dtype=torch.float32)
    assert wide.model_states - mp[2].model_states == 2 * psi // n
