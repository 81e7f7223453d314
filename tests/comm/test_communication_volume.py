"""Communication volume per optimizer step: the ring's 2 (N-1)/N Psi, plus padding.

Measured with `tests.support.comm_spy.CommSpy` on real gloo groups (world sizes 2 and 4), with
padded and unpadded flat buffers, stages 1 and 2: the reduce-scatter and the all-gather
each send (N-1) ceil(m / N) elements per bucket of m elements, plus one small flag
all-reduce per step and nothing else. The expectation is computed here from the model's
own parameters, with no code of zerolite's plan or layout: the buckets are what
docs/design.md's rule gives (parameters in reverse registration order, packed greedily up to
``bucket_size_mb`` of fp32, a larger parameter alone), each padded to a multiple of N;
in all 2 (N-1)/N Psi <= sent <= 2 (N-1)/N Psi + 2 (N-1)^2/N per bucket.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import zerolite
from examples.gpt import GPTConfig
from tests.support import parity
from tests.support.comm_spy import CommSpy
from tests.support.rank_reports import SMALL_BUCKETS_MB, TIMEOUT, WORLD_SIZES, guarded
from zerolite import ZeroConfig
from zerolite.testing import run_ranks

ODD = GPTConfig(vocab_size=61, seq_len=7, n_layer=1, n_head=3, d_model=9)


def _buckets(model, bucket_mb: float) -> list[int]:
    """Elements of each bucket docs/design.md's rule makes of ``model``'s parameters (written here,
    independently of `zerolite.plan.shard_plan`): reverse registration order, greedy up to the byte
    capacity, a parameter larger than it alone; a tied parameter counted once."""
    capacity = max(1, int(bucket_mb * 2**20))
    sizes, current, used = [], 0, 0
    for p in reversed(list(model.parameters())):
        nbytes = p.numel() * 4
        if current and used + nbytes > capacity:
            sizes.append(current)
            current, used = 0, 0
        current += p.numel()
        used += nbytes
    return [*sizes, current] if current else sizes


def _comm_rank() -> dict:
    n = dist.get_world_size()
    out = {}
    cases = [
        ("tiny/stage2/default", parity.TINY, 2, None),
        ("tiny/stage1/default", parity.TINY, 1, None),
        ("tiny/stage2/small", parity.TINY, 2, SMALL_BUCKETS_MB),
        ("odd/stage2/default", ODD, 2, None),
        ("odd/stage2/tiny buckets", ODD, 2, 0.0005),
    ]
    for label, cfg, stage, bucket_mb in cases:
        model = parity.make_model(cfg=cfg)
        buckets = _buckets(model, 25.0 if bucket_mb is None else bucket_mb)
        params = list(model.parameters())
        config = (ZeroConfig(stage=stage) if bucket_mb is None
                  else ZeroConfig(stage=stage, bucket_size_mb=bucket_mb))
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
        data = parity.batches(2, cfg=cfg, batch=8)
        steps = []
        with CommSpy() as spy:
            for x, y in data:
                since = len(spy.events)
                spy.phase = "backward"
                model(parity.local_slice(x), parity.local_slice(y)).backward()
                spy.phase = "step"
                opt.step()
                spy.phase = None
                ev = spy.events[since:]
                steps.append({
                    "isend": sum(e[1] for e in ev if e[0] == "isend"),
                    "irecv": sum(e[1] for e in ev if e[0] == "irecv"),
                    "rs_isend": sum(e[1] for e in ev
                                    if e[0] == "isend" and e[2] == "reduce_scatter"),
                    "ag_isend": sum(e[1] for e in ev if e[0] == "isend" and e[2] == "all_gather"),
                    "all_reduce_calls": sum(1 for e in ev if e[0] == "all_reduce"),
                    "all_reduce_elements": sum(e[1] for e in ev if e[0] == "all_reduce"),
                    "other": sorted({(e[0], e[2]) for e in ev
                                     if e[0] not in ("isend", "irecv", "all_reduce")}),
                })
                opt.zero_grad()
        out[label] = {
            "psi": sum(p.numel() for p in params),
            "buckets": buckets,
            "params": len(params),
            "n": n,
            "steps": steps,
        }
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_communication_volume_per_step(world_size):
    reports = run_ranks(guarded, world_size, _comm_rank, timeout=TIMEOUT)
    n = world_size
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        for label, c in rep.items():
            assert sum(c["buckets"]) == c["psi"], (label, c["buckets"], c["psi"])
            # Each rank sends its N-1 other chunks of every padded bucket, reduce-scatter and
            # again all-gather.
            expected_each = (n - 1) * sum(-(-m // n) for m in c["buckets"])
            expected = 2 * expected_each
            ring = 2 * (n - 1) / n * c["psi"]  # what a ring all-reduce of Psi sends per rank
            assert ring <= expected <= ring + 2 * (n - 1) ** 2 / n * len(c["buckets"]), label
            # One flag per parameter, "repeated step" (a step() with no backward since the last
            # one), "unreduced", and the lockstep check (exchanges, steps and forwards, each as
            # a max and a negated max).
            flags = c["params"] + 1 + 1 + 6
            if r == 0:
                flag_calls = [(s["all_reduce_calls"], s["all_reduce_elements"]) for s in c["steps"]]
                print(f"\n[comm ws={n}] {label}: psi={c['psi']} buckets={c['buckets']} "
                      f"expected/step={expected} "
                      f"(2 psi (N-1)/N = {2 * c['psi'] * (n - 1) / n:.1f}) "
                      f"measured={[s['isend'] for s in c['steps']]} flag all-reduce: "
                      f"{flag_calls} (int64)")
            for s, st in enumerate(c["steps"]):
                where = f"rank {r} {label} step {s}"
                assert st["rs_isend"] == expected_each, (
                    f"{where}: reduce-scatter sent {st['rs_isend']}, expected {expected_each}")
                assert st["ag_isend"] == expected_each, (
                    f"{where}: all-gather sent {st['ag_isend']}, expected {expected_each}")
                assert st["isend"] == expected, f"{where}: sent {st['isend']}, expected {expected}"
                assert st["irecv"] == expected, (
                    f"{where}: received {st['irecv']}, expected {expected}")
                # The small flag all-reduce: one call, one int64 per parameter + 8.
                assert (st["all_reduce_calls"], st["all_reduce_elements"]) == (1, flags), where
                assert st["other"] == [], f"{where}: unexpected communication {st['other']}"
