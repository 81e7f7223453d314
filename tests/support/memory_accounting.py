"""Independent accounting of what a rank holds, to check `zerolite.memory.footprint` against.

- `layout_sums`: what the flat-buffer layouts imply (element counts, padding included);
- `tensor_census`: the bytes of every live tensor of the process, found through the
  garbage collector whoever holds it (`settled_census`, `census_vs_footprint`);
- `fields`, `scalar_state_bytes`: footprint's fields as a dict, and the 0-dim ``step``
  tensors formula() does not count;
- `tier_bytes_held`: what an offload tier holds, measured where it lives (the kernel's size
  of the disk tier's file, the host tier's storage), not read from its layout.
"""

from __future__ import annotations

import gc
import os
import time

import torch

from zerolite.memory import MemoryBreakdown, footprint


def layout_sums(opt) -> dict:
    """What the flat-buffer layouts say this rank holds (element counts)."""
    rank = opt.group.rank
    return {
        "flats": len(opt.flats),
        "numel": sum(f.layout.numel for f in opt.flats),
        "padding": sum(f.layout.padding for f in opt.flats),
        "shard_numel": sum(f.layout.shard_numel for f in opt.flats),
        # Optimizer state is created per piece (the part of a parameter inside this rank's
        # shard): it holds the shard's parameter elements, not its padding.
        "piece_numel": sum(pc.numel for f in opt.flats for pc in f.layout.spans(rank)),
    }


def fields(m: MemoryBreakdown) -> dict:
    return {"params": m.params, "grads": m.grads, "master": m.master,
            "optimizer_state": m.optimizer_state, "transient": m.transient, "total": m.total}


def scalar_state_bytes(opt) -> int:
    """4 bytes per 0-dim ``step`` tensor in the optimizer's state."""
    return sum(4 for st in opt.state.values()
               if isinstance(st.get("step"), torch.Tensor) and st["step"].dim() == 0)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def live_tensors() -> list[torch.Tensor]:
    """Every live strided tensor gc tracks, except objects frozen by ``gc.freeze()``."""
    gc.collect()
    # type(), not isinstance(): the latter reads __class__, which some lazy objects (e.g.
    # torch.distributed's deprecated reduce_op) answer with a FutureWarning.
    return [o for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and o.layout == torch.strided
            and o.device.type != "meta"]


def tensor_census(exclude: set[tuple[str, int]]) -> tuple[int, dict[tuple[str, int], str]]:
    """Bytes of the distinct storages of every live tensor of this process, minus ``exclude``.

    Every Python-visible tensor (``torch.Tensor`` and ``nn.Parameter`` objects are
    gc-tracked) is found through ``gc.get_objects()`` after ``gc.collect()``, whoever
    holds it. Excluded, and why:
    - ``exclude``: storages alive before the current case built its model (module-level
      tensors of torch, anything an earlier case left behind, which
      `tests.memory.test_footprint.test_dropped_model_and_optimizer_are_freed` checks
      separately). The caller keeps those tensors alive, so that their addresses cannot be
      reused meanwhile, and frozen (``gc.freeze()``), so that each pass walks only objects
      made since (speed).
    - nothing else: the test holds no tensor of its own while counting (batches and
      losses live in helper frames that have returned) and builds no other model; the
      tiny GPT has no module buffers (asserted), which footprint would not count.
    Limitation: a tensor that never had a Python object (made and held by C++ alone) is
    not seen; one whose Python object C++ keeps alive is (see `settled_census`).
    """
    sizes: dict[tuple[str, int], int] = {}
    desc: dict[tuple[str, int], str] = {}
    for t in live_tensors():
        key = storage_key(t)
        if key in exclude:
            continue
        sizes[key] = t.untyped_storage().nbytes()
        desc.setdefault(
            key, f"{type(t).__name__}{tuple(t.shape)} {t.dtype} ({sizes[key]} B storage)")
    return sum(sizes.values()), desc  # bytes; storage -> description of one tensor on it


def _footprint_storages(opt) -> set[tuple[str, int]]:
    """Storages of what footprint() reads (for failure messages only, not for the check)."""
    model = opt.model
    tensors = [f.data for f in opt.flats] + [m.data for m in opt.masters]
    tensors += [t for b in opt.buckets for t in (b.full, b.shard) if t is not None]
    tensors += [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {storage_key(t) for t in tensors}


def settled_census(exclude: set[tuple[str, int]], expected: int) -> tuple[int, dict]:
    """`tensor_census` once it has settled: if it differs from ``expected``, it is taken again
    every 20 ms (up to 0.5 s) until two readings agree.

    gloo's worker threads may still hold the tensors of a collective that has just
    returned (seen: the length and payload tensors of the consensus all-gather inside
    shard()) for a few milliseconds before dropping them; those are torch.distributed's,
    not held by the model, the optimizer or zerolite. A tensor that something does hold
    does not go away, so settling hides nothing but that race.
    """
    result = tensor_census(exclude)
    deadline = time.monotonic() + 0.5
    while result[0] != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        previous, result = result, tensor_census(exclude)
        if result[0] == previous[0]:
            break
    return result


def census_vs_footprint(opt, exclude: set[tuple[str, int]]) -> dict:
    census, storages = settled_census(exclude, footprint(opt).total)
    counted = _footprint_storages(opt)
    missed = {key: d for key, d in storages.items() if key not in counted}
    kinds = sorted({d.split(" (")[0].split(")", 1)[1].strip() for d in missed.values()})
    return {"census": census, "footprint": fields(footprint(opt)),
            "missed": sorted(missed.values()),
            "missed_summary": f"{len(missed)} storages of {kinds}"}


def tier_bytes_held(model) -> int:
    """Bytes the offload tier of ``model`` holds, or 0 without one: for ``"disk"``, the size
    the kernel reports for the (unlinked) file through this process's open descriptor of it,
    found in ``/proc/self/fd``; for ``"host"``, the bytes of the arena tensor's storage."""
    from zerolite.state.shard_state import state_of

    tier = state_of(model).offload
    if tier is None:
        return 0
    if tier.path is None:
        return tier.arena.data.untyped_storage().nbytes()
    sizes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in (tier.path, f"{tier.path} (deleted)"):
            sizes.append(os.fstat(int(fd)).st_size)
    if len(sizes) != 1:
        raise AssertionError(f"{len(sizes)} open descriptors of {tier.path}, expected 1")
    return sizes[0]
