"""``zerolite consolidate | verify | inspect``: the checkpoint subcommands.

Paths are checked here before the library sees them, so that a user error gets a message
about what the path *is* (missing, a file, an Accelerate folder, a folder of checkpoints)
rather than "no index.json". Errors raise `CheckpointError` / `ValueError`; `zerolite.cli`
prints them as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from zerolite.checkpoint.commit import read_pointer
from zerolite.checkpoint.consolidate import consolidate, inspect, verify
from zerolite.checkpoint.format import INDEX, LATEST, CheckpointError

# --dtype of consolidate: floating dtypes only (an integer cast would zero the weights).
_FLOAT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def float_dtype_arg(text: str) -> torch.dtype:
    """``--dtype`` values: bf16, fp16, fp32, fp64 or their torch names."""
    if text not in _FLOAT_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a floating dtype (an integer cast would zero the weights); "
            "use bf16, fp16, fp32 or fp64"
        )
    return _FLOAT_DTYPES[text]


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory")
    parser.add_argument("out", help="safetensors file to write (outside the checkpoint)")
    parser.add_argument("--dtype", type=float_dtype_arg, default=None,
                        help="bf16, fp16, fp32 or fp64 (default: the fp32 masters)")
    parser.add_argument("--progress", action="store_true",
                        help="report each tensor written on stderr (default: only on a terminal)")


def run_consolidate(args: argparse.Namespace) -> int:
    path = checkpoint_dir(args.path)
    out = output_file(args.out, path)
    show = args.progress or sys.stderr.isatty()
    progress = _Progress(f"zerolite consolidate {out.name}") if show else None
    try:
        written = consolidate(path, out, args.dtype, progress=progress)
    finally:
        if progress is not None:
            progress.close()  # an error message then starts on a line of its own
    print(f"wrote {written}")
    return 0


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory")


def run_verify(args: argparse.Namespace) -> int:
    path = checkpoint_dir(args.path)
    print(f"{args.path}: OK ({len(verify(path)['files'])} files verified)")
    return 0


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory")


def run_inspect(args: argparse.Namespace) -> int:
    print(json.dumps(inspect(checkpoint_dir(args.path)), indent=2))
    return 0


def checkpoint_dir(text: str) -> Path:
    """``text`` as a checkpoint directory, or a `CheckpointError` saying what it is instead.

    An incomplete checkpoint (rank files, no index) is left to `read_index`, whose
    message ("was the save interrupted?") fits it.
    """
    path = Path(text)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if path.is_file():
        hint = f"; pass its directory {path.parent}" if path.name == INDEX else ""
        raise CheckpointError(f"{path}: a file, not a checkpoint directory{hint}")
    if (path / INDEX).is_file():
        return path
    if inner := _zerolite_dirs(path):  # ZeroAccelerator.save_state: one zerolite_{i} per model
        raise CheckpointError(f"{path}: this is an Accelerate checkpoint folder; "
                              f"the zerolite checkpoint is at {inner}")
    runs = sorted((p for p in path.glob("checkpoint_*") if _zerolite_dirs(p)), key=_number)
    if runs:  # Accelerate's project_dir/checkpoints, with automatic checkpoint naming
        raise CheckpointError(f"{path}: a folder of Accelerate checkpoints; the newest zerolite "
                              f"checkpoint is at {_zerolite_dirs(runs[-1])}")
    if (path / LATEST).is_file():  # the root that `save` keeps its `latest` pointer in
        newest = path / read_pointer(path)
        raise CheckpointError(f"{path}: a folder of checkpoints; the newest is {newest}")
    if not any(path.iterdir()):
        raise CheckpointError(f"{path}: empty directory, not a zerolite checkpoint")
    if not any(path.glob("rank-*.safetensors")):
        raise CheckpointError(f"{path}: not a zerolite checkpoint "
                              f"(no {INDEX}, no rank-*.safetensors)")
    return path


def _zerolite_dirs(folder: Path) -> str:
    """The zerolite checkpoints inside an Accelerate checkpoint folder, as text ('' if none)."""
    found = sorted((p for p in folder.glob("zerolite_*") if (p / INDEX).is_file()), key=_number)
    return " and ".join(str(p) for p in found)


def _number(folder: Path) -> int:
    digits = folder.name.rpartition("_")[2]
    return int(digits) if digits.isdigit() else -1


def output_file(text: str, checkpoint: Path) -> Path:
    """``text`` as a file consolidate can write, checked before the (long) work starts."""
    out = Path(text)
    if out.is_dir():
        raise ValueError(f"{out} is a directory; name the file to write, "
                         f"e.g. {out / 'model.safetensors'}")
    if out.resolve().is_relative_to(checkpoint.resolve()):  # symlinks resolved
        raise ValueError(f"{out} is inside the checkpoint {checkpoint}; write the consolidated "
                         "file elsewhere (it would replace or mix with the rank files)")
    if out.parent.exists() and not out.parent.is_dir():
        raise ValueError(f"{out}: {out.parent} is a file, not a directory")
    if not out.parent.is_dir():
        raise ValueError(f"{out}: directory {out.parent} does not exist; create it first")
    try:  # consolidate writes a temporary file next to `out`, then renames it
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as exc:
        raise ValueError(f"{out}: cannot write in {out.parent} ({exc.strerror})") from None
    return out


class _Progress:
    """``done/total tensors`` on stderr: rewritten in place on a terminal, else a line
    at most every 2 s (a log file gets a few lines, not one per tensor)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.open = False  # a terminal line written without its newline

    def __call__(self, done: int, total: int, name: str) -> None:
        now = time.monotonic()
        if done < total and not self.tty and now - self.last < 2.0:
            return
        self.last = now
        text = f"{self.label}: {done}/{total} tensors ({done / max(total, 1):.0%}) {name}"
        end = "\n" if done == total or not self.tty else ""
        print(f"\r{text}\033[K" if self.tty else text, end=end, file=sys.stderr, flush=True)
        self.open = end == ""

    def close(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
            self.open = False
