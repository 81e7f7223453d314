"""The model's own dtype is kept.

``ZeroConfig.param_dtype=None`` (the default) means the dtype every trained parameter shares:
a model loaded in bf16 trains bf16 parameters with fp32 master shards and is saved in bf16,
through `shard()` and `ZeroAccelerator` alike (the Trainer:
tests/integrations/test_hf_trainer.py and tests/integrations/test_trl.py); an fp32 model
stays fp32. `shard()`'s one log line says where the recipe differs from the stock run's, as
a warning where the user did not ask for the difference.
One 2-rank launch (``ACCELERATE_USE_CPU=1``: Accelerate finds run_ranks' group); the log
lines' words and levels are checked in this process.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.support import parity
from zerolite.plan.precision import HostPrecision, describe_precision
from zerolite.testing import run_ranks

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


class _Lines(logging.Handler):
    """The records the ``zerolite`` logger emits (rank 0 logs `shard()`'s line)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _train(model: torch.nn.Module, opt: Any, steps: int = 2) -> list[float]:
    losses = []
    for x, y in parity.batches(steps):
        loss = model(parity.local_slice(x), parity.local_slice(y))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _dtypes(tensors: Any) -> list[str]:
    return sorted({str(t.dtype) for t in tensors})


def _shard_case(root: Path, stage: int, dtype: torch.dtype) -> dict[str, Any]:
    """A model converted to ``dtype`` before `shard()`, param_dtype unset: what it trains,
    what it saves, and whether `estimate` (which resolves the dtype as `shard()` does) equals
    `footprint` byte for byte."""
    from zerolite.memory import estimate, footprint

    model = parity.make_model().to(dtype)
    config = zerolite.ZeroConfig(stage=stage)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    estimated = estimate(model, world_size=2, config=config, optimizer=adamw,
                         rank=dist.get_rank())
    opt = zerolite.shard(model, adamw, config)
    losses = _train(model, opt)
    held = footprint(opt)
    full = zerolite.full_state_dict(model, rank0_only=False)
    folder = root / f"ckpt-{stage}-{dtype}"
    zerolite.checkpoint.save(folder, model, opt)
    return {
        "config": str(opt.config.param_dtype),
        "params": _dtypes(model.parameters()),
        "masters": _dtypes(p for g in opt.param_groups for p in g["params"]),
        "full": _dtypes(full.values()),
        "index": zerolite.checkpoint.inspect(folder)["param_dtype"],
        "estimate_equals_footprint": all(
            getattr(estimated, f) == getattr(held, f)
            for f in ("params", "grads", "master", "optimizer_state")),
        "finite": all(torch.isfinite(torch.tensor(losses))),
    }


def _accelerate_case() -> dict[str, Any]:
    """ZeroAccelerator(mixed_precision="bf16") with a model converted to bf16, against the
    stock Accelerator with the same model: the dtype trained, and what get_state_dict
    returns (the weights the script saves)."""
    from accelerate import Accelerator

    from zerolite.accelerate import ZeroAccelerator

    out: dict[str, Any] = {}
    for name, cls in (("zerolite", ZeroAccelerator), ("stock", Accelerator)):
        accelerator = cls(mixed_precision="bf16")
        model = parity.make_model().to(BF16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = accelerator.prepare(model, opt)
        for x, y in parity.batches(2):
            accelerator.backward(model(parity.local_slice(x), parity.local_slice(y)))
            opt.step()
            opt.zero_grad()
        saved = accelerator.get_state_dict(model)
        out[name] = {"params": _dtypes(model.parameters()), "saved": _dtypes(saved.values())}
        if name == "zerolite":
            masters = zerolite.full_state_dict(accelerator.unwrap_model(model), masters=True,
                                               rank0_only=False)
            out[name]["saved_is_rounded_masters"] = all(
                torch.equal(saved[k], v.to(BF16)) for k, v in masters.items())
            out[name]["masters"] = _dtypes(
                p for g in opt.optimizer.param_groups for p in g["params"])
    return out


def _frozen_cast(stage: int) -> None:
    """Trained fp32 parameters, one frozen bf16 block: stage 3 shards the frozen block in the
    trained parameters' dtype (a cast nobody asked for: a warning); stage 2 leaves it."""
    model = parity.make_model()
    frozen = model.blocks[0]
    frozen.to(BF16).requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    zerolite.shard(model, torch.optim.AdamW(trained), zerolite.ZeroConfig(stage=stage))


def _cases(root: str) -> dict[str, Any]:
    os.environ["ACCELERATE_USE_CPU"] = "1"
    lines = _Lines()
    logger = logging.getLogger("zerolite")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    results: dict[str, Any] = {}
    for stage in (1, 2, 3):
        results[f"bf16_{stage}"] = _shard_case(Path(root), stage, BF16)
    results["fp32_2"] = _shard_case(Path(root), 2, FP32)
    for stage in (2, 3):
        _frozen_cast(stage)
    results["accelerate"] = _accelerate_case()
    results["lines"] = lines.lines
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_cases, 2, str(tmp_path_factory.mktemp("own_dtype")), timeout=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_model_trains_bf16_parameters_with_fp32_masters_and_saves_bf16(runs, stage):
    for rank, result in enumerate(runs):
        case = result[f"bf16_{stage}"]
        assert case == {
            "config": "torch.bfloat16",   # what shard() chose: the model's own dtype
            "params": ["torch.bfloat16"],
            "masters": ["torch.float32"],
            "full": ["torch.bfloat16"],   # full_state_dict / what a plain loop saves
            "index": "bfloat16",          # the checkpoint's param_dtype (its masters: fp32)
            "estimate_equals_footprint": True,
            "finite": True,
        }, (rank, stage)


def test_an_fp32_model_stays_fp32(runs):
    case = runs[0]["fp32_2"]
    assert (case["config"], case["params"], case["masters"], case["full"], case["index"]) == (
        "torch.float32", ["torch.float32"], ["torch.float32"], ["torch.float32"], "float32")
    assert case["estimate_equals_footprint"]


def test_zero_accelerator_keeps_and_saves_what_the_stock_accelerator_does(runs):
    for rank, result in enumerate(runs):
        got = result["accelerate"]
        assert got["stock"] == {"params": ["torch.bfloat16"], "saved": ["torch.bfloat16"]}
        assert {k: got["zerolite"][k] for k in ("params", "saved")} == got["stock"], rank
        assert got["zerolite"]["masters"] == ["torch.float32"], rank
        assert got["zerolite"]["saved_is_rounded_masters"], rank


def test_the_log_line_names_the_models_own_dtype_and_warns_of_an_unasked_cast(runs):
    lines = runs[0]["lines"]
    assert runs[1]["lines"] == []  # rank 0 logs
    bf16 = [m for level, m in lines if level == "INFO" and m.startswith(
        "zerolite: stage 2 over 2 ranks, bfloat16 parameters (the model's own dtype) with "
        "fp32 masters, partition flat")]
    assert bf16, lines
    assert any(m.startswith("zerolite: stage 2 over 2 ranks, fp32, partition flat")
               for _, m in lines), lines
    warned = [m for level, m in lines if level == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith("zerolite: stage 3 over 2 ranks, fp32; "
                                                     "stage 3 holds 12 frozen parameters"), lines
    assert "set ZeroConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in warned[0]
    accelerate = [m for _, m in lines if "Accelerate" in m]
    assert accelerate == [m for _, m in lines if m.startswith(
        "zerolite: stage 2 over 2 ranks, bfloat16 parameters (the model's own dtype) with fp32 "
        "masters under Accelerate's bf16 autocast (the stock Accelerate run steps the bfloat16 "
        "parameters themselves; zerolite steps fp32 master shards), ")], lines


# ---- the words and levels of every recipe, in this process ---------------------------------


def _line(config: zerolite.ZeroConfig, dtype: torch.dtype, before: torch.dtype,
          host: HostPrecision | None = None, frozen: torch.dtype | None = None) -> tuple[str, str]:
    cast = {"f": frozen} if frozen is not None else {}
    text, level = describe_precision(config, dtype, {"w": before}, cast, host)
    return text, logging.getLevelName(level)


TRAINER_BF16 = HostPrecision("Trainer", "bf16")
UNSET = zerolite.ZeroConfig(param_dtype=None)


@pytest.mark.parametrize(("config", "dtype", "before", "host", "frozen", "expected"), [
    (UNSET, FP32, FP32, None, None, ("fp32", "INFO")),
    (UNSET, BF16, BF16, None, None,
     ("bfloat16 parameters (the model's own dtype) with fp32 masters", "INFO")),
    # The stock Trainer's recipe for an fp32 model: unchanged, no warning.
    (UNSET, FP32, FP32, TRAINER_BF16, None,
     ("fp32 parameters under Trainer's bf16 autocast (Trainer's own recipe)", "INFO")),
    (UNSET, BF16, BF16, TRAINER_BF16, None,
     ("bfloat16 parameters (the model's own dtype) with fp32 masters under Trainer's bf16 "
      "autocast (the stock Trainer run steps the bfloat16 parameters themselves; zerolite "
      "steps fp32 master shards)", "INFO")),
    # Asked for: zerolite's 16-bit recipe, or fp32 parameters for a bf16 model.
    (zerolite.ZeroConfig(param_dtype=BF16), BF16, FP32, TRAINER_BF16, None,
     ("bfloat16 parameters with fp32 masters under Trainer's bf16 autocast (zerolite's "
      "16-bit recipe, ZeroConfig.param_dtype)", "INFO")),
    (zerolite.ZeroConfig(param_dtype=FP32), FP32, BF16, None, None,
     ("fp32 parameters (the model's were bfloat16)", "INFO")),
    # The host's fp16 read as fp16 parameters (filled, not set): not what the stock run does.
    (UNSET.with_param_dtype(FP16), FP16, FP32, HostPrecision("Trainer", "fp16"), None,
     ("float16 parameters (the model's were float32) with fp32 masters under Trainer's fp16 "
      "autocast (Trainer's fp16 read as fp16 parameters with zerolite's loss scaler; the "
      "stock run keeps the model's parameters under the autocast)", "WARNING")),
    # Stage 3 casts frozen parameters: a warning unless param_dtype was chosen.
    (UNSET, FP32, FP32, None, BF16,
     ("fp32; stage 3 holds 1 frozen parameters (bfloat16) in float32, the trained "
      "parameters' dtype: set ZeroConfig(param_dtype=torch.bfloat16, "
      "reduce_dtype=torch.float32) to keep them as they are", "WARNING")),
    (zerolite.ZeroConfig(param_dtype=FP32), FP32, FP32, None, BF16,
     ("fp32; stage 3 holds 1 frozen parameters (bfloat16) in float32", "INFO")),
])
def test_recipe_words_and_level(config, dtype, before, host, frozen, expected):
    assert _line(config, dtype, before, host, frozen) == expected
