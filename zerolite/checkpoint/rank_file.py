"""What one rank writes into a checkpoint: its tensors, and its file's entry in the index.

`rank_file` walks the shard state's views once (`ShardState.pieces` and
`ShardState.frozen_pieces`); a synchronous save writes the tensors straight from memory,
an asynchronous one copies them into its `zerolite.checkpoint.staging.StagingArea` first.
`model_only_tensors` and `state_dict_names` are shared with `load`, `load_pretrained` and
`zerolite.full_state_dict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zerolite.checkpoint.format import (
    FORMAT,
    frozen_key,
    master_key,
    model_key,
    shard_file,
    state_key,
)
from zerolite.checkpoint.groups import piece_groups
from zerolite.optim.sharded_optimizer import ShardedOptimizer

__all__ = ["RankFile", "model_only_tensors", "rank_file", "state_dict_names"]


@dataclasses.dataclass
class RankFile:
    """One rank's shard file: its name, tensors by key, and what its index entry records.

    Attributes:
        file: ``rank-R-of-N.safetensors``.
        tensors: key (`zerolite.checkpoint.format`) -> tensor, any device.
        pieces, frozen_pieces: ``[name, start, end]`` of every master and frozen piece.
        groups: ``{parameter name: param group}`` of this rank's pieces.
    """

    file: str
    rank: int
    tensors: dict[str, torch.Tensor]
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
    RNG states, which are read into new tensors."""
    tensors: dict[str, torch.Tensor] = {}
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
        tensors[master_key(name, start, end)] = piece.master.detach().reshape(-1)
        for key, value in piece.state.items():
            if isinstance(value, torch.Tensor):
                per_element = value.dim() > 0 and value.shape == piece.master.shape
                tensors[state_key(key, name, start, end)] = (
                    value.detach().reshape(-1) if per_element else value.detach()
                )
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    if opt.group.rank == 0:
        for name, tensor in model_only_tensors(model, opt).items():
            tensors[model_key(name)] = tensor.detach()
    return RankFile(
        file=shard_file(opt.group.rank, opt.group.size),
        rank=opt.group.rank,
        tensors=tensors,
        pieces=pieces,
        frozen_pieces=frozen_pieces,
        groups=piece_groups(opt),
    )


def model_only_tensors(model: nn.Module, opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """Buffers and the parameters zerolite does not shard (outside the optimizer; frozen
    ones in stages 1-2), by state-dict name: saved whole by rank 0."""
    managed = {id(p) for flat in [*opt.flats, *opt.frozen_flats] for p in flat.params}
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


