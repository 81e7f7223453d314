"""How long ``zerolite plan`` takes: the whole default search, as a user runs it.

Two cases, each a fresh ``python -m zerolite plan ... --json`` process (imports
included), timed over several rounds; the median wall and CPU time (the child's user +
system) are printed, and the pick of the last round:

- ``gpt2``: transformers' GPT-2 at 4 layers x 256 (4 heads, vocab 50257, sequence 128),
  2 ranks, ``--memory 150MB --batch 8``;
- ``llama-7b``: the 7B Llama of docs/memory.md (vocab 32000, 32 layers of 4096, MLP
  11008, sequence 2048), 8 ranks, ``--memory 24GiB --batch 8``.

Both are built on fake tensors by the planner: nothing is allocated.

    python benchmarks/plan_time.py [--cases gpt2,llama-7b] [--rounds 3] [--tree DIR]
                                   [--workers 1,2]

``--workers`` times ``zerolite plan --workers N`` for each N given, the settings
interleaved within each round (default: the command's own default, the CPUs, at most 8).

``--tree`` runs the command from another checkout (its ``zerolite`` first on the path),
e.g. an older commit's worktree, to time the same cases before a change; the model
functions are still this file's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "gpt2": ["--model", "plan_time:gpt2", "--inputs", "plan_time:gpt2_inputs",
             "--world-size", "2", "--memory", "150MB", "--batch", "8"],
    "llama-7b": ["--model", "plan_time:llama_7b", "--inputs", "plan_time:llama_inputs",
                 "--world-size", "8", "--memory", "24GiB", "--batch", "8"],
}


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4))


def gpt2_inputs(micro_batch: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(micro_batch, 128, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def llama_7b() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ))


def llama_inputs(micro_batch: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(micro_batch, 2048, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _round(case: str, tree: Path, workers: str) -> tuple[float, float, dict]:
    """One ``zerolite plan`` process: (wall s, CPU s, the pick)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(tree), str(Path(__file__).parent)]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    extra = ["--workers", workers] if workers else []
    done = subprocess.run(
        [sys.executable, "-m", "zerolite", "plan", *CASES[case], *extra, "--json"],
        env=env, cwd=tree, capture_output=True, text=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):  # 1: nothing fits, still an answer
        raise SystemExit(f"{case}: zerolite plan failed\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="gpt2,llama-7b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--workers", default="",
                        help="comma-separated --workers values (default: the command's)")
    args = parser.parse_args()
    settings = args.workers.split(",") if args.workers else [""]
    print(f"{'case':10s} {'workers':>7s} {'rounds':>6s} {'wall (median)':>14s} "
          f"{'CPU (median)':>13s}  pick")
    for case in args.cases.split(","):
        times: dict[str, list] = {w: [] for w in settings}
        for _ in range(args.rounds):
            for w in settings:
                times[w].append(_round(case, args.tree.resolve(), w))
        for w, runs in times.items():
            pick = runs[-1][2]
            what = (f"{pick['config']}, micro-batch {pick['micro_batch']} x "
                    f"{pick['accumulation']}, ckpt {pick['activation_checkpointing']}, "
                    f"{'fits' if pick['fits'] else 'nothing fits'}")
            print(f"{case:10s} {w or 'default':>7s} {args.rounds:6d} "
                  f"{statistics.median(t[0] for t in runs):13.1f}s "
                  f"{statistics.median(t[1] for t in runs):12.1f}s  {what}", flush=True)


if __name__ == "__main__":
    main()
