"""``zerolite estimate``: per-rank memory of every stage, from a count or a real model."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

from zerolite.config import ZeroConfig
from zerolite.memory.estimate import estimate
from zerolite.memory.footprint import MemoryBreakdown

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="number of parameters, e.g. 7.5e9")
    source.add_argument("--model", help="module:function returning an nn.Module (built on the meta device: no memory; counted exactly)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                        help="parameter dtype (default bf16: the ZeRO paper's mixed-precision accounting)")
    parser.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default=None, help="gradient dtype (default: --dtype)")
    parser.add_argument("--optimizer", default="adamw", choices=("adam", "adamw", "sgd", "sgd_momentum", "adagrad", "rmsprop"))


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g}"


def run_estimate(args: argparse.Namespace) -> int:
    dtype = _DTYPES[args.dtype]
    reduce = _DTYPES[args.reduce_dtype] if args.reduce_dtype else None
    if args.model:
        module, _, function = args.model.partition(":")
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own modules
        with torch.device("meta"):  # shapes are all the estimate needs: no memory, no init
            subject = getattr(importlib.import_module(module), function)()
        count = sum(p.numel() for p in subject.parameters())
    else:
        subject = count = int(args.params)
    print(f"{count:,} parameters, {args.world_size} ranks, {args.dtype} parameters, "
          f"{args.reduce_dtype or args.dtype} gradients, {args.optimizer}; decimal GB per rank")
    print(f"{'stage':8s} {'params':>8s} {'grads':>8s} {'master':>8s} {'optim':>8s} {'model states':>13s} {'transient':>10s}")
    for stage in (0, 1, 2, 3):
        config = ZeroConfig(stage=stage, param_dtype=dtype, reduce_dtype=reduce)
        target = count if stage == 0 else subject
        b: MemoryBreakdown = estimate(target, world_size=args.world_size, config=config, optimizer=args.optimizer)
        label = "0 (DDP)" if stage == 0 else str(stage)
        print(f"{label:8s} {_gb(b.params):>8s} {_gb(b.grads):>8s} {_gb(b.master):>8s} {_gb(b.optimizer_state):>8s} "
              f"{_gb(b.model_states):>13s} {_gb(b.transient) if b.transient else '-':>10s}")
    return 0
