"""Train a small GPT with zerolite under torchrun.

    torchrun --nproc_per_node 2 examples/train_gpt.py --stage 2 [--dtype bf16]

The text is the Python standard library's own source, read at run time as bytes
(vocabulary 256), so nothing is downloaded. Every rank reads a different slice of each
global batch. Rank 0 prints the loss, tokens/s and, at the end, the per-rank memory
footprint next to what DDP would hold for the same model.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def stdlib_text(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's .py files, as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_at(tokens: torch.Tensor, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
    rows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=int(os.environ.get("ZEROLITE_STAGE", 2)), choices=(1, 2))
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    model = GPT(cfg)
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95))
    opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=args.stage, param_dtype=DTYPES[args.dtype]))
    tokens = stdlib_text(4_000_000)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"zerolite stage {args.stage}, {args.dtype}, {world} ranks, {n / 1e6:.2f}M parameters, "
              f"{len(tokens) / 1e6:.1f}M bytes of stdlib text")
    start, seen = time.perf_counter(), 0
    for step in range(args.steps):
        x, y = batch_at(tokens, step, args.batch * world, cfg.seq_len)
        x, y = x[rank::world], y[rank::world]
        loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        seen += x.numel() * world
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            rate = seen / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss.item():.3f}  {rate:,.0f} tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
