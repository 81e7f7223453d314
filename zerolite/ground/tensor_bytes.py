"""A CPU tensor's memory as a writable ``memoryview``, without copying.

Not through ``Tensor.numpy()``: that marks the tensor's storage not resizable for good,
and with ``offload_params`` a parked shard frees its storage by resizing it to 0 bytes
(`zerolite.params.tiered_shard`), so a shard once written to disk or saved in a checkpoint
could never be parked again.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["bytes_of"]


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes (CPU, contiguous: a non-contiguous one is copied first). The view
    keeps the tensor alive; it is valid while the tensor's storage is not resized."""
    if tensor.device.type != "cpu":
        raise ValueError(f"bytes_of() needs a CPU tensor, got one on {tensor.device}")
    tensor = tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw.keep = tensor  # type: ignore[attr-defined]  # the memory's owner lives as long as the view
    return memoryview(raw).cast("B")
