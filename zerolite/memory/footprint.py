"""What a rank holds, measured (`footprint`), and what the ZeRO formulas say (`formula`).

`MemoryBreakdown` serves both. Its fields are bytes per rank:

- ``params``: parameter storage (flat buffers, plus the model's other parameters);
- ``grads``: persistent gradient storage (stage 1: the full-size flat gradient buffers
  that ``param.grad`` views; stage 2: this rank's reduced gradient shards);
- ``master``: fp32 master shards that are copies (16-bit training; in fp32 the master
  is the parameter shard itself and costs nothing extra);
- ``optimizer_state``: every tensor in the wrapped optimizer's ``state`` (moments, and
  scalar state such as Adam's 0-dim ``step``: 4 bytes per master piece);
- ``residual``: ``ZeroConfig.quantize_reduce``'s error-feedback residuals, fp32, what this
  rank's contributions to the other ranks' chunks lost: 4 (N-1)/N bytes per parameter;
  with hybrid sharding over shard groups of k, 4 (k-1)/k within the group plus 4/k for
  the quantized cross-node step (`zerolite.comm.quantized_replicas`)
  (``quantize_gather`` costs no residual, but in fp32 stages 1-2 it makes the master a
  copy: 4/N bytes per parameter under ``master``, 4/k with hybrid sharding);
- ``transient``: buffers alive only around communication or the step (stage-2 gradient
  buckets in flight, stage-1 reduced shards during the step, full-size gradients not
  yet moved into a bucket). A measurement reports what is alive at that moment.

One field is not bytes: ``ownership_imbalance``, under whole-tensor ownership
(``ZeroConfig.partition="tensor"``), is max / min over ranks of the trained elements each
rank owns (`zerolite.plan.owners.imbalance`; 1.0 under ``"flat"``): the rank owning the
most holds that much more master, gradient shard and optimizer state than the lightest.

With ``ZeroConfig(offload=...)``, ``offloaded`` is the tier's bytes (per-element
optimizer state, and 16-bit masters, of the offloaded pieces): their own line,
"optimizer state on disk" (or "in host memory"), outside the resident fields above and
outside ``model_states`` and ``total``. (A ``"host"`` arena of a CPU model is host
memory all the same: the process RSS includes it.) Both are the bytes actually allocated:
the arena is never pinned, and ``offload_staging`` -- the streamed step's three staging
buffers, host memory pinned at exactly their size for a CUDA model (`zerolite.state.pinned`),
allocated at the first step -- is its own line too.

`footprint` counts each distinct storage once (``untyped_storage().data_ptr()``), in
the order of the fields above: a view shares its base's storage and is not counted
again. `formula` is the table of docs/design.md ("Memory per rank") for Adam-style state
(8 bytes per parameter);
what each stage shards is `zerolite.plan.stages.STAGES`, state bytes `zerolite.plan.optimizers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from fractions import Fraction

import torch

from zerolite.optim.sharded_optimizer import ShardedOptimizer, require_sharded_optimizer
from zerolite.plan.layout import FlatLayout
from zerolite.plan.optimizers import STATE_BYTES_PER_PARAM
from zerolite.plan.owners import imbalance
from zerolite.plan.stages import STAGES

__all__ = ["MemoryBreakdown", "footprint", "formula", "offload_label", "STATE_BYTES_PER_PARAM"]

@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank by category (see the module docstring)."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer_state: int = 0
    transient: int = 0
    residual: int = 0
    ownership_imbalance: float = 1.0  # max/min owned elements over ranks (not bytes)
    offloaded: int = 0
    offload_tier: str | None = None
    offload_staging: int = 0  # host bytes of the streamed step's staging buffers

    @property
    def model_states(self) -> int:
        """Everything but ``transient``: what ZeRO's formulas count."""
        return self.params + self.grads + self.master + self.optimizer_state + self.residual

    @property
    def total(self) -> int:
        return self.model_states + self.transient

    def __str__(self) -> str:
        resident = ("params", "grads", "master", "optimizer_state", "transient", "residual")
        rows = [(name, getattr(self, name)) for name in resident]
        rows += [("model_states", self.model_states), ("total", self.total)]
        lines = [f"{name:16s} {_human(value):>12s}" for name, value in rows]
        if self.ownership_imbalance != 1.0:
            lines.append(f"{'imbalance':16s} {self.ownership_imbalance:>11.3f}x")
        if self.offload_tier is not None:
            lines.append(f"{offload_label(self.offload_tier)}: {_human(self.offloaded)}")
        if self.offload_staging:
            lines.append(f"offload staging buffers (host): {_human(self.offload_staging)}")
        return "\n".join(lines)


