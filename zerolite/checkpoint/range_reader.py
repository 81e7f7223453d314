"""Reading this rank's ranges of saved tensors, at any world size and layout.

`RangeReader` reads element ranges of one parameter's saved tensors across the shard
files that hold them (``get_slice`` reads part of a tensor without loading the rest);
`PieceReader` reads a whole master piece -- values and optimizer state -- for `load`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zerolite.checkpoint.format import CheckpointError, master_key, state_key
from zerolite.state.pieces import Piece

__all__ = ["PieceReader", "RangeReader", "state_keys"]


class RangeReader:
    """Reads element ranges of one parameter's saved tensors across files."""

    def __init__(self, path: Path, index: dict[str, Any], field: str = "pieces") -> None:
        self.path = path
        self.ranges: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        for entry in index["files"]:
            for name, start, end in entry.get(field, []):
                self.ranges[name].append((entry["file"], start, end))

    def read(
        self, key_of: Any, name: str, start: int, end: int, scalar: bool = False
    ) -> torch.Tensor:
        """Elements [start, end) of ``name``'s tensor ``key_of(name, s, e)``; 0-dim if
        ``scalar``."""
        # Every returned tensor is a copy in its own storage: a safetensors slice is a view
        # of the whole saved tensor (mapped from the file), which optimizer state would
        # otherwise keep alive -- the saved shard's size, not this rank's piece.
        parts: list[torch.Tensor] = []
        covered = start
        for file, s, e in self.ranges[name]:
            if (s, e) == (start, end):  # saved as this very piece: whole, in its saved shape
                with safe_open(self.path / file, framework="pt") as f:
                    key = key_of(name, s, e)
                    if key not in f.keys():
                        raise CheckpointError(f"{self.path / file}: no tensor {key!r}")
                    return f.get_tensor(key).clone()
        for file, s, e in sorted(self.ranges[name], key=lambda r: r[1]):
            lo, hi = max(start, s), min(end, e)
            if lo >= hi:
                continue
            if lo != covered:
                break
            # One handle per read: an open handle maps the file (docs/design.md on RSS).
            with safe_open(self.path / file, framework="pt") as f:
                key = key_of(name, s, e)
                if key not in f.keys():
                    raise CheckpointError(f"{self.path / file}: no tensor {key!r}")
                if scalar:
                    return f.get_tensor(key).clone()
                parts.append(f.get_slice(key)[lo - s : hi - s].clone())
            covered = hi
        if covered != end or not parts:
            raise CheckpointError(
                f"parameter {name!r}: elements [{covered}, {end}) are in no rank file"
            )
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class PieceReader:
    """Reads this rank's master pieces (values and optimizer state) from the files."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.reader = RangeReader(path, index)
        self.keys = state_keys(path, index)

    def read(self, piece: Piece) -> tuple[torch.Tensor, dict]:
        """The piece's fp32 values (in the master's shape) and optimizer state.

        Raises:
            CheckpointError: the saved state of a parameter has a shape of its own (not one
                value per element, e.g. Adafactor's row and column factors of a matrix
                stepped whole under ``partition="tensor"``) and this layout cuts the
                parameter into pieces or flattens it: it has no per-element meaning here."""
        name, s, e = piece.name, piece.param_start, piece.param_end
        shape = piece.master.shape  # 1-D, or the parameter's under whole-tensor ownership
        values = self.reader.read(master_key, name, s, e).float().view(shape)
        state = {}
        for key, kind in self.keys.get(name, {}).items():
            if kind == SHAPED:
                self._check_whole(piece, key)
            value = self.reader.read(
                lambda n, a, b, k=key: state_key(k, n, a, b), name, s, e, scalar=kind == SCALAR
            )
            # Per-element state is saved flat; state of its own shape comes back as saved.
            per_element = kind == ELEMENT and value.dim() == 1 and value.numel() == e - s
            state[key] = value.view(shape) if per_element else value
        return values, state

    @staticmethod
    def _check_whole(piece: Piece, key: str) -> None:
        param_shape = piece.flat.shapes[piece.index]
        if piece.master.shape == param_shape:  # stepped whole, as it was saved
            return
        raise CheckpointError(
            f"parameter {piece.name!r}: its saved optimizer state {key!r} has a shape of its "
            "own (the optimizer stepped the parameter whole, under partition='tensor'), "
            "which has no per-element meaning when the parameter is cut into flat pieces; "
            "load it with ZeroConfig(partition='tensor') (any world size and stage that "
            "accept it), or restart the optimizer from the saved weights: "
            "zerolite.checkpoint.consolidate(path, 'weights.safetensors') then "
            "zerolite.checkpoint.load_pretrained(model, ['weights.safetensors'])"
        )


SCALAR, ELEMENT, SHAPED = "scalar", "element", "shaped"


def state_keys(path: Path, index: dict[str, Any]) -> dict[str, dict[str, str]]:
    """name -> {state key: how it was saved}, from the first file holding each parameter:
    `SCALAR` (0-dim), `ELEMENT` (one value per element of its range, flat) or `SHAPED`
    (a shape of its own: state of a parameter stepped whole, read back whole)."""
    out: dict[str, dict[str, str]] = {}
    for entry in index["files"]:
        with safe_open(path / entry["file"], framework="pt") as f:
            for key in f.keys():
                if not key.startswith("state/"):
                    continue
                _, skey, rest = key.split("/", 2)
                name, span = rest.rsplit("/", 1)
                start, end = (int(x) for x in span.split("-"))
                dims = f.get_slice(key).get_shape()
                if not dims:
                    kind = SCALAR
                elif len(dims) == 1 and dims[0] == end - start:
                    kind = ELEMENT
                else:
                    kind = SHAPED
                out.setdefault(name, {}).setdefault(skey, kind)
    return out
