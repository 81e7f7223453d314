"""``zerolite estimate``: per-rank memory of every stage, from a count or a real model.

Bad values raise `argparse.ArgumentTypeError` (while parsing) or `ValueError`;
`zerolite.cli` prints either as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerolite.config import ZeroConfig
from zerolite.memory.estimate import estimate
from zerolite.memory.footprint import MemoryBreakdown, offload_label
from zerolite.plan.optimizers import NAMED
from zerolite.plan.stages import STAGES

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _param_count(text: str) -> int:
    """``--params``: a whole number >= 1, written as 7.5e9 or 7500000000."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; give a whole number >= 1, e.g. 7.5e9"
        )
    return int(value)


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks; give an integer >= 1")
    return value


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=_param_count, help="number of parameters, e.g. 7.5e9")
    source.add_argument("--model", metavar="MODULE:FUNCTION",
                        help="a function returning an nn.Module, e.g. examples.gpt:GPT "
                             "(built on the meta device: no memory; counted exactly)")
    parser.add_argument("--world-size", type=_world_size, required=True)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                        help="parameter dtype (default bf16: the ZeRO paper's "
                             "mixed-precision accounting)")
    parser.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default=None,
                        help="gradient dtype (default: --dtype)")
    parser.add_argument("--shard-group-size", type=_world_size, default=None, metavar="K",
                        help="hybrid sharding: shard over groups of K ranks (e.g. the GPUs "
                             "per machine), replicate across them (default: all ranks)")
    # The names the estimator knows the state fields of: one registry, so the two cannot drift.
    parser.add_argument("--optimizer", default="adamw", choices=sorted(NAMED))
    parser.add_argument("--offload", choices=["disk", "host"], default=None,
                        help="optimizer state (and 16-bit masters) on this tier "
                             "(ZeroConfig.offload): shown as its own column")
    parser.add_argument("--offload-fraction", type=float, default=None,
                        help="with --offload: fraction of each rank's shard offloaded, in "
                             "(0, 1] (default 1)")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g}"


def load_function(spec: str, flag: str) -> Callable[..., Any]:
    """The function ``module:function`` names (``flag`` is the option, for messages).

    Raises:
        ValueError: naming ``spec`` and what went wrong (one line, no traceback).
    """
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"{flag} {spec!r}: expected MODULE:FUNCTION, a Python function "
                         "(e.g. examples.gpt:GPT); hub model ids are not downloaded")
    sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name!r} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is one line
        raise ValueError(f"{flag} {spec!r}: importing {module_name!r} raised "
                         f"{type(exc).__name__}: {exc}") from None
    function: Any = module
    for attr in function_name.split("."):
        function = getattr(function, attr, None)
    if not callable(function):  # a bad command-line value: ValueError, as for every argument
        raise ValueError(  # noqa: TRY004
            f"{flag} {spec!r}: module {module_name!r} has no function {function_name!r}"
        )
    return function


def _build_model(spec: str) -> nn.Module:
    """The model ``module:function`` returns, built on the meta device.

    Raises:
        ValueError: naming ``spec`` and what went wrong (one line, no traceback).
    """
    function = load_function(spec, "--model")
    function_name = spec.partition(":")[2]
    try:
        with torch.device("meta"):  # shapes are all the estimate needs: no memory, no init
            model = function()
    except Exception as exc:  # noqa: BLE001 - the user's function: any failure is one line
        raise ValueError(f"--model {spec!r}: {function_name}() raised "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {function_name}() returned "  # noqa: TRY004
                         f"{type(model).__name__}, not an nn.Module")
    return model


def run_estimate(args: argparse.Namespace) -> int:
    if args.offload_fraction is not None and args.offload is None:
        raise ValueError(
            f"--offload-fraction {args.offload_fraction:g} needs --offload disk or --offload "
            "host: without a tier nothing is offloaded"
        )
    fraction = 1.0 if args.offload_fraction is None else args.offload_fraction
    dtype = _DTYPES[args.dtype]
    reduce = _DTYPES[args.reduce_dtype] if args.reduce_dtype else None
    if args.model:
        subject = _build_model(args.model)
        count = sum(p.numel() for p in subject.parameters())
    else:
        subject = count = args.params
    hybrid = {} if args.shard_group_size is None else {"shard_group_size": args.shard_group_size}
    shards = f" sharded in groups of {args.shard_group_size}" if hybrid else ""
    print(f"{count:,} parameters, {args.world_size} ranks{shards}, {args.dtype} parameters, "
          f"{args.reduce_dtype or args.dtype} gradients, {args.optimizer}; decimal GB per rank")
    offload = args.offload
    if offload is not None:
        print(f"{fraction:g} of each rank's optimizer state offloaded: "
              f"'{offload_label(offload)}' (stages 1-3; DDP keeps it)")
    print(
        f"{'stage':8s} {'params':>8s} {'grads':>8s} {'master':>8s} {'optim':>8s} "
        f"{'model states':>13s} {'transient':>10s}" + (f" {offload:>9s}" if offload else "")
    )
    for stage, policy in STAGES.items():
        ddp = not policy.shards_optimizer_state  # DDP shards nothing: counted, not planned
        # The estimate only lays the tier out; the directory is checked by shard().
        config = ZeroConfig(
            stage=stage, param_dtype=dtype, reduce_dtype=reduce,
            offload=None if ddp else offload, offload_fraction=fraction,
            offload_dir=tempfile.gettempdir() if offload == "disk" else None, **hybrid,
        )
        target = count if ddp else subject
        b: MemoryBreakdown = estimate(
            target, world_size=args.world_size, config=config, optimizer=args.optimizer
        )
        label = f"{stage} (DDP)" if ddp else str(stage)
        print(
            f"{label:8s} {_gb(b.params):>8s} {_gb(b.grads):>8s} {_gb(b.master):>8s} "
            f"{_gb(b.optimizer_state):>8s} "
            f"{_gb(b.model_states):>13s} {_gb(b.transient) if b.transient else '-':>10s}"
            + (f" {_gb(b.offloaded):>9s}" if offload else "")
        )
    return 0
