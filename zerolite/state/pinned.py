"""Host staging buffers pinned at exactly their size.

``torch.empty(n, pin_memory=True)`` allocates through CUDA's caching host allocator, which
rounds every block up to the next power of two and keeps freed blocks for reuse: a 10.5 GB
buffer pins 16 GB, and freeing it gives nothing back. zerolite pins only what device copies
stream through (the streamed step's staging buffers, an asynchronous save's staging area),
and pins them in place instead: an ordinary host allocation of exactly ``nbytes``,
page-locked with ``cudaHostRegister`` (as ``torch.distributed.checkpoint``'s stager does,
through `zerolite.ground.runtime.register_host`) and unregistered when its storage is freed.
The kernel locks whole pages, so at most one page more than asked is locked. Without CUDA,
or where registering fails, the buffer stays pageable: copies through it are then
synchronous but still correct.

Memory that is only read and written by the host (the offload tier's host arena) is never
pinned: pinning buys nothing there.
"""

from __future__ import annotations

import weakref

import torch

from zerolite.ground import runtime

__all__ = ["host_buffer", "pinning_available"]


def pinning_available() -> bool:
    """Whether host memory can be page-locked here (CUDA present and a register succeeds)."""
    if not runtime.pinning_supported():
        return False
    probe = host_buffer(1, pinned=True)
    return probe.is_pinned()


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A 1-D uint8 host tensor of exactly ``nbytes`` (its contents are undefined).

    Args:
        nbytes: the size in bytes (>= 0).
        pinned: page-lock it for asynchronous device copies when CUDA is available (see the
            module docstring); False gives an ordinary ``torch.empty``.
    Returns:
        The tensor. ``untyped_storage().nbytes()`` is ``nbytes``: what `zerolite.memory`
        reports for it.
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes > 0 and runtime.pinning_supported():
        _register(buffer.untyped_storage())
    return buffer


def _register(storage: torch.UntypedStorage) -> None:
    """Page-lock ``storage`` until it is freed (a finaliser unregisters it first)."""
    ptr = storage.data_ptr()
    if not runtime.register_host(ptr, storage.nbytes()):
        return  # logged there; the buffer stays pageable
    # The storage object lives exactly as long as its memory (torch keeps a storage's Python
    # object alive while any tensor uses it), so this runs before the memory is freed.
    finalizer = weakref.finalize(storage, runtime.unregister_host, ptr)
    finalizer.atexit = False  # never after the device context is gone
