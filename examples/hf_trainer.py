"""Train a tiny Llama with the Hugging Face Trainer + zerolite on the standard library's source.

    torchrun --nproc-per-node 2 examples/hf_trainer.py [--stage 1|2|3] [--steps 100] [--resume]
    python examples/hf_trainer.py            # one process works too

The model is built from a ``LlamaConfig`` (no download) with a byte vocabulary (256); the
text is the Python standard library's own ``.py`` files, read at run time. The only
change from a stock Trainer script is ``ZeroTrainer(..., zero_config=...)`` in place of
``Trainer(...)``. Checkpoints go to ``--out`` every ``--save-every`` steps
(``checkpoint-N/`` with a sharded ``zerolite/`` inside); ``--resume`` continues from the
newest one, at any number of processes or stage. At the end the model is saved in
Hugging Face format (``--out/final``) and reloaded with ``from_pretrained`` as a check.
Needs ``pip install zerolite[hf]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

import zerolite
from zerolite.hf import ZeroTrainer


class StdlibBytes(torch.utils.data.Dataset):
    """Non-overlapping ``seq_len``-byte windows of the standard library's .py files."""

    def __init__(self, seq_len: int, max_bytes: int, skip_bytes: int = 0) -> None:
        data = bytearray()
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            data += path.read_bytes()
            if len(data) >= skip_bytes + max_bytes:
                break
        tokens = torch.frombuffer(
            data[skip_bytes : skip_bytes + max_bytes], dtype=torch.uint8
        ).long()
        self.rows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}  # the model shifts the labels


def llama_config(seq_len: int) -> LlamaConfig:
    """The example's model: a 0.79M-parameter Llama over bytes (vocabulary 256)."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--stage", type=int, default=int(os.environ.get("ZEROLITE_STAGE", "2")), choices=(1, 2, 3)
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--out", default="runs/hf_trainer")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --out"
    )
    cli = parser.parse_args()

    seq_len = 128
    config = llama_config(seq_len)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=cli.out,
        max_steps=cli.steps,
        per_device_train_batch_size=cli.batch,
        per_device_eval_batch_size=cli.batch,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        weight_decay=0.1,
        warmup_steps=10,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=cli.save_every,
        save_steps=cli.save_every,
        save_total_limit=2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    trainer = ZeroTrainer(  # was: Trainer(
        model=model,
        args=args,
        train_dataset=StdlibBytes(seq_len, 2_000_000, skip_bytes=200_000),
        eval_dataset=StdlibBytes(seq_len, 32 * seq_len),
        zero_config=zerolite.ZeroConfig(stage=cli.stage),
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    final = Path(cli.out) / "final"
    trainer.save_model(str(final))  # every process: the parameters are gathered to rank 0
    metrics = trainer.evaluate()  # every process takes part (stage 3 gathers parameters)
    if trainer.is_world_process_zero():
        reloaded = AutoModelForCausalLM.from_pretrained(final)
        count = sum(p.numel() for p in reloaded.parameters())
        print(
            f"saved {final} ({count / 1e6:.2f}M parameters); eval loss {metrics['eval_loss']:.3f}"
        )


if __name__ == "__main__":
    main()
