"""Quantized collectives: accuracy, bytes on the wire and step time, against unquantized.

Accuracy: examples/train_gpt.py's training (its GPT: 4 layers, d_model 128, vocab 256,
seq 128; its data: the standard library's source as bytes; AdamW(lr 2e-3, betas
(0.9, 0.95), weight decay 0.1), 20-step warm-up, clipping at 1.0, micro-batch 8 per rank)
on 2 gloo ranks, bf16 parameters, run with zerolite.shard directly (the same arithmetic as
its Accelerate loop). Per stage (2, 3), setting (none, gather, reduce, both,
reduce / both without error feedback, and reduce with coarse 4096-element blocks with and
without error feedback) and seed (``--seeds``: the initial weights and where in the text
the batches come from) it trains once; it prints the mean loss over the last 50 steps
averaged over seeds, and its relative difference to the unquantized run of the same seed
(mean and range over seeds: bf16 rounding alone moves a single run by about half a
percent, so one seed cannot resolve a 1 % goal). It draws seed 0's loss curves into
benchmarks/quantized_accuracy.png (only where matplotlib is installed: it is not a
zerolite dependency).

Wire and time: benchmarks/step_time.py's GPT (6 layers, d_model 384, vocab 8192, seq 128,
micro-batch 4 per rank) at 2 ranks: bytes one rank sends per step (counted by
step_time.py's pass-through spy) and the median step time, quantized (both switches) vs
unquantized, fp32 and bf16, stages 2 and 3; and, from those, the link bandwidth below
which quantizing pays for its own cost (the saved bytes divided by the extra time).

Codec: the quantizer's own cost on one thread, without communication, and the link speed
below which it pays (less noisy than step times on a shared machine).

    python benchmarks/quantized_accuracy.py [--steps 300] [--stages 2,3] [--seeds 3]
        [--settings none,reduce,...] [--parts accuracy,wire,codec] [--save runs.json]

Error feedback's effect at the loss level is clearest where a block's scale is set by one
loud element: benchmarks/error_feedback_toy.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from benchmarks.step_time import CFG as BENCH  # noqa: E402
from benchmarks.step_time import MICRO_BATCH  # noqa: E402
from benchmarks.wire_count import CommSpy  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups, random_batch  # noqa: E402
from examples.train_gpt import batch_at, stdlib_text  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

TRAIN_GPT = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
# label -> ZeroConfig fields
SETTINGS = {
    "none": {},
    "gather": {"quantize_gather": True},
    "reduce": {"quantize_reduce": True},
    "both": {"quantize_gather": True, "quantize_reduce": True},
    "reduce no-EF": {"quantize_reduce": True, "error_feedback": False},
    "both no-EF": {"quantize_gather": True, "quantize_reduce": True, "error_feedback": False},
    # Coarse blocks (larger quantization errors) make error feedback's effect larger.
    "reduce B=4096": {"quantize_reduce": True, "quant_block": 4096},
    "reduce B=4096 no-EF": {"quantize_reduce": True, "quant_block": 4096,
                              "error_feedback": False},
}
LAST = 50
SEED_STRIDE = 100_000  # seed s reads the batches of steps s * SEED_STRIDE + i
PNG = ROOT / "benchmarks" / "quantized_accuracy.png"


def _train_rank(stage: int, setting: str, steps: int, seed: int) -> dict:
    """train_gpt.py's loop on this rank; returns per-step mean loss over ranks and times.
    ``seed`` picks the initial weights and where in the text the batches come from."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(TRAIN_GPT)
    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=0.1), lr=2e-3, betas=(0.9, 0.95)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    config = zerolite.ZeroConfig(stage=stage, param_dtype=torch.bfloat16, **SETTINGS[setting])
    opt = zerolite.shard(model, optimizer, config)
    tokens = stdlib_text(4_000_000)
    losses, times = [], []
    for step in range(steps):
        x, y = batch_at(tokens, step + SEED_STRIDE * seed, 8 * world, TRAIN_GPT.seq_len)
        start = time.perf_counter()
        loss = model(x[rank::world], y[rank::world])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "step_s": statistics.median(times)}


