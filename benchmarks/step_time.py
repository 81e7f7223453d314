"""Step time of zerolite against DDP and PyTorch's ZeRO-1, side by side.

Fixed configuration (stated here and in docs/benchmarks.md):
    GPT: 6 layers, d_model 384, 6 heads, vocab 8192, seq 128 (tied head)
    micro-batch 4 per rank, AdamW(lr 3e-4, weight_decay 0.1), 2 ranks, 1 thread per rank
    per launch: 3 warm-up + 10 timed steps; systems interleaved in rounds (>= 5)
Systems, in fp32 and bf16 (torch's peers use CPU autocast for bf16; zerolite keeps bf16
parameters with fp32 master shards):
    ddp      DistributedDataParallel + AdamW
    zero1    DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    fsdp2    torch's fully_shard per block + root (bf16 via MixedPrecisionPolicy)
    zl1/zl2/zl3  zerolite.shard stage 1 / 2 / 3
    zl2-disk/zl3-disk  stage 2 / 3 with ZeroConfig(offload="disk") under --offload-dir
        (not in the default list; its rows add the step-time ratio to the same stage in
        RAM, the tier's bytes and the peak RSS per rank measured by `zerolite.memory.track`)
    zl3-disk-params  stage 3 with ZeroConfig(offload="disk", offload_params="disk"): the
        parameter and gradient shards parked on disk between uses as well (not in the
        default list; its rows compare it with zl3-disk: step-time ratio, the tier's bytes
        (optimizer tier + parameter tier), peak RSS per rank, and the RSS drop over the
        parameter and gradient bytes moved to the parameter tier)
    zl2-hybrid/zl3-hybrid  stage 2 / 3 with ZeroConfig(shard_group_size=--node-size):
                 sharded within each "node" of --node-size consecutive ranks, gradient
                 shards all-reduced across nodes (not in the default list)
    zl2-hybrid-q/zl3-hybrid-q  the same with quantize_gather and quantize_reduce: int8
                 blocks within the node and, for the gradient shards, across nodes
                 (`zerolite.comm.quantized_replicas`; not in the default list)

Per system it prints the median step time, its ratio ("x base") to DDP's median in the
same round (a -disk system: to the same stage in RAM; a -params system: to the same stage
with the optimizer tier only; mean and spread over rounds), tokens/s,
model-state bytes per rank and their ratio to
`zerolite.memory.formula`, transient bytes, and logical elements per collective kind per
step, counted by a pass-through spy on torch.distributed in a separate counting step
(elements one rank sends, as a ring would: all-reduce 2(N-1)/N of the buffer,
all-gather and reduce-scatter (N-1)/N, point-to-point what is sent, N the call's group),
and the same elements split by link: within a "node" (``--node-size`` consecutive ranks)
or across nodes, and the bytes per link ("within MB", "across MB": elements times their
size, so the int8 codes and fp32 scales of a quantized message count as the bytes they
are). A point-to-point send is on one link; a collective whose group spans nodes is
counted across in full (an upper bound: a ring crosses nodes on some hops only).

    python benchmarks/step_time.py --world-size 4 --systems zl2,zl2-hybrid --rounds 2
    python benchmarks/step_time.py --world-size 4 --node-size 2 --systems zl2-hybrid,zl2-hybrid-q

    python benchmarks/step_time.py [--rounds 5] [--dtypes fp32,bf16] [--device cuda]
    python benchmarks/step_time.py --systems zl2,zl3,zl2-disk,zl3-disk --dtypes bf16
    python benchmarks/step_time.py --systems zl3,zl3-disk,zl3-disk-params --dtypes bf16

With ``--device cuda`` every system runs on the GPU with NCCL (one lent GPU allows
world size 1 only: ``--world-size 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from benchmarks.wire_count import CommSpy  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups, random_batch  # noqa: E402
from zerolite.memory import footprint, formula, track  # noqa: E402
from zerolite.state.shard_state import state_of  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

CFG = GPTConfig(vocab_size=8192, seq_len=128, n_layer=6, n_head=6, d_model=384)
MICRO_BATCH = 4
WARMUP, TIMED = 3, 10
TRACKED = 5  # zerolite systems: steps after the timed ones, each peak RSS read by track()
SYSTEMS = ("ddp", "zero1", "fsdp2", "zl1", "zl2", "zl3")
STAGE = {"ddp": 0, "zero1": 1, "fsdp2": 3, "zl1": 1, "zl2": 2, "zl3": 3, "zl2-disk": 2,
         "zl3-disk": 3, "zl3-disk-params": 3, "zl2-hybrid": 2, "zl3-hybrid": 3,
         "zl2-hybrid-q": 2, "zl3-hybrid-q": 3}


def _base(system: str) -> str:
    """The system a row's "x base" divides by: a -params system by the same stage with the
    optimizer tier only, a -disk one by the same stage in RAM, the rest by DDP."""
    if system.endswith("-params"):
        return system.removesuffix("-params")
    return system.removesuffix("-disk") if system.endswith("-disk") else "ddp"


def _census(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _build(system: str, dtype: str, device: torch.device, offload_dir: str, node_size: int):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    groups = param_groups(model, weight_decay=0.1)
    autocast = contextlib.nullcontext
    if system.startswith("zl"):
        offload = "disk" if "-disk" in system else None
        cfg = zerolite.ZeroConfig(
            stage=STAGE[system], param_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            offload=offload, offload_dir=offload_dir if offload else None,
            offload_params="disk" if system.endswith("-params") else None,
            shard_group_size=node_size if "-hybrid" in system else None,
            quantize_gather=system.endswith("-q"), quantize_reduce=system.endswith("-q"),
        )
        opt = zerolite.shard(model, torch.optim.AdamW(groups, lr=3e-4), cfg)
        return model, model, opt, autocast, lambda: footprint(opt)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-4)

        def measure_fsdp():
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            grads = [
                g.to_local() if hasattr(g, "to_local") else g
                for g in (p.grad for p in model.parameters())
            ]
            state = [
                v.to_local() if hasattr(v, "to_local") else v
                for st in opt.state.values()
                for v in st.values()
            ]
            return zerolite.memory.MemoryBreakdown(
                params=_census(local), grads=_census(grads), optimizer_state=_census(state)
            )

        return model, model, opt, autocast, measure_fsdp
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    if dtype == "bf16":
        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)
    if system == "ddp":
        opt = torch.optim.AdamW(groups, lr=3e-4)
    else:
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4, weight_decay=0.1
        )

    def measure():
        state = [v for s in opt.state.values() for v in s.values()] if system == "ddp" else [
            v for s in opt.optim.state.values() for v in s.values()]
        params = _census(model.parameters())
        grads = _census(p.grad for p in model.parameters())
        return zerolite.memory.MemoryBreakdown(
            params=params, grads=grads, optimizer_state=_census(state)
        )

    ddp._zerolite_bench_hook = allreduce_hook  # registered only for the counting step
    return model, ddp, opt, autocast, measure


def _one_step(module, opt, autocast, x, y, after_step=None):
    with autocast():
        loss = module(x, y)
    loss.backward()
    opt.step()
    if after_step is not None:
        after_step()  # gradients still held: DDP's count as model states
    opt.zero_grad(set_to_none=True)
    return loss


def _run_system(
    system: str, dtype: str, device_name: str, offload_dir: str, node_size: int
) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    device = torch.device(device_name, rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, module, opt, autocast, measure = _build(system, dtype, device, offload_dir, node_size)
    result = _timed(model, module, opt, autocast, measure, system, device, node_size)
    if system.startswith("zl"):  # more steps, each tracked (hooks would skew the timing)
        rank, world = dist.get_rank(), dist.get_world_size()
        peaks, held = [], []
        for s in range(TRACKED):
            x, y = random_batch(CFG, MICRO_BATCH * world, seed=s)
            rss0 = psutil.Process().memory_info().rss  # what track() grows from, at its start
            with track(opt) as t:
                _one_step(module, opt, autocast, x[rank::world].to(device),
                          y[rank::world].to(device))
            peaks.append(rss0 + max(p.process for p in t.peaks.values()))
            held.append(_heap_in_use())
        # RSS moves by tens of MB from step to step (activations, the allocator): a median.
        result["rss_peak"] = statistics.median(peaks)
        result["held"] = None if None in held else statistics.median(held)
        result["offloaded"] = t.offloaded
        params_tier = state_of(model).params_tier
        result["params_tier"] = 0 if params_tier is None else params_tier.capacity
    return result


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_in_use() -> int | None:
    """Bytes the process's malloc has handed out and not taken back (glibc's
    ``mallinfo2``: in-use heap chunks plus mmapped ones), or None elsewhere. Unlike RSS it
    leaves out freed memory the allocator keeps for reuse."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _timed(model, module, opt, autocast, measure, system, device, node_size) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [random_batch(CFG, MICRO_BATCH * world, seed=s) for s in range(WARMUP + TIMED + 1)]
    batches = [(x[rank::world].to(device), y[rank::world].to(device)) for x, y in batches]
    times = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cpu = []  # this process's CPU seconds (all threads): less sensitive to a loaded machine
    for i, (x, y) in enumerate(batches[:-1]):
        dist.barrier()
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        _one_step(module, opt, autocast, x, y)
        sync()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    # Counting step: a pass-through spy, DDP's all-reduce made visible through its Python hook.
    if system in ("ddp", "zero1"):
        module.register_comm_hook(None, module._zerolite_bench_hook)
    measured = []
    with CommSpy(node_size) as spy:
        _one_step(
            module, opt, autocast, *batches[-1], after_step=lambda: measured.append(measure())
        )
    mem = measured[0]
    return {"times": times, "cpu": cpu, "elements": dict(spy.elements),
            "bytes": dict(spy.bytes), "links": spy.links, "link_bytes": spy.link_bytes,
            "memory": mem,
            "numel": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--offload-dir", default=tempfile.gettempdir(),
                        help="directory of the -disk systems' files (default: the temp dir)")
    parser.add_argument("--node-size", type=int, default=2,
                        help="ranks per 'node': the hybrid systems' shard_group_size, and "
                        "the split of elements by link")
    args = parser.parse_args()
    os.makedirs(args.offload_dir, exist_ok=True)
    backend = "nccl" if args.device == "cuda" else "gloo"
    systems = args.systems.split(",")
    results: dict[tuple[str, str], list[dict]] = defaultdict(list)
    ratios: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in range(args.rounds):
        for dtype in args.dtypes.split(","):
            # Rotate the order each round so that drift does not favour one system.
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            medians = {}
            for system in order:
                ranks = run_ranks(_run_system, args.world_size, system, dtype, args.device,
                                  args.offload_dir, args.node_size, timeout=600,
                                  backend=backend)
                result = ranks[0]
                medians[system] = statistics.median(
                    max(rr["times"][i] for rr in ranks) for i in range(TIMED)
                )
                results[(system, dtype)].append(result)
            for system in systems:
                base = _base(system)
                if base in medians:
                    ratios[(system, dtype)].append(medians[system] / medians[base])
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    tokens = MICRO_BATCH * CFG.seq_len * args.world_size
    print(f"\n{CFG}, micro-batch {MICRO_BATCH}/rank, {args.world_size} ranks, {args.device}, "
          f"{args.rounds} rounds x {TIMED} timed steps")
    header = (
        f"{'system':15s} {'dtype':5s} {'median ms':>9s} {'x base':>6s} {'spread':>13s} "
        f"{'tok/s':>7s} {'states MB':>9s} {'/formula':>8s} {'trans MB':>8s} {'wire MB':>7s} "
        f"{'within M':>8s} {'across M':>8s} {'within MB':>9s} {'across MB':>9s}  "
        "elements per step by call"
    )
    print(header)
    for dtype in args.dtypes.split(","):
        for system in systems:
            runs = results[(system, dtype)]
            med = statistics.median(t for run in runs for t in run["times"])
            rs = ratios[(system, dtype)] or [math.nan]
            mem = runs[-1]["memory"]
            ref = formula(runs[-1]["numel"], world_size=args.world_size, stage=STAGE[system],
                          param_dtype=torch.bfloat16 if dtype == "bf16" and system.startswith("zl")
                          else torch.float32,
                          offload="disk" if "-disk" in system else None,
                          shard_group_size=args.node_size if "-hybrid" in system else None,
                          quantize_gather=system.endswith("-q"),
                          error_feedback=system.endswith("-q"))
            elements = ", ".join(
                f"{k}={v / 1e6:.2f}M" for k, v in sorted(runs[-1]["elements"].items())
            )
            links, link_bytes = runs[-1]["links"], runs[-1]["link_bytes"]
            print(
                f"{system:15s} {dtype:5s} {med * 1e3:9.1f} {statistics.mean(rs):6.3f} "
                f"{min(rs):6.3f}-{max(rs):6.3f} {tokens / med:7.0f} {mem.model_states / 1e6:9.1f} "
                f"{mem.model_states / ref.model_states:8.3f} {mem.transient / 1e6:8.1f} "
                f"{sum(runs[-1]['bytes'].values()) / 1e6:7.1f} "
                f"{links['within'] / 1e6:8.2f} {links['across'] / 1e6:8.2f} "
                f"{link_bytes['within'] / 1e6:9.2f} {link_bytes['across'] / 1e6:9.2f}  {elements}"
            )
    _offload_table(systems, args.dtypes.split(","), results)


