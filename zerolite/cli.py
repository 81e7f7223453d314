"""The ``zerolite`` command (also ``python -m zerolite``).

Each subcommand lives in the module of the feature it exposes, registered here in
`_SUBCOMMANDS`; that module defines ``add_NAME_arguments(parser)`` and
``run_NAME(args) -> int`` (the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from zerolite._version import __version__

# name -> (module providing add_arguments/run, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("zerolite.memory.commands", "per-rank memory of every stage (the ZeRO formulas, or exact for a model)"),
    "consolidate": ("zerolite.checkpoint.commands", "write a checkpoint as one plain safetensors file"),
    "verify": ("zerolite.checkpoint.commands", "check every shard file's size and sha256"),
    "inspect": ("zerolite.checkpoint.commands", "summarise a checkpoint (world size, stage, step, ...)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerolite", description="ZeRO-style sharding for PyTorch optimizers.")
    parser.add_argument("--version", action="version", version=f"zerolite {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), f"add_{name}_arguments")(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module, _ = _SUBCOMMANDS[args.command]
    return int(getattr(importlib.import_module(module), f"run_{args.command}")(args))


if __name__ == "__main__":
    sys.exit(main())
