"""``zerolite plan`` and `zerolite.memory.plan`: the configuration picked for a budget is
the cheapest that fits, the ones over it say why, and the pick then trains under the
budget on a real gloo group (its peak measured by `measure_peak`)."""

from __future__ import annotations

import json

import pytest
import torch

import zerolite
from tests.memory.test_predict_peak import TOLERANCE
from tests.support.peak_cases import MODELS
from zerolite.cli import main
from zerolite.memory import measure_peak, plan, predict_peak
from zerolite.testing import run_ranks

ARGS = ["plan", "--model", "tests.support.peak_cases:gpt",
        "--inputs", "tests.support.peak_cases:gpt_batch",
        "--world-size", "2", "--batch", "4", "--stages", "1,3", "--param-dtypes", "fp32",
        "--offload", "none"]


def _plan(capsys, memory: str, *extra: str) -> tuple[int, str]:
    code = main([*ARGS, "--memory", memory, *extra])
    return code, capsys.readouterr().out


def _train(entry: dict) -> int:
    model_fn, batch_fn = MODELS["gpt"]
    tracker = measure_peak(
        model_fn, batch_fn, zerolite.ZeroConfig(**entry["config"]),
        micro_batch=entry["micro_batch"],
        accumulation=entry["accumulation"],
        activation_checkpointing=entry["activation_checkpointing"],
    )
    return tracker.peak


def test_plan_picks_the_cheapest_that_fits_and_it_trains_under_the_budget(capsys):
    # Room for anything: nothing to trade, so stage 1, no recomputation, one micro-step.
    code, out = _plan(capsys, "1GiB")
    assert code == 0
    lines = out.splitlines()
    use = next(i for i, line in enumerate(lines) if line.startswith("use ("))
    assert lines[use].startswith("use (micro-batch 4 x 1 accumulation, activation "
                                 "checkpointing off)")
    assert lines[use + 1] == "zerolite.ZeroConfig(stage=1, param_dtype=torch.float32)"
    # Then the same for accelerate launch (tests/memory/test_plan_round_trip.py).
    assert lines[use + 2:] == ["or, for accelerate launch, in its environment:",
                               "ZEROLITE_STAGE=1", "ZEROLITE_PARAM_DTYPE=float32"]
    model_fn, batch_fn = MODELS["gpt"]
    roomy = predict_peak(model_fn, batch_fn, zerolite.ZeroConfig(stage=1), 2, micro_batch=4)

    budget = roomy.peak - 1  # that pick no longer fits
    code, out = _plan(capsys, str(budget), "--json")
    tight = json.loads(out)
    pick = tight[0]
    assert code == 0 and pick["fits"] and pick["peak_bytes"] <= budget
    assert set(pick) >= {"config", "micro_batch", "accumulation", "activation_checkpointing",
                         "peak_bytes", "fits"}
    assert (pick["config"]["stage"], pick["micro_batch"], pick["activation_checkpointing"]) != (
        1, 4, False)
    assert [e["fits"] for e in tight] == sorted((e["fits"] for e in tight), reverse=True)
    # Each one not picked is over the budget, or costs more than one that fits
    # ([Note: pruned search]: it is not predicted).
    rejected = [e for e in tight if not e["fits"]]
    assert all("over the budget" in e["reason"] or e["reason"].startswith("skipped")
               for e in rejected)
    measured = run_ranks(_train, 2, pick)
    assert max(measured) <= budget, (measured, budget, pick)


