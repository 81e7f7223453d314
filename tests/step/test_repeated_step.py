"""A second ``step()`` without a new backward, at stages 2 and 3.

torch's ``step()`` twice applies the same gradients again; zerolite's stages 2-3 free the
gradient shards at the step, so the second step used to find no gradients and skip every
parameter, silently (0.147 relative from torch). It is refused on every rank, naming the
stage, and refused before anything changes: the loop that goes on after catching the error
equals, bitwise, the same loop without the refused call (same arithmetic, same order).
``zero_grad()`` first makes a step without gradients a no-op, as in torch.
"""

from __future__ import annotations

import pytest
import torch

import zerolite
from tests.support import parity
from zerolite.testing import run_ranks


def _build(stage: int):
    model = parity.make_model()
    opt = zerolite.shard(
        model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=stage)
    )
    return model, opt


def _train(model, opt, data, *, extra: str | None) -> str | None:
    """Backward + step per batch; after the first step, ``extra`` is one more call:
    ``"step"`` (a step with no backward, caught) or ``"zero_step"`` (zero_grad, then step)."""
    refused = None
    for i, (x, y) in enumerate(data):
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        opt.step()
        if i == 0 and extra == "step":
            with pytest.raises(RuntimeError, match="no backward since the previous step") as e:
                opt.step()
            refused = str(e.value)
        if i == 0 and extra == "zero_step":
            opt.zero_grad()
            opt.step()
        opt.zero_grad()
    return refused


def _repeat(stage: int) -> dict:
    data = list(parity.batches(steps=3))
    finals, refused = {}, None
    for extra in (None, "step", "zero_step"):
        model, opt = _build(stage)
        message = _train(model, opt, data, extra=extra)
        refused = refused or message
        finals[extra] = zerolite.full_state_dict(model, rank0_only=False)
        finals[extra, "opt"] = opt.state_dict()["state"]
    same = {
        extra: all(torch.equal(finals[None][k], v) for k, v in finals[extra].items())
        and all(
            torch.equal(finals[None, "opt"][i][n], t)
            for i, s in finals[extra, "opt"].items()
            for n, t in s.items()
        )
        for extra in ("step", "zero_step")
    }
    return {"refused": refused, "same": same}


@pytest.mark.parametrize("stage", [2, 3])
def test_second_step_without_backward_is_refused_on_every_rank(stage):
    for rank, result in enumerate(run_ranks(_repeat, 2, stage)):
        message = result["refused"]
        assert message is not None and f"At stage {stage}" in message, (rank, message)
        assert "Nothing was changed" in message
        # Refused before anything changed: the loop that caught it equals the loop without
        # the call, bitwise (parameters and optimizer state); zero_grad() + step() is a no-op.
        assert result["same"] == {"step": True, "zero_step": True}, (rank, result)
