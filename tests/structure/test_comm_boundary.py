"""No module of the package calls a ``torch.distributed`` collective outside the
communication layer.

Device placement is one decision (`zerolite.comm.devices`), and only the communication layer
applies it: every collective of the package runs in one of `COMMUNICATION_MODULES`, so a
new module that calls ``dist.all_reduce`` (or any other collective) directly -- on a
CPU tensor that NCCL would refuse, or with a timeout that blocks the host -- fails here.
The check reads the source (an AST walk): every call of a collective through any alias of
``torch.distributed``, attribute chains (``torch.distributed.all_reduce``), ``from
torch.distributed import all_reduce`` and ``getattr(dist, "all_reduce")``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "zerolite"

# Where collectives may be called, relative to the package directory.
COMMUNICATION_LAYER = "comm/"
ELSEWHERE = {"testing.py": "the test launcher: a barrier before it tears its own group down"}

# torch.distributed functions that communicate (2.13 names and their older aliases).
COLLECTIVES = frozenset({
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object",
    "all_gather_single", "_all_gather_base", "all_reduce", "all_reduce_coalesced",
    "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
    "monitored_barrier", "recv", "recv_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "scatter",
    "scatter_object_list", "send", "send_object_list",
})
_DIST = ("torch.distributed", "torch.distributed.distributed_c10d")


def collective_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every use of a torch.distributed collective in ``source``."""
    tree = ast.parse(source)
    aliases = set()  # names bound to torch.distributed
    torch_names = set()  # names bound to torch itself
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in _DIST and a.asname:
                    aliases.add(a.asname)
                elif a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module in _DIST and a.name in COLLECTIVES:
                    found.append((node.lineno, a.name))
                elif node.module == "torch" and a.name == "distributed":
                    aliases.add(a.asname or "distributed")

    def is_dist(expr: ast.expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in aliases
        return (
            isinstance(expr, ast.Attribute) and expr.attr in ("distributed", "distributed_c10d")
            and (is_dist(expr.value) or isinstance(expr.value, ast.Name)
                 and expr.value.id in torch_names)
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and is_dist(node.value):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2 and is_dist(node.args[0])
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES
        ):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


def _modules() -> dict[str, str]:
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_collectives_are_called_only_in_the_communication_layer():
    outside = {
        module: uses
        for module, source in _modules().items()
        if not module.startswith(COMMUNICATION_LAYER) and module not in ELSEWHERE
        and (uses := collective_uses(source))
    }
    assert not outside, (
        f"torch.distributed collectives called outside zerolite/comm/: {outside}. Small "
        "values go through zerolite.comm.small_collectives.small_collective (it places them on "
        "the group's communication device); a flat buffer's data through its exchange "
        "(zerolite.comm.exchange); other data tensors through zerolite.comm.collectives."
    )


def test_the_communication_layer_and_each_exception_communicate():
    modules = _modules()
    layer = [
        m for m in modules if m.startswith(COMMUNICATION_LAYER) and collective_uses(modules[m])
    ]
    assert layer, "zerolite/comm/ calls no collective: the check reads the wrong files"
    idle = [m for m in ELSEWHERE if not collective_uses(modules[m])]
    assert not idle, f"listed as exceptions but call no collective: {idle}"


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndist.all_reduce(t)",
    "import torch\ntorch.distributed.all_reduce(t)",
    "from torch import distributed as d\nd.broadcast(t, 0)",
    "from torch.distributed import gather\ngather(t)",
    "import torch.distributed as dist\nf = getattr(dist, 'reduce_scatter_single', None)",
    "import torch.distributed as dist\nwork = dist.isend(t, 1)",
])
def test_the_check_sees_each_spelling(source):
    assert collective_uses(source), source


def test_the_check_ignores_queries_and_other_modules():
    source = (
        "import torch.distributed as dist\nimport torch\n"
        "dist.get_rank(); dist.is_initialized(); dist.new_group([0]); torch.cuda.synchronize()\n"
        "from zerolite.comm.collectives import all_reduce\nall_reduce(t, group)\n"
    )
    assert collective_uses(source) == []
