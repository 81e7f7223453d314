"""ZeroTrainer resumes only from a consistent checkpoint.

One straight run (2 ranks, stage 2, a checkpoint every 2 steps up to 4), then two damaged
copies of its output directory, as a user meets them:

- ``checkpoint-4`` holding ``checkpoint-2``'s ``zerolite/`` (a stale or copied folder): used
  to resume at step 4 with step-2 weights and optimizer state, silently. Refused, naming both
  steps, before anything is loaded (the model's weights are untouched).
- ``checkpoint-4`` without ``zerolite/`` (a crash during an asynchronous save, which commits
  ``zerolite/`` last): ``resume_from_checkpoint=True`` used to pick it and fail with a wrong
  explanation. It resumes from ``checkpoint-2`` instead, logging which checkpoint was
  skipped and why; steps 3-4 then repeat the straight run's, bitwise (same world size and
  stage: the same operations, as ``tests/integrations/test_hf_trainer.py`` establishes).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerolite.testing import run_ranks

pytest.importorskip("transformers")

from tests.support import hf_trainer_cases as cases  # noqa: E402 - after the importorskip

STEPS = 4


def _copy(src: Path, dst: Path, edit) -> None:
    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
        edit(dst)
    dist.barrier()


def _stale_zerolite(root: Path) -> None:
    shutil.rmtree(root / "checkpoint-4" / "zerolite")
    shutil.copytree(root / "checkpoint-2" / "zerolite", root / "checkpoint-4" / "zerolite")


def _crashed_async_save(root: Path) -> None:
    shutil.rmtree(root / "checkpoint-4" / "zerolite")


def _mismatch(root: Path) -> dict[str, Any]:
    trainer = cases._trainer(root, 2, model=cases.make_model(seed=7), max_steps=STEPS)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        trainer.train(resume_from_checkpoint=str(root / "checkpoint-4"))
        error = None
    except ValueError as exc:
        error = str(exc)
    after = trainer.model.state_dict()
    return {"error": error, "untouched": all(torch.equal(after[k], v) for k, v in before.items())}


def _skip_incomplete(root: Path) -> dict[str, Any]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerolite.checkpoint.trainer_resume").addHandler(handler)
    trainer = cases._trainer(root, 2, model=cases.make_model(seed=7), max_steps=STEPS)
    trainer.add_callback(recorder := cases.logged())
    trainer.train(resume_from_checkpoint=True)
    return {"steps": recorder.steps, "warnings": records, "state": cases._gathered(trainer)}


def _runs(out: str) -> dict[str, Any]:
    cases._warm()
    root = Path(out)
    straight = cases._trainer(
        root / "run", 2, max_steps=STEPS, save_strategy="steps", save_steps=2
    )
    straight.train()
    results: dict[str, Any] = {
        "straight": cases.steps(straight), "state": cases._gathered(straight)
    }
    _copy(root / "run", root / "stale", _stale_zerolite)
    results["mismatch"] = _mismatch(root / "stale")
    _copy(root / "run", root / "crashed", _crashed_async_save)
    results["skip"] = _skip_incomplete(root / "crashed")
    return results


def test_trainer_resumes_only_from_a_consistent_checkpoint(tmp_path) -> None:
    for rank, result in enumerate(run_ranks(_runs, 2, str(tmp_path), timeout=600)):
        error = result["mismatch"]["error"]
        assert error is not None, rank
        assert "zerolite/ was saved at global step 2" in error, error
        assert "trainer_state.json is at global step 4" in error, error
        assert result["mismatch"]["untouched"], rank
        warnings = result["skip"]["warnings"]
        assert len(warnings) == 1, warnings
        assert "skipping checkpoint-4, it has no complete zerolite/" in warnings[0], warnings
        assert "resuming from checkpoint-2" in warnings[0], warnings
        resumed = result["skip"]["steps"]
        assert [s for s, _, _ in resumed] == [3, 4], resumed
        assert resumed == [e for e in result["straight"] if e[0] in (3, 4)], rank
        state = result["skip"]["state"]
        assert all(torch.equal(state[k], v) for k, v in result["state"].items()), rank
