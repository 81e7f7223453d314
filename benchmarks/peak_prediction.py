"""Predicted vs measured peak of live tensor bytes per rank, and the 7B prediction time.

    python benchmarks/peak_prediction.py [--world-sizes 1,2,4] [--llama-7b]

For the example GPT and transformers' GPT-2 and Llama (tiny configurations:
tests/support/peak_cases.py), every stage, fp32 and bf16 parameters, accumulation 1 and 4 and
activation checkpointing off and on, it predicts rank 0's peak with
`zerolite.memory.predict_peak` (fake tensors, one simulated rank) and measures it with
`zerolite.memory.measure_peak` (a real step on a real gloo group of that many ranks, live
tensor bytes through ``track()``), and prints one markdown row per case and a summary.
``--budgets`` asks `zerolite.memory.plan` for three budgets per rank (4 ranks, a GPT
whose model states dominate) whose cheapest answers are stage 1, stage 3 and stage 3 with
a disk tier, then trains each pick on 4 real ranks and measures its peak against the
budget. ``--llama-7b`` then times the prediction for a 7B Llama (bf16, stage 3, 8 ranks,
sequence 2048, activation checkpointing), whose tensors are never allocated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from tests.support.peak_cases import MODELS, case_kwargs, measure_cases  # noqa: E402
from zerolite.memory import measure_peak, plan, predict_peak  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402


def _cases() -> list[dict]:
    return [
        dict(model=m, stage=s, dtype=d, accumulation=a, checkpointing=c)
        for m in MODELS for s in (1, 2, 3) for d in (torch.float32, torch.bfloat16)
        for a in (1, 4) for c in (False, True)
    ]


def _table(world_sizes: list[int]) -> None:
    print("| model | N | stage | dtype | accum. | ckpt | predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for n in world_sizes:
        cases = _cases()
        measured = run_ranks(measure_cases, n, cases, timeout=1800)[0]
        for case, (peak, _) in zip(cases, measured):
            model_fn, batch_fn = MODELS[case["model"]]
            config, kwargs = case_kwargs(case)
            predicted = predict_peak(model_fn, batch_fn, config, n, **kwargs).peak
            error = (predicted - peak) / peak
            errors.append(abs(error))
            print(f"| {case['model']} | {n} | {case['stage']} | {str(case['dtype'])[6:]} | "
                  f"{case['accumulation']} | {'on' if case['checkpointing'] else 'off'} | "
                  f"{predicted:,} | {peak:,} | {error:+.2%} |", flush=True)
    print(f"\n{len(errors)} cases; largest |error| {max(errors):.2%}; "
          f"exact in {sum(e == 0 for e in errors)}")


BUDGET_GPT = GPTConfig(vocab_size=8192, seq_len=8, n_layer=4, n_head=4, d_model=256)
BUDGETS_MB = (80, 69, 65)


def _budget_gpt() -> torch.nn.Module:
    return GPT(BUDGET_GPT)


def _budget_batch(micro_batch: int) -> dict:
    idx = torch.zeros(micro_batch, BUDGET_GPT.seq_len, dtype=torch.long)
    return {"idx": idx, "targets": idx}


def _train_pick(config: dict) -> int:
    return measure_peak(_budget_gpt, _budget_batch, zerolite.ZeroConfig(**config)).peak


def _budgets() -> None:
    print("\n| budget per rank | plan's pick | predicted | measured (4 ranks, rank max) |")
    print("|---|---|---|---|")
    for mb in BUDGETS_MB:
        entries = plan(_budget_gpt, _budget_batch, 4, mb * 10**6, 1, stages=(1, 3),
                       param_dtypes=(torch.float32,), offloads=(None, "disk"),
                       checkpointing=(False,))
        pick = entries[0]
        measured = max(run_ranks(_train_pick, 4, pick.config, timeout=1800))
        what = f"stage {pick.config['stage']}" + (
            f" + {pick.config['offload']}" if pick.config.get("offload") else "")
        print(f"| {mb} MB | {what} | {pick.peak_bytes / 1e6:.2f} MB | "
              f"{measured / 1e6:.2f} MB |", flush=True)


def _llama_7b() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                         max_position_embeddings=4096)

    def batch(b: int) -> dict:
        ids = torch.zeros(b, 2048, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    process = psutil.Process()
    rss, cpu = process.memory_info().rss, time.process_time()
    prediction = predict_peak(
        lambda: LlamaForCausalLM(config), batch,
        zerolite.ZeroConfig(stage=3, param_dtype=torch.bfloat16), 8,
        activation_checkpointing=True,
    )
    print(f"\n7B Llama, stage 3 bf16, 8 ranks: {prediction.seconds:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU, process grew "
          f"{(process.memory_info().rss - rss) / 2**20:.0f} MiB")
    print(prediction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--llama-7b", action="store_true")
    parser.add_argument("--budgets", action="store_true")
    parser.add_argument("--no-table", action="store_true")
    args = parser.parse_args()
    if not args.no_table:
        _table([int(n) for n in args.world_sizes.split(",")])
    if args.budgets:
        _budgets()
    if args.llama_7b:
        _llama_7b()


if __name__ == "__main__":
    main()
