"""The device runtime (`zerolite.ground.runtime`): the only module that names CUDA in code.

- The source rule (an AST walk of every module): outside ``ground/runtime.py`` no identifier,
  attribute, import or string that code acts on (``"cuda"``, ``"rng/cuda"``) contains
  ``cuda``. Docstrings, comments and prose messages to the user (a string with a space in
  it: ``"... model.to(f'cuda:{local_rank}') ..."``) may name it. So ``grep -rn cuda
  zerolite/`` outside that module finds text for people, never a CUDA-only decision.
- Its logic on the CPU device: which device types have a runtime, the routing of each
  call to ``torch.accelerator`` where this torch has the function and the device is the
  machine's accelerator, else to the device type's module (both exercised with stand-ins
  for an accelerator torch, and a torch older than 2.6 without ``torch.accelerator``),
  the CPU's events and forked generators, and host buffers that stay pageable without CUDA.

What only a GPU runs (events on a CUDA stream, CUDA generator states, the allocator's
peaks, cudaHostRegister) is in ``tests/gpu/test_cuda.py`` and ``tests/gpu/test_cuda_paths.py``.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch

from zerolite.ground import runtime
from zerolite.state.pinned import host_buffer

PACKAGE = Path(__file__).resolve().parents[2] / "zerolite"
RUNTIME = PACKAGE / "ground" / "runtime.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _names(node: ast.AST) -> list[str]:
    """The identifiers ``node`` introduces or uses."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return []


def cuda_in_code(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every use of ``cuda`` in ``source`` that code acts on."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        found += [(getattr(node, "lineno", 0), n) for n in _names(node) if "cuda" in n]
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings and "cuda" in node.value
                and not any(c.isspace() for c in node.value)):
            found.append((node.lineno, repr(node.value)))
    return sorted(found)


def test_the_rule_sees_code_and_lets_text_through():
    source = '''
"""The docstring may say torch.cuda and "cuda"."""
import torch.cuda
from torch.cuda import Event
x = torch.cuda.current_device()  # a comment may say cuda
if device.type == "cuda":
    key = "rng/cuda"
def f(on_cuda): return on_cuda
raise ValueError("move the model with model.to('cuda:0')")
def g():
    """cuda in a function's docstring"""
'''
    lines = [line for line, _ in cuda_in_code(source)]
    assert lines == [3, 4, 5, 6, 7, 8, 8], cuda_in_code(source)


def test_only_the_runtime_module_names_cuda_in_code():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py")) if path != RUNTIME
        for line, what in cuda_in_code(path.read_text())
    ]
    assert not offenders, (
        "device-specific code outside zerolite/ground/runtime.py (route it through that "
        "module):\n" + "\n".join(offenders)
    )
    assert cuda_in_code(RUNTIME.read_text())  # the rule reads what it claims to


# ------------------------------------------------------------------ the logic on the CPU


def test_device_types_with_a_runtime():
    assert not runtime.is_accelerator(torch.device("cpu"))
    assert not runtime.is_accelerator(torch.device("meta"))
    for name in ("cuda", "cuda:1", "xpu:0", "mps"):
        assert runtime.is_accelerator(torch.device(name)), name


def test_this_machine_has_no_accelerator():
    expected = None if not torch.cuda.is_available() else "cuda"
    assert runtime.accelerator_type() == expected
    if expected is None:
        assert runtime.device_count() == 0
        assert runtime.gpu_type() == "cuda"  # NCCL's devices, named without a GPU to ask
        assert not runtime.pinning_supported()


class _Accelerator(types.SimpleNamespace):
    """A stand-in for ``torch.accelerator`` on a machine with one accelerator type."""


def _fake_accelerator(monkeypatch, kind: str = "cuda", **functions) -> list:
    calls: list = []

    def record(name, result):
        def function(*args):
            calls.append((name, args))
            return result
        return function

    fake = _Accelerator(
        is_available=lambda: True,
        current_accelerator=lambda: torch.device(kind),
        **{name: record(name, result) for name, result in functions.items()},
    )
    monkeypatch.setattr(torch, "accelerator", fake, raising=False)
    return calls


def test_calls_go_to_torch_accelerator_for_the_machines_accelerator(monkeypatch):
    calls = _fake_accelerator(monkeypatch, device_count=4, current_device_index=3,
                              memory_allocated=100, max_memory_allocated=250,
                              set_device_index=None)
    gpu = torch.device("cuda", 2)
    assert runtime.accelerator_type() == "cuda"
    assert runtime.device_count() == 4
    assert runtime.resolve(torch.device("cuda")) == torch.device("cuda", 3)
    assert runtime.resolve(gpu) == gpu  # an index given: no call
    assert runtime.resolve(torch.device("cpu")) == torch.device("cpu")
    assert (runtime.memory_allocated(gpu), runtime.max_memory_allocated(gpu)) == (100, 250)
    runtime.set_current_device(gpu)
    assert calls == [("device_count", ()), ("current_device_index", ()),
                     ("memory_allocated", (gpu,)), ("max_memory_allocated", (gpu,)),
                     ("set_device_index", (gpu,))]
    assert runtime.memory_allocated(torch.device("cpu")) == 0  # no runtime: no call
    assert len(calls) == 5


def test_torch_2_6_names_are_used_where_2_7_ones_are_missing(monkeypatch):
    calls = _fake_accelerator(monkeypatch, current_device_idx=1, set_device_idx=None)
    assert runtime.resolve(torch.device("cuda")) == torch.device("cuda", 1)
    runtime.set_current_device(torch.device("cuda", 0))
    assert [name for name, _ in calls] == ["current_device_idx", "set_device_idx"]


def test_the_device_module_serves_what_torch_accelerator_lacks(monkeypatch):
    """A ``torch.accelerator`` without a function (later releases added them one by one), and
    a device type that is not the machine's accelerator: the device type's own module answers."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    for name in ("device_count", "current_device_index", "current_device_idx",
                 "max_memory_allocated"):
        monkeypatch.delattr(torch.accelerator, name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 77)
    assert runtime.accelerator_type() == "cuda"
    assert runtime.device_count() == 2
    assert runtime.resolve(torch.device("cuda")) == torch.device("cuda", 1)
    assert runtime.max_memory_allocated(torch.device("cuda", 0)) == 77
    assert runtime._call("device_count", "cpu", "device_count") == torch.cpu.device_count()


def test_cpu_events_and_streams():
    cpu = torch.device("cpu")
    event = runtime.record_event(cpu)  # torch.cpu's: complete at once
    event.synchronize()
    runtime.synchronize_stream(cpu)  # no stream to wait for: returns
    runtime.synchronize_stream(torch.device("meta"))


def test_generators_on_the_cpu():
    cpu = torch.device("cpu")
    assert runtime.rng_state(cpu) is None and runtime.rng_state(torch.device("meta")) is None
    runtime.set_rng_state(cpu, torch.get_rng_state())  # nothing of its own to set
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with runtime.fork_rng([]):
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the CPU generator was forked
    with pytest.raises(ValueError, match="one type"):
        with runtime.fork_rng([torch.device("cuda", 0), torch.device("xpu", 0)]):
            pass


def test_host_buffers_stay_pageable_without_cuda():
    if runtime.pinning_supported():
        pytest.skip("CUDA here: tests/gpu/test_cuda.py checks pinned buffers")
    assert runtime.register_host(0, 16) is False  # no runtime call is made
    buffer = host_buffer(1000, pinned=True)
    assert buffer.untyped_storage().nbytes() == 1000 and not buffer.is_pinned()
