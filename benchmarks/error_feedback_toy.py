"""Where error feedback changes the loss: a block whose scale one loud element sets.

Each rank ``r`` of 2 trains the same 4096-element parameter ``w`` on its own loss

    L_r(w) = s_r * G * sum(w[loud]) + 0.5 * sum((w[quiet] - t_r[quiet]) ** 2)

with ``s_r = +1, -1``: the loud elements (one per 256-element quantization block) have
gradients of +-G on each rank that cancel in the mean, so they never move and cost the
global loss nothing, but they set every block's scale to G/127. The quiet elements pull
towards a different target on each rank (``t_r`` uniform in [-0.1, 0.1]); the global loss,
the mean of the L_r, is smallest at the mean of the targets.

With ``quantize_reduce`` a rank receives the other rank's contribution quantized, and
quiet gradients (at most 0.2) are under half a step (G/254 = 0.25 for G = 64): each
exchange rounds them to zero. Without error feedback the owner of an element then only
sees its own target and converges to it, a fixed excess loss over the optimum. With
error feedback the rounded-off part is carried to the next exchange until it is sent, so
the mean of what arrives is the true mean and ``w`` converges to the optimum, jittering by
about one quantization step times the learning rate.

    python benchmarks/error_feedback_toy.py     (2 gloo ranks, a few seconds)

prints the global loss's excess over its minimum after ``STEPS`` SGD steps, unquantized and
quantized with and without error feedback. ``tests/comm/test_error_feedback.py`` asserts it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

NUMEL, BLOCK, LOUD, TARGET = 4096, 256, 64.0, 0.1
STEPS, LR = 200, 0.1
SETTINGS = {
    "unquantized": {},
    "error feedback": {"quantize_reduce": True, "error_feedback": True},
    "no error feedback": {"quantize_reduce": True, "error_feedback": False},
}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NUMEL))


def _targets(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-rank quiet targets ``(world, NUMEL)``, the loud mask), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    targets = (torch.rand(world, NUMEL, generator=g) * 2 - 1) * TARGET
    loud = torch.zeros(NUMEL, dtype=torch.bool)
    loud[::BLOCK] = True
    targets[:, loud] = 0.0
    return targets, loud


def excess_loss(w: torch.Tensor, targets: torch.Tensor, loud: torch.Tensor) -> float:
    """The global loss (the mean over ranks of their L_r; the loud terms cancel) minus its
    minimum, reached at the mean of the targets."""
    quiet = ~loud
    best = targets.mean(dim=0)
    return float(0.5 * ((w[quiet] - best[quiet]) ** 2).sum())


def train_rank(setting: str) -> float:
    """One rank's run; returns the excess loss of the final weights (every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    targets, loud = _targets(world)
    sign = 1.0 if rank % 2 == 0 else -1.0
    model = Toy()
    config = zerolite.ZeroConfig(stage=2, quant_block=BLOCK, **SETTINGS[setting])
    opt = zerolite.shard(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    for _ in range(STEPS):
        w = model.w
        loss = sign * LOUD * w[loud].sum() + 0.5 * ((w[~loud] - targets[rank][~loud]) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return excess_loss(model.w.detach(), targets, loud)


def run() -> dict[str, float]:
    """Every setting at 2 ranks: {setting: excess loss after STEPS steps}."""
    return {name: run_ranks(train_rank, 2, name)[0] for name in SETTINGS}


def main() -> None:
    _, loud = _targets(2)
    print(f"2 ranks, stage 2, SGD(lr={LR}), {STEPS} steps; {NUMEL} elements, blocks of "
          f"{BLOCK}, one loud element (+-{LOUD:g} per rank) per block; excess of the global "
          f"loss over its minimum (at start: "
          f"{excess_loss(torch.zeros(NUMEL), _targets(2)[0], loud):.3f})")
    for name, excess in run().items():
        print(f"  {name:18s} {excess:.4f}")


if __name__ == "__main__":
    main()
