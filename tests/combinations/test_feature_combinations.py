"""Hybrid sharding, offload, whole-tensor ownership, quantized collectives and asynchronous
saves, combined in depth (real gloo groups and files).

Each combination that `shard()` accepts runs against the same run without the second
feature; one 4-rank launch (hybrid) and one 2-rank launch run every case. Every case also
observes each of its features at work, so that a feature silently dropped in a combination
fails the test: the offload tier holds its bytes where it lives (`tier_bytes_held`) and the
resident bytes drop by as much; quantized exchanges send uint8 messages and fewer bytes than
unquantized training (`tests.support.comm_spy.exchanges`) and leave non-zero residuals; hybrid's
exchange across replica groups ran (bytes across "nodes" of 2 ranks).

1. hybrid sharding (k = 2 of 4) + offload ("host" and "disk", fraction 0.5), stage 2 bf16
   and stage 3 fp32, with clipping: losses and parameters bitwise those of hybrid in memory.
2. hybrid (k = 2) + whole-tensor ownership, Muon + AdamW and Adafactor, stage 2, 4 steps (3
   updates), against the single-process reference by `tests.support.parity`'s rule (per tensor and
   per step within 2 x DDP's deviation), DDP's deviation taken over several summation orders
   of the same gradient: Muon orthogonalises in bf16, so the last-ulp difference another
   summation order makes in a gradient moves some update elements by a bf16 step, for DDP
   as for hybrid (which sums within the node, then across).
3. ``save(blocking=False)`` + offload (disk, 0.5, bf16 masters on the tier), + partition=
   "tensor" (Muon + AdamW), + ``quantize_reduce`` (error-feedback residuals): the write is
   held open while 2 steps run; a fresh model loads, bitwise, the parameters, masters,
   optimizer state (read through the tier) and non-zero residuals of the call.
4. offload + ``quantize_gather`` / ``quantize_reduce``, stage 2 bf16: bitwise the quantized
   run in memory.
5. ``save(blocking=False)`` under hybrid + ``quantize_reduce`` writes,
   from the first replica group, the state at the call with every replica's residuals.
6. hybrid (k = 2) + ``quantize_gather`` / ``quantize_reduce`` / both, stage 2 bf16, and
   both at stage 3 fp32, against the same hybrid unquantized: per-step loss within the
   quantized tests' 1e-2 relative; the two replicas of each shard bitwise equal (masters,
   gradient shards); every rank's parameters equal; footprint == estimate (the cross-node
   residual included).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.offload.test_offload import _build, _config, _full, _train
from tests.step.test_tensor_ownership import oracle, shard
from tests.support import parity
from tests.support.comm_spy import CommSpy, exchanges
from tests.support.loss_checks import worst_deviation
from tests.support.memory_accounting import tier_bytes_held
from tests.support.rank_reports import guarded
from zerolite import checkpoint as ckpt
from zerolite.checkpoint.commit import HOLD_ENV
from zerolite.memory import estimate, footprint
from zerolite.testing import FootprintMismatch, assert_footprint, run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 2
TENSOR_STEPS = 4  # hybrid + "tensor": losses after 3 updates, not 1
TIMEOUT = 150.0
HALF = 0.5
K = 2  # hybrid: shard groups of K consecutive ranks ("nodes")


def _max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].double() - b[n].double()).abs().max().item() for n in b)


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in b)


def _observe(model, opt, spy: CommSpy) -> dict:
    """What the features of a run did, measured: bytes sent per exchange and link
    (`tests.support.comm_spy.exchanges`, nodes of K ranks), the resident master + optimizer-state
    bytes and the tier's line (`footprint`), the bytes the tier holds where it lives
    (`tier_bytes_held`), and how many error-feedback residuals (within a shard group; across
    replica groups) hold non-zero values."""
    fp = footprint(opt)
    exchanges_of = [f.exchange for f in opt.flats]
    return {
        "wire": exchanges(spy.events, K),
        "resident": fp.master + fp.optimizer_state,
        "offloaded": fp.offloaded,
        "tier": tier_bytes_held(model),
        "residuals": sum(bool(e.residual.any()) for e in exchanges_of if e.residual is not None),
        "cross_residuals": sum(bool(e.replica_residual.any()) for e in exchanges_of
                               if e.replica_residual is not None),
    }


def _run(config, data, name="AdamW") -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Train; (losses, full parameters, `_observe`)."""
    model, opt = _build(config, name)
    with CommSpy() as spy:
        losses = _train(model, opt, data)
    return losses, _full(model), _observe(model, opt, spy)


