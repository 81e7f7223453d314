"""The package keeps the shape docs/design.md ("Layers") describes, read from the source.

- The layer table exists once, in docs/design.md: this test reads it from there.
- Folders in layer order, each importing only its own layer and those below it: no
  import runs back up, type-only imports (``if TYPE_CHECKING:``) and imports inside
  functions included, and no import circle anywhere.
- No back-channel: no module hands one of its own functions down to a lower layer at
  import (a module-level call made for its effect, or an assignment into the lower
  module), which would let the lower layer call back up where no import shows it.
- The top level of ``zerolite/`` holds only public faces (names a user imports) and
  ``__init__``, ``__main__``, ``_version``.
- No function is longer than 80 lines (from its ``def`` to its last line, docstring
  included): a longer one is cut into named steps.
- The map stays true: every ``[Note: name]`` the code cites is written once and listed in
  docs/design.md's index under its file, and every name the "Words" table points to exists.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zerolite"
DESIGN = ROOT / "docs" / "design.md"
MAX_FUNCTION_LINES = 80
# Top-level modules that are not faces but every Python package has.
PACKAGE_FILES = frozenset({"__init__", "__main__", "_version"})


def layers_from_design(text: str) -> tuple[tuple[str, frozenset[str]], ...]:
    """The layer table of docs/design.md (the first table after "## Layers", written from the
    top layer down), lowest first: (layer name, the folders and top-level modules it holds,
    as ``comm`` or ``config``)."""
    section = text.split("\n## Layers\n", 1)[1]
    rows = []
    for line in section.split("\n"):
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        names = re.findall(r"`([\w.]+/?)`", cells[1])
        rows.append((cells[0], frozenset(n.removesuffix("/").removesuffix(".py") for n in names)))
    assert rows, "docs/design.md has no layer table under '## Layers'"
    return tuple(reversed(rows))


LAYERS = layers_from_design(DESIGN.read_text())


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
    raise AssertionError(f"{module} is in no layer of docs/design.md's table ('Layers'); add it")


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


def _public_top_level() -> set[str]:
    """Top-level modules a user imports: those ``zerolite/__init__.py`` takes a name of
    ``__all__`` from or loads on first use, the API reference's public modules, and the
    command's entry point."""
    init = ast.parse((PACKAGE / "__init__.py").read_text())
    public = set()
    for node in ast.walk(init):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerolite."):
            public.add(node.module.split(".")[1])
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY_SUBMODULES" for t in node.targets
        ):
            public.update(ast.literal_eval(node.value))
    hooks = (ROOT / "docs" / "hooks" / "zerolite_docs.py").read_text()
    public.update(m.split(".")[1] for m in re.findall(r'"(zerolite\.\w+)"', hooks))
    # [project.scripts]: the command's entry point (``zerolite = "zerolite.cli:main"``)
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    public.update(re.findall(r'=\s*"zerolite\.(\w+):', scripts.split("\n[", 1)[0]))
    return public


def test_the_top_level_holds_only_public_faces():
    top = {p.stem for p in PACKAGE.glob("*.py")} - PACKAGE_FILES
    assert not top - _public_top_level(), (
        f"top-level modules no user imports: {sorted(top - _public_top_level())}; move "
        "them into the folder of their layer (ground code into zerolite/ground/)"
    )


def test_the_layer_table_names_every_folder_and_top_level_module():
    listed = {name for _, members in LAYERS for name in members}
    present = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")
    }
    assert listed == present, (
        f"docs/design.md's layer table names {sorted(listed - present)} that do not exist "
        f"and leaves out {sorted(present - listed)}"
    )


