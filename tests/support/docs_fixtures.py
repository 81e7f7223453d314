"""What some README blocks are written against: "your" model, data and scheduler.

A block marked ``<!-- docs-test: fixture=NAME -->`` runs after ``NAME(namespace)`` has put
these names into its namespace (tests/support/docs_blocks.py). The docs pages' own blocks are
complete scripts and need none.
"""

from __future__ import annotations

from typing import Any

import torch

from examples.gpt import GPT, GPTConfig, random_batch

CFG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=2, d_model=32)


def gpt(namespace: dict[str, Any]) -> None:
    """``GPT``, a small ``cfg`` and a ``loader`` of two ``(x, y)`` batches."""
    namespace.update(GPT=GPT, cfg=CFG, loader=[random_batch(CFG, 2, seed) for seed in range(2)])


def sched(namespace: dict[str, Any]) -> None:
    """``sched`` on the block's ``opt``, and the ``step`` a loop would have reached."""
    namespace["sched"] = torch.optim.lr_scheduler.StepLR(namespace["opt"], step_size=10)
    namespace.setdefault("step", 2)


def fresh_model(namespace: dict[str, Any]) -> None:
    """A new, unsharded ``model`` (and ``opt``, ``sched``) for a block that shards again,
    with ``steps``, ``data`` and ``path`` for its loop and checkpoint."""
    gpt(namespace)
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    namespace.update(model=model, opt=opt, steps=2, data=namespace["loader"], path="ckpt/fresh",
                     sched=torch.optim.lr_scheduler.StepLR(opt, step_size=10),
                     CosineAnnealingLR=torch.optim.lr_scheduler.CosineAnnealingLR)


def hf_llama(namespace: dict[str, Any]) -> None:
    """A tiny Llama ``model``, Trainer ``args`` for 2 steps on the CPU, a dataset ``ds``, and
    ``zerolite`` (a block that starts a new launch has no earlier block's imports)."""
    from transformers import LlamaForCausalLM, TrainingArguments

    import zerolite
    from examples.hf_trainer import StdlibBytes, llama_config

    torch.manual_seed(0)
    namespace.update(
        zerolite=zerolite,
        model=LlamaForCausalLM(llama_config(32)),
        args=TrainingArguments(output_dir="trainer-out", max_steps=2, per_device_train_batch_size=2,
                               report_to=[], use_cpu=True, save_strategy="no",
                               logging_strategy="no", disable_tqdm=True),
        ds=StdlibBytes(seq_len=32, max_bytes=32 * 16),
    )


def next_step(namespace: dict[str, Any]) -> None:
    """The loop's next ``step``, for a block that saves a checkpoint of its own."""
    namespace["step"] += 1
