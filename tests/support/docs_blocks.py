"""Collect and run the code blocks of Markdown files (tests/docs/test_docs.py drives it).

Why a small collector of our own rather than pytest-markdown-docs, pytest-examples or
mktestdocs: those run each block in the pytest process, while most of zerolite's examples are
training scripts that need a process group on every rank. Here a block marked ``ranks=N``
runs on N real ranks through `zerolite.testing.run_ranks`, and the consecutive blocks of a page
on the same number of ranks share one launch (one launch costs about a second here, so
batching is what keeps the docs test at seconds).

How a page runs: its blocks run in order, in a fresh temporary working directory (so a
checkpoint one block saves is there for the next). A block without a marker runs in the
pytest process, and such blocks of one page share their variables, like a notebook's cells.
Consecutive ``ranks=N`` blocks form one launch and share their variables on each rank.

Markers: an HTML comment on the line before the fence (visible in the Markdown source,
invisible on the site), words separated by spaces::

    <!-- docs-test: ranks=2 -->               run on 2 ranks
    <!-- docs-test: fixture=gpt -->           first run tests/support/docs_fixtures.py's gpt()
    <!-- docs-test: ranks=2 fixture=gpt -->   both
    <!-- docs-test: skip needs a CUDA GPU --> not run (the reason is required)

A ``ranks=N`` block is written as the script a user would start with ``torchrun
--nproc-per-node N``: its ``torch.distributed.init_process_group(...)`` returns at once when
the launch has already initialised the group, and ``destroy_process_group()`` is left to the
launch. Line numbers in tracebacks are the Markdown file's.

``console`` blocks hold ``$ zerolite ...`` commands, each followed by its output: the command
runs through ``zerolite.cli.main`` in the page's directory and its output must match (shell
commands that are not checked belong in ``bash`` blocks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<words>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[\w+-]*)")  # info may go on: ```python title=...
PYTHON = {"python", "py"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker and its code."""

    path: str  # as given, e.g. "docs/checkpoints.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str  # dedented to the fence's indentation
    ranks: int | None = None  # None: in the pytest process
    fixtures: tuple[str, ...] = ()
    skip: str | None = None  # the reason, for an illustration that is not run

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def padded(self) -> str:
        """The code preceded by blank lines, so tracebacks give the Markdown line numbers."""
        return "\n" * self.line + self.code


def parse_marker(words: str, where: str) -> dict[str, Any]:
    if words.startswith("skip"):
        reason = words[len("skip"):].strip()
        if not reason:
            raise ValueError(f"{where}: 'docs-test: skip' needs a reason after it")
        return {"skip": reason}
    found: dict[str, Any] = {}
    for word in words.split():
        key, _, value = word.partition("=")
        if key == "ranks" and value.isdigit() and int(value) >= 1:
            found["ranks"] = int(value)
        elif key == "fixture" and value:
            found["fixtures"] = tuple(value.split(","))
        else:
            raise ValueError(f"{where}: unknown docs-test marker word {word!r}")
    return found


def collect(path: str | Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the marker on the line before it."""
    lines = (ROOT / path).read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence["indent"]), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        i += 1  # the closing fence
        marker = MARKER.match(lines[start - 1]) if start else None
        where = f"{path}:{start + 1}"
        options = parse_marker(marker["words"], where) if marker else {}
        blocks.append(Block(str(path), start + 1, fence["info"].lower(), "\n".join(body) + "\n",
                            **options))
    return blocks


def segments(blocks: list[Block]) -> Iterator[list[Block]]:
    """The blocks to run, in order: consecutive ``ranks=N`` Python blocks with the same N
    together (one launch), every other block alone."""
    current: list[Block] = []
    for block in blocks:
        if block.skip is not None or block.lang not in PYTHON | {"console"}:
            continue
        launched = block.lang in PYTHON and block.ranks is not None
        if launched and current and current[-1].ranks == block.ranks:
            current.append(block)
            continue
        if current:
            yield current
        current = [block] if launched else []
        if not launched:
            yield [block]
    if current:
        yield current


def run_python(block: Block, namespace: dict[str, Any]) -> None:
    from tests.support import docs_fixtures

    for name in block.fixtures:
        getattr(docs_fixtures, name)(namespace)
    exec(compile(block.padded(), block.path, "exec"), namespace)  # noqa: S102


def run_console(block: Block) -> None:
    """Run each ``$ zerolite ...`` line and compare its output with the lines after it."""
    from zerolite.cli import main

    commands: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line.rstrip())
        else:
            raise AssertionError(f"{block.where}: a console block starts with '$ command'")
    for command, expected in commands:
        argv = shlex.split(command)
        if argv[0] != "zerolite":
            raise AssertionError(f"{block.where}: '{command}' is not a zerolite command; "
                                 "put commands that are not checked in a bash block")
        out = io.StringIO()
        with contextlib.redirect_stdout(out), _columns(88):
            try:
                code = main(argv[1:])
            except SystemExit as exc:  # --help, --version
                code = exc.code
        got = [line.rstrip() for line in out.getvalue().splitlines()]
        while expected and not expected[-1]:
            expected.pop()
        assert code == 0, f"{block.where}: '{command}' exited with {code}"
        assert got == expected, (f"{block.where}: '{command}' printed\n" + "\n".join(got)
                                 + "\nbut the page shows\n" + "\n".join(expected))


@contextlib.contextmanager
def _columns(n: int) -> Iterator[None]:
    """argparse wraps help text to $COLUMNS: pin it so the pages do not depend on a terminal."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def run_on_rank(blocks: list[Block], workdir: str) -> None:
    """Body of every rank of a ``ranks=N`` launch: the blocks in order, in one namespace."""
    import torch.distributed as dist

    os.chdir(workdir)
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_once(*args: Any, **kwargs: Any) -> None:  # the launch has initialised the group
        if not dist.is_initialized():
            init(*args, **kwargs)

    def destroy_later(*args: Any, **kwargs: Any) -> None:  # the launch tears it down
        if args or kwargs:
            destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = init_once, destroy_later
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for block in blocks:
        run_python(block, namespace)
