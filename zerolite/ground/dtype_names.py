"""The one table of dtype names a `ZeroConfig` accepts, wherever a dtype is given.

``ZeroConfig(param_dtype="bf16")``, ``ZEROLITE_PARAM_DTYPE=bf16`` and ``zerolite plan
--param-dtypes bf16`` read their names here, and ``zerolite plan`` writes them from here
(`dtype_text`), so what one prints another reads back. A name is forgiven its case,
surrounding whitespace and a ``torch.`` prefix (``"torch.bfloat16"``, ``" BF16 "``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ALLOWED_DTYPES", "DTYPE_NAMES", "accepted_names", "as_dtype", "dtype_from_name", "dtype_text",
]

ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Each allowed dtype under the names users write: torch's own (``float32``, ``float``,
# ``half``), the short ones of Accelerate's ``mixed_precision`` and DeepSpeed (``fp32``,
# ``bf16``, ``fp16``). The first name of each dtype is torch's, the one written back.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def accepted_names() -> str:
    """The names, comma-separated, for error messages."""
    return ", ".join(repr(name) for name in DTYPE_NAMES)


def dtype_from_name(value: Any) -> torch.dtype | None:
    """The allowed dtype ``value`` names (a `str` as the module docstring says), or None
    when it names none (any other type, an unknown name, ``"float64"``)."""
    if not isinstance(value, str):
        return None
    return DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))


def as_dtype(value: Any) -> torch.dtype | None:
    """``value`` if it is an allowed dtype, the dtype it names if it is a name of one, else
    None (None included): what `ZeroConfig` stores for a dtype field."""
    if isinstance(value, torch.dtype):
        return value if value in ALLOWED_DTYPES else None
    return dtype_from_name(value)


def dtype_text(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` without ``torch.`` (``"bfloat16"``), which
    `dtype_from_name` reads back."""
    return str(dtype).removeprefix("torch.")
