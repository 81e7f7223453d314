"""Rank bodies for tests/integrations/test_stock_loops.py: the loop shapes of transformers' example
scripts (``run_clm_no_trainer.py``, ``run_glue_no_trainer.py``, ``run_clm.py``), written here
in their own words, under `zerolite.testing.run_ranks` (2 CPU ranks, no launcher).

The Accelerate loop, as ``run_clm_no_trainer.py`` shapes it: gradient accumulation 2,
``save_state(f"step_{completed_steps}")`` checked after every micro-step (so ``step_N`` is
saved on two consecutive micro-steps, and ``step_0`` on the first), ``epoch_N`` folders,
``resume_from_checkpoint`` of either (``load_state`` then ``skip_first_batches``), evaluation
through ``gather_for_metrics`` over an eval set that does not split evenly, then
``unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=
accelerator.save)`` on every rank and ``get_state_dict``. The training data is not shuffled
and dropout is off, so a resumed run must end bitwise where the uninterrupted one does.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

SEQ = 16
VOCAB = 64
ACCUMULATION = 2
TOTAL_STEPS = 6  # optimizer steps: 4 per epoch, so two epochs
SAVE_EVERY = 2


class Tokens(torch.utils.data.Dataset):
    """``n`` fixed random sequences (the same on every rank), labels = inputs."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Labelled(Tokens):
    """The GLUE shape: a sequence and one class label out of 3."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 3}


def make_model(head: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    if head == "clm":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _prepared(stage: int | None, precision: str, head: str) -> tuple[Any, ...]:
    """Stage ``None``: stock Accelerate (DDP). Precision ``"bf16_params"``: Accelerate's bf16
    with zerolite's 16-bit recipe asked for explicitly (``ZeroConfig.param_dtype``)."""
    from accelerate import Accelerator
    from transformers import get_scheduler

    import zerolite
    from zerolite.accelerate import ZeroAccelerator

    kwargs = {"cpu": True, "mixed_precision": precision.removesuffix("_params"),
              "gradient_accumulation_steps": ACCUMULATION}
    if stage is None:
        accelerator = Accelerator(**kwargs)
    else:
        params = {"param_dtype": torch.bfloat16} if precision == "bf16_params" else {}
        accelerator = ZeroAccelerator(zero_config=zerolite.ZeroConfig(stage=stage, **params),
                                      **kwargs)
    model = make_model(head)
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "norm" not in n.lower()]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n.lower()]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    data = (Tokens if head == "clm" else Labelled)
    train = torch.utils.data.DataLoader(data(32, seed=1), batch_size=2)
    evaluation = torch.utils.data.DataLoader(data(7, seed=2), batch_size=2)
    sched = get_scheduler("linear", opt, num_warmup_steps=0,
                          num_training_steps=TOTAL_STEPS * accelerator.num_processes)
    return accelerator, *accelerator.prepare(model, opt, train, evaluation, sched)


def _resume_position(
    accelerator: Any, folder: Path, train: Any, per_epoch: int
) -> tuple[int, int, int | None]:
    """``run_clm_no_trainer.py``'s reading of a ``step_N`` / ``epoch_N`` folder after
    ``load_state``: (starting epoch, completed steps, micro-batches to skip or None)."""
    accelerator.load_state(str(folder))
    name = os.path.splitext(folder.name)[0]
    if "epoch" in name:
        epoch = int(name.replace("epoch_", "")) + 1
        return epoch, epoch * per_epoch, None
    resume_step = int(name.replace("step_", "")) * ACCUMULATION
    epoch = resume_step // len(train)
    return epoch, resume_step // ACCUMULATION, resume_step - epoch * len(train)


