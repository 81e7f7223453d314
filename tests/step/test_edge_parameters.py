"""Parameters of unusual shapes: a 0-dim parameter trains at every stage like plain torch."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels


class ScaledMLP(nn.Module):
    """A 0-dim learnable temperature and a one-element bias beside ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.offset = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) / self.temperature + self.offset


def _train(model, opt, data, rank, world):
    for x, y in data:
        piece = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        nn.functional.mse_loss(model(x[piece]), y[piece]).backward()
        opt.step()
        opt.zero_grad()


def _zero_dim_parity():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = ScaledMLP()
    data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(4)]
    initial = copy.deepcopy(reference)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=0.05), data, 0, 1)
    worst = {}
    for stage in (1, 2, 3):
        model = copy.deepcopy(initial)
        opt = zerolite.shard(
            model, torch.optim.AdamW(model.parameters(), lr=0.05), zerolite.ZeroConfig(stage=stage)
        )
        _train(model, opt, data, rank, world)
        with zerolite.gathered_parameters(model):
            for name, p in model.named_parameters():
                ref = reference.get_parameter(name)
                err = ((p.detach() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                worst[(stage, name)] = err
    return worst


def test_zero_dim_parameter_matches_single_process():
    # Stage 3 used to crash in shard() (its freed-parameter placeholder could not take a 0-dim
    # shape) after the model had been modified.
    for r, worst in enumerate(run_ranks(_zero_dim_parity, 2, timeout=120)):
        for (stage, name), err in worst.items():
            assert err <= 1e-6, f"rank {r} stage {stage} {name}: {err:.2e}"
        assert {name for _, name in worst} >= {"temperature", "offset"}


