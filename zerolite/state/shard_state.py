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
import dataclasses
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerolite.state.state_device import loaded_state

if TYPE_CHECKING:
    from zerolite.comm.collectives import Group
    from zerolite.config import ZeroConfig
    from zerolite.grads.hooks import KeepFullGrads, ShardGradsInBackward
    from zerolite.grads.reducer import GradReducer
    from zerolite.optim.sharded_optimizer import ShardedOptimizer
    from zerolite.params.flat_buffer import FlatParamBuffer
    from zerolite.params.meta_init import MetaBuild
    from zerolite.params.unit_scheduler import UnitScheduler
    from zerolite.plan.layout import ParamPiece
    from zerolite.state.master import MasterShard
    from zerolite.state.offload import OffloadTier

__all__ = [
    "FrozenPiece",
    "Piece",
    "ShardState",
    "pieces_of",
    "register",
    "require_state",
    "state_of",
]


@dataclasses.dataclass(frozen=True)
class Piece:
    """This rank's piece of one trained parameter.

    Attributes:
        name: the parameter's name in its flat buffer (the first of tied names).
        index: the parameter's position in ``flat``.
        param_start, param_end: the piece's element range in the flattened parameter.
        flat: the flat buffer holding the parameter.
        offsets: where the piece lies in this rank's shard of ``flat``.
        master: fp32, ``param_end - param_start`` elements: the piece's master, a tensor
            of the optimizer's param groups; 1-D, or in the parameter's shape under
            whole-tensor ownership (then ``param_start == 0``, ``param_end == numel``).
        state: the optimizer's state of ``master`` (``{}`` before its first step). For an
            offloaded piece, only its scalar entries (``step``): read the rest with
            `read_state`.
        tier: the `OffloadTier` holding the piece's state (and 16-bit master, ``master``
            then being a meta placeholder), or None when it is resident.
        slot: the piece's slot in ``tier``.
        param_group: the optimizer's param group holding ``master`` (its ``fused`` /
            ``capturable`` flags decide where a loaded ``step`` goes), when known.

    Code that reads or writes values (checkpoints, loads) goes through `read_master`,
    `read_state` and `write`, which work for resident and offloaded pieces alike.
    """

    name: str
    index: int
    param_start: int
    param_end: int
    flat: FlatParamBuffer
    offsets: ParamPiece
    master: torch.Tensor
    state: dict[str, Any]
    tier: OffloadTier | None = None
    slot: int = -1
    optimizer_state: Mapping[Any, Any] | None = dataclasses.field(default=None, repr=False)
    param_group: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

    @property
    def master_offloaded(self) -> bool:
        """Whether the master lives on the tier (16-bit; ``master`` is a meta placeholder)."""
        return self.tier is not None and self.tier.has_master(self.slot)

    def write_master(self, values: torch.Tensor) -> None:
        """Replace the master's values (1-D fp32); see `write`."""
        if not self.master_offloaded:
            self.master.copy_(values)
            return
        assert self.tier is not None
        self.tier.write(self.slot, "master", 0, values)
        # publish() casts only the resident masters into the parameter shard: this one now.
        self.flat.shard[self.offsets.shard_start :][: self.offsets.numel].copy_(values)

    def read_master(self) -> torch.Tensor:
        """The piece's fp32 master values (1-D; a new CPU tensor when offloaded)."""
        if self.tier is not None and self.tier.has_master(self.slot):
            return self.tier.read(self.slot, "master", 0, self.param_end - self.param_start)
        return self.master.detach()

    def read_state(self) -> dict[str, Any]:
        """The piece's whole optimizer state (per-element entries read from the tier)."""
        if self.tier is None:
            return self.state
        return {**self.state, **self.tier.read_state(self.slot)}

    def write(self, master: torch.Tensor, state: dict[str, Any]) -> None:
        """Replace the piece's master values and optimizer state (a load). The parameters
        show the new masters after `ShardState.publish` (every rank must call it).

        State tensors go where torch's own ``load_state_dict`` puts them
        (`zerolite.state.state_device`): the master's device, except a ``step`` counter,
        which stays on the CPU unless the group is fused or capturable."""
        assert self.optimizer_state is not None
        target: Any = self.optimizer_state
        self.write_master(master)
        if self.tier is None:
            target[self.master] = loaded_state(state, self.master.device, self.param_group)
            return
        scalars = self.tier.write_state(self.slot, dict(state))
        device = self.tier.device  # (``master`` may be a meta placeholder)
        target[self.master] = loaded_state(scalars, device, self.param_group)


@dataclasses.dataclass(frozen=True)
class FrozenPiece:
    """Stage 3: this rank's piece of one frozen parameter (no master, no state).

    Attributes:
        name, index, param_start, param_end, flat, offsets: as in `Piece`.
        shard: the piece's values, a 1-D view of ``flat.shard`` (``flat.data.dtype``).
    """

    name: str
    index: int
    param_start: int
    param_end: int
    flat: FlatParamBuffer
    offsets: ParamPiece
    shard: torch.Tensor


