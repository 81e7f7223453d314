"""Checkpoint I/O side by side: zerolite (sync and async), DCP (sync and async), torch.save.

One model and optimizer for every method: the benchmark GPT (examples/gpt.py) at about
100M parameters (12 layers, d_model 768, 12 heads, vocab 16384, seq 128; tied head) with
AdamW, 2 ranks on gloo (CPU), 1 thread per rank, one training step taken first so that
the optimizer state exists. Methods:

- ``zerolite sync``: ``zerolite.checkpoint.save`` (stage 2: each rank its fp32 master and
  AdamW shard, rank 0 also the buffers), then ``load`` into a freshly sharded model;
- ``zerolite async``: ``save(..., blocking=False)``, with
  ``zerolite.checkpoint.prepare_async_save`` called after ``shard()`` (as a run that saves
  asynchronously does); blocking = the call, total = until ``wait()`` returns on every rank;
- ``zerolite async unprepared``: the same without ``prepare_async_save`` (its first save
  allocates the staging area);
- ``DCP sync`` / ``DCP async``: the model sharded with FSDP2 ``fully_shard`` (per block,
  then the root) on a CPU device mesh; ``get_state_dict`` then ``dcp.save`` /
  ``dcp.async_save`` (its background collectives on a separate gloo group, as DCP's docs
  advise); load: ``dcp.load`` + ``set_state_dict`` into a fresh FSDP2 model;
- ``torch.save (DDP)``: rank 0 writes ``{"model": ..., "optim": ...}`` of a DDP model
  (full state dict) and fsyncs it (the other methods fsync too); load: every rank
  ``torch.load(weights_only=True)`` + ``load_state_dict``.

Times are rank 0's between barriers, except blocking, the slowest rank's call. GB/s is
checkpoint bytes over total (save) or load seconds. zerolite's methods time the run's
first save apart (``1st block s``: its blocking time), then ``--rounds`` saves (default 5)
whose median is the steady state; the summary lines divide each asynchronous method's
blocking time, first and steady, by the synchronous save's steady time, per repeat (each
repeat a fresh model, optimizer and staging area). DCP saves once as a warm-up (its
``1st block s``), then the timed save. Files go to a temporary directory
(``--dir``) and are removed after each method; loads read what was just written, so
mostly from the page cache, for every method alike.

    python benchmarks/checkpoint_io.py [--repeats 1] [--dir DIR] [--small]
    python benchmarks/checkpoint_io.py --device cuda --world-size 1 [--small]

With ``--device cuda`` every model lives on the GPU of its rank and the ranks use NCCL
(one GPU allows ``--world-size 1``): saves then copy device-to-host (zerolite's
asynchronous save through its pinned staging area), and DCP's mesh is a CUDA mesh.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups, random_batch  # noqa: E402
from zerolite import checkpoint as ckpt  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

BIG = GPTConfig(vocab_size=16384, seq_len=128, n_layer=12, n_head=12, d_model=768)
DEVICE = torch.device("cpu")  # this rank's; set by `_run`
ROUNDS = 5  # zerolite's saves after the first (the steady state); set by `_run`
WARM_STEPS = 3  # zerolite's steps before its first save (the staging area is made after one)


def _model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg).to(DEVICE)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=3e-4)


def _step(cfg: GPTConfig, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = random_batch(cfg, 2, seed=dist.get_rank())
    model(x.to(DEVICE), y.to(DEVICE)).backward()
    opt.step()
    opt.zero_grad()


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


def _slowest(seconds: float) -> float:
    box: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(box, seconds)
    return max(b for b in box if b is not None)


def _bytes(path: Path) -> int:
    box = [sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _zerolite(cfg: GPTConfig, path: Path, blocking: bool, prepared: bool = True) -> dict:
    def sharded() -> tuple[torch.nn.Module, zerolite.ShardedOptimizer]:
        model = _model(cfg)
        return model, zerolite.shard(model, _optimizer(model), zerolite.ZeroConfig(stage=2))

    model, opt = sharded()
    if prepared and not blocking:  # as a run that saves asynchronously calls it, once
        ckpt.prepare_async_save(model, opt)
    for _ in range(WARM_STEPS):  # a run's first save comes some steps after its first step
        _step(cfg, model, opt)
    called: list[float] = []

    def save(target: Path) -> None:
        start = time.perf_counter()
        pending = ckpt.save(target, model, opt, blocking=blocking)
        called.append(time.perf_counter() - start)
        if not blocking:
            pending.wait()

    # The run's first save (staging area made then, unless prepared), then the steady state.
    first_total, _ = _timed(lambda: save(path.with_name(path.name + "-first")))
    totals = [_timed(lambda r=r: save(path.with_name(f"{path.name}-{r}")))[0]
              for r in range(ROUNDS)]
    total = statistics.median(totals)
    path = path.with_name(f"{path.name}-{ROUNDS - 1}")
    model = opt = None
    gc.collect()
    fresh, fresh_opt = sharded()
    load, _ = _timed(lambda: ckpt.load(path, fresh, fresh_opt))
    steady = statistics.median(_slowest(c) for c in called[1:])
    return {"first blocking": _slowest(called[0]), "first total": first_total,
            "blocking": steady, "total": total, "load": load, "bytes": _bytes(path)}


def _fsdp2(cfg: GPTConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(cfg)
    mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(model)


def _dcp(cfg: GPTConfig, path: Path, asynchronous: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp2(cfg)
    _step(cfg, model, opt)
    side_group = dist.new_group(backend="gloo") if asynchronous else None
    called: list[float] = []

    def save(target: Path) -> None:
        start = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        if asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(target), process_group=side_group)
            called.append(time.perf_counter() - start)
            future.result()
        else:
            dcp.save(state, checkpoint_id=str(target))
            called.append(time.perf_counter() - start)

    _timed(lambda: save(path.with_name(path.name + "-warm")))  # as for zerolite
    total, _ = _timed(lambda: save(path))
    model = opt = None
    gc.collect()
    fresh, fresh_opt = _fsdp2(cfg)

    def load() -> None:
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    load_s, _ = _timed(load)
    if side_group is not None:
        dist.destroy_process_group(side_group)
    return {"first blocking": _slowest(called[0]), "blocking": _slowest(called[1]),
            "total": total, "load": load_s, "bytes": _bytes(path)}


def _torch_save(cfg: GPTConfig, path: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def replicated() -> tuple[DDP, torch.optim.Optimizer]:
        model = DDP(_model(cfg), device_ids=None if DEVICE.index is None else [DEVICE.index])
        return model, _optimizer(model.module)

    model, opt = replicated()
    _step(cfg, model, opt)
    path.mkdir(parents=True, exist_ok=True)
    file = path / "checkpoint.pt"

    def save() -> None:
        if dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, file)
            with open(file, "rb+") as f:
                os.fsync(f.fileno())

    total, _ = _timed(save)
    model = opt = None
    gc.collect()
    fresh, fresh_opt = replicated()

    def load() -> None:
        state = torch.load(file, map_location=DEVICE, weights_only=True)
        fresh.module.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optim"])

    load_s, _ = _timed(load)
    return {"first blocking": total, "blocking": total, "total": total, "load": load_s,
            "bytes": _bytes(path)}


METHODS: dict[str, Callable[[GPTConfig, Path], dict]] = {
    "zerolite sync": lambda cfg, p: _zerolite(cfg, p, blocking=True),
    "zerolite async": lambda cfg, p: _zerolite(cfg, p, blocking=False),
    "zerolite async unprepared": lambda cfg, p: _zerolite(cfg, p, False, prepared=False),
    "DCP sync (FSDP2)": lambda cfg, p: _dcp(cfg, p, asynchronous=False),
    "DCP async (FSDP2)": lambda cfg, p: _dcp(cfg, p, asynchronous=True),
    "torch.save (DDP)": _torch_save,
}


def _run(root: str, repeats: int, small: bool, device: str, rounds: int,
         methods: list[str]) -> dict:
    global DEVICE, ROUNDS
    ROUNDS = rounds
    if device == "cuda":
        DEVICE = torch.device("cuda", dist.get_rank())  # run_ranks made it current
    cfg = GPTConfig() if small else BIG
    results: dict[str, list[dict]] = {name: [] for name in methods}
    for i in range(repeats):
        for name in methods:
            path = Path(root) / f"{re.sub(r'[^a-zA-Z0-9]+', '-', name)}-{i}"
            results[name].append(METHODS[name](cfg, path))
            dist.barrier()
            if dist.get_rank() == 0:
                for done in Path(root).iterdir():
                    shutil.rmtree(done, ignore_errors=True)
            gc.collect()
    params = sum(p.numel() for p in _model(cfg).parameters())
    return {"params": params, "results": results}


def _report(results: dict[str, list[dict]]) -> None:
    """Each zerolite asynchronous method's blocking time over the synchronous save's, the
    run's first save apart from the steady state; per repeat, then the median."""
    sync = results.get("zerolite sync")
    if sync is None:
        return
    for name in ("zerolite async", "zerolite async unprepared"):
        if name not in results:
            continue
        runs = list(zip(results[name], sync))
        first = [a["first blocking"] / s["total"] for a, s in runs]
        steady = [a["blocking"] / s["total"] for a, s in runs]
        print(f"{name}: blocking / synchronous save, first save "
              f"{statistics.median(first):.3f} (per repeat "
              f"{', '.join(f'{r:.3f}' for r in first)}), steady state "
              f"{statistics.median(steady):.3f} (per repeat "
              f"{', '.join(f'{r:.3f}' for r in steady)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5,
                        help="zerolite's saves after the first, per repeat (default 5)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated method names (default all), e.g. "
                             "'zerolite sync,zerolite async'")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    parser.add_argument("--small", action="store_true", help="the 11M default GPT (quick check)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods or args.rounds < 1:
        parser.error(f"--methods takes names from {list(METHODS)}; --rounds >= 1")
    backend = "nccl" if args.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        out = run_ranks(_run, args.world_size, root, args.repeats, args.small, args.device,
                        args.rounds, methods, timeout=3600, backend=backend)[0]
    print(f"GPT {out['params']:,} parameters, AdamW, {args.world_size} ranks ({backend}, "
          f"{args.device}, 1 thread each); median of {args.repeats} repeat(s), zerolite's "
          f"steady state the median of {args.rounds} saves after the first")
    print(f"{'method':27s} {'GB':>6s} {'1st block s':>11s} {'blocking s':>11s} "
          f"{'total s':>8s} {'save GB/s':>10s} {'load s':>7s} {'load GB/s':>10s}")
    for name, runs in out["results"].items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        gb = med["bytes"] / 1e9
        print(f"{name:27s} {gb:6.2f} {med['first blocking']:11.3f} {med['blocking']:11.3f} "
              f"{med['total']:8.3f} {gb / med['total']:10.2f} {med['load']:7.3f} "
              f"{gb / med['load']:10.2f}")
    _report(out["results"])


if __name__ == "__main__":
    main()