def _compare(base: tuple, other: tuple) -> dict:
    """Two `_run`s: equal losses (same length, NaN never equal), bitwise parameters, max
    |difference|; ``drop``: how much less resident master + state ``other`` holds."""
    return {"losses": other[0] == base[0], "bitwise": _bitwise(other[1], base[1]),
            "max_abs": _max_abs(other[1], base[1]), "drop": base[2]["resident"]
            - other[2]["resident"], "base": base[2], **other[2]}


def _sent(wire: dict, exchange: str) -> tuple[int, list[str]]:
    """(bytes, dtypes) of one ``caller/link`` of `_observe`'s ``wire``; (0, []) if absent."""
    entry = wire.get(exchange, {"bytes": 0, "dtypes": []})
    return entry["bytes"], entry["dtypes"]


# ---------------------------------------------------------------- 1, 2, 5: 4 ranks, k = 2


def _hybrid_offload(where: str) -> dict:
    data = parity.batches(STEPS)
    out = {}
    for stage, dtype in ((2, torch.bfloat16), (3, torch.float32)):
        base = _run(_config(stage, dtype, shard_group_size=K), data)
        for tier in ("host", "disk"):
            config = _config(stage, dtype, tier, HALF, where, shard_group_size=K)
            out[stage, str(dtype), tier] = _compare(base, _run(config, data))
    return out


def _hybrid_tensor() -> dict:
    """Per optimizer recipe: hybrid with whole-tensor ownership against the single-process
    reference, per tensor and per step, and what crossed nodes."""
    data = parity.batches(TENSOR_STEPS)
    out = {}
    for name in ("muon+adamw", "adafactor"):
        ref, ref_losses, ddp = oracle(name, data)
        model = parity.make_model()
        opt = shard(name, model, stage=2, bucket_size_mb=0.01, partition="tensor",
                    shard_group_size=K)
        with CommSpy() as spy:
            losses = parity.train(model, opt, data, sliced=True)
        out[name] = {"rel": parity.tensor_errors(model, ref), "ddp": ddp.tensors,
                     "wire": exchanges(spy.events, K), "cross_residuals": 0,
                     "loss_dev": parity.loss_deviations(losses, ref_losses),
                     "loss_bound": parity.loss_bound(ddp.losses)}
    return out


QUANTIZE = {"gather": {"quantize_gather": True}, "reduce": {"quantize_reduce": True},
            "both": {"quantize_gather": True, "quantize_reduce": True}}


def _hybrid_quantized() -> dict:
    """Hybrid (k = 2) quantized against the same hybrid unquantized: per-step losses, every
    replica's masters and gradient shards (bitwise equal to its other replica's), every
    rank's parameters, the footprint against the estimate, and what went on the wire."""
    data = parity.batches(4)
    out = {}
    for stage, dtype, cases in ((2, torch.bfloat16, QUANTIZE), (3, torch.float32, ["both"])):
        base, _, unquantized = _run(_config(stage, dtype, shard_group_size=K), data)
        for case in cases:
            config = _config(stage, dtype, shard_group_size=K, quant_block=64, **QUANTIZE[case])
            model, opt = _build(config)
            with CommSpy() as spy:
                losses = _train(model, opt, data)
            observed = _observe(model, opt, spy)
            x, y = data[0]
            model(parity.local_slice(x), parity.local_slice(y)).backward()
            opt.shard_state.reducer.reduce()  # the shards of one more backward, not stepped
            mine = [torch.cat([m.data for m in opt.masters]),
                    torch.cat([b.shard.float() for b in opt.buckets if b.shard is not None])]
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            rank = dist.get_rank()
            twin = everyone[(rank + K) % dist.get_world_size()]
            params = torch.cat([v.float().flatten() for v in _full(model).values()])
            all_params: list = [None] * dist.get_world_size()
            dist.all_gather_object(all_params, params)
            fresh = parity.make_model()
            predicted = estimate(fresh, world_size=dist.get_world_size(), config=config,
                                 optimizer=parity.make_optimizer("AdamW", fresh), rank=rank)
            try:
                assert_footprint(opt)  # against estimate_sharded
                assert_footprint(opt, expected=predicted)
                footprint_ok = "ok"
            except FootprintMismatch as exc:
                footprint_ok = str(exc)
            out[f"stage {stage} {dtype} {case}"] = {
                "loss_rel": worst_deviation(losses, base),
                "replicas_identical": all(torch.equal(a, b) for a, b in zip(mine, twin)),
                "params_identical": all(torch.equal(p, params) for p in all_params),
                "footprint": footprint_ok,
                "cross_residual_buffers": {f.exchange.replica_residual is not None
                                           for f in opt.flats},
                "base": unquantized, **observed,
            }
    return out


