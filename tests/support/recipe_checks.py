"""16-bit training of any one stage against `tests.support.mixed_recipe`'s hand-written recipe.

`stage_failures` applies the criteria `tests.support.mixed_recipe.check_parity` applies to stages 1
and 2 to the runs of one stage (stage 3 here), with loss lists compared step by step by
`tests.support.loss_checks` (equal length, NaN fails):

- every rank holds the same parameters;
- per tensor, rank 0's final parameters within ``TENSOR_TOL`` of the recipe whose gradient
  is the mean of the N slices' (the same-recipe reference);
- per tensor, within max(2 x the recipe's own data-parallel noise, ``TENSOR_TOL``) of the
  recipe run on the whole batch at once (the noise: sliced recipe against whole-batch);
- per step, losses within ``TENSOR_TOL`` of the sliced recipe's, and (bf16) within
  ``LOSS_VS_FP32_TOL`` of fp32 training's.
"""

from __future__ import annotations

import torch

from tests.support import parity
from tests.support.mixed_recipe import LOSS_VS_FP32_TOL, TENSOR_TOL
from tests.support.parity import loss_deviations

__all__ = ["stage_failures"]


def _errors(params: dict, reference: dict) -> dict[str, float]:
    return {n: parity.rel_err(p, reference[n]) for n, p in params.items()}


def stage_failures(label: str, runs: list[dict], sliced: dict, whole: dict,
                   fp32_losses: list[float] | None) -> list[str]:
    """The criteria above for ``runs`` (per rank: ``{"params": {name: tensor}, "losses":
    [...]}``, full parameters under ``model.named_parameters()`` names); returns the
    failures, after printing rank 0's numbers."""
    r0 = runs[0]
    failures = []
    if r0["params"].keys() != sliced["params"].keys():
        return [f"{label}: parameters {sorted(r0['params'])} against the recipe's "
                f"{sorted(sliced['params'])}"]
    for rank, run in enumerate(runs[1:], start=1):
        differ = [n for n, p in run["params"].items() if not torch.equal(p, r0["params"][n])]
        if differ:
            failures.append(f"{label}: rank {rank}'s parameters differ from rank 0's: {differ}")
    floor = _errors(sliced["params"], whole["params"])  # the recipe's own data-parallel noise
    errors = _errors(r0["params"], sliced["params"])
    vs_whole = _errors(r0["params"], whole["params"])
    bad = {n: e for n, e in errors.items() if not e <= TENSOR_TOL}  # NaN fails
    if bad:
        failures.append(f"{label}: tensors beyond {TENSOR_TOL} vs the recipe: {bad}")
    bad = {n: (e, floor[n]) for n, e in vs_whole.items() if not e <= max(2 * floor[n], TENSOR_TOL)}
    if bad:
        failures.append(f"{label}: beyond max(2 x floor, {TENSOR_TOL}) vs whole batch: {bad}")
    try:
        vs_recipe = loss_deviations(r0["losses"], sliced["losses"])
        if not all(d <= TENSOR_TOL for d in vs_recipe):
            failures.append(f"{label}: losses vs the recipe beyond {TENSOR_TOL}: {vs_recipe}")
        vs_fp32 = [] if fp32_losses is None else loss_deviations(r0["losses"], fp32_losses)
        if not all(d <= LOSS_VS_FP32_TOL for d in vs_fp32):
            failures.append(f"{label}: losses vs fp32 beyond {LOSS_VS_FP32_TOL}: {vs_fp32}")
    except AssertionError as exc:  # lists of different lengths
        failures.append(f"{label}: {exc}")
        vs_recipe = []
    print(f"\n{label}: worst tensor vs recipe {max(errors.values()):.2e}; vs whole batch "
          f"{max(vs_whole.values()):.2e} (recipe's own {max(floor.values()):.2e}); loss vs "
          f"recipe max {max(vs_recipe, default=float('nan')):.2e}")
    return failures
