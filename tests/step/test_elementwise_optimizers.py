"""The rest of the elementwise allow-list, trained: RMSprop, Adamax, NAdam and RAdam.

README lists them with Adam, AdamW, SGD and Adagrad as exact on flat shards; the parity
suite (`tests/step/test_parity.py`) trains only those four. Here each of the other four trains
the tiny GPT for 6 steps (two param groups with different hyperparameters) at stages 1-3
on 2 and 4 gloo ranks, against single-process training on the whole batch, by
`tests.support.parity`'s rule: per tensor within max(2 x DDP's own error on it, 1e-6), per step a
loss within max(2 x DDP's largest loss deviation, 1e-6), DDP measured in the same launch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import zerolite
from tests.support import parity
from tests.support.rank_reports import check_reports, guarded, new_report, record_parity
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

# Hyperparameters each optimizer's update is sensitive to, set away from the defaults so
# that a shard stepped with another group's values would show.
OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "RMSprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, alpha=0.9, momentum=0.5,
                                                  centered=True),
    "Adamax": lambda groups: torch.optim.Adamax(groups, lr=3e-3, betas=(0.8, 0.99)),
    "NAdam": lambda groups: torch.optim.NAdam(groups, lr=3e-3, momentum_decay=5e-3),
    "RAdam": lambda groups: torch.optim.RAdam(groups, lr=3e-3, decoupled_weight_decay=True),
}


def _make(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """`tests.support.parity.make_optimizer` for these classes: two groups, the second at
    half lr."""
    opt = OPTIMIZERS[name](parity.make_groups(model))
    opt.param_groups[1]["lr"] *= 0.5
    return opt


def _train_all() -> dict:
    data = parity.batches()
    report = new_report()
    report["classes"] = {}
    for name in OPTIMIZERS:
        ref = parity.make_model()
        ref_losses = parity.train(ref, _make(name, ref), data, sliced=False)
        ddp_model = parity.make_model()
        ddp_losses = parity.train(torch.nn.parallel.DistributedDataParallel(ddp_model),
                                  _make(name, ddp_model), data, sliced=True)
        ddp = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
        for stage in (1, 2, 3):
            model = parity.make_model()
            config = zerolite.ZeroConfig(stage=stage, bucket_size_mb=0.01)
            opt = zerolite.shard(model, _make(name, model), config)
            losses = parity.train(model, opt, data, sliced=True)
            report["classes"][name, stage] = type(opt.optimizer).__name__
            record_parity(f"{name}/stage{stage}", model, losses, ref, ref_losses, ddp, report)
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_rmsprop_adamax_nadam_radam_match_ddp(world_size: int) -> None:
    reports = run_ranks(guarded, world_size, _train_all, timeout=240)
    check_reports(reports)
    for rep in reports:
        assert set(rep["worst"]) == {f"{n}/stage{s}" for n in OPTIMIZERS for s in (1, 2, 3)}
        assert set(rep["classes"].values()) == set(OPTIMIZERS)  # each class stepped its shards
    print(f"\nworld size {world_size}: worst per-tensor rel error vs single process:",
          {k: f"{v:.1e}" for k, v in reports[0]["worst"].items()})