def _four_ranks(where: str) -> dict:
    out = {"offload": _hybrid_offload(where), "tensor": _hybrid_tensor(),
           "quantized": _hybrid_quantized()}
    # Async save under hybrid, with residuals within and across the shard groups.
    out["async_hybrid"] = _async_case(Path(where) / "async-hybrid", lambda: _build(
        _config(2, torch.float32, shard_group_size=K, quantize_reduce=True)))
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    where = str(tmp_path_factory.mktemp("combo4"))
    reports = run_ranks(guarded, 4, _four_ranks, where, timeout=TIMEOUT)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
    return reports


def _tier_problems(got: dict) -> list[str]:
    """The offload tier exists and holds the bytes: measured where it lives (`tier_bytes_held`),
    they equal the drop in resident master + optimizer state against the run in memory, and
    footprint's tier line."""
    problems = []
    if not got["tier"] > 0:
        problems.append(f"no offload tier (it holds {got['tier']} bytes)")
    if got["drop"] != got["tier"]:
        problems.append(f"resident bytes dropped by {got['drop']}, the tier holds {got['tier']}")
    if got["offloaded"] != got["tier"]:
        problems.append(f"footprint().offloaded is {got['offloaded']}, the tier holds "
                        f"{got['tier']}")
    return problems


def _quantized_problems(got: dict, base: dict, *, gather: bool, reduce: bool,
                        link: str = "within") -> list[str]:
    """Each quantized exchange sends uint8 messages and fewer bytes than the unquantized run
    (``base``) on ``link``; an unquantized one sends what ``base`` sends, with no uint8;
    ``quantize_reduce`` leaves non-zero error-feedback residuals."""
    problems = []
    for exchange, on in (("all_gather", gather), ("reduce_scatter", reduce)):
        (q, dtypes), (u, _) = _sent(got["wire"], f"{exchange}/{link}"), _sent(
            base["wire"], f"{exchange}/{link}")
        if on and not ("uint8" in dtypes and q < u):
            problems.append(f"{exchange}/{link} not quantized: {q} bytes {dtypes}, unquantized {u}")
        if not on and (q != u or "uint8" in dtypes):
            problems.append(f"{exchange}/{link} quantized: {q} bytes {dtypes}, unquantized {u}")
    if reduce and not got["residuals"]:
        problems.append("quantize_reduce left no non-zero error-feedback residual")
    return problems


def _replica_problems(got: dict, *, quantized: bool = False) -> list[str]:
    """Hybrid sharding ran its exchange across replica groups: the gradient shards crossed
    nodes in floats (on gloo a point-to-point reduce-scatter and all-gather of R parts), or
    (``quantized``, ``quantize_reduce``) as uint8 point-to-point messages only, with non-zero
    cross-node residuals."""
    wire = got["wire"]  # mean_over_ranks/across: the test's own loss average, left out
    across = {k: v for k, v in wire.items()
              if k.endswith("/across") and not k.startswith("mean_over_ranks")}
    if quantized:
        p2p = [v for k, v in across.items() if not k.startswith("all_reduce")]
        ok = p2p and all(v["dtypes"] == ["uint8"] and v["bytes"] > 0 for v in p2p) and (
            "all_reduce/across" not in wire) and got["cross_residuals"] > 0
    else:
        ok = set(across) == {"reduce_scatter/across", "all_gather/across"} and all(
            v["bytes"] > 0 and "uint8" not in v["dtypes"] for v in across.values())
    return [] if ok else [f"replica exchange ({quantized=}) not seen: {across}, cross residuals "
                          f"{got['cross_residuals']}"]


def test_hybrid_with_offload_is_bitwise_hybrid_in_memory(four) -> None:
    """Bitwise hybrid in memory, with both features observed: the tier holds the offloaded
    bytes (and resident bytes dropped by as much), and the gradient shards crossed nodes."""
    for r, rep in enumerate(four):
        for case, got in rep["offload"].items():
            assert got["losses"] and got["bitwise"], (r, case, got)
            assert not _tier_problems(got), (r, case, _tier_problems(got))
            assert not _replica_problems(got), (r, case, _replica_problems(got))
    print("\nhybrid + offload vs hybrid: max abs, tier bytes",
          {k: (v["max_abs"], v["tier"]) for k, v in four[0]["offload"].items()})


