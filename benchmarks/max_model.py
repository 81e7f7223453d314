"""The largest GPT that trains 3 steps at 4 ranks on this machine, per system.

Systems (AdamW, micro-batch 1 per rank, seq 32, vocab 8192, 1 thread per rank):
    ddp        DistributedDataParallel, fp32 (every rank holds everything)
    zl3        zerolite stage 3, bf16 parameters (fp32 masters), built on the meta device
    zl3-disk   the same with ZeroConfig(offload="disk") under --offload-dir
    zl3-disk-params  the same with offload_params="disk" as well: each rank's parameter and
               gradient shards are parked in files under --offload-dir between uses, so a
               rank holds a unit or two at a time, not its shard (meta build: each unit is
               materialised straight to the tier). Not in the default list: at 2.5B
               parameters it moves tens of GB per step, ~15 minutes a size on 2 cores.

There is no zl3-host-params: a host tier is an arena in the same process, so on a CPU
model it moves the shards from one part of the RSS to another and lowers nothing. It
helps a GPU model (the shards leave GPU memory for host memory), which this CPU script
does not measure.

Sizes grow d_model and n_layer together along a fixed ladder (`LADDER`, ~1M to ~3B
parameters). For each system the script starts at the largest size that its memory
estimate (`zerolite.memory.estimate` plus a per-process allowance) puts under
``--max-rss-gb`` (summed over ranks; for zl3-disk-params a conservative bound of this
script's own, `_parked_bytes`, until `estimate` counts ``offload_params``), runs it, and
steps down on failure. A run fails if
a rank's RSS passes its share of the cap (a watchdog thread ends the run before the
machine runs short, and a rank's ``VmHWM`` past it at the end fails the size too: the
watchdog samples every 20 ms), or shard() refuses the disk (not enough free space). It prints,
per system, the size, the peak RSS summed over ranks (each rank's ``VmHWM``), the phase
in which the largest rank reached its peak (build, or forward / backward / step of a
step), the bytes on disk (the optimizer tier and, for -params, the parameter tier) and
the seconds per step. A rank the watchdog stops prints the phase it was in.

    python benchmarks/max_model.py [--max-rss-gb 6] [--offload-dir DIR] [--systems ...]
    python benchmarks/max_model.py --d-model 1216 --systems zl3,zl3-disk   # one size
    python benchmarks/max_model.py --max-rss-gb 8 --systems zl3-disk-params --d-model 2368 \
        --offload-dir /scratch/zl --timeout-s 3000

``--max-rss-gb`` defaults to the machine's available memory: on a shared machine, give
a cap. The time budget (``--budget-s``, 30 min) stops stepping down when spent. Not part
of ``make test``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups, random_batch  # noqa: E402
from zerolite.memory import estimate, formula  # noqa: E402
from zerolite.state.shard_state import state_of  # noqa: E402
from zerolite.testing import RankFailure, run_ranks  # noqa: E402

WORLD = 4
STEPS = 3
SEQ, VOCAB = 32, 8192
# (d_model, n_layer): n_layer = d_model / 64, d_model in steps of 64 (each rung about
# 10-20 % more parameters than the last, so a system's largest size is found to that);
# about 12 * n_layer * d_model^2 + 2 * vocab * d_model parameters (1.4M to 3.2B).
LADDER = [(d, d // 64) for d in range(128, 2561, 64)]
SYSTEMS = ("ddp", "zl3", "zl3-disk")  # zl3-disk-params by name: a size takes ~15 minutes
# A rank's memory beyond its model states and transient buffers: the interpreter, torch,
# gloo, the allocator's slack and the activations of one short sequence.
PROCESS_BYTES = 450 * 2**20
OVER_CAP = 3  # a rank's exit code when the watchdog ends it


def _cfg(d_model: int, n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=d_model // 64,
                     d_model=d_model)


def _params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def _config(system: str, offload_dir: str) -> zerolite.ZeroConfig:
    disk = "-disk" in system
    return zerolite.ZeroConfig(stage=3, param_dtype=torch.bfloat16,
                               offload="disk" if disk else None,
                               offload_dir=offload_dir if disk else None,
                               offload_params="disk" if system.endswith("-params") else None)


def predicted_bytes(system: str, cfg: GPTConfig, offload_dir: str) -> tuple[int, int]:
    """(RSS summed over ranks, bytes on disk) this system should need for ``cfg``."""
    if system == "ddp":  # params, grads, DDP's bucket copy of the grads, Adam's 2 moments
        per_rank = formula(_params(cfg), world_size=1, stage=0).model_states
        per_rank += 4 * _params(cfg)
        return WORLD * (per_rank + PROCESS_BYTES), 0
    with torch.device("meta"):
        model = GPT(cfg)
    if system.endswith("-params"):
        return _parked_bytes(model, cfg, system, offload_dir)
    b = estimate(model, world_size=WORLD, config=_config(system, offload_dir))
    return WORLD * (b.model_states + b.transient + PROCESS_BYTES), WORLD * b.offloaded


def _parked_bytes(model: GPT, cfg: GPTConfig, system: str, offload_dir: str) -> tuple[int, int]:
    """A conservative bound for a -params system until `estimate` counts offload_params:
    the system without the parameter tier (``estimate`` of its config less
    ``offload_params``: its transient holds ``prefetch + 1`` gathered units, two gradient
    buckets and the streamed step's chunks), less the parameter and gradient shards that
    now live on the tier, plus what of them is in memory at once: the largest unit's
    parameter shard twice (the one in use and the one read ahead) and its gradient shard
    twice (the bucket reducing into it and the step's read-ahead)."""
    config = dataclasses.replace(_config(system, offload_dir), offload_params=None)
    b = estimate(model, world_size=WORLD, config=config)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    rest = _params(cfg) - cfg.n_layer * block  # the root: embeddings, final norm
    largest = -(-max(block, rest) // WORLD)  # elements of the largest unit's shard
    staged = 2 * largest * 2 + 2 * largest * 2  # bf16 parameter and gradient shards
    per_rank = b.model_states - b.params - b.grads + staged + b.transient + PROCESS_BYTES
    # On disk: the optimizer tier, plus the bf16 parameter and gradient shards.
    return WORLD * per_rank, WORLD * b.offloaded + 2 * 2 * _params(cfg)


class _Phases:
    """What this rank is doing now (for the watchdog's message) and where its ``VmHWM``
    first reached its final value (the phase that set the peak)."""

    def __init__(self) -> None:
        self.now = "build"
        self.peak_in, self._peak = "build", 0

    def enter(self, phase: str) -> None:
        self._record()
        self.now = phase

    def _record(self) -> None:
        hwm = _peak_rss()
        if hwm > self._peak:
            self.peak_in, self._peak = self.now, hwm

    def done(self) -> str:
        self._record()
        return self.peak_in


def _watch(limit: int, phases: _Phases) -> None:
    """End this rank (exit code OVER_CAP) once its RSS passes ``limit``."""
    proc = psutil.Process()

    def loop() -> None:
        while True:
            rss = proc.memory_info().rss
            if rss > limit:
                print(f"rank {dist.get_rank()} RSS {rss / 2**30:.2f} GiB passed "
                      f"{limit / 2**30:.2f} GiB in {phases.now}: stopping", flush=True)
                os._exit(OVER_CAP)
            time.sleep(0.02)

    threading.Thread(target=loop, daemon=True).start()


def _peak_rss() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024


def _rank(system: str, d_model: int, n_layer: int, offload_dir: str, limit: int) -> dict:
    phases = _Phases()
    _watch(limit, phases)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = _cfg(d_model, n_layer)
    torch.manual_seed(0)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = GPT(cfg)
        module = DistributedDataParallel(model)
        opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-4)
        offloaded = parked = 0
    else:
        with torch.device("meta"):  # materialised unit by unit by shard(): no full copy
            model = GPT(cfg)
        module = model
        opt = zerolite.shard(model, torch.optim.AdamW(param_groups(model, weight_decay=0.1),
                                                      lr=3e-4), _config(system, offload_dir))
        tier, params_tier = state_of(model).offload, state_of(model).params_tier
        offloaded = 0 if tier is None else tier.plan.nbytes
        parked = 0 if params_tier is None else params_tier.capacity
    times = []
    for step in range(STEPS):
        x, y = random_batch(cfg, WORLD, seed=step)
        dist.barrier()
        start = time.perf_counter()
        phases.enter(f"forward {step + 1}")
        loss = module(x[rank : rank + 1], y[rank : rank + 1])
        phases.enter(f"backward {step + 1}")
        loss.backward()
        phases.enter(f"step {step + 1}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        print(f"  rank {rank} step {step + 1}: {times[-1]:.1f} s, VmHWM "
              f"{_peak_rss() / 2**30:.2f} GiB", flush=True)
    return {"peak_rss": _peak_rss(), "offloaded": offloaded, "parked": parked,
            "times": times, "loss": loss.item(), "peak_in": phases.done()}


def _try(system: str, size: tuple[int, int], offload_dir: str, cap: int,
         timeout: float) -> dict | None:
    try:
        ranks = run_ranks(_rank, WORLD, system, *size, offload_dir, cap // WORLD,
                          timeout=timeout)
    except RankFailure as exc:
        first = str(exc).strip().splitlines()[-1][:160]
        print(f"  {system} {size}: failed ({first})", flush=True)
        return None
    # The watchdog samples every 20 ms and can miss a short spike: the high-water mark decides.
    over = [(i, r) for i, r in enumerate(ranks) if r["peak_rss"] > cap // WORLD]
    for i, r in over:
        print(f"  {system} {size}: failed (rank {i} VmHWM {r['peak_rss'] / 2**30:.3f} GiB passed "
              f"{cap // WORLD / 2**30:.2f} GiB, in {r['peak_in']})", flush=True)
    if over:
        return None
    return {
        "peak_rss": sum(r["peak_rss"] for r in ranks),
        "disk": sum(r["offloaded"] + r["parked"] for r in ranks),
        "parked": sum(r["parked"] for r in ranks),
        "s_per_step": sum(max(r["times"][i] for r in ranks) for i in range(STEPS)) / STEPS,
        "peak_in": max(ranks, key=lambda r: r["peak_rss"])["peak_in"],
        "rank_peak": max(r["peak_rss"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-rss-gb", type=float,
                        default=psutil.virtual_memory().available / 2**30,
                        help="cap on RSS summed over the 4 ranks, GiB (default: available RAM)")
    parser.add_argument("--offload-dir", default=tempfile.gettempdir())
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--budget-s", type=float, default=1800.0)
    parser.add_argument("--timeout-s", type=float, default=1500.0,
                        help="seconds one size may take, build and 3 steps (a disk tier of "
                             "tens of GB takes minutes per step)")
    parser.add_argument("--d-model", type=int, default=None,
                        help="run only this rung (n_layer = d_model / 64), e.g. to compare "
                             "two systems' RSS at one size")
    args = parser.parse_args()
    if args.d_model is not None and (args.d_model, args.d_model // 64) not in LADDER:
        parser.error(f"--d-model: {args.d_model} is not on the ladder (multiples of 64 from "
                     f"{LADDER[0][0]} to {LADDER[-1][0]})")
    cap = int(args.max_rss_gb * 2**30)
    started = time.perf_counter()
    print(f"cap {args.max_rss_gb:.2f} GiB RSS over {WORLD} ranks; offload dir {args.offload_dir} "
          f"({psutil.disk_usage(args.offload_dir).free / 1e9:.1f} GB free)", flush=True)
    best: dict[str, tuple[tuple[int, int], dict] | None] = {}
    for system in args.systems.split(","):
        free = psutil.disk_usage(args.offload_dir).free
        fits = []
        for i, size in enumerate(LADDER):
            rss, disk = predicted_bytes(system, _cfg(*size), args.offload_dir)
            if rss <= cap and disk <= free:
                fits.append(i)
        best[system] = None
        # Start at the estimate's largest fit; step up after a success, down after a failure
        # (the watchdog keeps every attempt under the cap, so stepping up is safe).
        i, tried = (max(fits) if fits else 0), set()
        if args.d_model is not None:
            i = LADDER.index((args.d_model, args.d_model // 64))
            tried = {j for j in range(len(LADDER)) if j != i}
        while 0 <= i < len(LADDER) and i not in tried:
            if time.perf_counter() - started > args.budget_s:
                print("  time budget spent", flush=True)
                break
            tried.add(i)
            print(f"  trying {system} d_model={LADDER[i][0]} n_layer={LADDER[i][1]}", flush=True)
            result = _try(system, LADDER[i], args.offload_dir, cap, args.timeout_s)
            if result is not None:
                if best[system] is None or best[system][0] < LADDER[i]:
                    best[system] = (LADDER[i], result)
                i += 1
            elif best[system] is None:
                i -= 1
            else:
                break
    print(f"\nlargest GPT trained {STEPS} steps at {WORLD} ranks under {args.max_rss_gb:.2f} GiB "
          f"(seq {SEQ}, vocab {VOCAB}, AdamW, micro-batch 1/rank)")
    print(f"{'system':15s} {'d_model':>7s} {'n_layer':>7s} {'params':>9s} "
          f"{'peak RSS GB':>11s} {'rank max GB':>11s} {'peak in':>10s} {'disk GB':>8s} "
          f"{'params GB':>9s} {'s/step':>7s}")
    for system, entry in best.items():
        if entry is None:
            print(f"{system:15s} {'none fits':>7s}")
            continue
        (d, n), r = entry
        print(f"{system:15s} {d:7d} {n:7d} {_params(_cfg(d, n)) / 1e6:8.1f}M "
              f"{r['peak_rss'] / 1e9:11.2f} {r['rank_peak'] / 1e9:11.2f} {r['peak_in']:>10s} "
              f"{r['disk'] / 1e9:8.2f} {r['parked'] / 1e9:9.2f} {r['s_per_step']:7.1f}")


if __name__ == "__main__":
    main()
