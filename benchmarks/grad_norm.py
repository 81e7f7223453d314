"""The clipping norm: how accurate zerolite's and torch's are, and what torch's exact value
would cost under sharding (issue 51, item 3).

One backward of a real model (transformers' GPT-2 with GPT-2 small's shapes by default:
124M parameters, its 50257 x 768 embedding tied to the head; dropout off) on a fixed batch,
single process, CPU. Three numbers per model:

- accuracy: the relative error of torch's ``clip_grad_norm_`` (what DDP, Accelerate and the
  Trainer call; ``torch._foreach_norm`` per tensor) and of zerolite's ``clip_grad_norm_``
  (stage 1, world size 1; zerolite's norm is the same bits at every stage, world size and
  layout, tests/step/test_same_arithmetic.py) against the fp64 norm of the same gradients;
- time: each ``clip_grad_norm_``'s median over ``--repeats`` calls (one thread; both take
  the norm and scale every gradient by the coefficient);
- what reproducing torch's value would move: torch takes each tensor's norm over the whole
  tensor, in an order a sum of pieces cannot reproduce, so every parameter that a flat
  layout cuts between ranks would have to be gathered whole onto one rank first. Counted
  from zerolite's own stage-2 layout (``plan_layout``, default 25 MiB buckets) for each
  world size, in fp32 gradient bytes a step, beside stage 2's own traffic (the 2 x 4 bytes
  per parameter of its reduce-scatter and all-gather). With ``partition="tensor"`` every
  parameter is whole on its owner: nothing would move.

    python benchmarks/grad_norm.py [--layers 12] [--repeats 5] [--worlds 2 4 8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import zerolite
from zerolite.plan.shard_plan import plan_layout


def _model(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _median_seconds(fn, repeats: int) -> float:  # noqa: ANN001 - a no-argument callable
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cut_bytes(model: torch.nn.Module, world: int) -> tuple[int, int]:
    """(parameters a stage-2 flat layout over ``world`` ranks cuts, the fp32 gradient bytes
    that gathering each onto the rank holding its largest piece moves)."""
    plan = plan_layout(model, [torch.optim.AdamW(model.parameters())],
                       zerolite.ZeroConfig(stage=2, param_dtype=torch.float32))
    count = nbytes = 0
    for b in range(len(plan.flat_params)):
        layout = plan.layout(b, world)
        pieces: dict[int, list[int]] = {}
        for rank in range(world):
            for span in layout.spans(rank):
                pieces.setdefault(span.index, []).append(span.numel)
        for sizes in pieces.values():
            if len(sizes) > 1:
                count += 1
                nbytes += 4 * (sum(sizes) - max(sizes))
    return count, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain = _model(args.layers)
    sharded = copy.deepcopy(plain)
    ids = torch.randint(0, plain.config.vocab_size, (2, 64),
                        generator=torch.Generator().manual_seed(1))
    plain(input_ids=ids, labels=ids).loss.backward()
    params = [p for p in plain.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    exact = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().item()
    opt = zerolite.shard(sharded, torch.optim.AdamW(sharded.parameters()),
                         zerolite.ZeroConfig(stage=1))
    sharded(input_ids=ids, labels=ids).loss.backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                           sharded.parameters()))
    torch_norm = torch.nn.utils.clip_grad_norm_(params, 1e9).item()
    zero_norm = opt.clip_grad_norm_(1e9).item()
    numel = sum(g.numel() for g in grads)
    print(f"GPT-2, {args.layers} layers: {numel:,} gradient elements in {len(grads)} tensors "
          f"(largest {max(g.numel() for g in grads):,}); same gradients: {same}")
    print(f"fp64 norm {exact:.9f}")
    for name, value in (("torch clip_grad_norm_", torch_norm), ("zerolite", zero_norm)):
        print(f"{name:22s} {value:.9f}  relative error {abs(value - exact) / exact:.2e}")
    # Both calls take the norm and scale every gradient by the (here 1.0) coefficient.
    torch_s = _median_seconds(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9), args.repeats)
    zero_s = _median_seconds(lambda: opt.clip_grad_norm_(1e9), args.repeats)
    print(f"time, median of {args.repeats}: torch {torch_s * 1e3:.1f} ms, zerolite "
          f"{zero_s * 1e3:.1f} ms")
    print("torch's exact value under a flat stage-2 layout: parameters cut between ranks, "
          "gathered whole each step")
    for world in args.worlds:
        count, nbytes = _cut_bytes(_model(args.layers), world)
        traffic = 2 * 4 * numel
        print(f"  {world} ranks: {count} cut parameters, {nbytes / 2**20:.1f} MiB a step "
              f"({nbytes / traffic:.1%} of stage 2's {traffic / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
