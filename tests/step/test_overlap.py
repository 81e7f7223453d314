"""Stage 2 overlaps communication with backward, and bounds full-size gradient memory.

On real gloo groups (world sizes 2 and 4), with a pass-through spy on ``torch.distributed``
(`tests.support.comm_spy.CommSpy`): with >= 4 buckets, all but the last bucket's reduce-scatters
start before the last gradient arrives, each bucket is reduce-scattered exactly once per
backward and nothing else is communicated in backward, and the full-size gradients alive
at any hook stay below twice the largest bucket (or parameter). The ranks only measure;
the assertions run in the parent.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import zerolite
from tests.support import parity
from tests.support.comm_spy import CommSpy
from tests.support.rank_reports import SMALL_BUCKETS_MB, TIMEOUT, WORLD_SIZES
from zerolite import ZeroConfig
from zerolite.testing import run_ranks


def _overlap_rank(steps: int) -> dict:
    n = dist.get_world_size()
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model),
                         ZeroConfig(stage=2, bucket_size_mb=SMALL_BUCKETS_MB))
    params = list(model.parameters())
    spy = CommSpy()
    # Per hook firing: (reduce-scatter isends so far, alive bytes).
    hooks: list[tuple[int, int]] = []

    def alive_bytes() -> int:
        storages: dict[int, int] = {}
        for p in params:
            if p.grad is not None:
                s = p.grad.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        for bucket in opt.buckets:
            if bucket.full is not None:
                s = bucket.full.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    def hook(_p):  # registered after shard(): runs after zerolite's own hook
        launched = spy.calls(name="isend", caller="reduce_scatter", since=start[0])
        hooks.append((launched, alive_bytes()))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    start = [0]
    backwards = []
    data = parity.batches(steps)
    with spy:
        for x, y in data:
            hooks.clear()
            start[0] = len(spy.events)
            spy.phase = "backward"
            loss = model(parity.local_slice(x), parity.local_slice(y))
            loss.backward()
            spy.phase = "step"
            rs_isends = spy.calls(name="isend", caller="reduce_scatter", since=start[0])
            backwards.append({
                "hook_firings": len(hooks),
                "rs_isends_at_hooks": [h[0] for h in hooks],
                # Our hook runs after zerolite's: at the last firing, the last gradient has been
                # handled (and may have launched everything). What was launched *before* the last
                # gradient arrived is what the previous firing saw.
                "rs_launched_before_last_grad": hooks[-2][0] / (n - 1),
                "rs_launched_at_last_hook": hooks[-1][0] / (n - 1),
                "rs_launched_in_backward": rs_isends / (n - 1),
                "other_comm_in_backward": [e for e in spy.events[start[0]:]
                                           if e[2] != "reduce_scatter"],
                "max_alive_bytes": max(h[1] for h in hooks),
                "alive_bytes_at_hooks": [h[1] for h in hooks],
                "alive_after_backward": alive_bytes(),
            })
            opt.step()
            opt.zero_grad()
    bucket_bytes = max(f.data.numel() * f.data.element_size() for f in opt.flats)
    largest_param = max(p.numel() * p.element_size() for p in params)
    return {
        "buckets": len(opt.flats),
        "n_params": len(params),
        "bucket_bytes": bucket_bytes,
        "largest_param_bytes": largest_param,
        "backwards": backwards,
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_overlap_and_bounded_grad_memory(world_size):
    reports = run_ranks(_overlap_rank, world_size, 2, timeout=TIMEOUT)
    for r, rep in enumerate(reports):
        buckets = rep["buckets"]
        assert buckets >= 4, f"need >= 4 buckets for the overlap check, got {buckets}"
        bound = 2 * max(rep["bucket_bytes"], rep["largest_param_bytes"])
        for s, bw in enumerate(rep["backwards"]):
            where = f"rank {r} step {s}"
            print(f"\n[overlap ws={world_size}] {where}: buckets={buckets} launched before last "
                  f"grad={bw['rs_launched_before_last_grad']} "
                  f"@last hook={bw['rs_launched_at_last_hook']} "
                  f"in backward={bw['rs_launched_in_backward']} "
                  f"max alive={bw['max_alive_bytes']} B bound={bound} B "
                  f"after={bw['alive_after_backward']} B")
            assert bw["hook_firings"] == rep["n_params"], where
            assert bw["rs_launched_before_last_grad"] >= buckets - 1, (
                f"{where}: only {bw['rs_launched_before_last_grad']} of {buckets} buckets' "
                f"reduce-scatters launched before the last gradient arrived (reduce-scatter "
                f"isends seen at each hook: {bw['rs_isends_at_hooks']})"
            )
            # Every bucket exactly once per backward, nothing else communicated in backward.
            assert bw["rs_launched_in_backward"] == buckets, where
            assert bw["other_comm_in_backward"] == [], where
            assert bw["max_alive_bytes"] <= bound, (
                f"{where}: {bw['max_alive_bytes']} bytes of full-size gradients alive, "
                f"bound {bound} (per hook: {bw['alive_bytes_at_hooks']})"
            )
            assert bw["alive_after_backward"] == 0, f"{where}: full-size gradients survive backward"