def _bindings(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> the package's module it is, or the module it was imported from."""
    path = MODULES[module]
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("zerolite"):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "zerolite"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("zerolite"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out[a.asname or a.name] = full if full in MODULES else base
    return out


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements that run at import: the body, and the bodies of its ``if``/``try``/
    ``with`` blocks, never a function's or a class's."""
    out = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        out.append(stmt)
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                out += _module_level([s for s in inner if isinstance(s, ast.stmt)]
                                     + [b for h in inner if isinstance(h, ast.ExceptHandler)
                                        for b in h.body])
    return out


def handed_down(module: str) -> list[str]:
    """Where ``module`` hands one of its own functions or classes to a module of a lower
    layer at import: a module-level call made for its effect with it as an argument
    (``lower.register(my_function)``, ``setattr(lower, "f", my_function)``), or an
    assignment of it into the lower module (``lower.hook = my_function``)."""
    tree = ast.parse(MODULES[module].read_text())
    own = {
        n.name for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    bound = _bindings(tree, module)

    def lower(expr: ast.expr) -> str | None:
        """The lower-layer module ``expr`` names (itself or through an attribute)."""
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        target = bound.get(expr.id) if isinstance(expr, ast.Name) else None
        return target if target is not None and _layer(target) < _layer(module) else None

    def is_own(expr: ast.expr) -> bool:
        return isinstance(expr, ast.Name) and expr.id in own

    found = []
    for stmt in _module_level(tree.body):
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            args = [*call.args, *(k.value for k in call.keywords)]
            receiver = lower(call.func)
            if isinstance(call.func, ast.Name) and call.func.id == "setattr" and call.args:
                receiver = lower(call.args[0])
            if receiver is not None and any(is_own(a) for a in args):
                found.append(f"{module} line {stmt.lineno}: hands a function to {receiver}")
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and stmt.value is not None and is_own(stmt.value):
                    if (receiver := lower(t)) is not None:
                        found.append(f"{module} line {stmt.lineno}: assigns into {receiver}")
    return found


def test_no_module_hands_a_function_down_to_a_lower_layer():
    found = [line for module in MODULES for line in handed_down(module)]
    assert not found, (
        "a higher layer's function passed down through a module global (a back-channel the "
        "import check cannot see): pass it as an argument, or move the code below:\n"
        + "\n".join(found)
    )


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


_FACE = "from zerolite.ground import phase_events\n\n\ndef shard():\n    pass\n\n\n"


@pytest.mark.parametrize("source,flagged", [
    (_FACE + "phase_events.provide_shard(shard)\n", True),  # the pattern this check removed
    (_FACE + "phase_events._shard = shard\n", True),
    (_FACE + "setattr(phase_events, '_shard', shard)\n", True),
    (_FACE + "if True:\n    phase_events.provide_shard(f=shard)\n", True),
    (_FACE + "def later():\n    phase_events.provide_shard(shard)\n", False),  # at call time
    (_FACE + "wrapped = phase_events.wrap(shard)\n", False),  # a value kept here
    (_FACE + "phase_events.sample(3)\n", False),
], ids=["call", "assignment", "setattr", "call-in-if", "call-at-run-time", "value-kept",
        "no-function"])
def test_the_back_channel_check_sees_a_function_handed_down(tmp_path, monkeypatch, source,
                                                            flagged):
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "zerolite.cli", path)  # a face: above every layer
    assert bool(handed_down("zerolite.cli")) == flagged


_NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def notes() -> tuple[dict[str, list[str]], set[str]]:
    """Where each note is written (name -> files) and every name cited. A note is written
    where a line opens with it (after ``#`` or ``\"\"\"``) and its text follows (not
    ``in `module```, which cites it)."""
    written: dict[str, list[str]] = {}
    cited = set()
    for path in MODULES.values():
        for line in path.read_text().split("\n"):
            for m in _NOTE.finditer(line):
                cited.add(m.group(1))
                opens = line[: m.start()].strip() in ("", "#", '"""')
                follows = line[m.end():]
                if opens and follows[:1] in (" ", "") and not follows.startswith(" in `"):
                    written.setdefault(m.group(1), []).append(
                        str(path.relative_to(PACKAGE)))
    return written, cited


def test_every_note_is_written_once_and_indexed_in_the_design_page():
    written, cited = notes()
    assert not {n: f for n, f in written.items() if len(f) > 1}, "notes written twice"
    assert not cited - set(written), f"notes cited but never written: {cited - set(written)}"
    index = dict(re.findall(r"^\| \[Note: ([^\]]+)\] \| `([^`]+)` \|", DESIGN.read_text(), re.M))
    assert index == {n: f[0] for n, f in written.items()}, (
        "docs/design.md's 'Notes in the code' differs from the code: "
        f"{set(index.items()) ^ {(n, f[0]) for n, f in written.items()}}"
    )


def test_every_name_the_words_table_points_to_exists():
    section = DESIGN.read_text().split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    names = [
        name for line in section.split("\n") if line.startswith("| **")
        for name in re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`", line.rsplit("|", 2)[-2])
    ]
    assert len(names) > 10, names
    missing = []
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(["zerolite", *parts[:cut]])
            if module in MODULES:
                obj = importlib.import_module(module)
                try:
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr)
                except AttributeError:  # an instance attribute: set in the class's code
                    set_here = re.search(rf"self\.{attr}\s*[:=]", inspect.getsource(obj))
                    if not (inspect.isclass(obj) and set_here):
                        missing.append(name)
                break
        else:
            missing.append(name)
    assert not missing, f"docs/design.md's Words name what the code no longer has: {missing}"
