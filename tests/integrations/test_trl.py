"""TRL's trainers with ``ZeroTrainerMixin`` against the stock trainers under DDP.

``class ZeroSFT(ZeroTrainerMixin, SFTTrainer)`` (docs/hf-trainer.md, "TRL") at stages 2 and 3
against the stock ``SFTTrainer`` on DDP, on a tiny Llama with a tied head loaded from a
folder as TRL loads a hub model (tests/support/trl_cases.py, one 2-rank launch): the logged loss and
``grad_norm`` and the weights (accumulation 2, clipping active), a resume of stage 2's
checkpoint at stage 3, LoRA through ``peft_config``, ``save_model``; a model loaded in bf16
(``model_init_kwargs``) kept bf16 in memory and on disk, as the stock trainer keeps it; and
``DPOTrainer`` (its reference model built from the same folder) at stage 2.

Tolerance: 1e-5 relative (tests/integrations/test_hf_trainer.py's), widened to twice the stock
trainer's own deviation from itself where that is larger. zerolite sums in another order
than DDP in two places: accumulation (stages 2-3 reduce each micro-batch) and the clipping
norm (docs/hf-trainer.md, "The gradient norm"); a few fp32 roundings, which AdamW can grow
on another CPU's kernels. The yardstick for that is the "envelope" run: the stock trainer on
the same samples per step without accumulation, computed in the same launch (measured here:
losses 4e-6 to 1e-5 and weights 2e-3 from the stock run, zerolite's at most 8e-6).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from tests.support import trl_cases as cases
from tests.support.parity import loss_deviations
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

TOL = 1e-5  # relative, per step and per tensor


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(cases.cases, 2, str(tmp_path_factory.mktemp("trl")), timeout=600)[0]


def _step_deviations(got: list, expected: list, numbers: tuple[int, ...]) -> list[list[float]]:
    """Per step, the relative deviation of the loss and of the logged norm."""
    reference = {step: (loss, norm) for step, loss, norm in expected}
    return [loss_deviations([entry[i] for entry in got], [reference[s][i - 1] for s in numbers])
            for i in (1, 2)]


def _assert_steps_close(got: list, expected: list, what: str, numbers: tuple[int, ...],
                        envelope: list | None = None) -> None:
    """``got`` logged the steps ``numbers``, each loss and norm within TOL of ``expected``'s,
    or within twice the largest deviation of ``envelope``'s (NaN fails)."""
    assert [step for step, _, _ in got] == list(numbers), (what, got)
    bounds = [TOL, TOL]
    if envelope is not None:
        widest = _step_deviations(envelope, expected, numbers)
        bounds = [max(TOL, 2 * max(d)) for d in widest]
    for deviations, bound, label in zip(_step_deviations(got, expected, numbers), bounds,
                                        ("loss", "grad_norm")):
        assert max(deviations) <= bound, (
            f"{what}: {label} off by {deviations} (bound {bound:.1e}): {got} vs {expected}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _assert_close(got: dict, expected: dict, what: str, envelope: dict | None = None) -> None:
    """Every tensor within TOL of ``expected``'s, or within twice ``envelope``'s deviation
    on its largest tensor."""
    assert got.keys() == expected.keys() and got, what
    bound = TOL
    if envelope is not None:
        bound = max(TOL, 2 * max(_rel(envelope[k], v) for k, v in expected.items()))
    for name, ref in expected.items():
        assert _rel(got[name], ref) <= bound, (
            f"{what}: {name} differs by {_rel(got[name], ref):.2e} (bound {bound:.1e})")


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_matches_the_stock_sft_trainer_on_ddp(runs: dict, stage: int) -> None:
    stock, run, envelope = runs["stock"], runs[f"s{stage}"], runs["envelope"]
    assert all(norm > 0.5 for _, _, norm in stock["steps"])  # clipping is active
    _assert_steps_close(run["steps"], stock["steps"], f"stage {stage}", (1, 2, 3, 4),
                        envelope["steps"])
    _assert_close(run["state"], stock["state"], f"stage {stage}", envelope["state"])
    assert run["unwrapped"]  # sharded in place, never wrapped in DDP


def test_sft_resumes_stage_2s_checkpoint_at_stage_3(runs: dict) -> None:
    """Steps 3-4 as the resumed run logged them itself, against the uninterrupted run."""
    envelope = runs["envelope"]
    _assert_steps_close(runs["resume"]["steps"], runs["s2"]["steps"], "resume", (3, 4),
                        [e for e in envelope["steps"] if e[0] in (3, 4)])
    _assert_close(runs["resume"]["state"], runs["s2"]["state"], "resume", envelope["state"])


def test_save_model_writes_what_the_stock_trainer_writes(runs: dict) -> None:
    stock, saved = runs["stock"]["saved"], runs["s2"]["saved"]
    assert saved["files"] == stock["files"], (saved["files"], stock["files"])
    assert saved["config_dtype"] == stock["config_dtype"] == "float32"
    state = runs["s2"]["state"]  # the gathered weights: written exactly (the tied head once)
    assert all(torch.equal(t, state[k]) for k, t in saved["tensors"].items())
    envelope = runs["envelope"]["state"]
    _assert_close(saved["tensors"], stock["tensors"], "saved weights",
                  {k: envelope[k] for k in stock["tensors"]})


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_through_peft_config_matches_the_stock_trainer(runs: dict, stage: int) -> None:
    stock, run = runs["lora_stock"], runs[f"lora_s{stage}"]
    assert len(stock["state"]) == 8  # lora_A and lora_B of q_proj and v_proj in 2 blocks
    _assert_steps_close(run["steps"], stock["steps"], f"LoRA, stage {stage}", (1, 2, 3, 4))
    _assert_close(run["state"], stock["state"], f"LoRA, stage {stage}")
    assert run["saved"]["files"] == stock["saved"]["files"]
    assert "adapter_model.safetensors" in run["saved"]["files"]
    _assert_close(run["saved"]["tensors"], stock["saved"]["tensors"], f"saved adapters {stage}")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_loaded_in_bf16_is_trained_and_saved_in_bf16(runs: dict, stage: int) -> None:
    """``SFTConfig(model_init_kwargs={"dtype": "bfloat16"}, bf16=True)``: bf16 parameters
    (fp32 master shards), saved in bf16 as the stock trainer saves them; before, shard()
    cast the model up to fp32 (twice the parameter bytes) and saved fp32."""
    stock, run = runs["bf16_None"], runs[f"bf16_{stage}"]
    assert stock["params"] == run["params"] == ["torch.bfloat16"]
    assert stock["optimizer_tensors"] == ["torch.bfloat16"]  # stock steps them directly
    assert run["optimizer_tensors"] == ["torch.float32"]  # zerolite: fp32 master shards
    if stage == 2:  # replicated parameters: the bf16 bytes (plus the flat buffers' padding)
        assert run["held_params"] <= stock["param_bytes"] + 64, (run["held_params"], stock)
    saved, expected = run["saved"], stock["saved"]
    assert saved["files"] == expected["files"]
    assert saved["config_dtype"] == expected["config_dtype"] == "bfloat16"
    assert {str(t.dtype) for t in saved["tensors"].values()} == {"torch.bfloat16"}
    # What is written is the fp32 masters rounded to bf16 (the tied head is written once).
    masters = run["masters"]
    assert all(torch.equal(t, masters[k].to(torch.bfloat16)) for k, t in saved["tensors"].items())
    # The first step's forward and backward are the stock run's (same bf16 weights, the same
    # autocast); the updates differ by design (fp32 masters against bf16 AdamW steps).
    assert run["steps"][0][1] == stock["steps"][0][1]
    assert all(abs(a[1] - b[1]) <= 2e-2 * abs(b[1]) for a, b in zip(run["steps"], stock["steps"]))


def test_dpo_is_bitwise_the_stock_dpo_trainer_on_ddp(runs: dict) -> None:
    """Without accumulation and clipping every reduced gradient is DDP's, so every step is:
    losses, the logged norms (no clipping: each trainer's own, of the same gradients, equal
    within their summation's rounding) and the weights, bit for bit."""
    stock, run = runs["dpo_stock"], runs["dpo_s2"]
    assert [s[:2] for s in run["steps"]] == [s[:2] for s in stock["steps"]]
    _assert_steps_close(run["steps"], stock["steps"], "DPO", (1, 2, 3))
    assert run["state"].keys() == stock["state"].keys()
    assert all(torch.equal(run["state"][k], v) for k, v in stock["state"].items())
    assert run["unwrapped"]

