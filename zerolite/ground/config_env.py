"""How the text of a ``ZEROLITE_*`` variable becomes a `ZeroConfig` value; the allowed values.

Each field of `zerolite.config.ZeroConfig` names its variable and one parser of this module
where it is declared. A parser takes the field's name and the variable's text and raises a
`ValueError` naming both when it cannot read the text; what it reads is then validated like
an argument. `env_text` is the way back: a value as the text its parser reads (what
``zerolite plan`` prints for ``accelerate launch``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerolite.ground.dtype_names import (
    ALLOWED_DTYPES,
    accepted_names,
    dtype_from_name,
    dtype_text,
)

__all__ = [
    "ALLOWED_DTYPES",
    "COLLECTIVES",
    "OFFLOAD_TIERS",
    "PARTITIONS",
    "QUANT_BLOCK_RANGE",
    "UNSET",
    "env_text",
    "parse_bool",
    "parse_choice",
    "parse_device",
    "parse_dtype",
    "parse_float",
    "parse_group_size",
    "parse_int",
    "parse_names",
    "parse_optional_choice",
    "parse_optional_dtype",
    "parse_path",
]

# quant_block bounds: a block's fp32 scale costs 4/quant_block bytes per element.
QUANT_BLOCK_RANGE = (16, 1 << 20)
COLLECTIVES = ("auto", "native", "point_to_point")
PARTITIONS = ("flat", "tensor", "auto")
OFFLOAD_TIERS = (None, "disk", "host")

class _Unset:
    """Marks a field the caller did not pass, so the environment may fill it."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def _none(raw: str) -> bool:
    return raw.strip().lower() in ("", "none")


def parse_int(field: str, raw: str) -> int:
    """An int, as ``int()`` reads it (``" 2 "``)."""
    return _number(field, raw, int)


def parse_float(field: str, raw: str) -> float:
    """A float, as ``float()`` reads it (``"0.5"``, ``"1e-3"``)."""
    return _number(field, raw, float)


def _number(field: str, raw: str, kind: type) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not "
            f"{'an integer' if kind is int else 'a number'}"
        ) from None


def parse_dtype(field: str, raw: str) -> torch.dtype:
    """A name of `zerolite.ground.dtype_names` (``bf16``, ``bfloat16``, ``fp32``, ``half``...;
    case and a ``torch.`` prefix forgiven)."""
    dtype = dtype_from_name(raw)
    if dtype is None:
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not a dtype; "
            f"use one of {accepted_names()}"
        )
    return dtype


def parse_optional_dtype(field: str, raw: str) -> torch.dtype | None:
    """A dtype as `parse_dtype`, or ``none`` (or nothing) for None."""
    return None if _none(raw) else parse_dtype(field, raw)


def parse_bool(field: str, raw: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``."""
    key = raw.strip().lower()
    if key in ("1", "true", "yes", "on"):
        return True
    if key in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"ZeroConfig.{field}: environment value {raw!r} is not a boolean (use 0 or 1)")


def parse_device(field: str, raw: str) -> torch.device:
    """A device string (``cpu``, ``cuda:0``)."""
    try:
        return torch.device(raw.strip())
    except (RuntimeError, TypeError):
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not a device; use e.g. 'cpu' or "
            "'cuda:0'"
        ) from None


def parse_choice(field: str, raw: str) -> str:
    """A choice, lower-cased and stripped (checked against the allowed ones afterwards)."""
    return raw.strip().lower()


def parse_optional_choice(field: str, raw: str) -> str | None:
    """A choice as `parse_choice`, or ``none`` (or nothing) for None."""
    return None if _none(raw) else raw.strip().lower()


def parse_path(field: str, raw: str) -> str | None:
    """A path as written; empty for None."""
    return raw or None


def parse_names(field: str, raw: str) -> tuple[str, ...]:
    """Comma-separated names, whitespace and empty entries dropped."""
    return tuple(name.strip() for name in raw.split(",") if name.strip())


def parse_group_size(field: str, raw: str) -> int | str | None:
    """``none`` (or nothing), ``node``, or an int."""
    key = raw.strip().lower()
    if key in ("", "none"):
        return None
    if key == "node":
        return "node"
    try:
        return int(key)
    except ValueError:
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not 'none', 'node' or an int"
        ) from None


def env_text(value: Any) -> str:
    """``value``, a `ZeroConfig` field's, as the text its variable's parser reads back to
    it: None as the empty text (every optional field's parser reads it as None; ``none``
    would be a directory's name to ``offload_dir``), a bool as ``1``/``0``, a dtype by name
    (``bfloat16``), names comma-separated, a path as written, anything else as ``str()``
    (ints, floats, choices, devices).

    Raises:
        ValueError: ``value`` has no text form (an object such as a process group, a
            callable, or classes: those fields have no variable).
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, torch.dtype):
        return dtype_text(value)
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, (str, int, float, torch.device, os.PathLike)):
        return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    raise ValueError(f"no ZEROLITE_* variable text for {value!r}")
