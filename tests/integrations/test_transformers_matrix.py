"""transformers models built from tiny configs, trained at stages 1-3 on 2 ranks, against DDP.

GPT-2 (``Conv1D``, tied head), Llama (GQA, RMSNorm, rotary), BERT masked LM (tied decoder,
labels that ignore most positions), T5 (encoder-decoder, relative attention bias), a
Mixtral MoE (4 experts, top-1; transformers 5 fuses the experts into 3-D tensors, so an
expert without tokens gets zero gradient rows) and a Switch Transformer (8 experts, one
module each, run only when routed to: some experts get no tokens in a step, so their
parameters have no gradient on a rank or on every rank).

The objective of a data-parallel step is the mean over ranks of each rank's mean loss
(with ignored labels the ranks' token counts differ, so this is not the whole batch's mean).
The reference computes exactly that on one process; DDP and zerolite must both reach it.
Per tensor, zerolite's error must be <= max(2 x DDP's own error, 1e-6) (`tests.support.parity`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

pytest.importorskip("transformers")

STEPS = 4
BATCH = 4  # global; 2 per rank
SEQ = 8
VOCAB = 64


def _build(name: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=32)
        return tf.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg)
    if name == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                          num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(cfg)
    if name == "mixtral":
        cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               num_local_experts=4, num_experts_per_tok=1,
                               max_position_embeddings=32)
        return tf.MixtralForCausalLM(cfg)
    if name == "switch":
        cfg = tf.SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
                                          num_layers=2, num_decoder_layers=2, num_heads=2,
                                          num_experts=8, expert_capacity=64,
                                          num_sparse_encoder_layers=1,
                                          num_sparse_decoder_layers=1, dropout_rate=0.0,
                                          router_jitter_noise=0.0, decoder_start_token_id=0,
                                          pad_token_id=0)
        return tf.SwitchTransformersForConditionalGeneration(cfg)
    raise ValueError(name)


def _batches(name: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        if name == "bert":  # ~25 % of positions predicted, a different count on each rank
            labels = torch.where(
                torch.rand(BATCH, SEQ, generator=g) < 0.25, ids, torch.full_like(ids, -100)
            )
            labels[:, 0] = ids[:, 0]  # at least one label per row
            out.append({"input_ids": ids, "labels": labels})
        elif name in ("t5", "switch"):
            out.append({"input_ids": ids,
                        "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)})
        else:
            out.append({"input_ids": ids, "labels": ids})
    return out


def _slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = BATCH // world
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _reference(name: str, data, world: int) -> tuple[nn.Module, list[float]]:
    """One process: the mean over the ranks' slices of each slice's mean loss."""
    model = _build(name)
    opt = _optimizer(model)
    losses = []
    for batch in data:
        total = sum(model(**_slice(batch, r, world)).loss for r in range(world)) / world
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return model, losses


def _distributed(name: str, data, stage: int | None) -> tuple[nn.Module, list[float]]:
    """DDP (``stage=None``) or zerolite at ``stage``, each rank on its slice."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build(name)
    opt = _optimizer(model)
    if stage is None:
        run = DistributedDataParallel(model, find_unused_parameters=True)
    else:
        opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=stage))
        run = model
    losses = []
    for batch in data:
        loss = run(**_slice(batch, rank, world)).loss
        loss.backward()
        opt.step()
        model.zero_grad()  # what transformers' Trainer calls
        losses.append(parity.mean_over_ranks(loss.item()))
    return model, losses


def _matrix_rank(names: tuple[str, ...]) -> dict:
    world = dist.get_world_size()
    report = {}
    for name in names:
        data = _batches(name)
        reference, ref_losses = _reference(name, data, world)
        ddp, ddp_losses = _distributed(name, data, None)
        ddp_dev = parity.DdpDeviation(
            {n: parity.rel_err(p, r) for (n, p), r in
             zip(ddp.named_parameters(), reference.parameters())},
            parity.loss_deviations(ddp_losses, ref_losses))
        for stage in (1, 2, 3):
            model, losses = _distributed(name, data, stage)
            report[(name, stage)] = parity.check_parity(
                f"{name} stage {stage}", model, losses, reference, ref_losses, ddp_dev)
        report[(name, "ddp")] = max(ddp_dev.tensors.values())
    return report


MODELS = ("gpt2", "llama", "bert", "t5", "mixtral", "switch")


def test_transformers_models_match_ddp_at_every_stage():
    reports = run_ranks(_matrix_rank, 2, MODELS, timeout=300)
    for name in MODELS:
        for stage in (1, 2, 3):
            assert (name, stage) in reports[0]
    assert reports[0] == reports[1]  # every rank measured the same gathered parameters


def _unused_expert_rank() -> list[int]:
    """How many parameters got no gradient in the MoE's first step (the case worth testing)."""
    model = _build("switch")
    rank, world = dist.get_rank(), dist.get_world_size()
    model(**_slice(_batches("switch")[0], rank, world)).loss.backward()
    return [sum(p.grad is None for p in model.parameters())]


def test_the_moe_case_has_experts_without_tokens():
    counts = run_ranks(_unused_expert_rank, 2, timeout=120)
    assert any(c[0] > 0 for c in counts), counts  # else the matrix would not test unused parameters

