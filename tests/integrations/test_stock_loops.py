"""The loop shapes of transformers' example scripts, at stages 1-3, fp32 and bf16.

Rank bodies in tests/support/stock_loop_cases.py (their docstring lists the shapes). What must hold:

- ``save_state`` of ``step_N`` on two consecutive micro-steps replaces the folder (this
  run's), as stock Accelerate does; a resumed run replaces later folders of the run it
  continues; every folder carries the run's marker.
- ``resume_from_checkpoint`` of a ``step_N`` folder (mid-epoch, saved twice) restores
  bitwise what its second save held: weights, scheduler, Accelerate's micro-step counter.
  One of an ``epoch_N`` folder ends bitwise where the uninterrupted run ends (unshuffled
  data, no dropout, so nothing else differs).
- ``gather_for_metrics`` returns exactly the eval set (7 samples over 2 ranks).
- ``mixed_precision='bf16'`` is Accelerate's recipe by default (fp32 parameters under its
  autocast, which reaches the model at every stage): at stage 1 the loop is bitwise the
  stock (DDP) one; the log line names the recipe.
- ``save_pretrained(..., save_function=accelerator.save)`` on every rank writes what
  ``get_state_dict`` returns: the fp32 masters (bitwise), also at stage 3 and with bf16
  parameters (asked for explicitly), where they differ from the parameters;
  ``from_pretrained`` loads float32, as the stock run's. The GLUE shape (another head)
  predicts on one process from the saved model what the gathered predictions said.
- ZeroTrainer with ``torch_compile`` (stage 3) trains the model compiled after sharding,
  with losses within twice DDP's own compile deviation. (``--bf16``'s saved model:
  tests/integrations/test_hf_trainer.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import stock_loop_cases as cases
from zerolite.testing import run_ranks

pytest.importorskip("transformers")

# "bf16" is Accelerate's recipe, zerolite's default (fp32 parameters under autocast);
# "bf16_params" asks for zerolite's 16-bit recipe (bf16 parameters, fp32 master shards).
CONFIGS = [(stage, precision) for stage in (1, 2, 3) for precision in ("no", "bf16")]
RECIPES = [(3, "bf16_params")]  # run once (no resumes): what it saves and computes in
EPOCH_RESUMES = [(1, "no"), (3, "bf16")]


def _all_loops(out: str) -> dict[str, Any]:
    """Every Accelerate case in one launch (AcceleratorState is reset between them)."""
    import logging

    from accelerate.state import AcceleratorState

    results: dict[str, Any] = {"log": []}
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: results["log"].append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerolite").addHandler(handler)
    logging.getLogger("zerolite").setLevel(logging.INFO)  # as the scripts' basicConfig(INFO)

    def run(key: str, *args: Any, **kwargs: Any) -> None:
        AcceleratorState._reset_state(reset_partial_state=False)
        results[key] = cases.accelerate_loop(*args, **kwargs)

    for stage, precision in CONFIGS:
        folder = Path(out) / f"s{stage}_{precision}"
        run(f"{stage}_{precision}", str(folder), stage, precision)
        if (stage, precision) in EPOCH_RESUMES:  # before from_step replaces epoch_0
            run(f"{stage}_{precision}_from_epoch", f"{folder}_from_epoch", stage, precision,
                resume=f"{folder}/epoch_0")  # a folder of its own: final/ is compared
        run(f"{stage}_{precision}_from_step", str(folder), stage, precision,
            resume=f"{folder}/step_{cases.SAVE_EVERY}")
    for stage, precision in RECIPES:
        run(f"{stage}_{precision}", str(Path(out) / f"s{stage}_{precision}"), stage, precision)
    run("glue", str(Path(out) / "glue"), 3, "no", head="glue")
    for stage in (None, 1):
        AcceleratorState._reset_state(reset_partial_state=False)
        results[f"parity_{stage}"] = cases.stock_parity_loop(stage)
    return results


@pytest.fixture(scope="module")
def loops(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("stock_loops")
    rank0, rank1 = run_ranks(_all_loops, 2, str(out), timeout=400)
    return out, {**rank0, "log_rank1": rank1["log"]}


@pytest.mark.parametrize(("stage", "precision"), CONFIGS)
def test_saves_on_consecutive_micro_steps_replace_this_runs_folder(loops, stage, precision):
    out, results = loops
    saves = results[f"{stage}_{precision}"]["saves"]
    # step_N again on the micro-step after the one that completed step N (step_4's second
    # save comes after epoch_0, on the next epoch's first micro-step).
    assert saves[:4] == ["step_0", "step_2", "step_2", "step_4"], saves
    assert saves.count("step_4") == 2 and "epoch_0" in saves and "epoch_1" in saves
    resumed = results[f"{stage}_{precision}_from_step"]["saves"]
    assert "step_4" in resumed and "epoch_1" in resumed  # the continued run's folders
    folder = out / f"s{stage}_{precision}"
    markers = {json.loads((folder / name / "zerolite_run.json").read_text())["run"]
               for name in saves}
    assert len(markers) == 1  # one run wrote them all, resumed or not


def _same_fingerprint(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert (got["step"], got["last_epoch"]) == (expected["step"], expected["last_epoch"])
    for name, tensor in expected["state"].items():
        assert torch.equal(got["state"][name], tensor), name


@pytest.mark.parametrize(("stage", "precision"), CONFIGS)
def test_resume_from_step_folder_restores_its_second_save(loops, stage, precision):
    _, results = loops
    whole, resumed = results[f"{stage}_{precision}"], results[f"{stage}_{precision}_from_step"]
    expected = whole["at_save"][f"step_{cases.SAVE_EVERY}"]
    # The second save, one micro-step past the boundary: Accelerate's counter is odd there.
    # (So stock Accelerate's resume of it steps after one micro-batch, as DDP's does: the
    # resumed run cannot end where the uninterrupted one does; the epoch resume below can.)
    assert expected["step"] == 2 * cases.SAVE_EVERY + 1
    _same_fingerprint(resumed["restored"], expected)
    assert resumed["eval_count"] == 7


@pytest.mark.parametrize(("stage", "precision"), EPOCH_RESUMES)
def test_resume_from_epoch_folder_ends_bitwise_where_the_whole_run_ends(loops, stage, precision):
    _, results = loops
    whole, resumed = results[f"{stage}_{precision}"], results[f"{stage}_{precision}_from_epoch"]
    _same_fingerprint(resumed["restored"], whole["at_save"]["epoch_0"])
    for name, tensor in whole["get_state_dict"].items():
        assert torch.equal(resumed["get_state_dict"][name], tensor), name
    assert resumed["eval_loss"] == whole["eval_loss"]


def test_each_prepare_logs_one_line_on_the_main_process(loops):
    _, results = loops
    log = results["log"]
    runs = [k for k in results if not k.startswith(("log", "parity_None"))]  # stock: no line
    assert len(log) == len(runs) and results["log_rank1"] == [], log
    first = log[0]  # stage 1, fp32; then stage 1 in bf16
    assert first.startswith("zerolite: stage 1 over 2 ranks, fp32, partition flat"), first
    assert "rank 0 holds" in first and "MiB" in first
    # Which mixed-precision recipe is active:
    assert any(line.startswith("zerolite: stage 1 over 2 ranks, fp32 parameters under "
                               "Accelerate's bf16 autocast (Accelerate's own recipe), ")
               for line in log), log
    assert any("bfloat16 parameters with fp32 masters under Accelerate's bf16 autocast "
               "(zerolite's 16-bit recipe" in line for line in log), log


def test_bf16_at_stage_1_is_bitwise_the_stock_ddp_loop(loops):
    """Accelerate's bf16 recipe by default: the one-line change gives the stock numbers."""
    _, results = loops
    stock, zero = results["parity_None"], results["parity_1"]
    assert zero["losses"] == stock["losses"], (zero["losses"], stock["losses"])
    assert len(stock["losses"]) == 8
    for name, tensor in stock["state"].items():
        assert torch.equal(zero["state"][name], tensor), name


