"""The native reduce-scatter averages on gloo, under every torch the suite runs on.

`zerolite.comm.collectives.reduce_scatter_avg` with ``collectives="native"`` runs
``torch.distributed``'s own reduce-scatter with ``ReduceOp.AVG``. torch 2.4.1's gloo backend
returned the *sum* for it (``[10, 12]`` where the average is ``[5, 6]``), which would make
every gradient ``N`` times too large without an error; that torch is below the floor, and
this test is what tells if a supported one (`make test-compat`) does the same. On a real 2-rank
gloo group, each rank's chunk is checked against the average of both ranks' buffers,
computed in the parent from the same inputs, and said to be the sum where it is one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolite.comm.collectives import Group, reduce_scatter_avg
from zerolite.testing import run_ranks

WORLD = 2
SHARD = 5


def _contribution(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s full buffer: distinct, non-zero values, so the sum is not the average."""
    values = torch.arange(1, WORLD * SHARD + 1, dtype=torch.float32) * (rank + 1) + rank
    return values.to(dtype)


def _native_reduce_scatter(dtype: torch.dtype) -> tuple[str, bool, torch.Tensor]:
    """On a rank: this rank's chunk of the native reduce-scatter of every rank's contribution."""
    group = Group(collectives="native")
    full = _contribution(dist.get_rank(), dtype)
    out = torch.empty(SHARD, dtype=dtype)
    reduce_scatter_avg(full, out, group, key=1, what="the test's reduce-scatter").wait()
    return group.backend, group.point_to_point, out


def test_native_reduce_scatter_on_gloo_averages() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        results = run_ranks(_native_reduce_scatter, WORLD, dtype)
        contributions = [_contribution(r, dtype).float() for r in range(WORLD)]
        total = torch.stack(contributions).sum(0)
        for rank, (backend, point_to_point, got) in enumerate(results):
            assert (backend, point_to_point) == ("gloo", False), (backend, point_to_point)
            chunk = slice(rank * SHARD, (rank + 1) * SHARD)
            expected = (total[chunk] / WORLD).to(dtype)
            assert not torch.equal(got, total[chunk].to(dtype)), (
                f"{dtype}, rank {rank}: the reduce-scatter returned the sum {got.tolist()}, "
                f"not the average {expected.tolist()}"
            )
            # Small integers and their halves: exact in fp32 and bf16, whatever the order.
            assert torch.equal(got, expected), (dtype, rank, got.tolist(), expected.tolist())
