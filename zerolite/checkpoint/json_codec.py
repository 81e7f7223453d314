"""Lossless, typed JSON for what a checkpoint index holds besides tensors.

Scheduler states and the user's ``extra`` go into ``index.json``. Plain JSON loses types
silently: ``MultiStepLR.milestones`` is a ``Counter`` with int keys, which comes back as
a dict with string keys (the scheduler then never decays); tuples come back as lists;
``inf`` is not JSON at all. `encode` keeps plain JSON where it is exact (str-keyed dicts,
lists, str, int, bool, None, finite floats) and tags everything else with a ``"$type"``
entry; `decode` inverts it exactly. A value that cannot round-trip is refused at encode
with a `ValueError` naming where it is (``extra['run']['obj']``). No pickle, no eval:
decoding builds only the types listed below.

=================  ==============================================================
Python             JSON
=================  ==============================================================
``float('inf')``   ``{"$type": "float", "value": "inf"}`` (also ``-inf``, ``nan``)
``tuple``          ``{"$type": "tuple", "items": [...]}``
``dict`` with a    ``{"$type": "dict", "items": [[key, value], ...]}`` (keys
non-str key        encoded too; also used when a key is ``"$type"``)
``Counter``,       ``{"$type": "Counter" | "OrderedDict", "items": [[key, value], ...]}``
``OrderedDict``
``torch.Tensor``   ``{"$type": "tensor", "dtype": "float32", "shape": [...],
                   "values": [...]}`` (CPU; e.g. a tensor learning rate)
=================  ==============================================================
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any

import torch

__all__ = ["decode", "encode"]

TAG = "$type"
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_MAPPINGS: dict[str, type] = {"dict": dict, "Counter": Counter, "OrderedDict": OrderedDict}
# Tensors stored in the index hold a few numbers (a learning rate), not weights.
_MAX_TENSOR_NUMEL = 4096


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON data that `decode` turns back into an equal value of the same types.

    Args:
        value: None, bool, int, float, str, list, tuple, dict / Counter / OrderedDict
            (keys of these types too) or a small tensor, nested freely.
        where: how the caller names ``value`` (``"extra"``), for error messages.
    Returns:
        Data that ``json.dumps(..., allow_nan=False)`` accepts.
    Raises:
        ValueError: a value of another type (or a subclass, e.g. a namedtuple, whose type
            would be lost), naming its place, e.g. ``extra['run'][2]``.
    """
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {
            TAG: "float",
            "value": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"),
        }
    if kind is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return {TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if kind in (dict, Counter, OrderedDict):
        if kind is dict and all(type(k) is str for k in value) and TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        if any(isinstance(k, torch.Tensor) for k in value):
            raise ValueError(
                f"{where}: tensor keys (hashed by identity) cannot round-trip; use numbers"
            )
        items = [
            [encode(k, f"{where} (key {k!r})"), encode(v, f"{where}[{k!r}]")]
            for k, v in value.items()
        ]
        return {TAG: kind.__name__, "items": items}
    if kind is torch.Tensor:
        return _encode_tensor(value, where)
    raise ValueError(
        f"{where}: a {kind.__module__}.{kind.__qualname__} value ({_short(value)}) cannot be "
        "stored"
        "exactly in the checkpoint's JSON index; use None, bool, int, float, str, list, tuple, "
        "dict, Counter, OrderedDict or a small tensor (convert it, e.g. to a dict of numbers)"
    )


def decode(data: Any, where: str) -> Any:
    """The value `encode` was given for ``data`` (parsed JSON).

    Raises:
        ValueError: ``data`` is not what `encode` writes (an unknown ``"$type"`` or a
            malformed entry), naming its place.
    """
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    if TAG not in data:
        return {k: decode(v, f"{where}[{k!r}]") for k, v in data.items()}
    kind = data[TAG]
    try:
        if kind == "float":
            return _NONFINITE[data["value"]]
        if kind == "tuple":
            return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(data["items"]))
        if kind in _MAPPINGS:
            mapping = _MAPPINGS[kind]()  # filled item by item: Counter(pairs) would count them
            for k, v in data["items"]:
                key = decode(k, f"{where} (key)")
                mapping[key] = decode(v, f"{where}[{key!r}]")
            return mapping
        if kind == "tensor":
            values = [decode(v, where) for v in data["values"]]
            return torch.tensor(values, dtype=getattr(torch, data["dtype"])).reshape(data["shape"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(
            f"{where}: malformed {kind!r} entry in the checkpoint index ({exc})"
        ) from None
    raise ValueError(
        f"{where}: unknown {TAG} {kind!r} in the checkpoint index (written by a newer zerolite?)"
    )


def _encode_tensor(value: torch.Tensor, where: str) -> dict[str, Any]:
    if value.is_complex() or value.numel() > _MAX_TENSOR_NUMEL or value.requires_grad:
        raise ValueError(
            f"{where}: a {value.dtype} tensor of shape {list(value.shape)} does not belong in the "
            f"checkpoint's JSON index (at most {_MAX_TENSOR_NUMEL} real elements, no "
            "requires_grad); "
            "keep tensors in the model or optimizer"
        )
    flat = value.detach().reshape(-1).cpu().tolist()
    return {
        TAG: "tensor",
        "dtype": str(value.dtype).removeprefix("torch."),
        "shape": list(value.shape),
        "values": [encode(v, where) for v in flat],
    }


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."
