"""`LiveTensorBytes`: the bytes of every tensor storage alive in this process, measured.

A ``TorchDispatchMode`` (as ``torch.distributed._tools.mem_tracker`` is) that sees the
result of every operation run in its thread: each storage it has not seen is counted
when it appears and uncounted when it is freed (a weak reference's callback), and a
storage resized in place (stage 3 frees and regathers units so) is recounted. Storages
alive when the mode starts are found through the garbage collector: every tensor object
of the process, the model's, the optimizer's and the user's own alike. So the count is
what a step really holds -- parameters, gradients, optimizer state, zerolite's buffers and
the activations autograd keeps -- per device type, with its peak since `reset_peak`.

Not seen: tensors made by other threads (the autograd engine runs CPU backward in the
calling thread; the offload tier's threads only fill buffers they were given), and
memory that is not a tensor storage (allocator caches, communication libraries' own
buffers: on CUDA, ``torch.cuda.max_memory_allocated`` covers the allocator's view).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes"]


class LiveTensorBytes(TorchDispatchMode):
    """Live tensor storage bytes per device type, and their peaks (module docstring).

    Use as a context manager around the code to measure; `current` and `peak` take a
    device type (``"cpu"``, ``"cuda"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._bytes: dict[int, tuple[str, int, weakref.ref]] = {}  # storage id -> entry
        self._current: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._resize = torch.UntypedStorage.resize_

    def current(self, device_type: str) -> int:
        """Bytes alive now on ``device_type``."""
        return self._current.get(device_type, 0)

    def peak(self, device_type: str) -> int:
        """The most bytes alive at once on ``device_type`` since the start or `reset_peak`."""
        return self._peak.get(device_type, 0)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self._peak = dict(self._current)

    # -- counting ------------------------------------------------------------------
    def _add(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        device = tensor.device.type
        if storage.device.type != device or storage._cdata in self._bytes:
            return  # a fake tensor's storage is on "meta": not memory of this process
        key = storage._cdata

        def freed(_: object, key: int = key) -> None:
            entry = self._bytes.pop(key, None)
            if entry is not None:
                self._current[entry[0]] -= entry[1]

        self._bytes[key] = (device, storage.nbytes(), weakref.ref(storage, freed))
        self._change(device, storage.nbytes())

    def _change(self, device: str, delta: int) -> None:
        now = self._current[device] = self._current.get(device, 0) + delta
        if now > self._peak.get(device, 0):
            self._peak[device] = now

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._bytes.get(storage._cdata)
        if entry is not None:
            device, old, ref = entry
            self._bytes[storage._cdata] = (device, storage.nbytes(), ref)
            self._change(device, storage.nbytes() - old)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    def __enter__(self) -> LiveTensorBytes:
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads __class__, which some deprecated
            # module objects answer with a warning.
            if issubclass(type(obj), torch.Tensor):
                self._add(obj)
        self.reset_peak()
        resize, tracker = self._resize, self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            tracker._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)
