"""Muon + AdamW: step time of zerolite (whole-tensor ownership) against DDP, and memory.

Fixed configuration (as benchmarks/step_time.py):
    GPT: 6 layers, d_model 384, 6 heads, vocab 8192, seq 128 (tied head), fp32
    micro-batch 4 per rank, 2 ranks (gloo, CPU), 1 thread per rank
    Muon(lr 0.02, weight_decay 0.01) on the blocks' 2-D matrices, AdamW(lr 3e-4) on the rest
    per launch: 3 warm-up + 10 timed steps (--warmup, --timed); systems interleaved in rounds
Systems:
    ddp   DistributedDataParallel, both optimizers stepping every parameter on every rank
    zl1   zerolite.shard(model, [muon, adamw]) stage 1 (partition "auto" -> "tensor")
    zl2   the same, stage 2
    zl3   the same, stage 3: each block a unit ordered by owner, gathered from the owners

Per system: median step time (forward, backward, step), its ratio to DDP's median in the
same round, and per rank the model-state bytes (`zerolite.memory.footprint`) and the
elements it owns; the ownership imbalance (max/min owned elements over ranks) measured
and as `zerolite.memory.estimate` predicts it.

    python benchmarks/muon_step_time.py [--rounds 3] [--world-size 2] [--warmup 3] [--timed 10]
        [--systems ddp,zl1,zl2,zl3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, random_batch  # noqa: E402
from zerolite.memory import estimate, footprint  # noqa: E402
from zerolite.optim.multi import MultiOptimizer  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

CFG = GPTConfig(vocab_size=8192, seq_len=128, n_layer=6, n_head=6, d_model=384)
MICRO_BATCH = 4
WARMUP, TIMED = 3, 10
SYSTEMS = ("ddp", "zl1", "zl2", "zl3")


def optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' 2-D matrices, AdamW for embeddings, norms and biases."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01),
        torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.0),
    ]


class _Both:
    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)


def _one_system(system: str, warmup: int, timed: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    if system == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model)
        opt = _Both(optimizers(model))
        sharded = None
    else:
        runner = model
        sharded = zerolite.shard(
            model, optimizers(model), zerolite.ZeroConfig(stage=int(system[-1]))
        )
        opt = sharded
    rank = dist.get_rank()
    times = []
    for step in range(warmup + timed):
        x, y = random_batch(CFG, MICRO_BATCH, seed=100 * step + rank)
        start = time.perf_counter()
        runner(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    out = {"median_s": statistics.median(times)}
    if sharded is not None:
        out["model_states"] = footprint(sharded).model_states
        out["owned"] = sum(p.master.numel() for p in sharded.shard_state.pieces())
        out["imbalance"] = footprint(sharded).ownership_imbalance
    else:
        n = sum(p.numel() for p in model.parameters())
        state = sum(
            v.numel() * v.element_size()
            for o in opt.opts for s in o.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        out["model_states"] = 4 * n + 4 * n + state  # params, grads, optimizer state
        out["owned"] = n
    return out


def _round(systems: list[str], warmup: int, timed: int) -> dict:
    torch.set_num_threads(1)
    return {system: _one_system(system, warmup, timed) for system in systems}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--timed", type=int, default=TIMED)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    systems = args.systems.split(",")
    if "ddp" not in systems:
        systems.insert(0, "ddp")  # every ratio is to DDP's step in the same round
    rounds = []
    for i in range(args.rounds):
        rounds.append(run_ranks(_round, args.world_size, systems, args.warmup, args.timed,
                                timeout=1800))
        medians = {s: round(max(r[s]["median_s"] for r in rounds[-1]), 3) for s in systems}
        print(f"round {i + 1}: slowest rank's median step (s) {medians}", flush=True)
    model = GPT(CFG)
    print(f"GPT {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{args.world_size} ranks, {args.rounds} rounds x {args.timed} timed steps")
    print(f"{'system':6s} {'median ms':>10s} {'vs DDP':>14s} "
          f"{'model states per rank (MB)':>34s} {'owned elements per rank':>30s}")
    for system in systems:
        medians = [max(r[system]["median_s"] for r in rnd) for rnd in rounds]  # slowest rank
        ratios = [
            max(r[system]["median_s"] for r in rnd) / max(r["ddp"]["median_s"] for r in rnd)
            for rnd in rounds
        ]
        mem = " / ".join(f"{r[system]['model_states'] / 1e6:.1f}" for r in rounds[0])
        owned = " / ".join(f"{r[system]['owned'] / 1e6:.2f}M" for r in rounds[0])
        spread = f"{statistics.mean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{system:6s} {1e3 * statistics.median(medians):10.1f} {spread:>14s} "
              f"{mem:>34s} {owned:>30s}")
    for system in systems[1:]:
        measured = rounds[0][0][system]["imbalance"]
        predicted = estimate(
            model, world_size=args.world_size, optimizer=MultiOptimizer(optimizers(model)),
            config=zerolite.ZeroConfig(stage=int(system[-1])),
        ).ownership_imbalance
        print(f"{system} ownership imbalance (max/min owned elements): measured "
              f"{measured:.3f}, estimated {predicted:.3f}")


if __name__ == "__main__":
    main()
