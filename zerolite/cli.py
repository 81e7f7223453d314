"""The ``zerolite`` command (also ``python -m zerolite``).

Each subcommand lives in the module of the feature it exposes, registered here in
`_SUBCOMMANDS`; that module defines ``add_NAME_arguments(parser)`` and
``run_NAME(args) -> int`` (the exit code).

Every error a user can cause -- a bad argument, a missing or corrupt checkpoint, an
unwritable output -- ends the command with exit code 2 and one line on stderr,
``zerolite NAME: error: ...``, naming the path or value and what to do instead; a
traceback means a bug in zerolite.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from zerolite._version import __version__
from zerolite.checkpoint.format import CheckpointError

# name -> (module providing add_arguments/run, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "estimate": (
        "zerolite.memory.commands",
        "per-rank memory of every stage (the ZeRO formulas, or exact for a model)",
    ),
    "plan": (
        "zerolite.memory.budget_commands",
        "the configurations whose predicted peak fits a memory budget, cheapest first",
    ),
    "consolidate": (
        "zerolite.checkpoint.commands",
        "write a checkpoint as one plain safetensors file",
    ),
    "verify": ("zerolite.checkpoint.commands", "check every rank file's size and sha256"),
    "inspect": (
        "zerolite.checkpoint.commands",
        "summarise a checkpoint (world size, stage, step, ...)",
    ),
}

# What a user's input can raise: reported in one line. Anything else is a bug: traceback.
_USER_ERRORS = (CheckpointError, ValueError, OSError)
EXIT_USAGE = 2  # argparse's code for a bad command line; used for every user error


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zerolite", description="ZeRO-style sharding for PyTorch optimizers.")
    parser.add_argument("--version", action="version", version=f"zerolite {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subparsers are _Parser too
    for name, (module, help_text) in _SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), f"add_{name}_arguments")(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code.

    0 on success; 2 with one line on stderr for a user error (see the module docstring);
    130 on Ctrl-C.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module, _ = _SUBCOMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(module), f"run_{args.command}")(args))
    except _USER_ERRORS as exc:
        print(f"zerolite {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"zerolite {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"  # not "[Errno 2] No such file ...: 'x'"
    else:
        text = str(exc) or type(exc).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
