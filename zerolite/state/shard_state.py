"""`ShardState`: everything zerolite keeps for one sharded model, in one object.

`zerolite.shard` builds one per model and `register`s it; everything that later needs
the model's flat buffers, masters, scheduler or meta build finds it with `state_of`
instead of reading attributes off the user's model. The registry holds the model weakly:
an entry lives exactly as long as its model. It holds its values strongly, and a value
that referenced its own model would keep the model alive forever (the registry is a
global root), so a `ShardState` reaches the model, and the unit scheduler (whose hooks
hold the modules), only through weak references; the model's own hooks keep the
scheduler alive.

`pieces` is the one place that walks "this rank's piece of each trained parameter, its
fp32 master and its optimizer state"; checkpoints, state dicts and estimates read it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from zerolite.comm.group import Group
from zerolite.config import ZeroConfig
from zerolite.grads.hooks import KeepFullGrads, ShardGradsInBackward
from zerolite.grads.reducer import GradReducer
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.meta_init import MetaBuild
from zerolite.params.tiered_shard import ShardTier
from zerolite.params.unit_scheduler import UnitScheduler
from zerolite.state.master import MasterShard
from zerolite.state.offload import OffloadTier
from zerolite.state.pieces import FrozenPiece, Piece, pieces_of

__all__ = ["ShardState", "register", "require_state", "state_of"]


class ShardState:
    """What `zerolite.shard` built for one model; one per sharded model.

    Attributes:
        group: zerolite's data-parallel group.
        config: the `ZeroConfig` the model was sharded with.
        inner: the user's optimizer (``param_groups`` hold the pieces' master views).
        flats: trained parameters' flat buffers, in gradient-bucket order
            (``config.param_dtype``; full, or this rank's shard in stage 3).
        masters: one `MasterShard` (fp32, this rank's shard) per entry of ``flats``.
        frozen_flats: stage 3: frozen parameters' flat buffers (sharded; no master).
        reducer: the `GradReducer` over one gradient bucket per entry of ``flats``.
        grads: the backward hooks feeding ``reducer`` (their ``_handles``).
        layout_digest: sha256 of what every rank agreed on at `shard()`.
        meta_build: a meta build's `MetaBuild` until its first forward passes, else None.
        offload: the `OffloadTier` (``config.offload`` set), else None.
        params_tier: where parameter and gradient shards are parked between uses
            (``config.offload_params`` set, `zerolite.params.tiered_shard`), else None.
        source_dtypes: every parameter's dtype when `shard()` took the model, by each of
            its names (tied parameters under each): what a stock run keeps, and saves.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        group: Group,
        config: ZeroConfig,
        inner: torch.optim.Optimizer,
        flats: list[FlatParamBuffer],
        masters: list[MasterShard],
        frozen_flats: list[FlatParamBuffer],
        reducer: GradReducer,
        grads: KeepFullGrads | ShardGradsInBackward,
        scheduler: UnitScheduler | None,
        layout_digest: str,
        meta_build: MetaBuild | None,
        offload: OffloadTier | None,
        source_dtypes: dict[str, torch.dtype],
        params_tier: ShardTier | None = None,
    ) -> None:
        self.group = group
        self.config = config
        self.inner = inner
        self.flats = flats
        self.masters = masters
        self.frozen_flats = frozen_flats
        self.reducer = reducer
        self.grads = grads
        self.layout_digest = layout_digest
        self.offload = offload
        self.params_tier = params_tier
        self.source_dtypes = source_dtypes
        self._meta_build = meta_build
        # Weak: see the module docstring (the model's hooks keep the scheduler alive).
        self._model = weakref.ref(model)
        self._scheduler = None if scheduler is None else weakref.ref(scheduler)

    @property
    def meta_build(self) -> MetaBuild | None:
        """A meta build's `MetaBuild` until its first forward passes its check, else None."""
        build = self._meta_build
        return None if build is None or build.checked else build

    def mark_loaded(self, names: list[str] | None) -> None:
        """Loading wrote ``names`` (``None``: every parameter and persistent buffer): a meta
        build no longer waits for them (`zerolite.params.meta_init.MetaBuild`)."""
        build = self.meta_build
        if build is not None:
            build.loaded(names)

    @property
    def model(self) -> nn.Module | None:
        """The sharded model (None once it was garbage-collected)."""
        return self._model()

    @property
    def scheduler(self) -> UnitScheduler | None:
        """Stage 3's `UnitScheduler` (None in stages 1-2, or once the model is gone)."""
        return None if self._scheduler is None else self._scheduler()

    def pieces(self) -> Iterator[Piece]:
        """This rank's piece of every trained parameter: buffer by buffer, in layout order."""
        return pieces_of(self.masters, self.inner.state, self.offload, self.inner.param_groups)

    def frozen_pieces(self) -> Iterator[FrozenPiece]:
        """Stage 3: this rank's piece of every frozen parameter, in layout order."""
        for flat in self.frozen_flats:
            for span in flat.spans:
                yield FrozenPiece(
                    name=flat.names[span.index],
                    index=span.index,
                    param_start=span.param_start,
                    param_end=span.param_end,
                    flat=flat,
                    span=span,
                    shard=flat.shard[span.shard_start : span.shard_start + span.numel],
                )

    @property
    def num_units(self) -> int:
        """Stage 3: how many units `gather` takes (the root last); 0 in stages 1-2."""
        scheduler = self.scheduler
        return 0 if scheduler is None else len(scheduler.flats)

    @contextlib.contextmanager
    def gather(self, unit: int) -> Iterator[list[FlatParamBuffer]]:
        """Stage 3: unit ``unit``'s parameters hold their full, current values in the block.

        Yields the unit's flat buffers (trained, then frozen). A unit that was not
        gathered on entry is freed on exit; one that was (a forward in progress) stays.
        Every rank must enter, for the same units in the same order (each is an
        all-gather).
        """
        scheduler = self.scheduler
        if scheduler is None:
            raise RuntimeError(
                "ShardState.gather() is for stage 3, whose parameters are sharded; in stages "
                "1-2 every parameter is always full"
            )
        scheduler.refresh_stale(unit)
        was_gathered = scheduler.is_unsharded(unit)
        scheduler.unshard(unit)
        try:
            yield scheduler.flats[unit]
        finally:
            if not was_gathered:
                scheduler.reshard(unit)

    @contextlib.contextmanager
    def resident(self, writes: bool = False) -> Iterator[None]:
        """Every parameter and gradient shard in memory for the block (with
        ``offload_params`` they are parked between uses; no-op otherwise), parked again
        on exit, written back if ``writes`` (the block changes them). Local to this rank."""
        if self.params_tier is None:
            yield
            return
        with self.params_tier.resident(writes):
            yield

    def publish(self) -> None:
        """Make the parameters show masters and shards written outside a step (a load).

        Frees stage-3 units that were gathered (their full copies predate the write),
        casts the masters into the parameter shards and all-gathers replicated (stage
        1-2) buffers. Every rank must call.
        """
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.reshard_all()
        with self.resident(writes=True):
            for master in self.masters:
                master.write_back()
        gathers = [m.flat.all_gather() for m in self.masters if m.flat.replicated]
        for gather in gathers:
            gather.wait()


# id(model) -> (weak reference to the model, its state, the optimizer shard() returned).
# Like a `weakref.WeakKeyDictionary`, an entry goes when its model does, but keyed by
# identity: a module class may define ``__eq__`` (two equal models are still two models) or
# be unhashable. The entry keeps that optimizer alive as long as the model: its loss scale
# and step bookkeeping describe the shard state they live beside.
_REGISTRY: dict[int, tuple[weakref.ref[nn.Module], ShardState, object]] = {}


def register(model: nn.Module, state: ShardState, optimizer: object) -> None:
    """Record ``state`` as ``model``'s, keeping ``optimizer`` (the `ShardedOptimizer` that
    wraps it) alive with the model (by `zerolite.shard`, once)."""
    key = id(model)

    def forget(ref: weakref.ref[nn.Module]) -> None:
        if _REGISTRY.get(key, (None,))[0] is ref:  # not a later model given the same id
            del _REGISTRY[key]

    _REGISTRY[key] = (weakref.ref(model, forget), state, optimizer)


def state_of(model: object) -> ShardState | None:
    """``model``'s `ShardState`, or None if `zerolite.shard` never sharded it."""
    entry = _REGISTRY.get(id(model))
    if entry is None or entry[0]() is not model:
        return None
    return entry[1]


def require_state(model: object, caller: str, fix: str = "") -> ShardState:
    """``model``'s `ShardState`; else ``ValueError("{caller} needs a model sharded ...{fix}")``."""
    state = state_of(model)
    if state is None:
        raise ValueError(f"{caller} needs a model sharded by zerolite.shard(){fix}")
    return state
