"""`zerolite.checkpoint.prepare_async_save`: the staging area of asynchronous saves made
ahead of the first one, on real gloo groups and files (stages 2 and 3):

1. called before the first step, it waits for that step's end (its step hook then removed),
   and the area is then held at exactly the size of the rank's file data, every page
   touched, and reported by `track` as staging;
2. the first asynchronous save uses that buffer (no new allocation) and writes the state
   at the call, bitwise, as a later save would;
3. called after a step, it prepares at once; a wrong model or optimizer is refused.

How much shorter the first save blocks is a timing, measured by
``benchmarks/checkpoint_io.py``, not asserted here.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.checkpoint.test_checkpoint import NO_DROPOUT, build, differences, snapshot, train
from tests.checkpoint.test_checkpoint_async import _file_data_bytes
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.checkpoint.format import rank_file_name
from zerolite.checkpoint.staging import staging_area
from zerolite.testing import run_ranks


def _prepared_first_save(root: Path, stage: int) -> dict:
    gc.collect()  # the previous stage's optimizer and its area (track counts every area)
    data = parity.batches(3, cfg=NO_DROPOUT)
    model, opt, _ = build(NO_DROPOUT, stage)
    area = staging_area(opt)
    ckpt.prepare_async_save(model, opt)
    out = {"before_step": area.nbytes, "hooks_before": len(opt._optimizer_step_post_hooks)}
    train(model, opt, data[:1])
    out["after_step"] = area.nbytes  # counted at once, while the thread touches it
    out["hooks_after"] = len(opt._optimizer_step_post_hooks)
    area._finish_preparing()
    out["untouched_bytes"] = int(area.buffer.count_nonzero())  # fill_(0) reached every page
    with zerolite.memory.track(opt) as tracker:
        train(model, opt, data[1:2])
    out["tracked"] = tracker.staging
    prepared = area.buffer.data_ptr()
    at_call = snapshot(model, opt)
    pending = ckpt.save(root / "first", model, opt, extra={"step": 2}, blocking=False)
    out["same_buffer"] = area.buffer.data_ptr() == prepared
    train(model, opt, data[2:])  # the live state moves on during the write
    pending.wait()
    out["area_bytes"] = area.nbytes
    out["file_bytes"] = _file_data_bytes(root / "first" / rank_file_name(dist.get_rank(), 2))
    fresh, fresh_opt, _ = build(NO_DROPOUT, stage, seed=1, rng_seed=555)
    out["extra"] = ckpt.load(root / "first", fresh, fresh_opt)
    out["diff"] = differences(snapshot(fresh, fresh_opt), at_call)
    return out


def _after_a_step_and_refusals() -> dict:
    model, opt, _ = build(NO_DROPOUT, 2)
    train(model, opt, parity.batches(1, cfg=NO_DROPOUT))
    ckpt.prepare_async_save(model, opt)  # a step was taken: at once, no hook
    out = {"hooks": len(opt._optimizer_step_post_hooks), "bytes": staging_area(opt).nbytes}
    other, _, _ = build(NO_DROPOUT, 2)
    for label, args in (("model", (other, opt)), ("optimizer", (model, torch.optim.SGD(
            model.parameters(), lr=0.1)))):
        try:
            ckpt.prepare_async_save(*args)
        except (TypeError, ValueError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _rank(root: str) -> dict:
    out = {stage: _prepared_first_save(Path(root) / f"stage{stage}", stage) for stage in (2, 3)}
    out["after"] = _after_a_step_and_refusals()
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return run_ranks(_rank, 2, str(tmp_path_factory.mktemp("prepared")), timeout=180)


@pytest.mark.parametrize("stage", [2, 3])
def test_prepared_area_is_the_first_saves_buffer(launched, stage):
    for rank, outs in enumerate(launched):
        out = outs[stage]
        assert out["before_step"] == 0 and out["hooks_before"] == 1, (rank, out)
        assert out["hooks_after"] == 0, "the step hook was not removed"
        assert out["after_step"] == out["area_bytes"] == out["file_bytes"] > 0, (rank, out)
        assert out["untouched_bytes"] == 0
        assert out["tracked"] == out["area_bytes"], (rank, out["tracked"])
        assert out["same_buffer"], "the first save allocated a new staging buffer"
        assert out["extra"] == {"step": 2}
        assert not out["diff"], f"rank {rank}: not the state at the call: {out['diff'][:8]}"


def test_prepare_after_a_step_and_bad_arguments(launched):
    for out in launched:
        after = out["after"]
        assert after["hooks"] == 0 and after["bytes"] > 0, after
        assert after["model"].startswith("ValueError: zerolite.checkpoint.prepare_async_save()"
                                         ": model is not the model"), after["model"]
        assert after["optimizer"].startswith("TypeError: zerolite.checkpoint.prepare_async_save"
                                             "() needs the ShardedOptimizer"), after["optimizer"]
