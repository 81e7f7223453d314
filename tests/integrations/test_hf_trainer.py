"""ZeroTrainer against the stock Trainer under DDP (zerolite.hf).

Two launches: everything at 2 ranks (tests/support/hf_trainer_cases.py), then a resume of the same
checkpoint at 1 rank. A tiny LlamaForCausalLM built from a config, nothing downloaded.
Oracle: the stock ``Trainer`` (DDP) with the same seed and global batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.support import hf_trainer_cases as cases
from tests.support.accelerate_versions import CPU_LAUNCH_NEEDS_USE_CPU
from tests.support.parity import loss_deviations
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

# ZeroTrainer against DDP's Trainer directly. At 2 ranks the reduced gradients are DDP's bit
# for bit (a + b == b + a, on every kernel family: both runs use this CPU's kernels on the
# same slices); the one sum in another order is the clipping norm (over shards, not per
# tensor), a few fp32 roundings (~1e-7) of each step's coefficient, which fp32 AdamW carries
# smoothly: 6 steps stay far inside 1e-5. No bf16 matmul runs here.
TOL = 1e-5  # relative, per step and per tensor (docs/hf-trainer.md)
RESUMED = (4, 5, 6)  # the steps a resume from checkpoint-3 trains itself


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


@pytest.fixture(scope="module")
def runs(out: Path) -> dict[str, Any]:
    return run_ranks(cases.parity_and_checkpoints, 2, str(out), timeout=240)[0]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_steps_equal(got: list, expected: list, what: str,
                        numbers: tuple[int, ...] = (1, 2, 3, 4, 5, 6)) -> None:
    """``got`` logged exactly the steps ``numbers``, each within TOL of ``expected``'s step of
    the same number (loss and grad_norm; NaN fails)."""
    assert [step for step, _, _ in got] == list(numbers), (what, got)
    reference = {step: (loss, norm) for step, loss, norm in expected}
    losses = loss_deviations([loss for _, loss, _ in got], [reference[s][0] for s in numbers])
    norms = loss_deviations([norm for _, _, norm in got], [reference[s][1] for s in numbers])
    for step, loss, norm in zip(numbers, losses, norms):
        assert loss <= TOL, f"{what}: step {step} loss off by {loss:.2e}: {got} vs {expected}"
        assert norm <= TOL, f"{what}: step {step} grad_norm off by {norm:.2e}: {got} vs {expected}"


def _assert_states_close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, ref in expected.items():
        rel = (got[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert rel <= TOL, f"{what}: {name} differs by {rel:.2e}"


def test_import_zerolite_does_not_import_transformers() -> None:
    code = (
        "import sys, zerolite; "
        "sys.exit('transformers' in sys.modules or 'accelerate' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loss_grad_norm_and_weights_match_ddp(runs: dict, stage: int) -> None:
    """GA=2, max_grad_norm=0.5 (it clips: DDP's norms are ~0.8), AdamW with weight-decay groups."""
    ddp, run = runs["ddp"], runs[f"s{stage}"]
    assert all(norm > 0.5 for _, _, norm in ddp["steps"])  # clipping is active
    _assert_steps_equal(run["steps"], ddp["steps"], f"stage {stage}")
    _assert_states_close(run["state"], ddp["state"], f"stage {stage}")


def test_user_optimizer_and_scheduler_are_sharded_and_match_ddp(runs: dict) -> None:
    """optimizers=(SGD + momentum, StepLR): clipping changes SGD's update, so a wrong norm shows."""
    ddp, run = runs["sgd_ddp"], runs["sgd_s2"]
    _assert_steps_equal(run["steps"], ddp["steps"], "optimizers=(SGD, StepLR)")
    assert run["lrs"] == ddp["lrs"] and len(set(run["lrs"])) == 3  # StepLR halves it every 2 steps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_is_sharded_in_place_never_wrapped(runs: dict, stage: int) -> None:
    assert runs[f"s{stage}"]["unwrapped"] and runs[f"s{stage}"]["sharded"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluate_and_predict_match_ddp(runs: dict, stage: int) -> None:
    ddp, run = runs["ddp"], runs[f"s{stage}"]
    assert run["before"] == ddp["before"]  # evaluate() before train(): the model is not sharded yet
    assert _rel(run["eval_loss"], ddp["eval_loss"]) <= TOL
    assert _rel(run["predict_loss"], ddp["predict_loss"]) <= TOL
    assert run["logits"].shape == ddp["logits"].shape
    torch.testing.assert_close(run["logits"], ddp["logits"], rtol=TOL, atol=TOL)


def test_checkpoint_holds_zerolite_checkpoint_and_trainer_files(runs: dict) -> None:
    files = set(runs["checkpoint_files"])
    assert {
        "zerolite",
        "trainer_state.json",
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "model.safetensors",
        "config.json",
    } <= files
    assert "optimizer.pt" not in files  # rank 0's pickle of a sharded optimizer would be wrong


@pytest.mark.parametrize("run", ["resume_s2", "resume_s3", "resume_true"])
def test_resume_from_checkpoint_3_matches_the_straight_run(runs: dict, run: str) -> None:
    """From a differently initialised model: 2 -> 2 ranks, stage 2 -> 3, and resume=True.
    Only the steps the resumed run trains itself (4-6, as its callback saw them logged) are
    compared: steps 1-3 of its log history are the straight run's, reloaded from
    ``trainer_state.json``. At the same world size and stage the resumed run repeats the
    straight run's operations: bitwise."""
    _assert_steps_equal(runs[run]["steps"], runs["s2"]["steps"], run, RESUMED)
    if "state" in runs[run]:
        _assert_states_close(runs[run]["state"], runs["s2"]["state"], run)
    if run != "resume_s3":
        assert runs[run]["steps"] == [e for e in runs["s2"]["steps"] if e[0] in RESUMED], run
        if "state" in runs[run]:
            state, expected = runs[run]["state"], runs["s2"]["state"]
            assert all(torch.equal(state[k], v) for k, v in expected.items()), run


def test_mixin_combines_with_a_trainer_subclass(runs: dict) -> None:
    assert runs["resume_true"]["custom_loss_calls"] == 3 * 2  # steps 4-6, two micro-batches each


def test_resume_at_one_rank_matches_the_two_rank_run(runs: dict, out: Path) -> None:
    one = run_ranks(cases.resume_one_rank, 1, str(out), timeout=240)[0]
    _assert_steps_equal(one["steps"], runs["s2"]["steps"], "2 -> 1 ranks", RESUMED)
    _assert_states_close(one["state"], runs["s2"]["state"], "2 -> 1 ranks")


@pytest.mark.parametrize("reentrant", [False, True])
def test_stage3_with_gradient_checkpointing_matches_ddp(runs: dict, reentrant: bool) -> None:
    _assert_steps_equal(
        runs[f"gc_reentrant_{reentrant}"]["steps"], runs["ddp"]["steps"], f"{reentrant=}"
    )


def test_bf16_args_keep_fp32_parameters_under_autocast_as_the_stock_trainer(runs: dict) -> None:
    bf16 = runs["bf16"]
    common = {
        "stage": 2,
        "master_dtypes": ["torch.float32"],
        "compute_dtypes": ["torch.bfloat16"],  # the Accelerator's autocast reaches the model
        "finite": True,
        # save_model writes what the stock --bf16 run writes (its parameters stay fp32):
        # the fp32 masters, and a config.json that makes from_pretrained load float32.
        "saved_dtype": "torch.float32",
        "saved_is_masters": True,
    }
    # The stock Trainer's recipe by default: fp32 parameters, their own masters.
    assert bf16["default"] == {
        **common, "param_dtypes": ["torch.float32"], "params_are_masters": True}
    # zerolite's 16-bit recipe when asked for: what is saved is not the bf16 rounding.
    assert bf16["bf16_params"] == {
        **common, "param_dtypes": ["torch.bfloat16"], "params_are_masters": False}


def test_a_bf16_model_keeps_bf16_parameters_and_saves_bf16_as_the_stock_trainer(runs: dict):
    """A model converted to bf16 before the Trainer (param_dtype unset): its own dtype, with
    fp32 master shards; save_model writes bf16 (the masters rounded), as the stock Trainer
    writes for that model. Before, shard() cast it up to fp32 and saved fp32."""
    stock, got = runs["bf16"]["bf16_model_stock"], runs["bf16"]["bf16_model"]
    assert got == {
        "stage": 2, "param_dtypes": ["torch.bfloat16"], "master_dtypes": ["torch.float32"],
        "compute_dtypes": ["torch.bfloat16"], "finite": True,
        "saved_dtype": "torch.bfloat16", "saved_is_masters": True, "params_are_masters": False,
    }
    assert stock == {"param_dtypes": got["param_dtypes"], "saved_dtype": got["saved_dtype"]}


def test_save_model_then_from_pretrained_gives_the_gathered_parameters(runs: dict) -> None:
    saved = runs["save_model"]
    assert saved["writers"] == [True, False]  # rank 0 alone reaches Trainer._save
    assert {"model.safetensors", "config.json"} <= set(saved["files"])
    assert saved["missing"] == []
    assert saved["max_diff"] == 0.0
    assert saved["changed"] > 0  # trained: not the initial weights


def test_load_best_model_at_end_with_save_total_limit(runs: dict) -> None:
    best = runs["best"]
    evals = best["evals"]
    assert best["best"] == f"checkpoint-{2 * (evals.index(min(evals)) + 1)}"
    assert best["kept"] == [best["best"]]  # save_total_limit=1 keeps only the best at the end
    assert best["max_diff"] == 0.0  # the model holds the best checkpoint's weights


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("deepspeed", "ValueError: ZeroTrainer cannot honour args.deepspeed="),
        ("fsdp", "ValueError: ZeroTrainer cannot honour args.fsdp="),
        (
            "auto_find_batch_size",
            "ValueError: ZeroTrainer cannot honour args.auto_find_batch_size=True",
        ),
        ("bf16_full_eval", "ValueError: ZeroTrainer cannot honour args.bf16_full_eval=True"),
        ("fp16_full_eval", "ValueError: ZeroTrainer cannot honour args.fp16_full_eval=True"),
        (
            "parallelism_config",
            "ValueError: ZeroTrainer cannot honour args.parallelism_config=ParallelismConfig(",
        ),
        (
            "device_map",
            "ValueError: ZeroTrainer cannot train a model dispatched over devices "
            "(from_pretrained(device_map=...))",
        ),
        (
            "contradiction",
            "ValueError: zero_config.param_dtype=torch.float16 contradicts args.bf16=True",
        ),
        (
            "optim",
            (
                "TypeError: args.optim='adafactor': "
                "transformers.optimization.Adafactor cannot be sharded"
            ),
        ),
        ("fp16_cpu", "ValueError: args.fp16=True needs a CUDA device"),
        ("stage0", "ValueError: ZeroConfig.stage=0 is plain DDP"),
        (
            "user_optimizer",
            "TypeError: optimizers=: torch.optim.Adafactor cannot be sharded",
        ),
        (  # the hint is the Trainer's own flag, not an accelerate launch config; before
            # Accelerate 1.13 the processes see each other without it: nothing to refuse
            "cpu_launch",
            "RuntimeError: the launcher started 2 processes (WORLD_SIZE=2) but Accelerate "
            "sees 1: every process would train alone. On CPU, pass --use_cpu"
            if CPU_LAUNCH_NEEDS_USE_CPU else "no error: Accelerate sees 2 processes",
        ),
    ],
)
def test_unsupported_arguments_are_refused_at_construction(
    runs: dict, case: str, expected: str
) -> None:
    assert runs["errors"][case].startswith(expected), runs["errors"][case]


def test_args_bf16_keeps_fp32_params_unless_the_config_sets_bf16(monkeypatch) -> None:
    from types import SimpleNamespace

    import zerolite
    from zerolite.hf import zero_config_for_args

    monkeypatch.delenv("ZEROLITE_PARAM_DTYPE", raising=False)
    args = SimpleNamespace(bf16=True, fp16=False, device=torch.device("cpu"))
    # The model's own dtype (an fp32 model: the stock Trainer's recipe, bf16 autocast).
    assert zero_config_for_args(args, zerolite.ZeroConfig(stage=3)).param_dtype is None
    explicit = zerolite.ZeroConfig(stage=3, param_dtype=torch.bfloat16)  # zerolite's recipe
    assert zero_config_for_args(args, explicit).param_dtype == torch.bfloat16


def test_generate_in_an_eval_callback_at_stage_3(runs: dict) -> None:
    # Two evaluations; rank 0 generates 2 tokens, rank 1 six: no hang, unsharded tokens.
    assert runs["generate"]["matches"] == [True, True]
