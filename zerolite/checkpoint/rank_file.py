"""What one rank writes into a checkpoint: its tensors, and its file's entry in the index.

`rank_file` walks the shard state's views once (`ShardState.pieces` and
`ShardState.frozen_pieces`); a synchronous save writes the tensors straight from memory,
an asynchronous one copies them into its `zerolite.checkpoint.staging.StagingArea` first.
An offloaded piece's tier-held values are `LazyTensor`s: read from the tier one tensor at
a time as they are written or staged, never all at once.
`model_only_tensors` and `state_dict_names` are shared with `load`, `load_pretrained` and
`zerolite.full_state_dict`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from zerolite.checkpoint.file_writer import LazyTensor
from zerolite.checkpoint.format import (
    FORMAT,
    frozen_key,
    master_key,
    model_key,
    rank_file_name,
    state_key,
)
from zerolite.checkpoint.param_groups import piece_param_groups
from zerolite.checkpoint.residuals import residual_tensors
from zerolite.ground import runtime
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.state.pieces import Piece
from zerolite.state.shard_state import ShardState

__all__ = ["RankFile", "model_only_tensors", "rank_file", "state_dict_names"]


@dataclasses.dataclass
class RankFile:
    """One rank's rank file: its name, tensors by key, and what its index entry records.

    Attributes:
        file: ``rank-R-of-N.safetensors``.
        tensors: key (`zerolite.checkpoint.format`) -> tensor, any device, or a
            `LazyTensor` (an offloaded piece's values, read when written).
        pieces, frozen_pieces: ``[name, start, end]`` of every master and frozen piece.
        groups: ``{parameter name: param group}`` of this rank's pieces.
    """

    file: str
    rank: int
    tensors: dict[str, torch.Tensor | LazyTensor]
    pieces: list[list]
    frozen_pieces: list[list]
    groups: dict[str, int]

    def record(self, size: int, sha256: str) -> dict[str, Any]:
        """The file's entry in ``index.json["files"]``, once written (``size`` bytes)."""
        return {
            "file": self.file,
            "rank": self.rank,
            "bytes": size,
            "sha256": sha256,
            "pieces": self.pieces,
            "frozen_pieces": self.frozen_pieces,
            "groups": self.groups,
        }

    @property
    def metadata(self) -> dict[str, str]:
        """The safetensors header's ``__metadata__``."""
        return {"format": FORMAT, "rank": str(self.rank)}


def rank_file(model: nn.Module, opt: ShardedOptimizer) -> RankFile:
    """What this rank writes now. The tensors are the live ones (not copied), except the
    RNG states, which are read into new tensors, and offloaded values (`LazyTensor`)."""
    tensors: dict[str, torch.Tensor | LazyTensor] = {}
    pieces: list[list] = []
    frozen_pieces: list[list] = []
    state = opt.shard_state
    for frozen in state.frozen_pieces():
        name, start, end = frozen.name, frozen.param_start, frozen.param_end
        frozen_pieces.append([name, start, end])
        tensors[frozen_key(name, start, end)] = frozen.shard
    for piece in state.pieces():
        name, start, end = piece.name, piece.param_start, piece.param_end
        pieces.append([name, start, end])
        # Flattened, so that any layout reads element ranges of it; state of another shape
        # than the master (Adafactor's row and column factors of a whole owned tensor) is
        # kept in its own shape and read back whole.
        if piece.tier is not None:
            tensors.update(_offloaded_tensors(piece))
            continue
        master = piece.read_master()
        tensors[master_key(name, start, end)] = master.reshape(-1)
        for key, value in piece.read_state().items():
            if isinstance(value, torch.Tensor):
                per_element = value.dim() > 0 and value.shape == master.shape
                tensors[state_key(key, name, start, end)] = (
                    value.detach().reshape(-1) if per_element else value.detach()
                )
    tensors.update(residual_tensors(opt))  # quantize_reduce's error feedback
    tensors["rng/cpu"] = torch.get_rng_state()
    device = opt.group.buffer_device
    own = runtime.rng_state(device)  # the generator of the model's own device, not the current one
    if own is not None:
        tensors[f"rng/{device.type}"] = own
    if opt.group.rank == 0:
        for name, tensor in model_only_tensors(model, state).items():
            tensors[model_key(name)] = tensor.detach()
    return RankFile(
        file=rank_file_name(opt.group.rank, opt.group.size),
        rank=opt.group.rank,
        tensors=tensors,
        pieces=pieces,
        frozen_pieces=frozen_pieces,
        groups=piece_param_groups(opt),
    )


def _offloaded_tensors(piece: Piece) -> dict[str, torch.Tensor | LazyTensor]:
    """An offloaded piece's tensors, as `rank_file` would have read them: the tier's fields
    (per-element state, flat; the 16-bit-offloaded master) lazily, the rest as they are."""
    tier, slot = piece.tier, piece.slot
    assert tier is not None
    name, start, end = piece.name, piece.param_start, piece.param_end
    numel = end - start

    def lazy(field: str) -> LazyTensor:
        read_into = functools.partial(tier.read_into, slot, field, 0)
        shape = tier.field_shape(slot, field)
        # As `rank_file` saves a resident piece: per-element state (the master's shape)
        # flat, other state (a whole owned tensor's factors) in its own shape.
        flat = shape == tuple(piece.master.shape)
        return LazyTensor(tier.field_dtype(slot, field), (numel,) if flat else shape, read_into)

    out: dict[str, torch.Tensor | LazyTensor] = {
        master_key(name, start, end):
            lazy("master") if piece.master_offloaded else piece.master.detach().reshape(-1)
    }
    for key, value in piece.state.items():  # the scalars (``step``)
        if isinstance(value, torch.Tensor):
            out[state_key(key, name, start, end)] = value.detach()
    if tier.initialized[slot]:  # else no per-element state yet (`OffloadTier.read_state`)
        for key in tier.state_keys(slot):
            out[state_key(key, name, start, end)] = lazy(key)
    return out


def model_only_tensors(model: nn.Module, state: ShardState) -> dict[str, torch.Tensor]:
    """Buffers and the parameters zerolite does not shard (outside the optimizer; frozen
    ones in stages 1-2), by state-dict name: saved whole by rank 0."""
    managed = {id(p) for flat in [*state.flats, *state.frozen_flats] for p in flat.params}
    out = {}
    for name, p in model.named_parameters():
        if id(p) not in managed:
            out[name] = p
    for name, b in model.named_buffers():
        out[name] = b
    return out


def state_dict_names(model: nn.Module) -> list[str]:
    """The keys ``model.state_dict()`` has, in its order, without reading any tensor."""
    names = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names += [dot + n for n, p in module._parameters.items() if p is not None]
        names += [
            dot + n for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
    return names


