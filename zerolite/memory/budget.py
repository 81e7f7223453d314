"""`plan`: the configurations that fit a memory budget, cheapest first.

For each combination of stage, ``param_dtype``, offload tier and the fraction offloaded,
the tier of stage 3's parameter and gradient shards (``offload_params``), activation
checkpointing and shard group size (hybrid sharding: sharded within groups of
k ranks, replicated across the ``world_size / k`` groups; k = ``world_size`` is plain
sharding), `predict_peak` is asked for the largest micro-batch (``batch``, then halves of
it) whose step fits ``memory``; the rest of ``batch`` is gradient accumulation. A combination with
no micro-batch that fits is rejected, saying by how much its smallest step is over.

[Note: pruned search] Most combinations need no trace, and the pick is the one the
whole search would make:

- one whose model states alone are over the budget ([Note: plan bounds]) is rejected
  by that arithmetic, and one whose lasting model states plus the activations another
  prediction of the same dtype, micro-batch and checkpointing held are over it
  ([Note: activation floor] in `zerolite.memory.budget_search`) too, and one whose
  optimizer step, as a prediction of the same configuration with checkpointing off or at
  a smaller micro-batch found it, is over it ([Note: step floor] there);
- the rest are predicted in groups of equal leading cost keys (offload tier, bytes
  offloaded, activation checkpointing: [Note: plan cost]); once a group holds one that
  fits, every later group costs more, so it is listed as skipped, not predicted;
- within a combination micro-batch 1 is tried first (most combinations searched are
  rejected by it), then the whole batch, then the halves in between by bisection (the
  peak grows with the micro-batch);
- each simulation stops once the rank holds more than the budget ([Note: stopped
  simulation] in `zerolite.memory.predict`), and simulates few micro-steps ([Note:
  micro-steps simulated] there);
- with ``workers``, other processes predict ahead of the search ([Note: predictions
  ahead] in `zerolite.memory.prediction_pool`).

``exhaustive=True`` predicts every combination at every micro-batch, as a check.

[Note: plan cost] Configurations that fit are ordered by what their step costs beyond
the same arithmetic, most expensive kinds first:

1. offload: parameters on a tier (``offload_params``, stage 3) first, since every gather
   and the step read them back (none, then host, then disk); then the optimizer's tier,
   which the step streams through the device every step (none, then host, then disk);
   within those, fewer bytes offloaded (`PeakPrediction.offloaded`) first: a partial
   offload (``offload_fraction`` < 1) streams less than a full one;
2. activation checkpointing: every forward runs twice (off before on);
3. bytes this rank sends per optimizer step (`PeakPrediction.communication_bytes`:
   stage 2 and 3, and fp32 parameters, send more). Hybrid sharding is counted the same
   way: every byte the rank sends, within its shard group and across the groups alike,
   with no weight for the slower link between groups. Its stage 1 and 2 send as many
   bytes as sharding over every rank (in a ring, the reduce-scatter and all-gather
   within the group and the all-reduce of the shard across groups add up to the
   reduce-scatter and all-gather over all ranks; the small collectives differ by a few
   hundred bytes), its stage 3 fewer (parameters are gathered within the group); fewer of them cross
   between groups in every stage. It holds more per rank, so it ranks ahead only when it
   fits;
4. forwards per step (accumulation: a smaller micro-batch uses the device less well).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerolite.config import ZeroConfig
from zerolite.memory.budget_bounds import StateBound, shared_fractions, state_bounds
from zerolite.memory.budget_entry import PlanEntry
from zerolite.memory.budget_search import (
    SKIPPED,
    Candidate,
    larger_after_fit,
    pruned,
    search,
)
from zerolite.memory.loop import OptimizerChoice
from zerolite.memory.peak_report import PeakPrediction
from zerolite.memory.predict import predict_peak
from zerolite.memory.prediction_pool import prediction_pool

__all__ = ["PlanEntry", "plan"]


def plan(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    world_size: int,
    memory: int,
    batch: int,
    *,
    stages: Sequence[int] = (1, 2, 3),
    param_dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    offloads: Sequence[str | None] = (None, "host", "disk"),
    offload_params: Sequence[str | None] = (None, "disk"),
    checkpointing: Sequence[bool] = (False, True),
    offload_fractions: Sequence[float] = (0.5, 1.0),
    shard_group_sizes: Sequence[int] | None = None,
    base: ZeroConfig | None = None,
    offload_dir: str | None = None,
    optimizer: OptimizerChoice = "adamw",
    max_grad_norm: float | None = 1.0,
    device: str = "cpu",
    exhaustive: bool = False,
    workers: int = 1,
) -> list[PlanEntry]:
    """Every configuration considered, those that fit first, cheapest first ([Note: plan
    cost]); then the rejected ones, least over the budget first. Single process, no
    process group (see `predict_peak`); nothing is allocated.

    Args:
        model_fn: ``() -> nn.Module`` (see `predict_peak`).
        batch_fn: ``(micro_batch) -> batch`` of keyword arguments for ``model(**batch)``.
        world_size: N, the data-parallel ranks.
        memory: the budget per rank, bytes (of ``device``).
        batch: samples per rank per optimizer step; micro-batch x accumulation.
        stages: the stages searched.
        param_dtypes: the parameter dtypes searched.
        offloads: the offload tiers searched (None: no offload).
        offload_params: stage 3's parameter tiers searched (None: in memory).
        checkpointing: the activation checkpointing settings searched.
        offload_fractions: each offload tier's ``offload_fraction``s, each in (0, 1].
        shard_group_sizes: the shard group sizes k searched, each a divisor of
            ``world_size`` (k = ``world_size``: sharded over every rank; a smaller k:
            hybrid sharding, ``shard_group_size=k``). Default: ``world_size`` and each
            of its divisors k with 1 < k < ``world_size``.
        base: other `ZeroConfig` settings every configuration keeps.
        offload_dir: a disk tier's directory (default: the system's temporary one).
        optimizer: as for `predict_peak`.
        max_grad_norm: as for `predict_peak`.
        device: as for `predict_peak`; ``memory`` is of this device.
        exhaustive: predict every combination at every micro-batch ([Note: pruned
            search]: the same pick, without the skipped and arithmetic rejections).
        workers: forked processes predicting ahead of the pruned search ([Note:
            predictions ahead]: the same plan, sooner); 1: this process alone.
    Returns:
        `PlanEntry`s; ``entries[0]`` is the one to use when ``entries[0].fits``. Then
        the rejected ones, least over the budget first, then the skipped ones.
    Raises:
        ValueError: ``world_size``, ``memory`` or ``batch`` < 1, an empty search, a fraction outside
            (0, 1], a group size that does not divide ``world_size``, or `predict_peak`'s
            own.
    """
    candidates = _candidates(world_size, memory, batch, stages, param_dtypes,
                             (offloads, offload_params), checkpointing, offload_fractions,
                             shard_group_sizes, offload_dir or tempfile.gettempdir())
    base = ZeroConfig() if base is None else base

    def direct(kw: dict[str, Any], m: int, a: int, c: bool, stop: int | None) -> PeakPrediction:
        return predict_peak(
            model_fn, batch_fn, dataclasses.replace(base, **kw), world_size,
            micro_batch=m, accumulation=a, activation_checkpointing=c,
            optimizer=optimizer, max_grad_norm=max_grad_norm, device=device, stop_above=stop,
        )

    if exhaustive:
        entries = [search(memory, batch, kw, c, direct) for kw, c in candidates]
    else:
        bounds = _bounds(model_fn, base, candidates, world_size, optimizer, device)
        shared = shared_fractions(direct, [kw for kw, _ in candidates], bounds)
        with prediction_pool(shared, workers, larger_after_fit) as pool:
            entries = pruned(memory, batch, candidates, bounds, pool, pool.ahead)
    return _in_plan_order(entries)


def _in_plan_order(entries: list[PlanEntry]) -> list[PlanEntry]:
    """Those that fit, cheapest first; the rejected, least over first; the skipped."""
    fits = sorted((e for e in entries if e.fits), key=PlanEntry.cost)
    skipped = [e for e in entries if (e.reason or "").startswith(SKIPPED)]
    rejected = sorted((e for e in entries if not e.fits and not (e.reason or "").startswith(
        SKIPPED)), key=lambda e: e.peak_bytes)
    return fits + rejected + skipped


def _bounds(
    model_fn: Callable[[], nn.Module], base: ZeroConfig, candidates: list[Candidate],
    world_size: int, optimizer: OptimizerChoice, device: str,
) -> list[StateBound | None]:
    """Each candidate's `StateBound`, computed once per configuration (checkpointing is no
    `ZeroConfig` setting: its values share one)."""
    keys = [tuple(sorted(kw.items())) for kw, _ in candidates]
    configs = list(dict.fromkeys(keys))
    found = dict(zip(configs, state_bounds(
        model_fn, [_config(base, dict(key)) for key in configs], world_size, optimizer,
        device)))
    return [found[key] for key in keys]


def _candidates(
    world_size: int, memory: int, batch: int, stages: Sequence[int],
    param_dtypes: Sequence[torch.dtype],
    tiers_searched: tuple[Sequence[str | None], Sequence[str | None]],
    checkpointing: Sequence[bool], offload_fractions: Sequence[float],
    shard_group_sizes: Sequence[int] | None, disk_dir: str,
) -> list[Candidate]:
    """`plan`'s arguments checked, and the combinations they make, in search order."""
    for name, value in (("world_size", world_size), ("memory", memory), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan(): {name} must be an int >= 1, got {value!r}")
    offloads, offload_params = tiers_searched
    groups = _group_sizes(world_size, shard_group_sizes)
    tiers = _tiers(offloads, offload_fractions)
    parked = list(dict.fromkeys(offload_params))
    combos = [(s, d, o, p, c, k) for s in stages for d in param_dtypes for o in tiers
              for p in (parked if s == 3 else [None]) for c in checkpointing for k in groups]
    if not combos or not parked:
        raise ValueError("plan(): nothing to search: stages, param_dtypes, offloads, "
                         "offload_params, checkpointing and shard_group_sizes each need at "
                         "least one value")
    return [
        (_kwargs(stage, dtype, (offload, fraction, params), None if k == world_size else k,
                 disk_dir), ckpt)
        for stage, dtype, (offload, fraction), params, ckpt, k in combos
    ]


def _config(base: ZeroConfig, kwargs: dict[str, Any]) -> ZeroConfig | None:
    """``base`` with ``kwargs``, or None where `ZeroConfig` refuses them (the trace
    reports it)."""
    try:
        return dataclasses.replace(base, **kwargs)
    except (ValueError, TypeError):
        return None


def _kwargs(stage: int, dtype: torch.dtype, tiers: tuple[str | None, float, str | None],
            group: int | None, disk_dir: str) -> dict[str, Any]:
    """One combination's `ZeroConfig` keyword arguments, defaults left out (the line
    `PlanEntry.zero_config_line` prints stays short); ``tiers``: the optimizer's tier, its
    fraction and the parameters' tier."""
    offload, fraction, params = tiers
    kwargs: dict[str, Any] = {"stage": stage, "param_dtype": dtype}
    if offload is not None:
        kwargs["offload"] = offload
    if params is not None:
        kwargs["offload_params"] = params
    if "disk" in (offload, params):
        kwargs["offload_dir"] = disk_dir
    if fraction != 1.0:
        kwargs["offload_fraction"] = fraction
    if group is not None:
        kwargs["shard_group_size"] = group
    return kwargs


def _group_sizes(world_size: int, sizes: Sequence[int] | None) -> list[int]:
    """The shard group sizes to search: ``sizes``, checked, or every divisor of
    ``world_size`` above 1 (``world_size`` itself first: plain sharding)."""
    if sizes is None:
        return [world_size, *(k for k in range(2, world_size) if world_size % k == 0)]
    bad = [k for k in sizes if isinstance(k, bool) or not isinstance(k, int) or k < 1
           or world_size % k]
    if bad:
        raise ValueError(f"plan(): shard group sizes {bad} do not divide world_size "
                         f"{world_size}; give divisors of it (k = {world_size}: no hybrid)")
    return list(dict.fromkeys(sizes))


def _tiers(offloads: Sequence[str | None], fractions: Sequence[float]) -> list[tuple]:
    """(tier, fraction) pairs: no offload once, each tier at each fraction."""
    bad = [f for f in fractions if isinstance(f, bool) or not isinstance(f, (int, float))
           or not 0 < f <= 1]
    if bad or (not fractions and any(o is not None for o in offloads)):
        raise ValueError(f"plan(): offload_fractions must be numbers in (0, 1], got "
                         f"{list(fractions)!r}")
    pairs: list[tuple] = []
    for o in dict.fromkeys(offloads):
        tier_fractions = [1.0] if o is None else dict.fromkeys(map(float, fractions))
        pairs += [(o, f) for f in tier_fractions]
    return pairs
