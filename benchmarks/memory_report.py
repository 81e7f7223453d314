"""Estimated vs measured memory per rank for the example GPT, every stage, N = 1, 2, 4.

    python benchmarks/memory_report.py [--png benchmarks/memory_report.png]

For each world size and stage (fp32, AdamW, the model of examples/train_gpt.py) it
trains two steps and prints, for rank 0: `zerolite.memory.estimate` (model states and
the configured transient bound), `footprint` (measured model states), and the peak of
zerolite's own bytes in any phase from `track()`. With matplotlib installed it also
draws a bar chart (matplotlib is optional: not a dependency of zerolite).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups, random_batch  # noqa: E402
from zerolite.memory import estimate, footprint, formula, track  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

# examples/train_gpt.py
CFG = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
WORLD_SIZES = (1, 2, 4)


def _measure(stage: int) -> dict:
    n = dist.get_world_size()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    config = zerolite.ZeroConfig(stage=stage)
    predicted = estimate(model, world_size=n, config=config, optimizer=opt, rank=rank)
    sharded = zerolite.shard(model, opt, config)
    x, y = random_batch(CFG, 4 * n, seed=0)
    x, y = x[rank::n], y[rank::n]
    model(x, y).backward()
    sharded.step()
    sharded.zero_grad()
    with track(sharded) as tracker:
        model(x, y).backward()
        sharded.step()
        sharded.zero_grad()
    return {
        "estimate": predicted.model_states,
        "bound": predicted.model_states + predicted.transient,
        "measured": footprint(sharded).model_states,
        "peak": max(p.zerolite for p in tracker.peaks.values()),
        "ddp": formula(
            sum(p.numel() for p in model.parameters()), world_size=n, stage=0
        ).model_states,
    }


def _all_stages() -> list[dict]:
    return [_measure(stage) for stage in (1, 2, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    args = parser.parse_args()
    rows = []
    for n in WORLD_SIZES:
        for stage, r in zip((1, 2, 3), run_ranks(_all_stages, n, timeout=300)[0]):
            rows.append((n, stage, r))
    print(f"example GPT ({CFG}), fp32, AdamW; MB per rank (rank 0)")
    print(
        f"{'N':>2s} {'stage':>5s} {'DDP':>7s} {'estimate':>9s} {'measured':>9s} "
        f"{'est.+bound':>10s} {'peak':>7s}"
    )
    for n, stage, r in rows:
        print(
            f"{n:2d} {stage:5d} {r['ddp'] / 1e6:7.2f} {r['estimate'] / 1e6:9.3f} "
            f"{r['measured'] / 1e6:9.3f} {r['bound'] / 1e6:10.2f} {r['peak'] / 1e6:7.2f}"
        )
    if args.png:
        _plot(rows, args.png)


def _plot(rows: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return
    labels = [f"N={n}\nstage {s}" for n, s, _ in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.27
    ax.bar(
        [x - width for x in xs],
        [r["estimate"] / 1e6 for *_, r in rows],
        width,
        label="estimate (model states)",
    )
    ax.bar(list(xs), [r["measured"] / 1e6 for *_, r in rows], width, label="measured footprint")
    ax.bar(
        [x + width for x in xs],
        [r["peak"] / 1e6 for *_, r in rows],
        width,
        label="measured peak (track)",
    )
    ax.plot(
        list(xs), [r["ddp"] / 1e6 for *_, r in rows], "k_", markersize=20, label="DDP (formula)"
    )
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("MB per rank")
    ax.set_title("zerolite: estimated vs measured memory, example GPT, fp32 AdamW")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
