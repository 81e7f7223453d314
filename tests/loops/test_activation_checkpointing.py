"""Activation checkpointing at every stage: what holds, measured against torch.

Recomputation gives the same values as the original forward (fp32, CPU), so each run is
compared with plain single-process training of the same model, under the parity metric
of `tests.support.parity`, with DDP (without checkpointing) as the yardstick of rounding error.

Cases, each at stages 1-3 on 2 ranks:

- ``torch.utils.checkpoint`` around each block, reentrant and not;
- everything after the embeddings inside one reentrant checkpoint (the first gradients
  arrive in a nested backward; a region whose inputs need no gradient gets none, in torch
  too, so the embeddings stay outside);
- a parameter used inside *and* outside reentrant checkpoints (the final norm applied in
  every checkpointed block too): autograd delivers its gradient several times per
  backward, the last after its bucket was reduce-scattered;
- transformers' ``gradient_checkpointing_enable()`` on a tiny Llama, reentrant and not.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zerolite
from examples.gpt import GPT
from tests.support import parity
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STAGES = (1, 2, 3)
SMALL_BUCKETS_MB = 0.01


class CheckpointedGPT(GPT):
    """The example GPT with its blocks (or itself) run under ``torch.utils.checkpoint``."""

    def __init__(self, cfg, mode: str) -> None:
        super().__init__(cfg)
        self.mode = mode

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if self.mode == "whole_reentrant":  # all but the embeddings in one region
            return checkpoint(self._body, x, targets, use_reentrant=True)
        return self._body(x, targets)

    def _body(self, x, targets):
        for block in self.blocks:
            if self.mode in ("reentrant", "non_reentrant"):
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
            elif self.mode == "shared_reentrant":
                x = checkpoint(self._block_then_norm, block, x, use_reentrant=True)
            elif self.mode == "shared_plain":  # its reference, without checkpoints
                x = self._block_then_norm(block, x)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def _block_then_norm(self, block, x):
        return x + 0.1 * self.ln_f(block(x))  # ln_f is used outside the checkpoints too


def _gpt(mode: str) -> GPT:
    torch.manual_seed(0)
    return CheckpointedGPT(parity.TINY, mode)


def _llama(mode: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    if mode != "plain":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"}
        )
    model.train()
    return model


def _llama_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def _gpt_loss(model, x, y):
    return model(x, y)


def _train(model, opt, data, loss_fn, *, sliced: bool) -> list[float]:
    losses = []
    for x, y in data:
        if sliced:
            x, y = parity.local_slice(x), parity.local_slice(y)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(parity.mean_over_ranks(loss.item()) if sliced else loss.item())
    return losses


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _matrix_rank(cases: list[tuple[str, str]]) -> dict:
    data = parity.batches(steps=4)
    report: dict = {"worst": {}, "failures": []}
    for family, mode in cases:
        build, loss_fn = (_gpt, _gpt_loss) if family == "gpt" else (_llama, _llama_loss)
        plain = "shared_plain" if mode == "shared_reentrant" else "plain"
        ref = build(plain)
        ref_losses = _train(ref, _adamw(ref), data, loss_fn, sliced=False)
        ddp_model = build(plain)
        ddp_losses = _train(
            torch.nn.parallel.DistributedDataParallel(ddp_model),
            _adamw(ddp_model),
            data,
            loss_fn,
            sliced=True,
        )
        ddp_dev = parity.ddp_deviation(ddp_model, ddp_losses, ref, ref_losses)
        for stage in STAGES:
            model = build(mode)
            config = zerolite.ZeroConfig(
                stage=stage, bucket_size_mb=SMALL_BUCKETS_MB if stage == 2 else 25.0
            )
            opt = zerolite.shard(model, _adamw(model), config)
            label = f"{family}/{mode}/stage{stage}"
            try:
                losses = _train(model, opt, data, loss_fn, sliced=True)
                report["worst"][label] = parity.check_parity(
                    label, model, losses, ref, ref_losses, ddp_dev
                )
            except Exception as exc:  # noqa: BLE001 - every rank fails alike; reported to the parent
                report["failures"].append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
    return report


GPT_CASES = [
    ("gpt", m) for m in ("reentrant", "non_reentrant", "whole_reentrant", "shared_reentrant")
]
LLAMA_CASES = [("llama", m) for m in ("reentrant", "non_reentrant")]


@pytest.mark.parametrize("cases", [GPT_CASES, LLAMA_CASES], ids=["torch_checkpoint", "hf_llama"])
def test_activation_checkpointing_matrix(cases):
    reports = run_ranks(_matrix_rank, 2, cases, timeout=240)
    for r, rep in enumerate(reports):
        assert not rep["failures"], f"rank {r}:\n" + "\n".join(rep["failures"])
    print()
    for label, err in reports[0]["worst"].items():
        print(f"  {label:35s} worst rel error {err:.2e}")
