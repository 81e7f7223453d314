"""The disk tier's directory (``ZeroConfig.offload_dir``): a missing one is created by
``shard()`` when its parent is an existing, writable directory -- by two ranks racing to
create the same one -- and otherwise refused with a clear error before anything is changed
(the model, its optimizer and the file system as they were). Real gloo ranks, real
directories; the unwritable parent is ``/sys``, where even root cannot create one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import zerolite
from tests.support import parity
from zerolite.plan.offload import OffloadPlan
from zerolite.state.offload import check_offload
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks


def _shard(offload_dir: str) -> tuple[str | None, bool]:
    """shard() with ``offload_dir``: its error (None: it sharded, and took a step) and
    whether a refused model and optimizer are untouched."""
    model = parity.make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inner = parity.make_optimizer("AdamW", model)
    config = zerolite.ZeroConfig(stage=2, offload="disk", offload_dir=offload_dir)
    try:
        opt = zerolite.shard(model, inner, config)
    except ValueError as exc:
        untouched = state_of(model) is None and all(
            torch.equal(before[k], v) for k, v in model.state_dict().items())
        return str(exc), untouched
    x, y = parity.batches(1)[0]
    model(parity.local_slice(x), parity.local_slice(y)).backward()
    opt.step()
    return None, state_of(model).offload.arena.nbytes > 0


def _rank(where: str) -> dict[str, tuple[str | None, bool]]:
    cases = {
        "created": os.path.join(where, "made here"),
        "missing parent": os.path.join(where, "nope", "deeper"),
        "parent is a file": os.path.join(__file__, "sub"),
        "unwritable parent": "/sys/zerolite-offload",
    }
    return {label: _shard(path) for label, path in cases.items()}


def test_missing_offload_dir_is_created_or_clearly_refused(tmp_path):
    where = tmp_path / "root"
    where.mkdir()
    for rank in run_ranks(_rank, 2, str(where)):
        assert rank["created"] == (None, True), rank["created"]
        error, untouched = rank["missing parent"]
        assert error is not None and untouched, rank
        assert "is not an existing directory, and its parent" in error and "nope" in error
        error, untouched = rank["parent is a file"]
        assert error is not None and "is not one either" in error and untouched, rank
        error, untouched = rank["unwritable parent"]
        assert error is not None and untouched, rank
        assert "does not exist and cannot be created in '/sys'" in error, error
    assert sorted(os.listdir(where)) == ["made here"]  # only the one that could be made
    assert not Path("/sys/zerolite-offload").exists()


def test_a_directory_created_for_a_refused_tier_is_removed(tmp_path):
    """Created, then refused for space (more bytes than any disk has): the directory made
    for it is gone again, while an existing one is left as it was."""
    plan = OffloadPlan(tier="disk", slots=(), per_buffer=(), nbytes=1 << 62, master_bytes=0)
    made = tmp_path / "made"
    config = zerolite.ZeroConfig(offload="disk", offload_dir=str(made))
    with pytest.raises(ValueError, match=r"bytes free; offloading this rank's optimizer state"):
        check_offload(plan, config, torch.device("cpu"))
    assert not made.exists()
    existing = zerolite.ZeroConfig(offload="disk", offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"bytes free"):
        check_offload(plan, existing, torch.device("cpu"))
    assert tmp_path.is_dir()
    small = OffloadPlan(tier="disk", slots=(), per_buffer=(), nbytes=1, master_bytes=0)
    check_offload(small, config, torch.device("cpu"))
    assert made.is_dir()