def accelerate_loop(
    out: str, stage: int, precision: str, head: str = "clm", resume: str | None = None
) -> dict[str, Any]:
    """The loop (module docstring); returns what the test checks, tensors on every rank."""
    import zerolite

    out_dir = Path(out)
    accelerator, model, opt, train, evaluation, sched = _prepared(stage, precision, head)
    per_epoch = math.ceil(len(train) / ACCUMULATION)
    epoch0, completed, skip = 0, 0, None
    restored: dict[str, Any] = {}
    if resume is not None:
        epoch0, completed, skip = _resume_position(accelerator, Path(resume), train, per_epoch)
        restored = _fingerprint(accelerator, model, sched)
    saves: list[str] = []
    at_save: dict[str, Any] = {}  # the state each folder's last save held
    compute_dtypes = _watch_compute_dtypes(model)
    for epoch in range(epoch0, math.ceil(TOTAL_STEPS / per_epoch)):
        model.train()
        active = accelerator.skip_first_batches(train, skip) if skip and epoch == epoch0 else train
        for batch in active:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                completed += 1
            if completed % SAVE_EVERY == 0:  # also on the micro-step after: saved twice
                saves.append(accelerator.save_state(str(out_dir / f"step_{completed}")))
                if completed == SAVE_EVERY:
                    at_save[f"step_{completed}"] = _fingerprint(accelerator, model, sched)
            if completed >= TOTAL_STEPS:
                break
        metrics = _evaluate(accelerator, model, evaluation, head)
        saves.append(accelerator.save_state(str(out_dir / f"epoch_{epoch}")))
        if epoch == 0:
            at_save["epoch_0"] = _fingerprint(accelerator, model, sched)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(str(out_dir / "final"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    return {
        **metrics,
        "saves": [Path(s).name for s in saves],
        "at_save": at_save,
        "restored": restored,
        "get_state_dict": accelerator.get_state_dict(model),
        "masters": zerolite.full_state_dict(unwrapped, rank0_only=False, masters=True),
        "params": zerolite.full_state_dict(unwrapped, rank0_only=False),
        "param_dtypes": sorted({str(p.dtype) for p in unwrapped.parameters()}),
        "compute_dtypes": sorted(compute_dtypes),
        "marker_runs": sorted({(out_dir / s / "zerolite_run.json").read_text() for s in saves}),
    }


def _watch_compute_dtypes(model: Any) -> set[str]:
    """The dtypes the model's linear layers (GPT-2's ``Conv1D`` included) output in training,
    filled as it runs: bf16 where Accelerate's autocast reaches them."""
    seen: set[str] = set()
    for module in model.modules():
        if type(module).__name__ in ("Linear", "Conv1D"):
            module.register_forward_hook(
                lambda m, args, out: seen.add(str(out.dtype)) if m.training else None)
    return seen


def stock_parity_loop(stage: int | None) -> dict[str, Any]:
    """One epoch of the bf16 loop (no saves), by stock Accelerate (``stage=None``, DDP) or
    `ZeroAccelerator` at ``stage`` with its default recipe: per-micro-step losses and the
    final weights, for a bitwise comparison."""
    accelerator, model, opt, train, _, sched = _prepared(stage, "bf16", "clm")
    model.train()
    losses = []
    for batch in train:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": accelerator.get_state_dict(model)}


def _fingerprint(accelerator: Any, model: Any, sched: Any) -> dict[str, Any]:
    """What a resume must restore: the weights ``get_state_dict`` returns (fp32 masters in
    bf16), the scheduler's position and Accelerate's micro-step counter. Every rank calls."""
    return {"state": accelerator.get_state_dict(model), "step": accelerator.step,
            "last_epoch": sched.state_dict()["last_epoch"]}


def _evaluate(accelerator: Any, model: Any, evaluation: Any, head: str) -> dict[str, Any]:
    """``run_clm_no_trainer.py``'s perplexity or ``run_glue_no_trainer.py``'s predictions,
    gathered with ``gather_for_metrics`` (which drops the last batch's padding)."""
    model.eval()
    losses, predictions, references = [], [], []
    for batch in evaluation:
        with torch.no_grad():
            outputs = model(**batch)
        if head == "clm":
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(2)))
        else:
            got, ref = accelerator.gather_for_metrics((outputs.logits.argmax(-1), batch["labels"]))
            predictions.append(got)
            references.append(ref)
    if head == "clm":
        gathered = torch.cat(losses)
        return {"eval_count": len(gathered), "eval_loss": gathered.mean().item()}
    got, ref = torch.cat(predictions), torch.cat(references)
    return {"eval_count": len(got), "predictions": got,
            "accuracy": (got == ref).float().mean().item()}


def loaded(folder: str, head: str) -> dict[str, Any]:
    """``from_pretrained`` of a saved model: its dtype, weights, and (GLUE) predictions of
    the eval set on one process."""
    import transformers as tf

    cls = tf.AutoModelForCausalLM if head == "clm" else tf.AutoModelForSequenceClassification
    model = cls.from_pretrained(folder)
    out: dict[str, Any] = {"dtype": str(model.dtype), "state": model.state_dict()}
    if head != "clm":
        ids = Labelled(7, seed=2).ids
        with torch.no_grad():
            out["predictions"] = torch.cat([model(input_ids=ids[i : i + 2]).logits.argmax(-1)
                                            for i in range(0, len(ids), 2)])
    return out


def trainer_cases(out: str) -> dict[str, Any]:
    """``run_clm.py``'s ``--torch_compile`` at stage 3, with DDP eager and compiled beside it
    (DDP's own compile deviation is the yardstick). ``--bf16``'s saved model is
    tests/integrations/test_hf_trainer.py's."""
    from transformers import Trainer

    import zerolite
    from tests.support.hf_trainer_cases import TokenData, _warm, make_args, make_model, steps
    from zerolite.hf import ZeroTrainer

    _warm()
    result: dict[str, Any] = {}
    for name, stage, compiled in (("ddp", None, False), ("ddp_compiled", None, True),
                                  ("zero_compiled", 3, True)):
        backend = {"torch_compile_backend": "aot_eager"} if compiled else {}
        args = make_args(Path(out) / name, max_steps=3, torch_compile=compiled, **backend)
        kwargs = {"model": make_model(), "args": args, "train_dataset": TokenData()}
        trainer = (Trainer(**kwargs) if stage is None
                   else ZeroTrainer(**kwargs, zero_config=zerolite.ZeroConfig(stage=stage)))
        torch._dynamo.reset()
        trainer.train()
        result[name] = [s[1] for s in steps(trainer)]
        result[f"{name}_wrapper"] = type(trainer.model_wrapped).__name__
    return result
