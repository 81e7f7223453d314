"""Train a small GPT with Accelerate + zerolite on the Python standard library's source.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file examples/accelerate/cpu_2proc.yaml \\
        examples/train_gpt.py [--stage 1|2|3] [--steps 200] [--resume] [--meta]

The text is the standard library's own ``.py`` files, read at run time as bytes
(vocabulary 256): nothing is downloaded. The only change from a stock Accelerate loop is
``ZeroAccelerator`` instead of ``Accelerator``. Rank 0 prints step, loss and tokens/s,
then each rank's measured memory footprint next to what DDP would hold. A checkpoint is
saved every ``--save-every`` steps under ``--out`` (``save_state``); ``--resume`` continues
from the newest one and says which; a run without ``--resume`` refuses an ``--out`` that already
holds checkpoints (another run's). On a terminal, rank 0 shows a progress bar with loss and
tokens/s; the periodic log lines are printed either way. The stage comes from ``--stage`` or
``ZEROLITE_STAGE``. With ``--meta`` the model is built on the meta
device (no memory) and ``shard()`` materialises it unit by unit with ``GPT.init_weights``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration, tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups  # noqa: E402
from zerolite.accelerate import ZeroAccelerator  # noqa: E402
from zerolite.memory import footprint, formula  # noqa: E402


def stdlib_text(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's .py files, as int64 byte tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_at(
    tokens: torch.Tensor, step: int, batch: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank; each rank takes its rows)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
    rows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--stage", type=int, default=int(os.environ.get("ZEROLITE_STAGE", 2)), choices=(1, 2, 3)
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--out", default="runs/train_gpt", help="checkpoints go to OUT/checkpoints")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in OUT"
    )
    parser.add_argument(
        "--meta", action="store_true", help="build on the meta device; shard() materialises it"
    )
    args = parser.parse_args()

    project = ProjectConfiguration(
        project_dir=args.out, automatic_checkpoint_naming=True, total_limit=2
    )
    config = zerolite.ZeroConfig(stage=args.stage, init_fn=GPT.init_weights if args.meta else None)
    accelerator = ZeroAccelerator(project_config=project, zero_config=config)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    with torch.device("meta") if args.meta else contextlib.nullcontext():
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    start_step = 0
    checkpoints = Path(args.out) / "checkpoints"
    earlier = sorted(checkpoints.glob("checkpoint_*")) if checkpoints.is_dir() else []
    if earlier and not args.resume:
        raise SystemExit(
            f"{checkpoints} holds checkpoints of an earlier run "
            f"({', '.join(p.name for p in earlier)}): "
            "pass --resume to continue it, or choose another --out"
        )
    if args.resume and earlier:
        accelerator.load_state()  # the newest checkpoint_N
        start_step = accelerator.step
        newest = checkpoints / f"checkpoint_{accelerator.project_configuration.iteration - 1}"
        accelerator.print(f"resumed from {newest} at step {start_step}")
    elif args.resume:
        accelerator.print(f"--resume: no checkpoint under {checkpoints}; starting at step 0")
    tokens = stdlib_text(4_000_000)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"zerolite stage {args.stage} via Accelerate ({accelerator.distributed_type}), {world} "
        f"processes, "
        f"{n_params / 1e6:.2f}M parameters, {len(tokens) / 1e6:.1f}M bytes of standard-library text"
    )
    clock, seen = time.perf_counter(), 0
    bar = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, unit="step",
               disable=not sys.stderr.isatty())
    for step in bar:
        x, y = batch_at(tokens, step, args.batch * world, cfg.seq_len)
        x, y = x[rank::world].to(accelerator.device), y[rank::world].to(accelerator.device)
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        accelerator.step = step + 1
        seen += x.numel() * world
        rate = seen / (time.perf_counter() - clock)
        bar.set_postfix(loss=f"{loss.item():.3f}", tokens_per_s=f"{rate:,.0f}", refresh=False)
        if step % 20 == 0 or step == args.steps - 1:
            line = f"step {step:4d}  loss {loss.item():.3f}  {rate:,.0f} tokens/s"
            if bar.disable:
                accelerator.print(line)
            else:
                bar.write(line)  # above the bar, not through it
        if (step + 1) % args.save_every == 0:
            accelerator.save_state()
    bar.close()
    mine = footprint(optimizer.optimizer)
    ddp = formula(
        n_params, world_size=world, stage=0, param_dtype=optimizer.optimizer.config.param_dtype
    )
    for r in range(world):
        if r == rank:
            print(
                f"[rank {rank}] model states held: {mine.model_states / 1e6:.2f} MB (params "
                f"{mine.params / 1e6:.2f}, grads {mine.grads / 1e6:.2f}, master "
                f"{mine.master / 1e6:.2f}, optimizer {mine.optimizer_state / 1e6:.2f}); DDP would "
                f"hold {ddp.model_states / 1e6:.2f} MB",
                flush=True,
            )
        accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
