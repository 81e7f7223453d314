"""Where a sharded model's tensors and small collectives live: decided once, at `shard()`.

Two devices matter, and this module is the only place that decides them:

- the *buffer device*: where the flat buffers live (and so the parameters, gradient
  shards and fp32 masters): ``ZeroConfig.device``; else the parameters' own device; for a
  model built on the meta device, the CUDA device of the process group (its bound device,
  ``init_process_group(device_id=...)``, else the current CUDA device) when the group runs
  a CUDA backend other than gloo, else the CPU. ``"cuda"`` without an index means the
  current CUDA device and is resolved to it here, once.
- the *communication device* of small collectives (the step's agreement flags and
  counters, norms, overflow flags, digests of plans, generator states): the buffer device
  when its backend is not gloo (NCCL carries CUDA tensors only), else the CPU (gloo's
  fastest path). `zerolite.comm.small_collectives` moves every small collective there and back.

[Note: backends of a process group] ``dist.get_backend(pg)`` is not enough to tell what a
group can carry. On torch 2.13 it is ``"gloo"`` or ``"nccl"`` for a group created with that
name, but ``"undefined"`` for ``init_process_group()`` without a backend, and the string
itself for a per-device spec such as ``"cpu:gloo,cuda:nccl"``. ``dist.get_backend_config(pg)``
always gives the map from device type to backend: ``"cpu:gloo,cuda:gloo"`` for gloo,
``"cuda:nccl"`` for nccl, and for a backend-less init only the machine's accelerator:
``"cuda:nccl"`` on a GPU machine, ``"cpu:gloo"`` without one. `backends_of` reads that map;
everything here decides from it, never from the group's name.

`check_buffer_device` is `shard()`'s refusal of a device the group cannot carry (a CPU model
with an NCCL group), and of point-to-point exchanges over NCCL (tags are ignored there, and
two ranks that both send before they receive on one stream can deadlock).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from zerolite.ground import runtime

__all__ = [
    "backends_of",
    "buffer_device",
    "check_buffer_device",
    "communication_device",
    "meta_device",
    "parse_backend_config",
]


def parse_backend_config(text: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}`` (lower case).

    A bare backend name (older torch reports ``"nccl"``) maps the device types torch gives
    that backend (``Backend.backend_capability``), or ``cpu`` and ``cuda`` when unknown.
    """
    text = str(text).strip().lower()
    if ":" not in text:
        capable = dist.Backend.backend_capability.get(text, ["cpu", runtime.GPU_TYPE])
        return {device: text for device in capable}
    out = {}
    for pair in text.split(","):
        device, _, backend = pair.partition(":")
        out[device.strip()] = backend.strip()
    return out


def backends_of(process_group: dist.ProcessGroup | None) -> dict[str, str]:
    """Device type -> backend name of ``process_group`` (``None``: the default group);
    ``{}`` when torch.distributed is not initialised (a group of one). See
    [Note: backends of a process group]."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    try:
        return parse_backend_config(dist.get_backend_config(process_group))
    except (AttributeError, RuntimeError, ValueError):  # torch without backend configs
        return parse_backend_config(str(dist.get_backend(process_group)))


def _bound_device(process_group: dist.ProcessGroup | None) -> torch.device | None:
    """The CUDA device the group was bound to (``init_process_group(device_id=...)``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = process_group if process_group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    return None if bound is None else torch.device(bound)


def _first_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    for t in tensors:
        return t.device
    return None


def buffer_device(
    parameters: Iterable[torch.Tensor],
    configured: torch.device | None,
    process_group: dist.ProcessGroup | None,
) -> torch.device:
    """Where the flat buffers of a model live (the module docstring's rule).

    Never raises on odd input (`shard()` calls it before its validation, to know where the
    ranks' agreement travels): a model with no parameters gets ``configured`` or the CPU;
    on mixed devices the first parameter's device (`zerolite.plan.shard_plan` then refuses
    the model).

    Args:
        parameters: the model's parameters, in registration order.
        configured: ``ZeroConfig.device``.
        process_group: the data-parallel group (`zerolite.comm.hybrid.data_parallel_group`).
    """
    if configured is not None:
        return runtime.resolve(configured)
    source = _first_device(parameters)
    if source is not None and source.type != "meta":
        return source
    if source is None:
        return torch.device("cpu")
    return meta_device(backends_of(process_group), _bound_device(process_group))


def meta_device(backends: Mapping[str, str], bound: torch.device | None) -> torch.device:
    """Where a meta-built model is materialised when ``ZeroConfig.device`` is None: the
    group's CUDA device when it runs a CUDA backend other than gloo (``bound``, the group's
    ``device_id``, else the current CUDA device), otherwise the CPU.

    Args:
        backends: the group's device -> backend map (`backends_of`).
        bound: the group's bound device, if any.
    """
    for device_type, backend in backends.items():
        if runtime.is_accelerator(torch.device(device_type)) and backend != "gloo":
            return runtime.resolve(bound if bound is not None else torch.device(device_type))
    return torch.device("cpu")


def communication_device(buffers: torch.device, backends: Mapping[str, str]) -> torch.device:
    """Where small collectives run for buffers on ``buffers`` over a group with ``backends``:
    the buffer device unless its backend is gloo (or it has none), then the CPU when the
    group carries CPU tensors. With no process group (``{}``), the CPU."""
    backend = backends.get(buffers.type)
    if backend is not None and backend != "gloo":
        return buffers
    if "cpu" in backends or not backends:
        return torch.device("cpu")
    return buffers  # nothing better: `check_buffer_device` refuses such a group at shard()


def check_buffer_device(
    device: torch.device, backends: Mapping[str, str], collectives: str
) -> None:
    """Refuse, at `shard()`, buffers on ``device`` over a group with ``backends``.

    Every rank runs it before any exchange (a group that cannot carry the buffers cannot
    carry the ranks' agreement either); all ranks see the same group and, normally, the
    same device type, so all raise together.

    Raises:
        ValueError: the group has no backend for ``device``'s type (a CPU model with an
            NCCL group); ``collectives="point_to_point"`` where the buffers travel over NCCL.
    """
    if not backends:
        return
    spec = ",".join(f"{d}:{b}" for d, b in backends.items())
    backend = backends.get(device.type)
    if backend is None:
        carried = ", ".join(sorted(backends))
        raise ValueError(
            f"zerolite.shard(): the model's flat buffers would live on {device}, but the process "
            f"group's backend ({spec}) carries only {carried} tensors, so every exchange would "
            f"fail inside torch. Move the model to its GPU before shard() (model.to(f'cuda:"
            f"{{local_rank}}')) or pass ZeroConfig(device=...), or create the group with a "
            f"backend for {device.type} tensors (e.g. init_process_group('gloo') for a CPU "
            f"model)"
        )
    if collectives == "point_to_point" and backend == "nccl":
        raise ValueError(
            "ZeroConfig.collectives='point_to_point' is refused over NCCL: NCCL ignores the "
            "tags that pair zerolite's messages, and ranks that all send before they receive "
            "on one stream can deadlock. Use collectives='native' or 'auto' (native kernels on "
            "NCCL); point-to-point is for gloo"
        )
