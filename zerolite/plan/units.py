"""Stage 3 units: which parameters are gathered together, and by which module.

A unit is a module whose managed parameters share one flat buffer and are
all-gathered just before the module runs. By default every element of every
``nn.ModuleList`` is a unit (a transformer's blocks); ``ZeroConfig.unit_modules``
chooses other modules. The root module is always a unit and holds every managed
parameter that no other unit holds (embeddings, final norm, head). A parameter inside
nested units belongs to the innermost one; a parameter used by two units (tied weights)
belongs to the root.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

__all__ = ["Unit", "find_units"]


@dataclasses.dataclass
class Unit:
    """One unit: its module, qualified name (``""`` for the root) and managed parameters."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]  # trainable: flat buffer with master and gradient bucket
    # sharded, no grads
    frozen: list[tuple[str, nn.Parameter]] = dataclasses.field(default_factory=list)


def _is_unit_factory(
    model: nn.Module, unit_modules: tuple[type[nn.Module], ...] | Callable[[nn.Module], bool] | None
) -> Callable[[nn.Module], bool]:
    if unit_modules is None:
        in_lists = {
            id(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m
        }
        return lambda module: id(module) in in_lists
    if isinstance(unit_modules, tuple):
        classes = unit_modules
        return lambda module: isinstance(module, classes)
    return unit_modules


def find_units(
    model: nn.Module,
    managed: dict[int, str],
    unit_modules: tuple[type[nn.Module], ...] | Callable[[nn.Module], bool] | None,
) -> list[Unit]:
    """The units of ``model``: non-root units in registration order, then the root.

    Args:
        model: the model to shard.
        managed: ``id(param) -> name`` of the parameters to shard; those that do not
            require grad land in `Unit.frozen` (sharded, without gradients or state).
        unit_modules: ``ZeroConfig.unit_modules``.
    Returns:
        Units with at least one managed parameter (the root always comes last, even if empty).
    """
    is_unit = _is_unit_factory(model, unit_modules)
    names = [name for name, module in model.named_modules() if name and is_unit(module)]
    modules = dict(model.named_modules())
    unit_names = set(names)
    reached: dict[int, set[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        unit_name = _innermost(module_name, unit_names)
        for p in module.parameters(recurse=False):
            if id(p) in managed:
                reached.setdefault(id(p), set()).add(unit_name)
    # A parameter shared by several units (tied weights) goes to the root, which stays
    # gathered from the start of forward to the end of backward, so every user sees it.
    owner = {pid: units.pop() if len(units) == 1 else "" for pid, units in reached.items()}
    params_of: dict[str, list[tuple[str, nn.Parameter]]] = {u: [] for u in [*names, ""]}
    for name, p in model.named_parameters():
        if id(p) in owner:
            params_of[owner[id(p)]].append((name, p))
    def split(ps: list[tuple[str, nn.Parameter]]) -> tuple[list, list]:
        return [x for x in ps if x[1].requires_grad], [x for x in ps if not x[1].requires_grad]

    units = [Unit(u, modules[u], *split(params_of[u])) for u in names if params_of[u]]
    units.append(Unit("", model, *split(params_of[""])))
    return units


def _innermost(module_name: str, unit_names: set[str]) -> str:
    """The longest of ``unit_names`` that is ``module_name`` or encloses it ("": none)."""
    while module_name:
        if module_name in unit_names:
            return module_name
        module_name = module_name.rpartition(".")[0]
    return ""
