"""Run zerolite on fake tensors: every operation's output counted, nothing allocated.

`fake_step` is a ``FakeTensorMode`` (torch's: tensors with shapes, dtypes and devices but
no data) that reports each operation's outputs to a `StorageLedger`, so the model, its
flat buffers, masters, buckets, activations and the optimizer's temporaries are counted
byte for byte as the real code creates and drops them, for a model of any size.

[Note: values in a simulation] A fake tensor has no values, but a step reads a few:
which parameters got gradients, the ranks' counters, lengths of byte strings. So:

- operations on small integer and boolean CPU tensors run for real (on real tensors):
  the flags and counters zerolite exchanges keep their values, and with the simulated
  world (`zerolite.memory.simulated_world`) every agreement holds;
- reading a fake value (``.item()``, ``bool(t)``) gives 0 -- no overflow, a zero norm --
  which changes no allocation zerolite makes.

Each operation is dispatched under one lock, one thread at a time (a fake mode serves one
thread at once); the offload tier's reader and writer threads run inline, which changes
no live byte since they only fill preallocated staging buffers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
)
from torch.utils._python_dispatch import _disable_current_modes

from zerolite.memory.ledger import StorageLedger
from zerolite.params import tiered_shard
from zerolite.state import offload as offload_tier

__all__ = ["fake_step"]

_aten = torch.ops.aten
_REAL_LIMIT = 16 << 20  # bytes: integer and bool CPU tensors up to this size stay real
_DEVICE = torch.ops.prim.device.default
# False: dispatch as the plain fake mode does ([Note: dispatch cost]; what
# tests/memory/test_prediction_shortcuts.py holds the shortcuts against).
SHORTCUTS = True
# Argument types torch's cache key takes as they are: their type, then the value.
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
# `torch.profiler.record_function`'s entry: no tensor in or out, a handle the exit takes.
_PROFILER_ENTER = torch.ops.profiler._record_function_enter_new.default


def _tensors(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results, appended to ``out``: an ATen
    schema nests them only in lists and tuples (``Tensor[]``, ``Tensor?[]``, a tuple of
    results), so this walk finds what ``tree_leaves`` would, without its per-node type
    lookups (it ran twice per operation, a sixth of a prediction's time)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, out)
    return out


def _integral(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex)


def _stays_real(t: torch.Tensor) -> bool:
    """A real (not fake) small integer or bool CPU tensor ([Note: values in a simulation])."""
    return (
        not isinstance(t, FakeTensor)
        and _integral(t)
        and t.device.type == "cpu"
        and t.untyped_storage().nbytes() <= _REAL_LIMIT
    )


def _zero_of(func: Any) -> Any:
    """The value a read of a fake tensor gives: 0 of the operation's return type."""
    returns = str(func._schema.returns[0].type) if func._schema.returns else ""
    return {"bool": False, "int": 0, "float": 0.0}.get(returns, 0)


def _zero_of_dtype(dtype: torch.dtype) -> bool | float | int:
    """What ``.item()`` of a fake tensor of ``dtype`` gives."""
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point else 0


