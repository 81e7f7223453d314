"""The combination matrix: the axes every feature is crossed on, what `shard()` refuses,
and a pairwise-covering set of the accepted configurations.

A configuration is a dict over `AXES`. Its *recipe* (stage, dtype, accumulation, clipping)
is what the user trains; its *features* (offload, partition, hybrid, quantization, async
save, collectives) are how zerolite runs it. Each configuration is judged against its
`base`: the same recipe with every feature at its default. The rule per feature
(`RULES`) says how close the two runs must be:

- ``bitwise``: the feature moves no arithmetic (offload streams the same step through a
  tier; offload_params parks the same shards there between uses; an asynchronous save
  copies the state; whole-tensor ownership sums each gradient
  element in rank order, as the flat reduce-scatter does, and AdamW steps elementwise; with
  native collectives the backend's reduce and reduce-scatter add in their own orders, so
  there ownership follows the ``order`` rule; with quantization the int8 blocks run over
  each owner's chunk instead of equal shards, so there it follows the ``quantized`` rule).
- ``order``: the feature sums the same gradients in another order (hybrid averages within
  the node, then across; native collectives add in the backend's order): in fp32 the loss
  per step within `tests.support.parity.loss_bound` of DDP's own deviation between summation
  orders, in bf16 within `tests.support.mixed_recipe.TENSOR_TOL` (the mixed-precision rule).
- ``quantized``: int8 on the wire with error feedback: the loss per step within the
  quantized tests' 1e-2 relative.

A configuration with several features takes the loosest of their rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

__all__ = ["AXES", "DEFAULTS", "RECIPE", "REFUSED", "RULES", "accepted", "base", "features",
           "full_product", "label", "pairwise", "rule", "without_bitwise"]

AXES: dict[str, tuple] = {
    "stage": (1, 2, 3),
    "dtype": ("fp32", "bf16"),
    "offload": (None, "host", "disk"),
    "offload_params": (None, "disk"),  # stage 3 only (REFUSED)
    "partition": ("flat", "tensor"),
    "hybrid": (None, 2),  # shard groups of 2 of the 4 ranks
    "quantize": (None, "gather", "reduce", "both"),
    "async_save": (False, True),
    "accumulate": (1, 2),
    "clip": (False, True),
    "collectives": ("auto", "native"),
}
RECIPE = ("stage", "dtype", "accumulate", "clip")
DEFAULTS = {"offload": None, "offload_params": None, "partition": "flat", "hybrid": None,
            "quantize": None, "async_save": False, "collectives": "auto"}
RULES = {"offload": "bitwise", "offload_params": "bitwise", "async_save": "bitwise",
         "partition": "bitwise", "hybrid": "order", "collectives": "order",
         "quantize": "quantized"}
_LOOSENESS = ("bitwise", "order", "quantized")

# (what is refused, why), as (predicate, reason) pairs. A refusal added to `shard()` (or
# to `ZeroConfig`) must be listed here and in docs/limits.md.
REFUSED: tuple = (
    (lambda c: c.get("offload_params") is not None and c["stage"] != 3,
     "offload_params below stage 3: every rank holds the whole parameters there"),
)


def accepted(config: dict) -> bool:
    """Whether `shard()` accepts ``config`` today."""
    return not any(refused(config) for refused, _ in REFUSED)


def features(config: dict) -> list[str]:
    """The axes where ``config`` differs from its `base`."""
    return [k for k, v in DEFAULTS.items() if config[k] != v]


def base(config: dict) -> dict:
    """``config`` with every feature at its default: the run it is judged against."""
    return {**config, **DEFAULTS}


def _rule_of(feature: str, config: dict) -> str:
    if feature == "partition" and config["quantize"] is not None:
        return "quantized"  # the int8 blocks run over each owner's chunk, not equal shards
    if feature == "partition" and config["collectives"] == "native":
        return "order"
    return RULES[feature]


def rule(config: dict) -> str:
    """The loosest rule of ``config``'s features (``bitwise`` for none)."""
    return max((_rule_of(f, config) for f in features(config)), key=_LOOSENESS.index,
               default="bitwise")


def without_bitwise(config: dict) -> dict:
    """``config`` with its ``bitwise`` features at their defaults: it must train bit for bit
    as ``config`` does."""
    return {**config, **{f: DEFAULTS[f] for f in features(config)
                         if _rule_of(f, config) == "bitwise"}}


def label(config: dict) -> str:
    """A short, unique name: the recipe, then each feature."""
    parts = [f"stage{config['stage']}", config["dtype"]]
    parts += [f"accumulate{config['accumulate']}"] if config["accumulate"] > 1 else []
    parts += ["clip"] if config["clip"] else []
    parts += [f"{f}={config[f]}" for f in features(config)]
    return " ".join(parts)


def full_product() -> Iterator[dict]:
    """Every accepted configuration, in product order."""
    for values in itertools.product(*AXES.values()):
        config = dict(zip(AXES, values))
        if accepted(config):
            yield config


def _pairs(config: dict) -> set[tuple]:
    items = list(config.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def pairwise() -> list[dict]:
    """A small set of accepted configurations in which every pair of values that some accepted
    configuration holds appears at least once: greedy, deterministic (the first configuration
    of the product that covers the most uncovered pairs, until none is left)."""
    candidates = [(config, _pairs(config)) for config in full_product()]
    uncovered = set().union(*(pairs for _, pairs in candidates))
    chosen = []
    while uncovered:
        config, pairs = max(candidates, key=lambda c: len(c[1] & uncovered))
        chosen.append(config)
        uncovered -= pairs
    return chosen
