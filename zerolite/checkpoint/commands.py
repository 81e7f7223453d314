"""``zerolite consolidate | verify | inspect``: the checkpoint subcommands."""

from __future__ import annotations

import argparse
import json

from zerolite.checkpoint.consolidate import consolidate, dtype_arg, inspect, verify
from zerolite.checkpoint.format import CheckpointError


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory")
    parser.add_argument("out", help="safetensors file to write")
    parser.add_argument("--dtype", type=dtype_arg, default=None, help="bf16, fp16 or fp32 (default: fp32 masters)")


def run_consolidate(args: argparse.Namespace) -> int:
    return _guarded(lambda: print(f"wrote {consolidate(args.path, args.out, args.dtype)}"))


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory")


def run_verify(args: argparse.Namespace) -> int:
    return _guarded(lambda: print(f"{args.path}: OK ({len(verify(args.path)['files'])} files verified)"))


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory")


def run_inspect(args: argparse.Namespace) -> int:
    return _guarded(lambda: print(json.dumps(inspect(args.path), indent=2)))


def _guarded(action) -> int:
    try:
        action()
    except CheckpointError as exc:
        print(f"error: {exc}")
        return 1
    return 0
