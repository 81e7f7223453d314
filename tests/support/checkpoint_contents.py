"""A checkpoint's contents, read back whole from its files (tests only; single process).

- `full_state`: every parameter's fp32 master and optimizer state, reassembled from the
  saved element ranges whatever setup wrote them, so two checkpoints of the same state
  under different setups compare equal bit for bit. Per-element state is joined in
  element order; 0-dim state (Adam's ``step``) must agree across a parameter's pieces;
  state of another shape (Adafactor's factors of a whole owned tensor) is kept as saved.
- `residual_mass`: what the error-feedback residuals owe the mean gradient, per parameter
  element (`zerolite.checkpoint.residual_fold`'s weights: ``1/W`` within a shard group,
  ``1/R`` and ``1`` for the cross-node phases).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from zerolite import checkpoint as ckpt

__all__ = ["full_state", "residual_mass"]

_RANGE = re.compile(r"^(?P<head>.+)/(?P<start>\d+)-(?P<end>\d+)$")
_RESIDUAL = re.compile(r"^residual(?:@replica\d+)?/(?P<name>.+)$|"
                       r"^residual-across@replica\d+/(?P<phase>send|gather)/(?P<cname>.+)$")


def _ranges(path: Path):
    """(key without its range, start, end, tensor) of every ranged tensor in the files."""
    index = ckpt.verify(path)
    for entry in index["files"]:
        with safe_open(path / entry["file"], framework="pt") as f:
            for key in f.keys():
                if (match := _RANGE.match(key)) is not None:
                    yield match["head"], int(match["start"]), int(match["end"]), f.get_tensor(key)


def full_state(path: Path) -> dict[str, torch.Tensor]:
    """``master/{name}`` and ``state/{key}/{name}`` -> the whole tensor (see the module
    docstring); raises AssertionError where the pieces overlap, leave holes or disagree."""
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
    for head, start, end, tensor in _ranges(path):
        if head.startswith(("master/", "state/")):
            pieces[head].append((start, end, tensor))
    out = {}
    for head, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        if all(t.dim() == 0 for _, _, t in parts):
            assert all(torch.equal(t, parts[0][2]) for _, _, t in parts), (path, head)
            out[head] = parts[0][2]
        elif all(t.dim() == 1 and t.numel() == e - s for s, e, t in parts):
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), (path, head)
            out[head] = torch.cat([t for _, _, t in parts])
        else:
            for s, e, t in parts:
                out[f"{head}/{s}-{e}"] = t
    return out


def residual_mass(path: Path) -> dict[str, torch.Tensor]:
    """Parameter name -> fp64 per element: the saved residuals, weighted by what their
    exchange divides them by."""
    index = ckpt.verify(path)
    replicas = index.get("replicas", 1)
    world = index["world_size"] * replicas
    numel = {p["name"]: int(torch.Size(p["shape"]).numel()) for p in index["params"]}
    weight = {None: 1 / world, "send": 1 / replicas, "gather": 1.0}
    out: dict[str, torch.Tensor] = {}
    for head, start, end, tensor in _ranges(path):
        if (match := _RESIDUAL.match(head)) is None:
            continue
        name = match["name"] or match["cname"]
        mass = out.setdefault(name, torch.zeros(numel[name], dtype=torch.float64))
        mass[start:end] += weight[match["phase"]] * tensor.double()
    return out
