"""``torch.compile`` on a sharded model, stages 1-3 (stage 3 also with ``partition="tensor"``),
2 ranks.

Two shapes users write, each against single-process training with `tests.support.parity`'s rules
(per tensor and per step, within twice DDP's own deviation; AOTAutograd's decompositions
round differently from the eager kernels, as another summation order would):

- ``torch.compile(model)`` after ``shard()``, backend ``aot_eager`` (AOTAutograd's joint
  graph, which is what broke stage 3; inductor is measured by hand, see docs/limits.md's
  Limits: its cold compile on CPU takes about a minute);
- a compiled step function that also runs ``loss.backward()`` (backend ``eager``: the
  recompile storm is dynamo's, whatever the backend): every zerolite hook and autograd
  callback then fires under an active compiled frame.

Both with ``error_on_recompile`` and a count of compiled graphs: before zerolite's hooks
were excluded from compilation, dynamo compiled its gradient hook once per parameter
index until ``recompile_limit`` (10 graphs on this model instead of 1). Stages 1-2 compile
with ``fullgraph=True``; stage 3 with ``fullgraph=True`` gets dynamo's error naming why.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import zerolite
from tests.support import parity
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 2


def _loop(model, opt, data, step_fn) -> list[float]:
    losses = []
    for x, y in data:
        loss = step_fn(parity.local_slice(x), parity.local_slice(y))
        opt.step()
        opt.zero_grad()
        losses.append(parity.mean_over_ranks(loss.item()))
    return losses


def _run(stage: int, how: str) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Train parity.TINY for STEPS steps; ``how``: "module", "step", or "tensor" (as
    "module", under whole-tensor ownership: stage 3 gathers each unit from its owners).

    Returns the losses, the full parameters and the number of graphs dynamo compiled.
    """
    torch._dynamo.reset()
    counters.clear()
    model = parity.make_model()
    config = zerolite.ZeroConfig(stage=stage, partition="tensor" if how == "tensor" else "flat")
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    # Stages 1-2: zerolite's hooks on the compiled module run outside its graph, so
    # fullgraph=True holds; stage 3 gathers units inside the forward (graph breaks).
    compiled = torch.compile(model, backend="aot_eager", fullgraph=stage != 3)
    forward = model if how == "step" else compiled

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = forward(x, y)
        loss.backward()
        return loss

    step_fn = torch.compile(step, backend="eager") if how == "step" else step
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses = _loop(model, opt, parity.batches(STEPS), step_fn)
    graphs = counters["stats"]["unique_graphs"]
    return losses, zerolite.full_state_dict(model, rank0_only=False), graphs


def _compiled_vs_reference(cases: list[tuple[int, str]]) -> list[tuple[int, str, float, int]]:
    """Per case: (stage, how, worst per-tensor error against the reference, graphs)."""
    ref, ref_losses, ddp = parity.ddp_oracle("AdamW", parity.batches(STEPS))
    out = []
    for stage, how in cases:
        losses, full, graphs = _run(stage, how)
        worst = parity.check_values(f"stage {stage} {how}", full, losses, ref, ref_losses, ddp)
        out.append((stage, how, worst, graphs))
    return out


def _stage3_fullgraph_error() -> str:
    """What ``fullgraph=True`` raises at stage 3's first compiled forward."""
    torch._dynamo.reset()
    model = parity.make_model()
    zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    x, y = parity.batches(1)[0]
    try:
        torch.compile(model, backend="eager", fullgraph=True)(x, y)
    except torch._dynamo.exc.Unsupported as exc:
        return str(exc)
    return "no error"


def _all_cases(cases: list[tuple[int, str]]) -> tuple[list[tuple[int, str, float, int]], str]:
    return _compiled_vs_reference(cases), _stage3_fullgraph_error()


def test_compiled_training_matches_uncompiled_without_recompiles() -> None:
    # One launch for all cases: dynamo's first compile in a process pays for its imports.
    cases = [(stage, how) for how in ("module", "step") for stage in (1, 2, 3)] + [(3, "tensor")]
    results, fullgraph_error = run_ranks(_all_cases, 2, cases, timeout=240)[0]
    assert [(stage, how) for stage, how, _, _ in results] == cases
    for stage, how, worst, graphs in results:
        # One graph: stages 1-2 compile the whole forward; stage 3 the block forward
        # (its gathers are breaks, so the loop over blocks runs eagerly), once for both
        # blocks. Before zerolite's hooks were excluded: 10 graphs (stage 2, "step").
        assert graphs == 1, (stage, how, graphs)
    # Stage 3 with fullgraph=True: dynamo's own error, naming zerolite's hook and what to do.
    assert "zerolite's hooks run eagerly" in fullgraph_error, fullgraph_error
    assert "fullgraph=False" in fullgraph_error, fullgraph_error