def test_plan_says_when_nothing_fits(capsys):
    code, out = _plan(capsys, "1KiB", "--checkpointing", "on")
    assert code == 1
    assert "nothing fits" in out and "over the budget" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--memory", "lots"], "not a memory size"),
        (["--memory", "1GiB", "--offload", "tape"], "comma-separated list of none, host, disk"),
    ],
)
def test_plan_refuses_bad_arguments(capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        main([*ARGS, *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_function_refuses_a_zero_budget():
    model_fn, batch_fn = MODELS["gpt"]
    with pytest.raises(ValueError, match="memory must be an int >= 1"):
        plan(model_fn, batch_fn, 2, 0, 4)


def test_plan_searches_partial_offload_and_hybrid_sharding(capsys, tmp_path):
    # At 4 ranks stage 3 over groups of 2 sends fewer bytes than over all 4 and fits this
    # budget, so it is the pick; within the disk tier the half offload, which streams
    # fewer bytes, ranks before the full one. The pick then trains under the budget.
    budget = 8 << 20
    code = main(["plan", "--model", "tests.support.peak_cases:gpt", "--inputs",
                 "tests.support.peak_cases:gpt_batch", "--world-size", "4", "--batch", "4",
                 "--stages", "3", "--param-dtypes", "fp32", "--checkpointing", "off",
                 "--offload", "none,disk", "--offload-fractions", "1,0.5",
                 "--offload-params", "none", "--offload-dir", str(tmp_path),
                 "--memory", str(budget), "--json"])
    entries = json.loads(capsys.readouterr().out)
    # Without offload both fit, so the disk tier, which costs more, is not predicted.
    assert code == 0 and [e["fits"] for e in entries] == [True, True] + [False] * 4
    assert all(e["reason"].startswith("skipped") for e in entries[2:])
    pick = entries[0]
    assert pick["config"].get("shard_group_size") == 2, entries
    plain = next(e for e in entries if e["config"] == {"stage": 3, "param_dtype": "float32"})
    assert pick["communication_bytes"] < plain["communication_bytes"]
    model_fn, batch_fn = MODELS["gpt"]
    disk = plan(model_fn, batch_fn, 4, budget, 4, stages=[3], param_dtypes=[torch.float32],
                offloads=["disk"], offload_fractions=[1, 0.5], offload_params=[None],
                checkpointing=[False], shard_group_sizes=[4], offload_dir=str(tmp_path),
                exhaustive=True)
    assert [e.config.get("offload_fraction", 1.0) for e in disk] == [0.5, 1.0]
    assert 0 < disk[0].offloaded_bytes < disk[1].offloaded_bytes
    measured = max(run_ranks(_train, 4, pick))
    assert measured <= budget
    # test_predict_peak.py's TOLERANCE (the promised bound; byte-exact on this CPU).
    assert abs(measured - pick["peak_bytes"]) <= TOLERANCE * measured, (measured, pick)


def test_plan_parks_parameters_only_where_nothing_else_fits(tmp_path):
    """A budget between the least peak without ``offload_params`` and the least with it: the
    pick parks the parameters (the costliest kind, [Note: plan cost]), and trains under the
    budget; with room for both, the plan without it is the pick."""
    model_fn, batch_fn = MODELS["gpt"]
    search = dict(stages=[3], param_dtypes=[torch.float32], offloads=[None, "disk"],
                  offload_params=[None, "disk"], offload_fractions=[1.0], checkpointing=[False],
                  shard_group_sizes=[4], offload_dir=str(tmp_path))
    every = plan(model_fn, batch_fn, 4, 1 << 40, 1, exhaustive=True, **search)
    parked = min(e.peak_bytes for e in every if e.config.get("offload_params"))
    resident = min(e.peak_bytes for e in every if not e.config.get("offload_params"))
    assert parked < resident, (parked, resident)
    assert "offload_params" not in every[0].config  # room for both: the cheaper kind
    budget = (parked + resident) // 2
    entries = plan(model_fn, batch_fn, 4, budget, 1, **search)
    pick = entries[0]
    assert pick.fits and pick.config["offload_params"] == "disk", entries
    assert all(not e.fits for e in entries if not e.config.get("offload_params"))
    measured = max(run_ranks(_train, 4, pick.to_json()))
    assert measured <= budget
    assert abs(measured - pick.peak_bytes) <= TOLERANCE * measured, (measured, pick)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shard_group_sizes": [3]}, r"shard group sizes \[3\] do not divide world_size 4"),
        ({"offload_fractions": [0.0]}, r"offload_fractions must be numbers in \(0, 1\]"),
    ],
)
def test_plan_function_refuses_a_bad_search(kwargs, message):
    model_fn, batch_fn = MODELS["gpt"]
    with pytest.raises(ValueError, match=message):
        plan(model_fn, batch_fn, 4, 1 << 30, 4, **kwargs)