def test_hybrid_with_tensor_ownership_matches_ddp(four) -> None:
    """Hybrid (k = 2 of 4) with whole-tensor ownership, Muon + AdamW and Adafactor, 4 steps
    (3 updates), against the single-process reference by `tests.support.parity`'s rule, DDP's
    deviation taken over its summation orders (`tests.step.test_tensor_ownership.oracle`): per
    tensor within max(2 x DDP's, 1e-6); Adafactor's losses per step within max(2 x DDP's
    largest over the run, 1e-6). Muon's losses are printed, not bounded: its bf16
    orthogonalisation turns each summation order's last-ulp gradient differences into
    bf16-step update differences, so at 1e-6 its loss deviation is a matter of which
    elements happen to round the other way (measured after 3 updates: hybrid 1.1e-6, flat
    "tensor" at 4 ranks 5.6e-6, DDP's orders up to 1.1e-6), while every tensor stays within
    its bound. The gradient shards crossed nodes (hybrid ran)."""
    for r, rep in enumerate(four):
        for recipe, got in rep["tensor"].items():
            assert not _replica_problems(got), (r, recipe, _replica_problems(got))
            bad = {n: (e, got["ddp"][n]) for n, e in got["rel"].items()
                   if not e <= max(2 * got["ddp"][n], 1e-6)}
            assert not bad, (r, recipe, "tensor: (error, DDP's)", bad)
            if recipe != "muon+adamw":
                bad = [(s, d) for s, d in enumerate(got["loss_dev"]) if not d <= got["loss_bound"]]
                assert not bad, (r, recipe, "step, loss deviation", bad, got["loss_bound"])
    for recipe, got in four[0]["tensor"].items():
        ratio = max(e / max(2 * got["ddp"][n], 1e-6) for n, e in got["rel"].items())
        print(f"\nhybrid + tensor ({recipe}) vs reference: worst tensor / bound {ratio:.2f}; "
              f"loss {['%.1e' % d for d in got['loss_dev']]} "
              f"(bound {got['loss_bound']:.1e})")


def test_hybrid_with_quantization_stays_close_and_replicas_identical(four) -> None:
    """Within the quantized tests' tolerance (1e-2 relative per-step loss) of hybrid
    unquantized; the two replicas of each shard hold bitwise-equal masters and gradient
    shards (a replica keeping its own piece exact would drift); every rank the same
    parameters; footprint == estimate, the cross-node residual included. On the wire, at
    both stages: every switch on sends uint8 and fewer bytes within the node, every switch
    off sends what the unquantized run sends; with ``quantize_reduce`` the cross-node step
    sends uint8 and leaves non-zero residuals, without it the float all-reduce runs."""
    for r, rep in enumerate(four):
        for case, got in rep["quantized"].items():
            assert got["loss_rel"] <= 1e-2, (r, case, got)
            assert got["replicas_identical"] and got["params_identical"], (r, case, got)
            assert got["footprint"] == "ok", (r, case, got)
            assert got["cross_residual_buffers"] == {not case.endswith("gather")}, (r, case, got)
            switches = case.split()[-1]
            gather, reduce = switches in ("gather", "both"), switches in ("reduce", "both")
            problems = _quantized_problems(got, got["base"], gather=gather, reduce=reduce)
            problems += _replica_problems(got, quantized=reduce)
            assert not problems, (r, case, problems)
    print("\nhybrid + quantized vs hybrid: loss rel",
          {k: f"{v['loss_rel']:.1e}" for k, v in four[0]["quantized"].items()})


def test_async_save_under_hybrid_writes_the_state_at_the_call(four) -> None:
    """Hybrid (k = 2 of 4) + ``quantize_reduce``: the first replica group writes while two
    steps run, the other replicas' residuals (within and across shard groups) gathered
    before the call returned; a fresh hybrid model loads the parameters, masters, optimizer
    state and every residual of the call, bit for bit, on every rank."""
    for r, rep in enumerate(four):
        got = rep["async_hybrid"]
        assert got["held"] and got["moved"], (r, got)
        assert got["equal"], f"rank {r}: the loaded state is not the state at the call"
        assert got["residuals"] > 1, (r, got["residuals"])  # within and across


# ---------------------------------------------------------------- 3, 4: 2 ranks