def offload_label(tier: str) -> str:
    """How an offload tier's line is labelled: "optimizer state on disk" / "in host memory"."""
    return "optimizer state on disk" if tier == "disk" else "optimizer state in host memory"


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


class _StorageCensus:
    """Adds up bytes of distinct storages, each counted in the first category that claims it."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def count(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key not in self._seen:
                self._seen.add(key)
                total += storage.nbytes()
        return total


def _state_tensors(opt: ShardedOptimizer) -> Iterable[torch.Tensor]:
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _in_flats(p: torch.Tensor, opt: ShardedOptimizer) -> bool:
    return any(p is q for f in [*opt.flats, *opt.frozen_flats] for q in f.params)


def footprint(opt: ShardedOptimizer) -> MemoryBreakdown:
    """Measure what this rank holds for ``opt`` and its model, by category.

    Local: no communication; any rank may call it at any time. The four model-state
    fields do not depend on when it is called (gradient buffers are persistent);
    ``transient`` is what is alive at that moment.
    """
    require_sharded_optimizer(opt, "footprint()")
    census = _StorageCensus()
    model = opt.model
    model_params = list(model.parameters()) if model is not None else []
    # Stage 3 holds shards; full buffers of gathered units are transient.
    params = census.count(
        [f.data if f.replicated else f.shard for f in [*opt.flats, *opt.frozen_flats]]
    )
    master = census.count(m.data for m in opt.masters)
    params += census.count(
        p for p in model_params if p.untyped_storage().nbytes() and not _in_flats(p, opt)
    )
    persistent = [b.full if b.keep_full else b.shard for b in opt.buckets]
    other_grads = [p.grad for p in model_params if not _in_flats(p, opt)]
    grads = census.count(persistent + other_grads)
    state = census.count(_state_tensors(opt))
    residual = census.count(
        [r for flat in opt.flats for r in flat.exchange.residuals]
    )
    transient = census.count(
        [b.shard if b.keep_full else b.full for b in opt.buckets]
        + [p.grad for p in model_params]
        + [f.data for f in [*opt.flats, *opt.frozen_flats] if not f.replicated]
        + opt.bookkeeping_tensors()
    )
    tier, params_tier = opt.shard_state.offload, opt.shard_state.params_tier
    return MemoryBreakdown(
        params=params, grads=grads, master=master, optimizer_state=state, transient=transient,
        residual=residual,
        ownership_imbalance=layout_imbalance([f.layout for f in opt.flats]),
        offloaded=(0 if tier is None else tier.arena_bytes) + (
            0 if params_tier is None else params_tier.capacity),
        offload_tier=tier.plan.tier if tier is not None else (
            None if params_tier is None else params_tier.tier),
        offload_staging=0 if tier is None else tier.staging_bytes,
    )


def layout_imbalance(layouts: Iterable[FlatLayout]) -> float:
    """``ownership_imbalance`` of trained buffers' layouts: 1.0 unless whole-tensor owned."""
    sizes = [layout.chunk_sizes for layout in layouts if layout.chunk_sizes is not None]
    if not sizes:
        return 1.0
    return imbalance(sizes, len(sizes[0]))


