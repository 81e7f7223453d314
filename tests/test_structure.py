"""The package keeps the shape docs/design.md ("Layers") describes, read from the source.

- Folders along the data path, each importing only its own layer and those below it: no
  import runs back up, type-only imports (``if TYPE_CHECKING:``) and imports inside
  functions included, and no import circle anywhere.
- The top level of ``zerolite/`` holds at most 16 modules: the public faces and the ground.
- No function is longer than 80 lines (from its ``def`` to its last line, docstring
  included): a longer one is cut into named steps.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerolite"

# Lowest first. A module belongs to the layer of its folder (a top-level module: the layer
# naming it); it may import modules of its own layer and of the layers before it.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("ground", frozenset({
        "_version", "errors", "config_env", "config", "compile_guard", "phase_events",
    })),
    ("comm", frozenset({"comm"})),
    ("plan", frozenset({"plan"})),
    ("params", frozenset({"params"})),
    ("grads", frozenset({"grads"})),
    ("state", frozenset({"state"})),
    ("optim", frozenset({"optim"})),
    ("checkpoint", frozenset({"checkpoint"})),
    ("memory", frozenset({"memory"})),
    ("faces", frozenset({
        "__init__", "__main__", "zero", "gathered", "testing", "pytest_plugin", "accelerate",
        "hf", "cli", "saving",
    })),
)
MAX_TOP_LEVEL_MODULES = 16
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    """The index in `LAYERS` of ``module`` (``zerolite.comm.group`` -> comm's)."""
    parts = module.split(".")
    key = "__init__" if len(parts) == 1 else parts[1]
    for i, (_, members) in enumerate(LAYERS):
        if key in members:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_structure.py; add it")


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports that module (the package itself runs
            # first, as it does for every import of one of its modules: not counted).
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_runs_back_up():
    upward = sorted(
        f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(target) > _layer(module)
    )
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circle():
    """Tarjan's strongly connected components of the import graph: all of size 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_the_top_level_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def _functions() -> list[tuple[int, str]]:
    out = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                out.append((lines, f"{module}.{node.name} (line {node.lineno})"))
    return out


def test_no_function_is_longer_than_80_lines():
    long = sorted((f for f in _functions() if f[0] > MAX_FUNCTION_LINES), reverse=True)
    assert not long, [f"{name}: {lines} lines" for lines, name in long]


@pytest.mark.parametrize("source,expected", [
    ("import zerolite.comm.group\n", {"zerolite.comm.group"}),
    ("from zerolite.comm import group\n", {"zerolite.comm.group"}),
    ("from zerolite import ZeroConfig\n", {"zerolite"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerolite.optim import x\n",
     {"zerolite.optim"}),
    ("def f():\n    from zerolite.checkpoint.format import INDEX\n",
     {"zerolite.checkpoint.format"}),
])
def test_the_check_sees_each_kind_of_import(tmp_path, monkeypatch, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "zerolite.plan.probe", path)
    assert _imports("zerolite.plan.probe") == expected