def _snapshot(model, opt) -> dict:
    """Parameters, every piece's master and optimizer state (through the tier), and the
    error-feedback residuals: clones."""
    state = {}
    for p in opt.shard_state.pieces():
        entry = {k: v.clone() for k, v in p.read_state().items() if isinstance(v, torch.Tensor)}
        state[p.name, p.param_start] = {"master": p.read_master().clone(), **entry}
    residuals = [r.clone() for f in opt.flats for r in f.exchange.residuals]
    return {"params": _full(model), "state": state, "residuals": residuals}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _async_case(root: Path, make) -> dict:
    """Train 2 steps, save asynchronously, hold the write open through 2 more steps, load
    into a fresh model; the loaded state against the state at the call."""
    data = parity.batches(4)
    model, opt = make()
    _train(model, opt, data[:2])
    at_call = _snapshot(model, opt)
    release = root / "release"
    os.environ[HOLD_ENV] = f"writing:{release}"
    try:
        pending = ckpt.save(root / "ckpt", model, opt, blocking=False)
        _train(model, opt, data[2:])
        held = not pending.done()
        dist.barrier()
        if dist.get_rank() == 0:
            release.touch()
        pending.wait()
    finally:
        del os.environ[HOLD_ENV]
    moved = not _equal(_snapshot(model, opt), at_call)
    fresh, fresh_opt = make()
    ckpt.load(root / "ckpt", fresh, fresh_opt)
    return {"held": held, "moved": moved, "equal": _equal(_snapshot(fresh, fresh_opt), at_call),
            "residuals": sum(bool(r.any()) for r in at_call["residuals"]),
            "tier": (tier_bytes_held(model), tier_bytes_held(fresh))}


def _async_cases(where: str, root: str) -> dict:
    cases = {
        "offload": lambda: _build(_config(2, torch.bfloat16, "disk", HALF, where)),
        "tensor": lambda: (lambda m: (m, shard("muon+adamw", m, stage=2, bucket_size_mb=0.01,
                                               partition="tensor")))(parity.make_model()),
        "quantize_reduce": lambda: _build(_config(2, torch.float32, quantize_reduce=True)),
    }
    return {name: _async_case(Path(root) / name, make) for name, make in cases.items()}


def _offload_quantized(where: str) -> dict:
    data = parity.batches(3)
    out = {}
    unquantized = _run(_config(2, torch.bfloat16), data)[2]
    for quantize in (dict(quantize_gather=True, quantize_reduce=True),
                     dict(quantize_gather=True), dict(quantize_reduce=True)):
        base = _run(_config(2, torch.bfloat16, **quantize), data)
        for tier, fraction in (("host", HALF), ("disk", HALF), ("disk", 1.0)):
            config = _config(2, torch.bfloat16, tier, fraction, where, **quantize)
            out[tuple(quantize), tier, fraction] = {**_compare(base, _run(config, data)),
                                                    "unquantized": unquantized}
    return out


def _two_ranks(where: str, root: str) -> dict:
    return {"async": _async_cases(where, root), "quantized": _offload_quantized(where)}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    where = str(tmp_path_factory.mktemp("combo2"))
    root = str(tmp_path_factory.mktemp("combo2ckpt"))
    reports = run_ranks(guarded, 2, _two_ranks, where, root, timeout=TIMEOUT)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
    return reports


@pytest.mark.parametrize("case", ["offload", "tensor", "quantize_reduce"])
def test_async_save_writes_the_state_at_the_call(two, case) -> None:
    for r, rep in enumerate(two):
        got = rep["async"][case]
        assert got["held"] and got["moved"], (r, case, got)
        assert got["equal"], f"rank {r}: {case}: the loaded state is not the state at the call"
        if case == "offload":  # the saved model's tier and the loading model's hold bytes
            assert min(got["tier"]) > 0, (r, got["tier"])
        if case == "quantize_reduce":
            assert got["residuals"] > 0, (r, got["residuals"])


def test_offload_with_quantized_collectives_is_bitwise_quantized_in_memory(two) -> None:
    """Bitwise the quantized run in memory, with both features observed: the tier holds the
    offloaded bytes (resident bytes dropped by as much), and each quantized exchange sends
    uint8, fewer bytes than unquantized training (residuals non-zero with quantize_reduce)."""
    for r, rep in enumerate(two):
        for case, got in rep["quantized"].items():
            assert got["losses"] and got["bitwise"], (r, case, got)
            switches = case[0]
            problems = _tier_problems(got) + _quantized_problems(
                got, got["unquantized"], gather="quantize_gather" in switches,
                reduce="quantize_reduce" in switches)
            assert not problems, (r, case, problems)
    print("\noffload + quantized vs quantized: max abs",
          {k: v["max_abs"] for k, v in two[0]["quantized"].items()})
