"""Step time of the Hugging Face Trainer: stock ``Trainer`` (DDP) against ``ZeroTrainer``.

Fixed configuration, the model and data of ``examples/hf_trainer.py``:
    Llama from a LlamaConfig: 4 layers, hidden 128, MLP 344, 4 heads (2 KV heads),
    byte vocabulary (256), seq 128; the example's ``StdlibBytes`` windows of the standard
    library's .py files; micro-batch 8 per rank, gradient accumulation 2 (global batch 32
    sequences), AdamW (``adamw_torch``, lr 2e-3, weight decay 0.1), cosine schedule,
    max_grad_norm 1.0, fp32; 2 CPU ranks (gloo), 1 thread per rank.
    per launch: 3 warm-up + 15 timed optimizer steps; systems interleaved in rounds (>= 5),
    the order rotated each round.
Systems (the first four by default):
    ddp          transformers.Trainer (Accelerate wraps the model in DDP) with
                 ddp_find_unused_parameters=False: the baseline every ratio is taken against
    zl1/zl2/zl3  zerolite.hf.ZeroTrainer at stage 1 / 2 / 3
    ddp_stock    transformers.Trainer as shipped: for a model without gradient checkpointing
                 it passes find_unused_parameters=True to DDP, an extra autograd-graph walk
                 per backward (DDP warns about it), which would flatter the ratios

A step is timed by a ``TrainerCallback``: a barrier in ``on_step_begin`` (so that no rank
waits for a peer still busy between steps), then ``time.perf_counter()`` from there to
``on_step_end``. That covers forward and backward of both micro-batches, gradient
clipping, ``optimizer.step()``, the scheduler and ``zero_grad``; it leaves out data loading
(Trainer fetches a step's batches before ``on_step_begin``) and logging (after
``on_step_end``). A step's time is the slower rank's; per launch, the median over the timed
steps. Every system sees the same batches (same seed, same sampler, same global batch), so
the mean training loss printed per system agrees up to rounding: a check that the systems
did the same work.

It prints per system the median step time over all rounds, the mean ratio to DDP's median
in the same round with its min-max over rounds, and the mean training loss of the last round.

    python benchmarks/trainer_step_time.py [--rounds 5] [--steps 15] [--warmup 3]
                                           [--systems ddp,zl1,zl2,zl3,ddp_stock]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

from transformers import (  # noqa: E402
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import zerolite  # noqa: E402
from examples.hf_trainer import StdlibBytes, llama_config  # noqa: E402
from zerolite.hf import ZeroTrainer  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

SEQ = 128
MICRO_BATCH, ACCUMULATION = 8, 2
SYSTEMS = ("ddp", "zl1", "zl2", "zl3")
STAGE = {"ddp": None, "zl1": 1, "zl2": 2, "zl3": 3, "ddp_stock": None}


class StepTimer(TrainerCallback):
    """Seconds from ``on_step_begin`` (after a barrier) to ``on_step_end`` of every step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        dist.barrier()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def _run_system(system: str, warmup: int, steps: int, out: str) -> dict:
    """One launch on every rank: build the example's model and Trainer, train, time."""
    # Trainer.train() runs gc.collect() (Accelerate's free_memory); frozen, the objects that
    # importing transformers created (this module, on every rank) are not walked again
    # (about a second per train() call).
    gc.collect()
    gc.freeze()
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(SEQ))
    world = dist.get_world_size()
    total = warmup + steps
    args = TrainingArguments(
        output_dir=out,
        max_steps=total,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=2e-3,
        weight_decay=0.1,
        warmup_steps=min(10, total),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_strategy="no",  # train() still returns the mean loss
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=None if system == "ddp_stock" else False,
    )
    rows = total * MICRO_BATCH * ACCUMULATION * world
    data = StdlibBytes(SEQ, rows * SEQ, skip_bytes=200_000)
    if len(data) < rows:
        raise ValueError(f"the standard library holds {len(data)} windows, fewer than {rows}: "
                         "lower --steps/--warmup")
    timer = StepTimer()
    kwargs = {"model": model, "args": args, "train_dataset": data, "callbacks": [timer]}
    stage = STAGE[system]
    if stage is None:
        trainer = Trainer(**kwargs)
    else:
        trainer = ZeroTrainer(**kwargs, zero_config=zerolite.ZeroConfig(stage=stage))
    trainer.remove_callback(PrinterCallback)  # its final metrics line, once per rank
    output = trainer.train()
    return {"times": timer.times[warmup:], "loss": output.training_loss,
            "numel": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per launch")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(STAGE))
    if unknown or "ddp" not in systems:
        parser.error(f"--systems must include ddp and name only {', '.join(STAGE)}; "
                     f"got {args.systems!r}")
    world = 2
    # Accelerate warns (once per rank and launch) when these are unset; ranks use 1 thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    medians: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    losses: dict[str, float] = {}
    numel = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerolite-trainer-bench-") as tmp:
        for r in range(args.rounds):
            # Rotate the order each round so that drift does not favour one system.
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            this_round = {}
            for system in order:
                ranks = run_ranks(_run_system, world, system, args.warmup, args.steps,
                                  str(Path(tmp) / system), timeout=600)
                slowest = [max(rank["times"][i] for rank in ranks) for i in range(args.steps)]
                this_round[system] = statistics.median(slowest)
                medians[system].append(this_round[system])
                losses[system] = ranks[0]["loss"]
                numel = ranks[0]["numel"] if system == "ddp" else numel
            for system in systems:
                ratios[system].append(this_round[system] / this_round["ddp"])
            print(f"round {r + 1}/{args.rounds} done ({time.monotonic() - started:.0f} s)",
                  flush=True)
    print(f"\nLlama {numel / 1e6:.2f}M parameters, seq {SEQ}, micro-batch {MICRO_BATCH}/rank x "
          f"accumulation {ACCUMULATION}, {world} CPU ranks x 1 thread, {args.rounds} rounds x "
          f"({args.warmup} warm-up + {args.steps} timed) steps")
    print(f"{'system':9s} {'median ms':>9s} {'x DDP':>6s} {'min-max':>13s} {'mean loss':>10s}")
    for system in systems:
        rs = ratios[system]
        print(f"{system:9s} {statistics.median(medians[system]) * 1e3:9.1f} "
              f"{statistics.mean(rs):6.3f} {min(rs):6.3f}-{max(rs):6.3f} {losses[system]:10.5f}")


if __name__ == "__main__":
    main()
