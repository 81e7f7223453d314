"""Build hooks of the docs site (mkdocs.yml, ``hooks:``).

- **Benchmark figures.** The PNGs the benchmarks write under ``benchmarks/`` are served as
  ``assets/benchmarks/NAME.png``, so the pages show the figures the README shows, never a
  copy that could go stale.
- **Every public name is documented.** A name of a public module (its ``__all__``; for a
  module without one, each public function and class it defines) must be rendered by a
  ``::: module.name`` block on some page and must have a docstring. Anything missing is
  logged as a warning, which ``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import griffe
from mkdocs.structure.files import File, Files

# The modules whose names are the public API (the API reference's pages).
PUBLIC_MODULES = (
    "zerolite",
    "zerolite.checkpoint",
    "zerolite.memory",
    "zerolite.accelerate",
    "zerolite.hf",
    "zerolite.testing",
    "zerolite.pytest_plugin",
)
FIGURES_URI = "assets/benchmarks"

log = logging.getLogger("mkdocs.hooks.zerolite_docs")
_ROOT = Path(__file__).resolve().parents[2]
_DIRECTIVE = re.compile(r"^:::\s+(\S+)", re.MULTILINE)
_rendered: set[str] = set()


def on_files(files: Files, config) -> Files:
    for png in sorted((_ROOT / "benchmarks").glob("*.png")):
        files.append(File.generated(config, f"{FIGURES_URI}/{png.name}", abs_src_path=str(png)))
    return files


def on_pre_build(config) -> None:
    _rendered.clear()


def on_page_markdown(markdown: str, page, config, files) -> str:
    _rendered.update(_DIRECTIVE.findall(markdown))
    return markdown


def on_post_build(config) -> None:
    for problem in undocumented_public_names(_rendered):
        log.warning(problem)


def public_names(module: griffe.Module) -> list[str]:
    """The module's ``__all__``, or else the public functions and classes it defines."""
    if module.exports is not None:
        return [str(name) for name in module.exports]
    return [
        name
        for name, member in module.members.items()
        if not name.startswith("_")
        and not member.is_alias
        and (member.is_function or member.is_class)
    ]


def undocumented_public_names(rendered: set[str]) -> list[str]:
    """One line per public name that no ``:::`` block renders or that has no docstring."""
    package = griffe.load("zerolite", search_paths=[str(_ROOT)], docstring_parser="google")
    problems = []
    for module_path in PUBLIC_MODULES:
        module = package if module_path == "zerolite" else package[module_path[len("zerolite."):]]
        for name in public_names(module):
            identifier = f"{module_path}.{name}"
            if identifier not in rendered:
                problems.append(
                    f"API reference: public name {identifier} is on no page; add "
                    f"'::: {identifier}' to a page under docs/reference/"
                )
            if not module[name].docstring:
                problems.append(f"API reference: public name {identifier} has no docstring")
    return problems
