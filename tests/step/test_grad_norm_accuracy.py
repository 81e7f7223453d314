"""How accurate the clipping norm is, against an fp64 norm of the same gradients.

zerolite sums ``|g|^2`` in one pairwise tree fixed by the parameters ([Note: norm tree] in
`zerolite.plan.norm_tree`): the norm is the same bits at every stage, world size and
layout (tests/step/test_same_arithmetic.py), so one process at world size 1 measures what every
run computes for these gradients. torch's ``clip_grad_norm_`` (what DDP, Accelerate and the
Trainer call) takes each tensor's norm with ``torch._foreach_norm``, which on the CPU sums a
large tensor in fp32 far less accurately. Real transformers models, one backward each, the
same gradients for both (checked bit for bit); docs/hf-trainer.md, "The gradient norm",
states the numbers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import zerolite

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

pytest.importorskip("transformers")

VOCAB = 4000  # GPT-2's tied embedding: 4000 x 32 = 128,000 elements, the issue's size
EPS = 2.0**-24  # fp32's unit roundoff


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64))


def measure(build: Callable[[], Any], seed: int = 0) -> dict[str, Any]:
    """One backward of ``build()``'s model on a fixed batch: the fp64 norm of its gradients,
    torch's ``clip_grad_norm_`` and zerolite's ``clip_grad_norm_`` (stage 1, world size 1,
    whose full gradients are compared with the plain model's), and each one's relative
    error against the fp64 norm."""
    torch.manual_seed(seed)
    plain = build()
    sharded = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(seed + 1))
    plain(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in plain.parameters() if p.grad is not None]
    exact = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().item()
    torch_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm=1e9).item()
    opt = zerolite.shard(sharded, torch.optim.AdamW(sharded.parameters()),
                         zerolite.ZeroConfig(stage=1))
    sharded(input_ids=ids, labels=ids).loss.backward()
    same = all(torch.equal(a.grad, b.grad)
               for a, b in zip(plain.parameters(), sharded.parameters()) if a.grad is not None)
    zero_norm = opt.clip_grad_norm_(1e9).item()
    return {
        "same_gradients": same,
        # The tree's depth: within a parameter, then over the parameters (zeros added to
        # pad it are exact additions).
        "depth": max(g.numel() - 1 for g in grads).bit_length() + (len(grads) - 1).bit_length(),
        "largest": max(g.numel() for g in grads),
        "exact": exact,
        "torch": abs(torch_norm - exact) / exact,
        "zerolite": abs(zero_norm - exact) / exact,
    }


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2-tied", "llama"])
def test_zerolites_norm_is_closer_to_fp64_than_torchs(build: Callable[[], Any]) -> None:
    got = measure(build)
    assert got["same_gradients"], got
    # Each square rounds once and each sum of two non-negative values once, ``depth`` sums
    # on any element's path: the sum of squares is within (depth + 1) u; the square root
    # halves that and rounds once more.
    assert got["zerolite"] <= ((got["depth"] + 1) / 2 + 1) * EPS, got
    assert got["zerolite"] <= got["torch"], got