def formula(
    num_params: int,
    *,
    world_size: int,
    stage: int,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    offload: str | None = None,
    offload_fraction: float = 1.0,
    quantize_gather: bool = False,
    error_feedback: bool = False,
    shard_group_size: int | None = None,
) -> MemoryBreakdown:
    """The ZeRO paper's per-rank model states for ``num_params`` parameters, without padding
    (docs/design.md, "Memory per rank").

    Args:
        num_params: Ψ, the number of trained parameter elements.
        world_size: N.
        stage: 0 (DDP, for comparison), 1, 2 or 3.
        param_dtype: compute dtype; 16-bit adds a 4-byte fp32 master per parameter.
        reduce_dtype: dtype of gradient shards (stages 2-3); None means ``param_dtype``.
            Stages 0-1 keep full gradients in ``param_dtype``.
        optimizer: a key of `STATE_BYTES_PER_PARAM`.
        offload: as in `zerolite.ZeroConfig`: the tier that ``offloaded`` counts.
        offload_fraction: as in `zerolite.ZeroConfig`: that fraction of the master and
            optimizer-state bytes moves to ``offloaded`` (not rounded to pieces).
        quantize_gather: ``ZeroConfig.quantize_gather`` (fp32 stages 1-2 at N > 1: the
            master becomes a 4-byte copy).
        error_feedback: ``ZeroConfig.quantize_reduce`` with ``error_feedback``: a 4-byte
            residual per parameter and other rank, 4 (N-1)/N bytes per parameter; with
            hybrid sharding, 4 (k-1)/k within the shard group plus 4/k for the cross-node
            step (when N > k).
        shard_group_size: k, hybrid sharding (`zerolite.comm.hybrid`): states are sharded over
            k ranks, not N (stage 3 in fp32 with Adam: 16Ψ/k); None means N.
    Returns:
        A `MemoryBreakdown` with ``transient = 0``. Example: 7.5e9 parameters, N=64,
        bf16, stages 0-3 give 120, 31.4, 16.6 and 1.88 GB of model states.
    """
    k = _check_formula(world_size, stage, optimizer, shard_group_size, param_dtype)
    policy = STAGES[stage]
    psi = Fraction(num_params)

    def held(sharded: bool) -> Fraction:  # elements per rank
        return psi / k if sharded else psi

    p = torch.empty(0, dtype=param_dtype).element_size()
    kept_grad_dtype = policy.kept_grad_dtype(param_dtype, reduce_dtype or param_dtype)
    g = torch.empty(0, dtype=kept_grad_dtype).element_size()
    # The gather runs over the k ranks of a shard group: none travels at k = 1.
    copied = quantize_gather and k > 1 and not policy.shards_parameters
    master_bytes = 0 if param_dtype == torch.float32 and not copied else 4
    state_bytes = STATE_BYTES_PER_PARAM[optimizer]
    master = round(master_bytes * held(policy.shards_optimizer_state))
    state = round(state_bytes * held(policy.shards_optimizer_state))
    fraction = Fraction(offload_fraction) if offload is not None else Fraction(0)
    off_master, off_state = round(master * fraction), round(state * fraction)
    return MemoryBreakdown(
        params=round(p * held(policy.shards_parameters)),
        grads=round(g * held(policy.shards_gradients)),
        master=master - off_master,
        optimizer_state=state - off_state,
        offloaded=off_master + off_state,
        offload_tier=offload,
        residual=round(4 * (psi * (k - 1) / k + (psi / k if k < world_size else 0)))
        if error_feedback
        else 0,
    )


def _check_formula(
    world_size: int, stage: int, optimizer: str, shard_group_size: int | None,
    param_dtype: object,
) -> int:
    """`formula`'s arguments, checked; returns k (the ranks that shard)."""
    if not isinstance(param_dtype, torch.dtype):
        raise TypeError(
            f"formula(): param_dtype must be a torch.dtype, got {param_dtype!r} (a count has "
            "no dtype of its own: ZeroConfig's None means the model's, so pass the model's "
            "dtype, or a sharded optimizer's opt.config.param_dtype)"
        )
    if stage not in tuple(STAGES):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    k = world_size if shard_group_size is None else shard_group_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > world_size or world_size % k:
        raise ValueError(
            f"shard_group_size must be None or an int k >= 1 dividing world_size={world_size}, "
            f"got {shard_group_size!r}"
        )
    if optimizer not in STATE_BYTES_PER_PARAM:
        raise ValueError(
            f"optimizer must be one of {sorted(STATE_BYTES_PER_PARAM)}, got {optimizer!r}"
        )
    return k
