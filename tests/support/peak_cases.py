"""Models, batches and the measuring rank function shared by tests/memory/test_predict_peak.py and
benchmarks/peak_prediction.py: tiny configurations of the example GPT and transformers'
GPT-2 and Llama, random token batches (the peak does not depend on the tokens)."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

import zerolite
from examples.gpt import GPT, GPTConfig
from zerolite.memory import measure_peak

SEQ = 32
VOCAB = 512


def gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=64))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2)
    )


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    ))


def gpt_batch(micro_batch: int) -> dict[str, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=torch.Generator().manual_seed(0))
    return {"idx": idx, "targets": idx}


def hf_batch(micro_batch: int) -> dict[str, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": idx, "labels": idx}


MODELS = {"gpt": (gpt, gpt_batch), "gpt2": (gpt2, hf_batch), "llama": (llama, hf_batch)}


def case_kwargs(case: dict[str, Any]) -> tuple[zerolite.ZeroConfig, dict[str, Any]]:
    """A case (model, stage, dtype, accumulation, checkpointing, micro_batch) as the
    `ZeroConfig` and the keyword arguments `predict_peak` and `measure_peak` share."""
    config = zerolite.ZeroConfig(stage=case["stage"], param_dtype=case["dtype"],
                                 offload_params=case.get("offload_params"))
    kwargs = {
        "micro_batch": case.get("micro_batch", 4),
        "accumulation": case["accumulation"],
        "activation_checkpointing": case["checkpointing"],
    }
    return config, kwargs


def measure_cases(cases: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """On each rank: the measured peak (bytes) and its phase of each case, in order."""
    out = []
    for case in cases:
        model_fn, batch_fn = MODELS[case["model"]]
        config, kwargs = case_kwargs(case)
        gc.collect()  # the cases before: the process's live bytes are what is measured
        torch.manual_seed(0)
        tracker = measure_peak(model_fn, batch_fn, config, **kwargs)
        out.append((tracker.peak, tracker.peak_phase))
        del tracker
    return out