class _LedgerMode(FakeTensorMode):
    """``FakeTensorMode`` that keeps small integer tensors real and reports outputs.

    [Note: dispatch cost] A prediction is a few hundred thousand dispatches, so their
    fixed cost is most of its time; three things cut it without changing any result:

    - ``prim.device`` (every ``.device`` of a fake tensor, over half of all dispatches)
      is answered first, as the fake mode's own handler answers it: no storage comes
      of it; so is `torch.profiler.record_function`'s entry (zerolite marks each
      exchange with one), run as it runs outside the mode: no tensor goes in or out,
      and the fake mode would take it on its slowest path;
    - the fake mode is entered through its ``dispatch``, and this class's
      ``__torch_dispatch__`` is unwrapped from the "no torch.compile here" guard a
      dispatch mode gets (nothing here is compiled);
    - the dispatch cache's key of a plain fake tensor is one tuple of what torch's key
      holds (`_fake_key`), built directly instead of through its metadata record: a key
      as fine as torch's or finer, so a cached output is the one the op would make; and
      a cache hit's output is made as torch makes it, in one step (`_output_tensor`):
      its meta tensor with only torch dispatch off (torch enters its kernel-invocation
      state, which only ops on fake tensors read), its Python fields copied from one
      fake tensor torch's constructor made (`_FakeFields`: that constructor checks its
      arguments and sets twenty fields one by one, a seventh of a prediction's time).

    Only `SHORTCUTS` at construction turns them on (the guard is off either way).
    """

    def __init__(self, ledger: StorageLedger) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.ledger = ledger
        self._shortcuts = SHORTCUTS
        self._fields = _FakeFields.of(self) if SHORTCUTS else None
        self._lock = threading.RLock()
        self._local = threading.local()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE and len(args) == 1 and type(args[0]) is FakeTensor \
                and self._shortcuts:
            return args[0].fake_device
        kwargs = kwargs or {}
        with self._lock:
            if getattr(self._local, "inside", False):  # the fake mode's own decompositions
                return self._fake(func, types, args, kwargs)
            self._local.inside = True
            try:
                out = self._run(func, types, args, kwargs)
            finally:
                self._local.inside = False
            for t in _tensors(out, []):
                self.ledger.saw(t)
            return out

    def _fake(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        first = args[0] if args else None
        if func is _aten._local_scalar_dense.default and (
            isinstance(first, FakeTensor) and first.constant is None
        ):
            return _zero_of_dtype(first.dtype)
        try:
            if self._shortcuts:
                return self.dispatch(func, types, args, kwargs)
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DataDependentOutputException:
            return _zero_of(func)

    def _run(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is _PROFILER_ENTER and self._shortcuts:
            with _disable_current_modes():
                return func(*args, **kwargs)
        tensors = _tensors(kwargs, _tensors(args, []))
        if tensors and all(_stays_real(t) for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        out = self._fake(func, types, args, kwargs)
        if tensors:
            return out
        # A factory: real if what it made is a small integer tensor.
        made = _tensors(out, [])
        if made and all(_integral(t) and t.device.type == "cpu" for t in made) and sum(
            t.numel() * t.element_size() for t in made
        ) <= _REAL_LIMIT:
            with _disable_current_modes():
                return func(*args, **kwargs)
        return out


# Without the guard `TorchDispatchMode.__init_subclass__` put around it ([Note: dispatch cost]).
_LedgerMode.__torch_dispatch__ = inspect.unwrap(  # type: ignore[method-assign]
    _LedgerMode.__dict__["__torch_dispatch__"]
)


def _prep_args_for_hash(self: _LedgerMode, result: list, args: Any, state: Any,
                        id_hashed_objects: list) -> None:
    """The dispatch cache key's part for ``args`` ([Note: dispatch cost]): torch's, but a
    plain fake tensor of this mode is one `_fake_key` tuple, and a plain scalar is put
    as torch puts it (its type, then itself) without torch's chain of type tests."""
    base = FakeTensorMode._prep_args_for_hash
    if isinstance(args, dict) or not self._shortcuts:
        base(self, result, args, state, id_hashed_objects)
        return
    if isinstance(args, (list, tuple)):
        result.append(type(args))
        result.append(f"length_{len(args)}")
    for arg in args:
        kind = type(arg)
        if kind is FakeTensor and arg.fake_mode is self and arg.constant is None \
                and arg.layout is torch.strided:
            result.append(_fake_key(arg))
        elif kind in _PLAIN:
            result.append(kind)
            result.append(arg)
        elif kind is list or kind is tuple:
            _prep_args_for_hash(self, result, arg, state, id_hashed_objects)
        else:
            base(self, result, (arg,), state, id_hashed_objects)


def _output_tensor(self: _LedgerMode, state: Any, entry: Any, key: Any, func: Any,
                   args: Any) -> Any:
    """A cache hit's output tensor ([Note: dispatch cost]): torch's, made in one step
    for the common case -- a new dense tensor or a view of an argument, of plain integer
    sizes, neither conjugate nor negative -- and by torch otherwise."""
    meta = entry.metadata
    if (not self._shortcuts or self.shape_env is not None or entry.inplace_idx is not None
            or meta is None or meta.layout is not torch.strided or meta.is_conj
            or meta.is_neg or type(meta.storage_offset) is not int
            or not all(type(n) is int for n in (*meta.shape, *meta.stride))):
        return FakeTensorMode._get_output_tensor_from_cache_entry(self, state, entry, key,
                                                                  func, args)
    # Only plain meta tensors are made here (no fake tensor goes in), so no mode may see
    # them, and the fake mode's kernel-invocation state (what a fake tensor's ops read)
    # is not needed.
    with torch._C._DisableTorchDispatch():
        empty = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta",
                                    requires_grad=meta.requires_grad)
        if isinstance(func, torch._ops.OpOverload) and func.is_view:
            # a view shares its argument's storage
            empty.set_(args[entry.view_idx].untyped_storage(), meta.storage_offset,
                       meta.shape, meta.stride)
    if self._fields is not None and (meta.device.type == "cpu" or meta.device.index is not None):
        return self._fields.made(empty, meta.device)
    return FakeTensor(self, empty, meta.device)


class _FakeFields:
    """A new fake tensor of one mode, made as torch's ``FakeTensor(mode, elem, device)``
    makes it for a device it need not normalise (the CPU, or one with an index): the
    subclass over ``elem``, the mutable-data-pointer guard, then the Python fields --
    the same for every tensor of the mode but the device -- copied at once from a fake
    tensor torch made (`of`)."""

    def __init__(self, fields: dict[str, Any], device_field: str, guard: Any) -> None:
        self._fields = fields
        self._device_field = device_field
        self._guard = guard

    @classmethod
    def of(cls, mode: FakeTensorMode) -> _FakeFields | None:
        """The fields of ``mode``'s fake tensors, from one torch makes; None (make each
        with torch's constructor) where they are not plain per-mode values and one
        device field, or torch's debug mode records a traceback per tensor."""
        guard = getattr(torch._C, "_set_warn_deprecated_on_mutable_data_ptr"
                        if mode._allow_unsafe_data_ptr_access
                        else "_set_throw_on_mutable_data_ptr", None)
        if guard is None or FakeTensorConfig.debug:
            return None
        cpu = torch.device("cpu")
        try:
            made = FakeTensor(mode, torch.empty(0, device="meta"), cpu)
        except Exception:  # noqa: BLE001 - another constructor: keep torch's
            return None
        fields = dict(made.__dict__)
        devices = [k for k, v in fields.items() if isinstance(v, torch.device)]
        if len(devices) != 1 or fields[devices[0]] != cpu or made.fake_device != cpu or any(
                v is not None and v is not mode for k, v in fields.items() if k not in devices):
            return None
        return cls(fields, devices[0], guard)

    def made(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """A fake tensor over the meta tensor ``elem``, on ``device``."""
        out = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad,
                                          dispatch_device=True,
                                          device_for_backend_keys=device)
        self._guard(out)
        fields = out.__dict__
        fields.update(self._fields)
        fields[self._device_field] = device
        return out


# torch's key builder takes (result, args, state, id_hashed_objects) on the torch zerolite is
# tested with (and its cache entries this metadata); where not, key and outputs stay torch's.
if list(inspect.signature(FakeTensorMode._prep_args_for_hash).parameters) == [
    "self", "result", "args", "state", "id_hashed_objects"
]:
    _LedgerMode._prep_args_for_hash = _prep_args_for_hash  # type: ignore[method-assign]
    _LedgerMode._get_output_tensor_from_cache_entry = _output_tensor  # type: ignore[method-assign]


def _fake_key(t: FakeTensor) -> tuple:
    """What the dispatch cache's key records of a dense fake tensor (torch's
    ``TensorMetadata``: its memory format follows from the sizes and strides, its sparse
    fields are empty), as one tuple. No other part of a key is a tuple (torch flattens
    lists and tuples into the key), so this one cannot match anything else."""
    return (t.dtype, tuple(t.shape), t.stride(), t.fake_device, t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, t.is_quantized, t.is_conj(),
            t.is_neg(), t.is_inference())


class _Inline(Executor):
    """Runs each task when it is submitted (the offload tier's threads, simulated)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


@contextlib.contextmanager
def fake_step(ledger: StorageLedger) -> Iterator[_LedgerMode]:
    """Inside the block, tensors are fake and every storage is reported to ``ledger``.

    Also inside: storage resizes are reported (stage 3 frees and regrows units in place),
    the offload tier's threads run inline, and zerolite's info logs and torch's warnings
    about fake tensors are silenced. The caller's random generator state is restored.
    """
    original_resize = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original_resize(storage, size)
        ledger.resized(storage)
        return out

    zerolite_logger = logging.getLogger("zerolite")
    level = zerolite_logger.level
    threads = offload_tier.ThreadPoolExecutor
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    offload_tier.ThreadPoolExecutor = lambda *a, **k: _Inline()  # type: ignore[misc,assignment]
    tiered_shard.ThreadPoolExecutor = lambda *a, **k: _Inline()  # type: ignore[misc,assignment]
    zerolite_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            with _LedgerMode(ledger) as mode:
                yield mode
    finally:
        torch.UntypedStorage.resize_ = original_resize  # type: ignore[method-assign]
        offload_tier.ThreadPoolExecutor = threads  # type: ignore[misc]
        tiered_shard.ThreadPoolExecutor = threads  # type: ignore[misc]
        zerolite_logger.setLevel(level)