def _offload_table(systems, dtypes, results) -> None:
    """Per tiered system whose base ran too (a -disk system: the same stage in RAM; a
    -params system: the same stage with the optimizer tier only): the resident drop (peak
    RSS per rank, by track()) against the bytes it moved to its tier ("moved": the
    optimizer tier of a -disk row, the parameter tier of a -params row), the tier's bytes
    in all (optimizer tier + parameter tier), and the drop in bytes malloc holds after the
    step (glibc only; RSS also counts freed memory the allocator keeps, which varies by
    tens of MB from run to run)."""
    rows = [s for s in systems if s.endswith(("-disk", "-params")) and _base(s) in systems]
    if not rows:
        return
    print("\n'x base' of a -disk row is its step time over the same stage in RAM; of a -params "
          "row, over the same stage with the optimizer tier only. 'moved': the bytes this "
          "row's tier took over from its base (-disk: optimizer state; -params: parameter "
          "and gradient shards); 'tier': all bytes on disk.")
    print(f"{'system':15s} {'dtype':5s} {'RSS MB base':>11s} {'RSS MB':>8s} "
          f"{'drop MB':>8s} {'moved MB':>8s} {'drop/moved':>10s} {'tier MB':>8s} "
          f"{'CPU ms base':>11s} {'CPU ms':>8s} {'CPU x':>6s} {'held drop MB':>12s} "
          f"{'held/moved':>10s}")
    for dtype in dtypes:
        for system in rows:
            base = results[(_base(system), dtype)]
            tiered = results[(system, dtype)]
            # Rank 0's peak RSS per step as track() saw it: median over steps, then rounds.
            base_rss = statistics.median(r["rss_peak"] for r in base)
            rss = statistics.median(r["rss_peak"] for r in tiered)
            last = tiered[-1]
            moved = last["params_tier"] if system.endswith("-params") else last["offloaded"]
            # Rank 0's CPU time per timed step (its threads included), median over all.
            base_cpu = statistics.median(c for r in base for c in r["cpu"])
            cpu = statistics.median(c for r in tiered for c in r["cpu"])
            held = [statistics.median(r["held"] for r in runs) if runs[0]["held"] else None
                    for runs in (base, tiered)]
            held_drop = (f"{(held[0] - held[1]) / 1e6:12.1f} {(held[0] - held[1]) / moved:10.2f}"
                         if None not in held else f"{'n/a':>12s} {'n/a':>10s}")
            print(f"{system:15s} {dtype:5s} {base_rss / 1e6:11.1f} {rss / 1e6:8.1f} "
                  f"{(base_rss - rss) / 1e6:8.1f} {moved / 1e6:8.1f} "
                  f"{(base_rss - rss) / moved:10.2f} "
                  f"{(last['offloaded'] + last['params_tier']) / 1e6:8.1f} {base_cpu * 1e3:11.1f} "
                  f"{cpu * 1e3:8.1f} {cpu / base_cpu:6.3f} {held_drop}")


if __name__ == "__main__":
    main()
