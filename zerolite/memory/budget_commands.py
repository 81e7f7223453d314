"""``zerolite plan``: the configurations that fit a memory budget, cheapest first
(`zerolite.memory.plan`).

Bad values raise `argparse.ArgumentTypeError` (while parsing) or `ValueError`;
`zerolite.cli` prints either as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
from collections.abc import Callable
from typing import Any

import torch

from zerolite.config import ZeroConfig
from zerolite.ground import runtime
from zerolite.ground.config_env import env_text
from zerolite.ground.dtype_names import DTYPE_NAMES
from zerolite.memory.budget import PlanEntry, plan
from zerolite.memory.commands import load_function
from zerolite.memory.peak_report import human_bytes
from zerolite.memory.prediction_pool import default_workers

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_OFFLOADS = {"none": None, "host": "host", "disk": "disk"}
_SWITCH = {"off": False, "on": True}


def _memory(text: str) -> int:
    """``--memory``: bytes with an optional unit, e.g. 24GiB, 80GB, 512MiB, 1e9."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    try:
        value = float(match.group(1)) * _UNITS[unit] if match else 0.0
    except (ValueError, KeyError):
        value = 0.0
    if not value >= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size; give bytes with a unit, e.g. 24GiB or 80GB"
        )
    return int(value)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _choices(table: dict[str, Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in table]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a comma-separated list of {', '.join(table)}"
            )
        return [table[n] for n in names]
    return parse


def _list_of(kind: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    """A comma-separated list, each item parsed by ``kind`` (ValueError: not ``what``)."""
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(t) for t in text.split(",") if t.strip()]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {what}")
        return values
    return parse


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="MODULE:FUNCTION", required=True,
                        help="a function returning the model, e.g. examples.gpt:GPT (built on "
                             "fake tensors: no memory)")
    parser.add_argument("--inputs", metavar="MODULE:FUNCTION", required=True,
                        help="a function (micro_batch_size) -> dict of keyword arguments for "
                             "model(**inputs); the output is the loss or has .loss")
    parser.add_argument("--world-size", type=_positive, required=True)
    parser.add_argument("--memory", type=_memory, required=True,
                        help="the budget per rank, e.g. 24GiB or 80GB")
    parser.add_argument("--batch", type=_positive, required=True,
                        help="samples per rank per optimizer step (micro-batch x accumulation)")
    parser.add_argument("--device", choices=("cpu", runtime.GPU_TYPE), default="cpu",
                        help="the device the budget is of (default cpu)")
    parser.add_argument("--stages", type=_choices({"1": 1, "2": 2, "3": 3}), default=[1, 2, 3],
                        help="stages to consider (default 1,2,3)")
    parser.add_argument("--param-dtypes", type=_choices(DTYPE_NAMES),
                        default=[torch.float32, torch.bfloat16],
                        help="parameter dtypes to consider: fp32,bf16,fp16 (default fp32,bf16)")
    parser.add_argument("--offload", type=_choices(_OFFLOADS), default=[None, "host", "disk"],
                        help="offload tiers to consider: none,host,disk (default all)")
    parser.add_argument("--offload-params", type=_choices(_OFFLOADS), default=[None, "disk"],
                        help="stage 3: tiers of the parameter and gradient shards to consider: "
                             "none,host,disk (default none,disk)")
    parser.add_argument("--offload-fractions", type=_list_of(float, "fractions in (0, 1]"),
                        default=[0.5, 1.0],
                        help="offload_fraction values for each offload tier (default 0.5,1)")
    parser.add_argument("--shard-group-sizes", type=_list_of(int, "integers"), default=None,
                        help="shard group sizes k, divisors of --world-size (k < world size: "
                             "hybrid sharding; default: the world size and every divisor "
                             "between 1 and it)")
    parser.add_argument("--checkpointing", type=_choices(_SWITCH), default=[False, True],
                        help="activation checkpointing: off,on (default both)")
    parser.add_argument("--offload-dir", default=None,
                        help="a disk tier's directory (default: the temporary directory)")
    parser.add_argument("--workers", type=_positive, default=default_workers(),
                        help="processes predicting ahead of the search; the plan is the same "
                             "at any number (default: the CPUs this process may use, at "
                             "most 8; 1: this process alone)")
    parser.add_argument("--json", action="store_true",
                        help="print the list as JSON, cheapest first")


def _row(e: PlanEntry) -> str:
    c = e.config
    what = (f"stage {c['stage']} {str(c['param_dtype']).removeprefix('torch.'):8s} "
            f"offload {_offload(c):9s} "
            f"group {c.get('shard_group_size', 'all')!s:3s} "
            f"ckpt {'on ' if e.activation_checkpointing else 'off'} "
            f"micro-batch {e.micro_batch} x {e.accumulation}")
    if e.fits:
        return (f"  fits  {what}: peak {human_bytes(e.peak_bytes)}, sends "
                f"{human_bytes(e.communication_bytes)} per step")
    return f"  no    {what}: {e.reason}"


def _offload(config: dict[str, Any]) -> str:
    tier = config.get("offload")
    fraction = config.get("offload_fraction", 1.0)
    text = "none" if tier is None else tier if fraction == 1.0 else f"{tier} x{fraction:g}"
    params = config.get("offload_params")
    return text if params is None else f"{text}+params {params}"


def run_plan(args: argparse.Namespace) -> int:
    model_fn = load_function(args.model, "--model")
    batch_fn = load_function(args.inputs, "--inputs")
    entries = plan(
        model_fn, batch_fn, args.world_size, args.memory, args.batch, stages=args.stages,
        param_dtypes=args.param_dtypes, offloads=args.offload,
        offload_params=args.offload_params, checkpointing=args.checkpointing,
        offload_fractions=args.offload_fractions, shard_group_sizes=args.shard_group_sizes,
        offload_dir=args.offload_dir, device=args.device, workers=args.workers,
    )
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0 if entries[0].fits else 1
    print(f"configurations for {args.world_size} rank(s), {human_bytes(args.memory)} each, "
          f"{args.batch} samples per rank per step (cheapest first):")
    for entry in entries:
        print(_row(entry))
    if not entries[0].fits:
        print("nothing fits: add ranks or memory, or lower --batch")
        return 1
    best = entries[0]
    print(f"use (micro-batch {best.micro_batch} x {best.accumulation} accumulation, "
          f"activation checkpointing {'on' if best.activation_checkpointing else 'off'}):")
    print(best.zero_config_line())
    print("or, for accelerate launch, in its environment:")
    for line in env_lines(best.config):
        print(line)
    return 0


def env_lines(config: dict[str, Any]) -> list[str]:
    """``NAME=value`` for each `ZeroConfig` keyword argument in ``config``: the variables
    `ZeroConfig` reads when its argument is not given (``ZEROLITE_STAGE=2``), each value
    the text that variable's parser reads back (`env_text`), quoted for a POSIX shell."""
    env = {f.name: f.metadata["env"] for f in dataclasses.fields(ZeroConfig) if "env" in f.metadata}
    missing = sorted(set(config) - set(env))
    if missing:
        raise ValueError(f"no ZEROLITE_* variable for ZeroConfig field(s) {missing}")
    return [f"{env[name]}={shlex.quote(env_text(value))}" for name, value in config.items()]
