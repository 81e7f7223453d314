"""Resume across any change: which (save setup, load setup) pairs the suite runs.

A *setup* is a dict over `AXES`: everything about how zerolite runs the same training
(world size, stage, partition, hybrid shard groups, offload, quantization, parameter
dtype, bucket size). A checkpoint saved under any accepted setup must load under any
other (`tests/checkpoint/test_resume_matrix.py` says what is checked). `accepted` is
`tests.support.combination_matrix`'s refusals plus the one of this matrix's world sizes (shard
groups of 2 need 4 ranks here), so when another helper lifts a refusal there, its
setups join these pairs too.

`setups` picks, greedily and deterministically, accepted setups holding every value of
every axis `TIMES` times (world size 2 preferred: the cheapest that shards; each next
one differing from the last on as many axes as it can); `pairs` crosses them as a cycle
at `OFFSETS`, ``L[i] -> L[i + 1]`` and ``L[i] -> L[i + 2]``, so every value is saved
from and loaded into at least four times, most other axes changing with it (8 setups,
16 pairs today). Adding a value to `AXES` adds it to the pairs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from tests.support import combination_matrix

__all__ = ["AXES", "accepted", "all_setups", "label", "setups", "loss_rule", "pairs"]

AXES: dict[str, tuple] = {
    "world": (2, 4, 1),
    "stage": (1, 2, 3),
    "partition": ("flat", "tensor"),
    "hybrid": (None, 2),  # shard groups of 2 (of 4 ranks)
    "offload": (None, "host", "disk", "host:0.5"),  # host:0.5 = offload_fraction 0.5
    "quantize": (None, "reduce", "both"),
    "dtype": ("fp32", "bf16"),
    "bucket": (0.01, 0.004),  # MB: several flat buffers, cut elsewhere
}
OFFSETS = (1, 2)
TIMES = 2
COST = {1: 1, 2: 0, 4: 2}  # preference per world size: 2 is the cheapest that shards


def _as_combination(setup: dict) -> dict:
    """The setup as `tests.support.combination_matrix` spells a configuration (for its
    refusals)."""
    offload = setup["offload"]
    return {
        "stage": setup["stage"], "dtype": setup["dtype"], "partition": setup["partition"],
        "offload": None if offload is None else offload.split(":")[0],
        "hybrid": setup["hybrid"], "quantize": setup["quantize"], "async_save": False,
        "accumulate": 1, "clip": False, "collectives": "auto",
    }


def accepted(setup: dict) -> bool:
    """Whether `shard()` accepts ``setup`` today (and it fits this matrix's world sizes)."""
    if setup["hybrid"] is not None and setup["world"] != 4:
        return False
    return combination_matrix.accepted(_as_combination(setup))


def all_setups() -> Iterator[dict]:
    """Every accepted setup, in product order."""
    for values in itertools.product(*AXES.values()):
        setup = dict(zip(AXES, values))
        if accepted(setup):
            yield setup


def setups(times: int = TIMES) -> list[dict]:
    """Accepted setups that together hold every value of every axis ``times`` times:
    greedy, deterministic (the candidate that holds the most values still short, then
    the one that differs from the last chosen on the most axes, then the first of the
    product), so that consecutive setups -- the pairs -- change as much as they can."""
    candidates = [(setup, set(setup.items())) for setup in all_setups()]
    short = {value: times for _, values in candidates for value in values}
    chosen: list[dict] = []

    def score(candidate: tuple[dict, set]) -> tuple[int, int, int]:
        setup, values = candidate
        last = chosen[-1] if chosen else {}
        return (sum(short[v] > 0 for v in values), -COST[setup["world"]],
                sum(setup[a] != last.get(a) for a in AXES))

    while any(short.values()):
        setup, values = max((c for c in candidates if c[0] not in chosen), key=score)
        chosen.append(setup)
        for value in values:
            short[value] = max(short[value] - 1, 0)
    return chosen


def pairs(chosen: list[dict] | None = None) -> list[tuple[dict, dict]]:
    """(save setup, load setup): ``chosen`` (default `setups`) as a cycle at `OFFSETS`."""
    chosen = setups() if chosen is None else chosen
    n = len(chosen)
    return [(chosen[i], chosen[(i + k) % n]) for k in OFFSETS for i in range(n)]


def label(setup: dict) -> str:
    """A short name: ``w2 s1 flat host bf16 q=reduce b=0.004 k=2``."""
    parts = [f"w{setup['world']}", f"s{setup['stage']}", setup["partition"],
             setup["offload"] or "mem", setup["dtype"]]
    parts += [f"q={setup['quantize']}"] if setup["quantize"] else []
    parts += [f"b={setup['bucket']}", f"k={setup['hybrid']}" if setup["hybrid"] else ""]
    return " ".join(p for p in parts if p)


def loss_rule(save: dict, load: dict) -> str:
    """How close the resumed run's losses must be to the uninterrupted one's:

    - ``bitwise`` when neither the summation order nor what is rounded changes: same world
      size, shard groups, parameter dtype and quantization (stage, partition, offload and
      -- unquantized -- bucket size move no arithmetic);
    - ``dtype`` (the mixed-precision rule) when the parameter dtype changes;
    - ``quantized`` (the quantized tests' bound) when either side quantizes at more than
      one rank and anything else differs (other blocks, other residual holders);
    - ``order`` otherwise: another world size or shard groups sum the same gradients in
      another order."""
    quantized = any(x["quantize"] and x["world"] > 1 for x in (save, load))
    same = ("world", "hybrid", "dtype", "quantize") + (("bucket",) if quantized else ())
    if all(save[a] == load[a] for a in same):
        return "bitwise"
    if save["dtype"] != load["dtype"]:
        return "dtype"
    return "quantized" if quantized else "order"
