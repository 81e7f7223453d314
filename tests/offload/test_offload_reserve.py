"""The disk tier is reserved before the ranks agree.

One rank of two cannot reserve its tier: its file-size limit (``ulimit -f``, set with
``resource.setrlimit`` in that rank only: a real limit, enforced by the kernel) is below the
tier's size, so ``posix_fallocate`` fails with EFBIG. The reservation used to run in the
build, after the optimizer had been re-pointed: that rank's ``shard()`` failed halfway,
leaving its model and optimizer unshardable, and its peer's first step waited
``timeout_s``. Now every rank raises at ``shard()``, naming the reservation (the failing
rank) or the failed peer, with both models and optimizers untouched; with the limit lifted,
the same model and optimizer shard and train. ``timeout_s`` is 600 s: a rank that waited
for its peer would hang the launch, which fails at its own 120 s bound instead.
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

import zerolite
from tests.support import parity
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

LIMIT = 4096  # bytes: far below the tiny GPT's optimizer state


def _untouched(model, opt, ptrs, groups) -> bool:
    return (
        state_of(model) is None
        and {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        and [[id(p) for p in g["params"]] for g in opt.param_groups] == groups
        and not opt.state
    )


def _reserve(where: str) -> dict:
    model = parity.make_model()
    opt = parity.make_optimizer("AdamW", model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    config = zerolite.ZeroConfig(stage=2, offload="disk", offload_dir=where, timeout_s=600)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        zerolite.shard(model, opt, config)
        error = None
    except (ValueError, zerolite.RankMismatchError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    untouched = _untouched(model, opt, ptrs, groups)
    sharded = zerolite.shard(model, opt, config)  # the limit lifted: shardable again
    losses = parity.train(model, sharded, parity.batches(steps=2), sliced=True)
    return {"error": error, "untouched": untouched, "losses": losses}


def test_a_rank_that_cannot_reserve_its_tier_fails_shard_on_every_rank(tmp_path):
    results = run_ranks(_reserve, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result["error"] is not None, rank
        assert "cannot reserve" in result["error"], result["error"]
        assert result["untouched"], rank
        assert len(result["losses"]) == 2 and all(map(torch.isfinite, map(torch.tensor,
                                                                         result["losses"])))
