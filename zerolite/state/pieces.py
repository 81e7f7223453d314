"""This rank's pieces: its part of each parameter, with the fp32 master and optimizer state.

A *piece* is the intersection of one parameter with this rank's shard of its flat buffer
(`zerolite.plan.layout`). `Piece` is what the rest of zerolite reads and writes per piece --
checkpoints, state dicts, loads, estimates -- through
`zerolite.state.shard_state.ShardState.pieces`, never by re-deriving ranges: its element
range in the parameter, its fp32 master (the tensor the user's optimizer steps), its
optimizer state, and, when offloaded, the tier that holds them. `FrozenPiece` is the same
for a frozen parameter sharded in stage 3 (no master, no state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.plan.layout import Span
from zerolite.state.master import MasterShard
from zerolite.state.offload import OffloadTier
from zerolite.state.state_device import loaded_state

__all__ = ["FrozenPiece", "Piece", "pieces_of"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """This rank's piece of one trained parameter.

    Attributes:
        name: the parameter's name in its flat buffer (the first of tied names).
        index: the parameter's position in ``flat``.
        param_start, param_end: the piece's element range in the flattened parameter.
        flat: the flat buffer holding the parameter.
        span: where the piece lies in ``flat`` and in this rank's shard of it.
        master: fp32, ``param_end - param_start`` elements: the piece's master view, a
            tensor of the optimizer's param groups; 1-D, or in the parameter's shape under
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
    span: Span
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
        """Replace the master's values (fp32, 1-D or in the master's shape); see `write`."""
        if not self.master_offloaded:
            self.master.copy_(values)
            return
        self.tier.write(self.slot, "master", 0, values)  # type: ignore[union-attr]
        # publish() casts only the resident masters into the parameter shard: this one now.
        start = self.span.shard_start
        self.flat.shard[start : start + self.span.numel].copy_(values.reshape(-1))

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
        name, index, param_start, param_end, flat, span: as in `Piece`.
        shard: the piece's values, a 1-D view of ``flat.shard`` (``flat.data.dtype``).
    """

    name: str
    index: int
    param_start: int
    param_end: int
    flat: FlatParamBuffer
    span: Span
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
    param_group_of = {id(t): g for g in param_groups for t in g["params"]}
    for b, master in enumerate(masters):
        flat = master.flat
        for j, (span, view) in enumerate(zip(flat.spans, master.views)):
            slot = None if tier is None else tier.slot_of(b, j)
            yield Piece(
                name=flat.names[span.index],
                index=span.index,
                param_start=span.param_start,
                param_end=span.param_end,
                flat=flat,
                span=span,
                master=view,
                state=optimizer_state.get(view, {}),
                tier=None if slot is None else tier,
                slot=-1 if slot is None else slot,
                optimizer_state=optimizer_state,
                param_group=param_group_of.get(id(view)),
            )
