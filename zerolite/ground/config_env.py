"""How the text of a ``ZEROLITE_*`` variable becomes a `ZeroConfig` value; the allowed values.

Each field of `zerolite.config.ZeroConfig` names its variable and one parser of this module
where it is declared. A parser takes the field's name and the variable's text and raises a
`ValueError` naming both when it cannot read the text; what it reads is then validated like
an argument.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ALLOWED_DTYPES",
    "COLLECTIVES",
    "OFFLOAD_TIERS",
    "PARTITIONS",
    "QUANT_BLOCK_RANGE",
    "UNSET",
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

ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# quant_block bounds: a block's fp32 scale costs 4/quant_block bytes per element.
QUANT_BLOCK_RANGE = (16, 1 << 20)
COLLECTIVES = ("auto", "native", "point_to_point")
PARTITIONS = ("flat", "tensor", "auto")
OFFLOAD_TIERS = (None, "disk", "host")

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


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
    """``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16`` (case and a
    ``torch.`` prefix forgiven)."""
    key = raw.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not a dtype; "
            f"use one of {sorted(_DTYPES)}"
        )
    return _DTYPES[key]


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
