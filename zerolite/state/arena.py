"""Where an offload tier keeps its bytes: a preallocated file, or a host tensor.

Both take and fill CPU tensors of any dtype at byte offsets, from any thread; the
layout of what lies where is `zerolite.state.offload`'s.
"""

from __future__ import annotations

import os
import uuid
import weakref

import torch

from zerolite.ground.tensor_bytes import bytes_of

__all__ = ["DiskArena", "HostArena"]


class DiskArena:
    """A preallocated file under ``directory``, unlinked as soon as it is reserved: its
    space lives as long as the descriptor, which closes when the arena is collected or
    the process ends in any way (an OOM kill included), so no run leaves files behind
    and no two runs or models ever share one (``O_EXCL`` on a fresh random name)."""

    def __init__(self, directory: str, nbytes: int, rank: int) -> None:
        name = f"zerolite-offload-{os.getpid()}-{uuid.uuid4().hex[:12]}-rank{rank}.bin"
        self.path = os.path.join(directory, name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as exc:
            os.close(self.fd)
            raise ValueError(
                f"ZeroConfig.offload_dir: cannot reserve {nbytes} bytes in {self.path}: {exc}"
            ) from None
        finally:
            os.remove(self.path)
        self._nbytes = nbytes
        self._finalizer = weakref.finalize(self, os.close, self.fd)

    def read(self, offset: int, out: torch.Tensor) -> None:
        view = bytes_of(out)
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read from {self.path} at {offset + done}")
            done += n

    def write(self, offset: int, src: torch.Tensor) -> None:
        src = src.contiguous()
        view = bytes_of(src)
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def close(self) -> None:
        self._finalizer()

    @property
    def nbytes(self) -> int:
        """Bytes the arena reserved in its file (``os.posix_fallocate``)."""
        return self._nbytes


class HostArena:
    """One host byte tensor holding the offloaded state. Never pinned, for a CUDA model
    too: only the host reads and writes it (device copies go through the streamed step's
    pinned staging buffers, `zerolite.state.pinned`), and pinned memory from torch's caching
    host allocator would reserve the next power of two above ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.path = None

    @property
    def nbytes(self) -> int:
        """Host bytes the arena holds (exactly the layout's size)."""
        return self.data.untyped_storage().nbytes()

    def read(self, offset: int, out: torch.Tensor) -> None:
        out.view(torch.uint8).copy_(self.data[offset : offset + out.numel() * out.itemsize])

    def write(self, offset: int, src: torch.Tensor) -> None:
        self.data[offset : offset + src.numel() * src.itemsize].copy_(
            src.contiguous().view(torch.uint8)
        )

    def close(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