@pytest.mark.parametrize(("stage", "precision"), CONFIGS + RECIPES)
def test_accelerate_autocast_reaches_the_sharded_model(loops, stage, precision):
    _, results = loops
    expected = "torch.float32" if precision == "no" else "torch.bfloat16"
    assert results[f"{stage}_{precision}"]["compute_dtypes"] == [expected]


@pytest.mark.parametrize(("stage", "precision"), CONFIGS)
def test_gather_for_metrics_returns_the_eval_set(loops, stage, precision):
    _, results = loops
    assert results[f"{stage}_{precision}"]["eval_count"] == 7


@pytest.mark.parametrize(("stage", "precision"), CONFIGS + RECIPES)
def test_save_pretrained_on_every_rank_writes_the_fp32_masters(loops, stage, precision):
    out, results = loops
    key = f"{stage}_{precision}"
    result = results.get(f"{key}_from_step", results[key])  # the last run to write final/
    saved = cases.loaded(str(out / f"s{stage}_{precision}" / "final"), "clm")
    assert saved["dtype"] == "torch.float32"  # as the stock run's, in fp32 and bf16
    expected = "torch.bfloat16" if precision == "bf16_params" else "torch.float32"
    assert result["param_dtypes"] == [expected]
    differs = False
    for name, master in result["masters"].items():
        assert torch.equal(result["get_state_dict"][name], master), name
        assert torch.equal(saved["state"][name], master), name
        differs |= not torch.equal(result["params"][name].float(), master)
    # With bf16 parameters the masters are not the parameters: what was saved is not a
    # rounding. (Accelerate's recipe keeps fp32 parameters, their own masters.)
    assert differs == (precision == "bf16_params")


def test_glue_shape_predicts_from_the_saved_model_what_it_gathered(loops):
    out, results = loops
    glue = results["glue"]
    assert glue["eval_count"] == 7 and 0.0 <= glue["accuracy"] <= 1.0
    saved = cases.loaded(str(out / "glue" / "final"), "glue")
    assert torch.equal(saved["predictions"], glue["predictions"])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("stock_trainer")
    return run_ranks(cases.trainer_cases, 2, str(out), timeout=400)[0]


def test_zero_trainer_compiles_after_sharding(trainer):
    assert trainer["zero_compiled_wrapper"] == "OptimizedModule"
    assert trainer["ddp_compiled_wrapper"] == "OptimizedModule"
    # DDP's own deviation under compile (AOTAutograd rounds differently from eager) is the
    # yardstick, as in tests/support/parity.py.
    ddp_deviation = max(abs(a - b) for a, b in zip(trainer["ddp_compiled"], trainer["ddp"]))
    bound = max(2 * ddp_deviation, 1e-6)
    assert len(trainer["zero_compiled"]) == len(trainer["ddp_compiled"]) == 3
    for zero, ddp in zip(trainer["zero_compiled"], trainer["ddp_compiled"]):
        assert abs(zero - ddp) <= bound, (trainer["zero_compiled"], trainer["ddp_compiled"])
