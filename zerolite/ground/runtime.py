"""The device runtime: every call zerolite makes into an accelerator's own runtime.

The rest of the package is device-agnostic: it asks this module, never ``torch.cuda``,
for the machine's accelerator, the current device, streams and events, generator states,
allocator statistics and page-locked host memory, and it decides "does this device have a
runtime of its own" with `is_accelerator`, never with ``device.type == "cuda"``
(``tests/comm/test_runtime.py`` reads the source and keeps it so).

Each call goes to ``torch.accelerator`` where this torch has the function and the device
is of the machine's accelerator type (torch 2.6 brought devices and streams, later
releases the allocator statistics), else to the device type's own module
(``torch.get_device_module(device)``: ``torch.cuda`` on an NVIDIA GPU, ``torch.cpu`` for the
CPU). ``torch.accelerator`` gains names from release to release (zerolite supports torch
>= 2.9.1), so every ``torch.accelerator`` name is looked up, never assumed.

Page-locking host memory in place has no device-generic API: it is CUDA's
``cudaHostRegister`` (`register_host`), and on any other device a buffer stays pageable
(copies through it are then synchronous, still correct).

On the CPU: `is_accelerator` is False, `rng_state` is None, `record_event`'s event is
complete at once (host copies are synchronous), the allocator statistics are 0. The same
code path serves every accelerator type; what only an NVIDIA GPU runs is listed in
docs/limits.md ("Validated where") and checked by ``make gpu-check``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = [
    "Event",
    "accelerator_type",
    "device_count",
    "fork_rng",
    "gpu_type",
    "is_accelerator",
    "max_memory_allocated",
    "memory_allocated",
    "pinning_supported",
    "record_event",
    "register_host",
    "resolve",
    "rng_state",
    "set_current_device",
    "set_rng_state",
    "synchronize_stream",
    "unregister_host",
]

logger = logging.getLogger(__name__)

# The device type torch's GPU backends carry (NCCL's), named where no accelerator is present
# to ask: a backend map read on a CPU-only machine, a backend named without its devices.
GPU_TYPE = "cuda"
_NO_RUNTIME = ("cpu", "meta")  # device types without streams, a generator or an allocator
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class Event(Protocol):
    """What `record_event` returns (``torch.cuda.Event`` on a GPU): wait for it on the host."""

    def synchronize(self) -> None: ...


def accelerator_type() -> str | None:
    """The machine's accelerator device type (``"cuda"`` on an NVIDIA GPU), or None when
    none is available (this torch has no accelerator build, or sees no device)."""
    if not torch.accelerator.is_available():
        return None
    device = torch.accelerator.current_accelerator()
    return None if device is None else device.type


def gpu_type() -> str:
    """The accelerator type a GPU backend's devices have here: the machine's, else
    ``"cuda"`` (NCCL's, for a backend map read on a machine without one)."""
    return accelerator_type() or GPU_TYPE


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` has a runtime of its own (streams, a generator, an allocator):
    every device type but ``cpu`` and ``meta``."""
    return device.type not in _NO_RUNTIME


def device_count() -> int:
    """Devices of the machine's accelerator (0 without one)."""
    kind = accelerator_type()
    if kind is None:
        return 0
    return int(_call("device_count", kind, "device_count"))


def _call(accelerator_name: str, device_type: str, module_name: str, *args: Any) -> Any:
    """``torch.accelerator.<accelerator_name>(*args)`` when this torch has it and
    ``device_type`` is the machine's accelerator, else ``<device module>.<module_name>(*args)``."""
    accelerator = getattr(torch, "accelerator", None)
    function = getattr(accelerator, accelerator_name, None)
    if function is not None and device_type == accelerator_type():
        return function(*args)
    return getattr(torch.get_device_module(device_type), module_name)(*args)


def resolve(device: torch.device) -> torch.device:
    """``device`` with its index: an accelerator device named without one (``"cuda"``) is
    the current device of its type; any other device is returned as it is."""
    if not is_accelerator(device) or device.index is not None:
        return device
    accelerator = getattr(torch, "accelerator", None)
    name = "current_device_index" if hasattr(accelerator, "current_device_index") else (
        "current_device_idx")
    return torch.device(device.type, int(_call(name, device.type, "current_device")))


def set_current_device(device: torch.device) -> None:
    """Make ``device`` (an accelerator device with an index) the current one of its type."""
    accelerator = getattr(torch, "accelerator", None)
    name = "set_device_index" if hasattr(accelerator, "set_device_index") else "set_device_idx"
    _call(name, device.type, "set_device", device)


def synchronize_stream(device: torch.device) -> None:
    """Block the host until the work queued on ``device``'s current stream is done (no-op
    on the CPU and meta devices)."""
    if is_accelerator(device):
        _call("current_stream", device.type, "current_stream", device).synchronize()


def record_event(device: torch.device) -> Event:
    """An event recorded on ``device``'s current stream: once it completes, everything
    queued there before (device-to-host copies) has landed. On the CPU, whose copies are
    synchronous, it is complete at once."""
    module = torch.get_device_module(device.type)
    event = module.Event()
    event.record(module.current_stream(device))
    return event


# ----------------------------------------------------------------------- generator states


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The state of ``device``'s own generator (uint8; not the current device's), or None
    for the CPU and meta devices (the CPU generator is ``torch.get_rng_state()``)."""
    if not is_accelerator(device):
        return None
    return torch.get_device_module(device.type).get_rng_state(device)


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    """Set ``device``'s own generator to ``state`` (from `rng_state`)."""
    if is_accelerator(device):
        torch.get_device_module(device.type).set_rng_state(state, device)


@contextlib.contextmanager
def fork_rng(devices: Sequence[torch.device]) -> Iterator[None]:
    """``torch.random.fork_rng`` over the CPU generator and ``devices``' (accelerator
    devices of one type; an empty list forks the CPU generator alone)."""
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"fork_rng: devices of one type, got {sorted(kinds)}")
    options = {"device_type": kinds.pop()} if kinds else {}
    with torch.random.fork_rng(devices=list(devices), **options):
        yield


# ----------------------------------------------------------------------- allocator statistics


def memory_allocated(device: torch.device) -> int:
    """Bytes the caching allocator has handed out on ``device`` now (0 on the CPU)."""
    if not is_accelerator(device):
        return 0
    return int(_call("memory_allocated", device.type, "memory_allocated", device))


def max_memory_allocated(device: torch.device) -> int:
    """The most bytes allocated on ``device`` since its peak counter was last reset (never
    reset here: the counter is the user's); 0 on the CPU."""
    if not is_accelerator(device):
        return 0
    return int(_call("max_memory_allocated", device.type, "max_memory_allocated", device))


def allocation_granularity(device_type: str) -> int:
    """Bytes a storage's size is rounded up to by ``device_type``'s allocator: 512 for
    CUDA's caching allocator (its smallest block), 1 elsewhere (the CPU's allocator is
    not modelled: a storage counts its own bytes)."""
    return 512 if device_type == GPU_TYPE else 1


# ----------------------------------------------------------------------- page-locked host memory


def pinning_supported() -> bool:
    """Whether host memory can be page-locked in place here (`register_host`): CUDA only."""
    return accelerator_type() == GPU_TYPE


def register_host(ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for the accelerator (``cudaHostRegister``,
    portable to every CUDA context). Returns whether it worked; a failure is logged and
    leaves the memory pageable. False, and nothing logged, without CUDA."""
    if not pinning_supported():
        return False
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))
    if error != 0:
        logger.warning(
            "zerolite: cudaHostRegister of %d bytes failed (cudaError %d); the staging buffer "
            "stays pageable and its device copies are synchronous", nbytes, error,
        )
    return error == 0


def unregister_host(ptr: int) -> None:
    """Undo `register_host` for the memory at ``ptr`` (before it is freed)."""
    error = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if error != 0:
        logger.warning("zerolite: cudaHostUnregister failed (cudaError %d)", error)
