"""Stages 1, 2 and 3 in fp32 match single-process and DDP training
(tests/support/parity.py's rules)."""

import pytest
import torch.distributed as dist

import zerolite
from tests.support import parity
from tests.support.comm_spy import CommSpy
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels


def _parity_all_optimizers(stages: tuple[int, ...]) -> dict:
    data = parity.batches()
    report = {}
    for name in parity.OPTIMIZERS:
        ref_model, ref_losses, ddp = parity.ddp_oracle(name, data)
        report[f"{name}/DDP"] = max(ddp.tensors.values())
        for stage in stages:
            # zero_grad(set_to_none=False) leaves zeroed gradients behind whatever the
            # optimizer: one optimizer checks it.
            for set_to_none in (True, False) if name == "AdamW" else (True,):
                # Small buckets in stage 2 exercise several flat buffers and overlap.
                bucket_mb = 0.01 if stage == 2 else 25.0
                model = parity.make_model()
                opt = zerolite.shard(
                    model, parity.make_optimizer(name, model),
                    zerolite.ZeroConfig(stage=stage, bucket_size_mb=bucket_mb),
                )
                losses = parity.train(model, opt, data, sliced=True, set_to_none=set_to_none)
                label = f"{name}/stage{stage}/set_to_none={set_to_none}"
                report[label] = parity.check_parity(
                    label, model, losses, ref_model, ref_losses, ddp
                )
            if stage >= 2 and dist.get_world_size() > 1:
                # The collectives NCCL runs (torch.distributed's reduce-scatter / all-gather
                # kernels), here on gloo, so that path is exercised without a GPU.
                model = parity.make_model()
                opt = zerolite.shard(
                    model, parity.make_optimizer(name, model),
                    zerolite.ZeroConfig(stage=stage, bucket_size_mb=0.01, collectives="native"),
                )
                with CommSpy() as spy:
                    losses = parity.train(model, opt, data, sliced=True)
                point_to_point = [e for e in spy.events if e[0] in ("isend", "irecv")]
                if point_to_point:
                    raise AssertionError(
                        f"collectives='native' sent point-to-point: {point_to_point[:3]}"
                    )
                label = f"{name}/stage{stage}/native"
                report[label] = parity.check_parity(
                    label, model, losses, ref_model, ref_losses, ddp
                )
    return report


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_all_stages_fp32(world_size):
    reports = run_ranks(_parity_all_optimizers, world_size, (1, 2, 3), timeout=300)
    for rank_report in reports:
        assert set(rank_report) >= {
            "AdamW/stage1/set_to_none=True",
            "Adagrad/stage2/set_to_none=True",
            "AdamW/stage2/set_to_none=False",
        }
        if world_size > 1:
            assert {"AdamW/stage2/native", "SGD/stage3/native"} <= set(rank_report)
    print(f"\nworld size {world_size}: worst per-tensor rel error vs single process:")
    for label, err in reports[0].items():
        print(f"  {label:40s} {err:.3e}")
