"""Every Python block of the README and the docs site runs, and the troubleshooting page
names every exception type zerolite raises.

tests/support/docs_blocks.py says how blocks run, which markers exist and why this is an in-repo
collector rather than pytest-markdown-docs, pytest-examples or mktestdocs. ``mkdocs build
--strict`` (run by ``make test`` before pytest) checks the rest of the docs: links, anchors,
and that every public name is on an API reference page with a docstring.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.docs_blocks import (
    ROOT,
    Block,
    collect,
    run_console,
    run_on_rank,
    run_python,
    segments,
)
from zerolite.testing import RankFailure, run_ranks

# The Markdown files whose blocks must run: any list of paths relative to the repository root.
MARKDOWN_FILES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
]
LAUNCH_TIMEOUT_S = 180.0


def run_file(path: str | Path, workdir: Path) -> int:
    """Run every block of one Markdown file in ``workdir`` (the caller's cwd); return how
    many blocks ran."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    ran = 0
    for segment in segments(collect(path)):
        first = segment[0]
        if first.lang == "console":
            run_console(first)
        elif first.ranks is None:
            with _torch_state_kept():
                run_python(first, namespace)
        else:
            run_ranks(run_on_rank, first.ranks, segment, str(workdir), timeout=LAUNCH_TIMEOUT_S)
        ran += len(segment)
    return ran


class _torch_state_kept:
    """A block run in the pytest process leaves the RNG, default dtype and thread count as
    they were, so later tests do not depend on the docs."""

    def __enter__(self) -> None:
        self.rng = torch.random.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()

    def __exit__(self, *exc: object) -> None:
        torch.random.set_rng_state(self.rng)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)


@pytest.mark.parametrize("path", MARKDOWN_FILES)
def test_markdown_blocks_run(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_file(path, tmp_path)


def test_docs_have_blocks_and_every_block_is_run_or_marked() -> None:
    blocks = [b for path in MARKDOWN_FILES for b in collect(path) if b.lang in ("python", "py")]
    run = [b for b in blocks if b.skip is None]
    launched = [b for b in run if b.ranks is not None]
    assert len(run) >= 20 and len(launched) >= 10, (len(run), len(launched))
    for block in blocks:  # a skipped block says why (collect() refuses an empty reason)
        assert block.skip is None or len(block.skip) > 5, block.where


# -- the harness itself: a failing block fails the test, at its Markdown line --------------

FAILING_PAGE = """\
# A page

```python
x = 1
```

<!-- docs-test: ranks=2 -->
```python
import torch.distributed as dist
dist.init_process_group("gloo")
assert dist.get_world_size() == 2
rank = dist.get_rank()
```

<!-- docs-test: ranks=2 -->
```python
assert rank in (0, 1)
raise ValueError(f"failed on rank {rank}")
```

<!-- docs-test: skip an illustration -->
```python
raise AssertionError("a skipped block never runs")
```
"""


def test_harness_runs_and_reports_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text(FAILING_PAGE)
    blocks = collect(page)
    assert [(b.line, b.ranks, b.skip) for b in blocks] == [
        (3, None, None), (8, 2, None), (16, 2, None), (22, None, "an illustration")]
    assert [[b.line for b in s] for s in segments(blocks)] == [[3], [8, 16]]  # one launch
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RankFailure) as failure:
        run_file(page, tmp_path)
    assert 'page.md", line 18' in str(failure.value)  # the Markdown file's own line
    assert "failed on rank 1" in str(failure.value)


def test_harness_checks_console_output(tmp_path: Path) -> None:
    wrong = Block("page.md", 1, "console", "$ zerolite --version\nzerolite 9.9\n")
    with pytest.raises(AssertionError, match="zerolite --version' printed"):
        run_console(wrong)
    with pytest.raises(AssertionError, match="not a zerolite command"):
        run_console(Block("page.md", 1, "console", "$ ls\n"))
    bad = tmp_path / "bad.md"
    bad.write_text("<!-- docs-test: skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        collect(bad)


# -- troubleshooting covers every exception type -----------------------------------------

def raised_exception_types() -> set[str]:
    """The class names in every ``raise Name(...)``, ``raise module.Name(...)`` and ``raise
    Name`` of the package, and the type that the helper ``group.failure()`` builds."""
    names: set[str] = set()
    for path in (ROOT / "zerolite").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", "")
            if name[:1].isupper():
                names.add(name)
    # `raise group.failure(...)` builds a CollectiveTimeout (meta_init's `_init_error(...)` a
    # RuntimeError, raised by name elsewhere too).
    return names | {"CollectiveTimeout"}


def test_troubleshooting_names_every_exception_type() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^#+ .*?`([\w.]+)`", page, re.MULTILINE))
    missing = {name for name in raised_exception_types() if name.split(".")[-1] not in
               {h.split(".")[-1] for h in headings}}
    assert not missing, f"docs/troubleshooting.md has no heading for {sorted(missing)}"
