"""Which dtype the parameters take, and how that recipe differs from the stock run's.

[Note: the model's own dtype] ``ZeroConfig.param_dtype=None`` (the default) keeps the dtype
the model was loaded in: when every parameter the optimizer trains shares one floating
dtype, the flat buffers take it (`resolve_param_dtype`). A model loaded in bf16 keeps bf16
parameters in memory and on disk, with fp32 master shards; an fp32 model trains in fp32,
which under Accelerate's or the Trainer's bf16 autocast is the host framework's own recipe.
A dtype the user sets is what was asked for, and every trained parameter takes it.

A stock run never changes a parameter's dtype, so where zerolite's recipe differs from what
the same script would do without zerolite, `shard()`'s one log line says so
(`describe_precision`): fp32 masters under 16-bit parameters, a cast nobody asked for, a
host framework's setting that zerolite reads differently. Where the user would not expect
the difference, the line is a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from zerolite.config import ZeroConfig
from zerolite.ground.config_env import ALLOWED_DTYPES

__all__ = ["HostPrecision", "describe_precision", "resolve_param_dtype"]


def resolve_param_dtype(
    managed: Sequence[tuple[str, nn.Parameter]], config: ZeroConfig
) -> torch.dtype:
    """The dtype of the flat buffers: ``config.param_dtype``, or the model's own.

    ``None`` means the model's own dtype: the one floating dtype every trained parameter
    (``managed``, as (name, param)) shares. A mixed-dtype model (a bf16 layer in an fp32
    model) would need a cast nobody asked for, and a float64 one cannot be sharded as it
    is: both are refused. (One flat buffer per dtype is not offered yet.)

    Raises:
        ValueError: naming one parameter of each dtype and the two ways out.
    """
    if config.param_dtype is not None:
        return config.param_dtype
    first: dict[torch.dtype, str] = {}
    for name, p in managed:
        first.setdefault(p.dtype, name)
    listed = ", ".join(f"{name!r} is {dtype}" for dtype, name in first.items())
    if len(first) > 1:
        raise ValueError(
            f"the optimizer's parameters have mixed dtypes ({listed}); zerolite keeps one "
            "dtype for all of them (ZeroConfig.param_dtype), and by default (None) the model's "
            "own only when they share one. Set ZeroConfig(param_dtype=...) to choose it (the "
            "masters stay fp32), or convert the model to one dtype before shard()"
        )
    dtype = next(iter(first))
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(
            f"the optimizer's parameters are {dtype} ({listed}); zerolite shards float32, "
            "bfloat16 or float16 parameters. Convert the model (model.float()) or set "
            "ZeroConfig(param_dtype=...) to have them cast before shard()"
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class HostPrecision:
    """What a host framework does around the model that `shard()` cannot see (set by the
    integrations, `zerolite.sharding.announcing_host`).

    Attributes:
        framework: whose loop it is: ``"Accelerate"`` or ``"Trainer"``.
        autocast: ``"bf16"`` or ``"fp16"`` when the framework's autocast wraps the model's
            forward, else None.
    """

    framework: str
    autocast: str | None = None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: set[torch.dtype]) -> str:
    return " and ".join(sorted(_name(d) for d in dtypes))


def describe_precision(
    config: ZeroConfig,
    param_dtype: torch.dtype,
    trained: Mapping[str, torch.dtype],
    cast_frozen: Mapping[str, torch.dtype],
    host: HostPrecision | None,
) -> tuple[str, int]:
    """The precision part of `shard()`'s log line, and the line's logging level.

    Args:
        config: the config `shard()` was given (``param_dtype`` None: the model's own; set
            but not `ZeroConfig.is_set`: filled by an integration from the host's fp16).
        param_dtype: the dtype the flat buffers took.
        trained: each trained parameter's dtype before `shard()`.
        cast_frozen: stage 3: each frozen parameter that `shard()` casts to
            ``param_dtype``, with its dtype before.
        host: the host framework's mixed precision, or None (a plain loop).
    Returns:
        ``(text, level)``: ``logging.WARNING`` where the recipe differs from the stock run's
        in a way the user did not ask for (a cast of frozen parameters that nobody chose,
        the host's fp16 read as fp16 parameters), else ``logging.INFO``.
    """
    name = _name(param_dtype)
    before = set(trained.values())
    own = before == {param_dtype}
    filled = config.param_dtype is not None and not config.is_set("param_dtype")
    surprising = False
    if param_dtype == torch.float32:
        plain = own and (host is None or host.autocast is None)
        text = "fp32" if plain else "fp32 parameters"
    else:
        text = f"{name} parameters"
    if config.param_dtype is None and param_dtype != torch.float32:
        text += " (the model's own dtype)"
    elif not own and (param_dtype == torch.float32 or filled):
        text += f" (the model's were {_names(before)})"
    if param_dtype != torch.float32:
        text += " with fp32 masters"
    if host is not None:
        recipe, surprising = _against_stock(config, param_dtype, own, filled, host)
        if host.autocast is not None:
            text += f" under {host.framework}'s {host.autocast} autocast"
        text += f" ({recipe})" if recipe else ""
    if cast_frozen:
        chosen = config.param_dtype is not None
        text += (
            f"; stage 3 holds {len(cast_frozen)} frozen parameters "
            f"({_names(set(cast_frozen.values()))}) in {name}"
            + ("" if chosen else ", the trained parameters' dtype: set ZeroConfig(param_dtype="
               f"torch.{_name(next(iter(cast_frozen.values())))}, reduce_dtype=torch.float32) "
               "to keep them as they are")
        )
        surprising = surprising or not chosen
    return text, logging.WARNING if surprising else logging.INFO


def _against_stock(
    config: ZeroConfig, param_dtype: torch.dtype, own: bool, filled: bool, host: HostPrecision
) -> tuple[str, bool]:
    """How the recipe compares with the stock ``host.framework`` run of the same model, and
    whether the user would not expect the difference."""
    framework = host.framework
    if own and param_dtype == torch.float32:
        return (f"{framework}'s own recipe" if host.autocast is not None else ""), False
    if own:  # a 16-bit model: the stock run steps its 16-bit parameters themselves
        return (f"the stock {framework} run steps the {_name(param_dtype)} parameters "
                "themselves; zerolite steps fp32 master shards"), False
    if filled:
        return (f"{framework}'s fp16 read as fp16 parameters with zerolite's loss scaler; "
                "the stock run keeps the model's parameters under the autocast"), True
    if param_dtype == torch.float32:
        return "ZeroConfig.param_dtype", False
    return "zerolite's 16-bit recipe, ZeroConfig.param_dtype", False