def _wire_rank(stage: int, dtype: torch.dtype, quantize: bool, timed: int) -> dict:
    """step_time.py's GPT: bytes sent in one step and the median time of ``timed`` steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(BENCH)
    config = zerolite.ZeroConfig(stage=stage, param_dtype=dtype, quantize_gather=quantize,
                                 quantize_reduce=quantize)
    opt = zerolite.shard(model, torch.optim.AdamW(param_groups(model, 0.1), lr=3e-4), config)
    times = []
    for i in range(timed + 2):
        x, y = random_batch(BENCH, MICRO_BATCH * world, seed=i)
        dist.barrier()
        start = time.perf_counter()
        model(x[rank::world], y[rank::world]).backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - start)
    with CommSpy(node_size=world) as spy:  # one "node": every byte counts, on one link
        x, y = random_batch(BENCH, MICRO_BATCH * world, seed=timed + 2)
        model(x[rank::world], y[rank::world]).backward()
        opt.step()
        opt.zero_grad()
    return {"bytes": sum(spy.bytes.values()), "step_s": statistics.median(times)}


def accuracy(stages: list[int], steps: int, seeds: int, settings: list[str],
             save: Path | None) -> dict:
    """Train every (stage, setting, seed), essential runs first; print each setting once
    all its seeds landed; keep the loss curves in ``save`` (JSON) after each run, so a
    cut-off run keeps its results."""
    runs: dict = json.loads(save.read_text()) if save is not None and save.exists() else {}
    first = [s for s in ("none", "both", "gather", "reduce") if s in settings]
    order = [(stage, s) for s in first for stage in stages]
    order += [(stage, s) for s in settings for stage in stages if (stage, s) not in order]
    print(f"examples/train_gpt.py's GPT, {steps} steps, 2 ranks, bf16; mean loss over the "
          f"last {LAST} steps, averaged over {seeds} seed(s); 'vs none' is the relative "
          f"difference to the unquantized run of the same seed: mean [min, max] over seeds",
          flush=True)
    print(f"{'stage':>5s} {'quantized':21s} {'mean loss':>9s} {'vs none':>8s} "
          f"{'[min, max]':>17s} {'step ms':>8s} {'x none':>7s}", flush=True)
    for stage, setting in order:
        for seed in range(seeds):
            key = f"{stage}/{setting}/{seed}"
            if key not in runs:
                runs[key] = run_ranks(_train_rank, 2, stage, setting, steps, seed,
                                      timeout=7200)[0]
                if save is not None:
                    save.write_text(json.dumps(runs))
        _report(runs, stage, setting, seeds)
    _plot(runs, stages)
    return runs


def _report(runs: dict, stage: int, setting: str, seeds: int) -> None:
    def tail(name: str, seed: int) -> float:
        return statistics.mean(runs[f"{stage}/{name}/{seed}"]["losses"][-LAST:])

    def step_s(name: str) -> float:
        return statistics.median(runs[f"{stage}/{name}/{s}"]["step_s"] for s in range(seeds))

    base = "none" if all(f"{stage}/none/{s}" in runs for s in range(seeds)) else setting
    rel = [100 * (tail(setting, s) - tail(base, s)) / tail(base, s) for s in range(seeds)]
    mean = statistics.mean(tail(setting, s) for s in range(seeds))
    spread = f"[{min(rel):+.2f}, {max(rel):+.2f}]"
    print(f"{stage:5d} {setting:21s} {mean:9.4f} {statistics.mean(rel):+7.2f}% {spread:>17s} "
          f"{1e3 * step_s(setting):8.1f} {step_s(setting) / step_s(base):7.2f}", flush=True)


def _plot(runs: dict, stages: list[int]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {PNG.name} not drawn (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, len(stages), figsize=(6 * len(stages), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        for setting in SETTINGS:
            if f"{stage}/{setting}/0" not in runs:
                continue
            losses = runs[f"{stage}/{setting}/0"]["losses"]
            # A 10-step running mean: single steps are noisy.
            smooth = [statistics.mean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
            ax.plot(smooth, label=setting, linewidth=1)
        ax.set_title(f"stage {stage}, bf16, 2 ranks, seed 0 (10-step running mean)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_ylim(top=3.0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)
    print(f"wrote {PNG}")


def wire(stages: list[int], timed: int) -> None:
    print(f"\nbenchmarks/step_time.py's GPT, 2 ranks, gloo on loopback; bytes one rank sends "
          f"per step, median of {timed} steps")
    print(f"{'stage':>5s} {'dtype':5s} {'MB none':>8s} {'MB quant':>8s} {'ratio':>6s} "
          f"{'ms none':>8s} {'ms quant':>8s} {'x none':>7s} {'pays below':>11s}")
    for stage in stages:
        for dtype in (torch.float32, torch.bfloat16):
            none, quant = (
                run_ranks(_wire_rank, 2, stage, dtype, q, timed, timeout=1800)[0]
                for q in (False, True)
            )
            saved = none["bytes"] - quant["bytes"]
            extra = quant["step_s"] - none["step_s"]
            # Quantizing costs `extra` seconds per step and saves `saved` bytes: it pays on
            # any link slower than saved / extra bytes per second.
            pays = f"{saved / extra / 1e9:8.2f} GB/s" if extra > 0 else "always"
            name = "fp32" if dtype == torch.float32 else "bf16"
            ratio = quant["step_s"] / none["step_s"]
            print(f"{stage:5d} {name:5s} {none['bytes'] / 1e6:8.2f} {quant['bytes'] / 1e6:8.2f} "
                  f"{quant['bytes'] / none['bytes']:6.3f} {1e3 * none['step_s']:8.1f} "
                  f"{1e3 * quant['step_s']:8.1f} {ratio:7.2f} {pays:>11s}", flush=True)


def codec() -> None:
    """The quantizer's own cost, one thread, no communication: encode + decode of a buffer
    the size of step_time.py's GPT, and the link speed below which the bytes it saves take
    longer to send than it takes to compute (2 ranks: each rank sends and receives half of
    each exchange; one reduce-scatter and one all-gather per step)."""
    from zerolite.plan.layout import FlatLayout
    from zerolite.plan.quantization import wire_format

    torch.set_num_threads(1)
    numel = sum(p.numel() for p in GPT(BENCH).parameters())
    layout = FlatLayout((numel,), 2)
    print(f"\nquantizer cost, 1 thread, {numel / 1e6:.1f}M elements (one exchange each way)")
    print(f"{'dtype':5s} {'encode+decode ms':>16s} {'MB saved':>9s} {'pays below':>11s}")
    for dtype in (torch.float32, torch.bfloat16):
        wire = wire_format(layout, set(), dtype, 256)
        full = torch.randn(layout.padded_numel).to(dtype)
        messages = wire.messages(full.device)
        out = torch.empty(layout.shard_numel, dtype=dtype)
        shard = layout.shard_numel
        times = []
        for _ in range(5):
            start = time.perf_counter()
            # One step at 2 ranks: the reduce-scatter encodes and decodes one chunk, so does
            # the all-gather.
            for _exchange in range(2):
                wire.chunks[1].encode(full[shard:], messages[1])
                wire.chunks[1].decode(messages[1], out)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        saved = 2 * shard * (full.element_size() - wire.message_bytes / shard)
        name = "fp32" if dtype == torch.float32 else "bf16"
        print(f"{name:5s} {1e3 * seconds:16.1f} {saved / 1e6:9.2f} "
              f"{saved / seconds / 1e9:7.2f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds per (stage, setting): init and data offset")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, from: {', '.join(SETTINGS)}")
    parser.add_argument("--parts", default="accuracy,wire,codec")
    parser.add_argument("--timed", type=int, default=8, help="timed steps per wire run")
    parser.add_argument(
        "--save", type=Path, default=None,
        help="JSON of the accuracy runs: read (runs in it are not repeated), then written",
    )
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    parts = args.parts.split(",")
    if "accuracy" in parts:
        settings = args.settings.split(",")
        unknown = [name for name in settings if name not in SETTINGS]
        if unknown:
            parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
        accuracy(stages, args.steps, args.seeds, settings, args.save)
    if "wire" in parts:
        wire(stages, args.timed)
    if "codec" in parts:
        codec()


if __name__ == "__main__":
    main()
