"""Each `ZeroConfig` field's environment variable, its parser, and the allowed values.

`ZeroConfig.__post_init__` fills a field the caller did not pass from its ``ZEROLITE_*``
variable (parsed here, with a `ValueError` naming the variable's field), else its default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Unset:
    """Marks a field the caller did not pass, so the environment may fill it."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def _parse_dtype(field: str, raw: str) -> torch.dtype:
    key = raw.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not a dtype; "
            f"use one of {sorted(_DTYPES)}"
        )
    return _DTYPES[key]


def _parse_bool(field: str, raw: str) -> bool:
    key = raw.strip().lower()
    if key in ("1", "true", "yes", "on"):
        return True
    if key in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"ZeroConfig.{field}: environment value {raw!r} is not a boolean (use 0 or 1)")


def _parse_number(field: str, raw: str, kind: type) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"ZeroConfig.{field}: environment value {raw!r} is not a {kind.__name__}"
        ) from None


def _parse_device(raw: str) -> torch.device:
    try:
        return torch.device(raw.strip())
    except (RuntimeError, TypeError):
        raise ValueError(
            f"ZeroConfig.device: environment value {raw!r} is not a device; use e.g. 'cpu' or "
            "'cuda:0'"
        ) from None


def _parse_group_size(raw: str) -> int | str | None:
    key = raw.strip().lower()
    if key in ("", "none"):
        return None
    if key == "node":
        return "node"
    try:
        return int(key)
    except ValueError:
        raise ValueError(
            f"ZeroConfig.shard_group_size: environment value {raw!r} is not 'none', 'node' or an "
            "int"
        ) from None


# field -> (environment variable, parser of its text, default)
ENV_FIELDS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "stage": ("ZEROLITE_STAGE", lambda s: _parse_number("stage", s, int), 2),
    "param_dtype": (
        "ZEROLITE_PARAM_DTYPE",
        lambda s: _parse_dtype("param_dtype", s),
        torch.float32,
    ),
    "reduce_dtype": (
        "ZEROLITE_REDUCE_DTYPE",
        lambda s: None if s.strip().lower() in ("", "none") else _parse_dtype("reduce_dtype", s),
        None,
    ),
    "bucket_size_mb": (
        "ZEROLITE_BUCKET_SIZE_MB",
        lambda s: _parse_number("bucket_size_mb", s, float),
        25.0,
    ),
    "device": ("ZEROLITE_DEVICE", _parse_device, None),
    "prefetch": ("ZEROLITE_PREFETCH", lambda s: _parse_number("prefetch", s, int), 1),
    "reshard_after_forward": (
        "ZEROLITE_RESHARD_AFTER_FORWARD",
        lambda s: _parse_bool("reshard_after_forward", s),
        True,
    ),
    "collectives": ("ZEROLITE_COLLECTIVES", lambda s: s.strip().lower(), "auto"),
    "timeout_s": ("ZEROLITE_TIMEOUT_S", lambda s: _parse_number("timeout_s", s, float), 600.0),
    "partition": ("ZEROLITE_PARTITION", lambda s: s.strip().lower(), "auto"),
    "offload": (
        "ZEROLITE_OFFLOAD",
        lambda s: None if s.strip().lower() in ("", "none") else s.strip().lower(),
        None,
    ),
    "offload_dir": ("ZEROLITE_OFFLOAD_DIR", lambda s: s or None, None),
    "offload_fraction": (
        "ZEROLITE_OFFLOAD_FRACTION",
        lambda s: _parse_number("offload_fraction", s, float),
        1.0,
    ),
    "quantize_gather": (
        "ZEROLITE_QUANTIZE_GATHER",
        lambda s: _parse_bool("quantize_gather", s),
        False,
    ),
    "quantize_reduce": (
        "ZEROLITE_QUANTIZE_REDUCE",
        lambda s: _parse_bool("quantize_reduce", s),
        False,
    ),
    "quant_block": ("ZEROLITE_QUANT_BLOCK", lambda s: _parse_number("quant_block", s, int), 256),
    "quantize_skip": (
        "ZEROLITE_QUANTIZE_SKIP",
        lambda s: tuple(name.strip() for name in s.split(",") if name.strip()),
        (),
    ),
    "error_feedback": (
        "ZEROLITE_ERROR_FEEDBACK",
        lambda s: _parse_bool("error_feedback", s),
        True,
    ),
    "shard_group_size": ("ZEROLITE_SHARD_GROUP_SIZE", lambda s: _parse_group_size(s), None),
}

# quant_block bounds: a block's fp32 scale costs 4/quant_block bytes per element.
QUANT_BLOCK_RANGE = (16, 1 << 20)

COLLECTIVES = ("auto", "native", "point_to_point")
PARTITIONS = ("flat", "tensor", "auto")
OFFLOAD_TIERS = (None, "disk", "host")