def pieces_of(
    masters: list[MasterShard],
    optimizer_state: Mapping[Any, Any],
    tier: OffloadTier | None = None,
    param_groups: Iterable[Mapping[str, Any]] = (),
) -> Iterator[Piece]:
    """This rank's piece of every parameter of ``masters``' flat buffers, in layout order.

    `ShardState.pieces` with the state spelled out: `shard()` needs it before the state
    exists, to re-point the optimizer at the pieces (and before the offload tier exists).
    ``param_groups``: the optimizer's, to give each piece its group (`Piece.param_group`).
    """
    group_of = {id(t): g for g in param_groups for t in g["params"]}
    for b, master in enumerate(masters):
        flat = master.flat
        for j, (piece, tensor) in enumerate(zip(flat.pieces, master.pieces)):
            slot = None if tier is None else tier.slot_of(b, j)
            yield Piece(
                name=flat.names[piece.index],
                index=piece.index,
                param_start=piece.param_start,
                param_end=piece.param_end,
                flat=flat,
                offsets=piece,
                master=tensor,
                state=optimizer_state.get(tensor, {}),
                tier=None if slot is None else tier,
                slot=-1 if slot is None else slot,
                optimizer_state=optimizer_state,
                param_group=group_of.get(id(tensor)),
            )


class ShardState:
    """What `zerolite.shard` built for one model; one per sharded model.

    Attributes:
        group: zerolite's data-parallel group.
        config: the `ZeroConfig` the model was sharded with.
        inner: the user's optimizer (``param_groups`` hold the master pieces).
        flats: trained parameters' flat buffers, in gradient-bucket order
            (``config.param_dtype``; full, or this rank's shard in stage 3).
        masters: one `MasterShard` (fp32, this rank's shard) per entry of ``flats``.
        frozen_flats: stage 3: frozen parameters' flat buffers (sharded; no master).
        reducer: the `GradReducer` over one gradient bucket per entry of ``flats``.
        grads: the backward hooks feeding ``reducer`` (their ``_handles``).
        layout_digest: sha256 of what every rank agreed on at `shard()`.
        meta_build: a meta build's `MetaBuild` until its first forward passes, else None.
        offload: the `OffloadTier` (``config.offload`` set), else None.
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
        self.meta_build = meta_build
        self.offload: OffloadTier | None = None
        # Weak: see the module docstring (the model's hooks keep the scheduler alive).
        self._model = weakref.ref(model)
        self._scheduler = None if scheduler is None else weakref.ref(scheduler)
        # Weak too: the optimizer holds this state, and a cycle would outlive the model's
        # registry entry until the next garbage collection. The entry holds it strongly.
        self._optimizer: weakref.ref[ShardedOptimizer] | None = None

    @property
    def optimizer(self) -> ShardedOptimizer | None:
        """The `ShardedOptimizer` `shard()` returned (None until it is built)."""
        return None if self._optimizer is None else self._optimizer()

    @optimizer.setter
    def optimizer(self, value: ShardedOptimizer) -> None:
        self._optimizer = weakref.ref(value)

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
            for piece in flat.pieces:
                yield FrozenPiece(
                    name=flat.names[piece.index],
                    index=piece.index,
                    param_start=piece.param_start,
                    param_end=piece.param_end,
                    flat=flat,
                    offsets=piece,
                    shard=flat.shard[piece.shard_start : piece.shard_start + piece.numel],
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

    def publish(self) -> None:
        """Make the parameters show masters and shards written outside a step (a load).

        Frees stage-3 units that were gathered (their full copies predate the write),
        casts the masters into the parameter shards and all-gathers replicated (stage
        1-2) buffers. Every rank must call.
        """
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.reshard_all()
        for master in self.masters:
            master.write_back()
        gathers = [m.flat.all_gather() for m in self.masters if m.flat.replicated]
        for gather in gathers:
            gather.wait()


# id(model) -> (weak reference to the model, its state, its ShardedOptimizer). Like a
# `weakref.WeakKeyDictionary`, an entry goes when its model does, but keyed by identity: a
# module class may define ``__eq__`` (two equal models are still two models) or be
# unhashable. The entry keeps the optimizer alive as long as the model, as `shard()`
# promises (`gathered_parameters(model)` needs it after the user dropped theirs).
_REGISTRY: dict[int, tuple[weakref.ref[nn.Module], ShardState, object]] = {}


def register(model: nn.Module, state: ShardState) -> None:
    """Record ``state`` (and its ``optimizer``) as ``model``'s (by `zerolite.shard`, once)."""
    key = id(model)

    def forget(ref: weakref.ref[nn.Module]) -> None:
        if _REGISTRY.get(key, (None,))[0] is ref:  # not a later model given the same id
            del _REGISTRY[key]

    _REGISTRY[key] = (weakref.ref(model, forget), state, state.optimizer)


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
