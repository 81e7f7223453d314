"""Greedy generation at stage 3: milliseconds per new token, against the unsharded model.

Fixed configuration (the example GPT of ``benchmarks/step_time.py``):
    GPT: 6 layers, d_model 384, 6 heads, vocab 8192, seq 128 (tied head), fp32, eval mode
    batch 1, prompt 16 tokens, 32 new tokens (argmax; no KV cache: each new token is one
    forward over the whole prefix, as examples/gpt.py has no cache), 2 ranks, 1 thread each
    systems interleaved in rounds (>= 5), one warm-up generation per system first
Systems:
    unsharded       the plain model (no zerolite), every rank generating alone
    zl3             stage 3 (default config): every unit gathered for every forward
    zl3_gathered    stage 3 inside ``zerolite.gathered_parameters(model)``: gathered once
    zl3_keep        stage 3 with ``ZeroConfig(reshard_after_forward=False)``: a no-grad
                    forward leaves its units gathered for the next one

Per system it prints the median ms/token over rounds and the ratio to the unsharded
model's time in the same round (median, min and max over rounds). Only rank 0's clock
is reported; ranks run the same work.

    python benchmarks/generate_time.py [--rounds 5] [--new-tokens 32] [--world-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402

CFG = GPTConfig(vocab_size=8192, seq_len=128, n_layer=6, n_head=6, d_model=384)
PROMPT = 16
SYSTEMS = ("unsharded", "zl3", "zl3_gathered", "zl3_keep")


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompt`` ([1, T] int64) followed by ``new_tokens`` argmax tokens."""
    idx = prompt
    for _ in range(new_tokens):
        logits = model(idx)[:, -1]
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


def _build(system: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    if system != "unsharded":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        reshard = system != "zl3_keep"
        zerolite.shard(model, opt, zerolite.ZeroConfig(stage=3, reshard_after_forward=reshard))
    return model


def _generate(system: str, model: torch.nn.Module, prompt: torch.Tensor,
              new_tokens: int) -> torch.Tensor:
    if system == "zl3_gathered":
        with zerolite.gathered_parameters(model):
            return greedy(model, prompt, new_tokens)
    return greedy(model, prompt, new_tokens)


def _rank(rounds: int, new_tokens: int) -> dict[str, list[float]]:
    models = {s: _build(s) for s in SYSTEMS}
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, CFG.vocab_size, (1, PROMPT), generator=generator)
    outputs = {s: _generate(s, models[s], prompt, new_tokens) for s in SYSTEMS}  # warm-up
    for s in SYSTEMS:
        if not torch.equal(outputs[s], outputs["unsharded"]):
            raise RuntimeError(f"{s} generated other tokens than the unsharded model")
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))  # no system always first
        for s in order:
            torch.distributed.barrier()
            start = time.perf_counter()
            _generate(s, models[s], prompt, new_tokens)
            times[s].append((time.perf_counter() - start) * 1e3 / new_tokens)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 1 or PROMPT + args.new_tokens > CFG.seq_len:
        parser.error(f"need rounds >= 1 and 1 <= new tokens <= {CFG.seq_len - PROMPT}")
    times = run_ranks(_rank, args.world_size, args.rounds, args.new_tokens, timeout=1800)[0]
    base = times["unsharded"]
    print(f"{args.world_size} ranks, {args.new_tokens} new tokens, {args.rounds} rounds "
          "(rank 0's clock)")
    print(f"{'system':<14}{'ms/token':>10}{'ratio median':>14}{'min':>8}{'max':>8}")
    for s in SYSTEMS:
        ratios = [t / b for t, b in zip(times[s], base)]
        print(f"{s:<14}{statistics.median(times[s]):>10.2f}{statistics.median(ratios):>14.2f}"
              f"{min(ratios):>8.2f}{max(ratios):>8.2f}")


if __name__ == "__main__":
    main()
