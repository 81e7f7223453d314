"""Rank bodies for tests/integrations/test_hf_trainer.py: a tiny Llama trained by a stock
``Trainer`` (DDP) and by ``ZeroTrainer`` inside `zerolite.testing.run_ranks` launches.

Trainer finds the process group that run_ranks created (``RANK``/``WORLD_SIZE`` are set and
``use_cpu=True`` makes Accelerate's state ``MULTI_CPU``), so no launcher or port is needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SEQ = 16
VOCAB = 64


def _warm() -> None:
    """Import transformers' Trainer once and freeze the heap: Trainer.train() runs a full
    gc.collect() (Accelerate's free_memory), which otherwise walks every object the import
    created -- about a second per train() call here."""
    import gc

    import transformers.trainer  # noqa: F401

    gc.freeze()


def make_model(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):
    """``n`` fixed random sequences (the same on every rank), labels = inputs."""

    def __init__(self, n: int = 48, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_args(out: str | os.PathLike, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    world = dist.get_world_size() if dist.is_initialized() else 1
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "use_cpu": True,
        "per_device_train_batch_size": 4 // world,
        "per_device_eval_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 6,
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "warmup_steps": 1,
        "lr_scheduler_type": "linear",
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        "optim": "adamw_torch",
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def steps(trainer: Any) -> list[tuple[int, float, float]]:
    """``(step, loss, grad_norm)`` of every training step in the log history (a resumed run's
    history begins with the steps ``trainer_state.json`` brought back: see `Logged`)."""
    return [(e["step"], e["loss"], e["grad_norm"])
            for e in trainer.state.log_history if "grad_norm" in e]


def logged() -> Any:
    """A callback recording ``(step, loss, grad_norm)`` of each training step this process
    logs itself (``on_log``), unlike `steps`, which also returns what a resume reloaded."""
    from transformers import TrainerCallback

    class Logged(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[tuple[int, float, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            if logs and "grad_norm" in logs:
                self.steps.append((state.global_step, logs["loss"], logs["grad_norm"]))

    return Logged()


# ---- the cases run by tests/integrations/test_hf_trainer.py -------------------------------


def _trainer(out: Path, stage: int | None, *, model: Any = None, **overrides: Any) -> Any:
    from transformers import Trainer

    import zerolite
    from zerolite.hf import ZeroTrainer

    optimizers = overrides.pop("optimizers", (None, None))
    args = make_args(out, **overrides)
    kwargs = {
        "optimizers": optimizers,
        "model": model if model is not None else make_model(),
        "args": args,
        "train_dataset": TokenData(),
        "eval_dataset": TokenData(8, seed=2),
    }
    if stage is None:
        return Trainer(**kwargs)
    return ZeroTrainer(**kwargs, zero_config=zerolite.ZeroConfig(stage=stage))


def _mixin_trainer(out: Path, **kwargs: Any) -> Any:
    """ZeroTrainerMixin on a user's Trainer subclass (one that overrides compute_loss)."""
    from transformers import Trainer

    from zerolite.hf import ZeroTrainerMixin

    class CountingTrainer(Trainer):
        calls = 0

        def compute_loss(self, *args: Any, **kw: Any) -> Any:
            self.calls += 1
            return super().compute_loss(*args, **kw)

    class ZeroCountingTrainer(ZeroTrainerMixin, CountingTrainer):
        pass

    return ZeroCountingTrainer(args=make_args(out), train_dataset=TokenData(), **kwargs)


def _evaluation(trainer: Any) -> dict[str, Any]:
    metrics = trainer.evaluate()
    prediction = trainer.predict(TokenData(4, seed=3))
    return {
        "eval_loss": metrics["eval_loss"],
        "predict_loss": prediction.metrics["test_loss"],
        "logits": torch.as_tensor(prediction.predictions),
    }


def _gathered(trainer: Any) -> dict[str, torch.Tensor]:
    import zerolite

    return zerolite.full_state_dict(trainer.model, rank0_only=False)


def parity_and_checkpoints(out: str) -> dict[str, Any]:
    """DDP, then stages 1-3 (GA=2, clipping), a checkpoint at step 3 (stage 2) resumed at
    2 ranks and at stage 3, gradient checkpointing, bf16, save_model, best-model loading."""
    from zerolite.optim.sharded_optimizer import ShardedOptimizer

    _warm()
    root = Path(out)
    results: dict[str, Any] = {}
    for name, stage in (("ddp", None), ("s1", 1), ("s2", 2), ("s3", 3)):
        extra = {"save_strategy": "steps", "save_steps": 3} if name == "s2" else {}
        trainer = _trainer(root / name, stage, **extra)
        # evaluate() before train(): the model is not sharded yet. (Not on the stock Trainer's
        # own model: after that evaluate(), its train() no longer wraps the model in DDP.)
        evaluated = trainer if stage is not None else _trainer(root / "ddp-eval", None)
        before = evaluated.evaluate()["eval_loss"]
        trainer.train()
        results[name] = {"steps": steps(trainer), "before": before, **_evaluation(trainer)}
        if stage is not None:
            results[name]["unwrapped"] = trainer.model_wrapped is trainer.model
            results[name]["sharded"] = isinstance(trainer.optimizer.optimizer, ShardedOptimizer)
            results[name]["state"] = _gathered(trainer)
        else:
            results[name]["state"] = {
                k: v.detach().clone() for k, v in trainer.model.state_dict().items()
            }
    for name, stage in (("sgd_ddp", None), ("sgd_s2", 2)):
        results[name] = _user_optimizer(root / name, stage)
    checkpoint = root / "s2" / "checkpoint-3"
    results["checkpoint_files"] = sorted(p.name for p in checkpoint.iterdir())
    for name, stage in (("resume_s2", 2), ("resume_s3", 3)):
        trainer = _trainer(root / name, stage, model=make_model(seed=7))
        trainer.add_callback(recorder := logged())
        trainer.train(resume_from_checkpoint=str(checkpoint))
        results[name] = {"steps": recorder.steps, "state": _gathered(trainer)}
    # resume_from_checkpoint=True finds the newest checkpoint-N in output_dir.
    if dist.get_rank() == 0:
        import shutil

        shutil.copytree(checkpoint, root / "resume_true" / "checkpoint-3")
    dist.barrier()
    trainer = _mixin_trainer(root / "resume_true", model=make_model(seed=7))
    trainer.add_callback(recorder := logged())
    trainer.train(resume_from_checkpoint=True)
    results["resume_true"] = {"steps": recorder.steps, "custom_loss_calls": trainer.calls}
    for reentrant in (False, True):
        trainer = _trainer(
            root / f"gc-{reentrant}",
            3,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        )
        trainer.train()
        results[f"gc_reentrant_{reentrant}"] = {"steps": steps(trainer)}
    results["generate"] = _generate_in_eval_callback(root / "generate")
    results["bf16"] = _bf16(root / "bf16")
    results["save_model"] = _save_model(root / "saved")
    results["best"] = _best_model(root / "best")
    results["errors"] = bad_arguments(str(root / "errors"))
    return results


def _user_optimizer(out: Path, stage: int | None) -> dict[str, Any]:
    """optimizers=(SGD with momentum, StepLR) built by the user on the unsharded model.
    SGD is not scale-invariant like Adam, so clipping by a wrong norm would show."""
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5)
    trainer = _trainer(out, stage, model=model, optimizers=(sgd, schedule))
    trainer.train()
    return {
        "steps": steps(trainer),
        "lrs": [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
    }


def _generate_in_eval_callback(out: Path) -> dict[str, Any]:
    """Stage 3: a callback generates in on_evaluate, a different length on each rank
    (ranks that finish early must keep joining the unit gathers)."""
    from transformers import TrainerCallback

    import zerolite

    class GenerateOnEvaluate(TrainerCallback):
        def __init__(self) -> None:
            self.matches: list[bool] = []

        def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            prompt = torch.tensor([[1, 2, 3, 4]])
            new = 2 if dist.get_rank() == 0 else 6
            tokens = model.generate(prompt, max_new_tokens=new, do_sample=False)
            unsharded = make_model()
            unsharded.load_state_dict(zerolite.full_state_dict(model, rank0_only=False))
            expected = unsharded.generate(prompt, max_new_tokens=new, do_sample=False)
            self.matches.append(bool(torch.equal(tokens, expected)))

    callback = GenerateOnEvaluate()
    trainer = _trainer(out, 3, max_steps=4, eval_strategy="steps", eval_steps=2)
    trainer.add_callback(callback)
    trainer.train()
    return {"matches": callback.matches}


def _bf16(out: Path) -> dict[str, Any]:
    """``args.bf16`` with the default recipe (an fp32 model: the stock Trainer's, fp32
    parameters under the Accelerator's autocast), with zerolite's bf16 parameters asked for
    explicitly, and with a model converted to bf16 before (its own dtype kept), beside the
    stock Trainer with that model."""
    import zerolite

    return {"default": _bf16_run(out / "default", None),
            "bf16_params": _bf16_run(out / "params",
                                     zerolite.ZeroConfig(param_dtype=torch.bfloat16)),
            "bf16_model": _bf16_run(out / "model", None, torch.bfloat16),
            "bf16_model_stock": _stock_bf16_model(out / "stock")}


def _stock_bf16_model(out: Path) -> dict[str, Any]:
    """The stock Trainer with a bf16 model: what it trains and saves."""
    from transformers import Trainer

    trainer = Trainer(model=make_model().to(torch.bfloat16),
                      args=make_args(out, max_steps=2, bf16=True), train_dataset=TokenData())
    trainer.train()
    trainer.save_model(str(out / "model"))
    result = {"param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()})}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        result["saved_dtype"] = str(AutoModelForCausalLM.from_pretrained(out / "model").dtype)
    return result


def _bf16_run(out: Path, config: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    import zerolite
    from zerolite.hf import ZeroTrainer

    trainer = ZeroTrainer(
        model=make_model().to(dtype), args=make_args(out, max_steps=2, bf16=True),
        train_dataset=TokenData(), zero_config=config,
    )
    computed: set[str] = set()  # what the linear layers output in training
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(
                lambda m, args, out: computed.add(str(out.dtype)) if m.training else None)
    trainer.train()
    trainer.save_model(str(out / "model"))  # as the stock --bf16 run: fp32 (the masters)
    masters = zerolite.full_state_dict(trainer.model, masters=True)
    params = zerolite.full_state_dict(trainer.model)
    opt = trainer.optimizer.optimizer
    result = {
        "stage": trainer.zero_config.stage,
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "master_dtypes": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
        "compute_dtypes": sorted(computed),
        "finite": bool(steps(trainer)) and all(
            torch.isfinite(torch.tensor(s[1:])).all().item() for s in steps(trainer)),
    }
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(out / "model")
        state = loaded.state_dict()
        result["saved_dtype"] = str(loaded.dtype)
        result["saved_is_masters"] = all(  # in the dtype written: bf16 rounds them
            torch.equal(state[k], v.to(loaded.dtype)) for k, v in masters.items())
        result["params_are_masters"] = all(
            torch.equal(params[k].float(), v) for k, v in masters.items())
    return result


def _save_model(out: Path) -> dict[str, Any]:
    trainer = _trainer(out / "run", 3, max_steps=2)
    trainer.train()
    # Which ranks reach Trainer._save, the method that writes (in older transformers on
    # every rank that calls it: another rank's empty state_dict could replace rank 0's file).
    stock_save, reached = trainer._save, []
    trainer._save = lambda *args, **kwargs: (reached.append(True), stock_save(*args, **kwargs))
    trainer.save_model(str(out / "model"))
    writers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(writers, bool(reached))
    gathered = _gathered(trainer)
    if dist.get_rank() != 0:
        return {}
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out / "model")
    reloaded = loaded.state_dict()
    return {
        "writers": writers,
        "files": sorted(p.name for p in (out / "model").iterdir()),
        "missing": sorted(set(gathered) - set(reloaded)),
        "max_diff": max((reloaded[k] - v).abs().max().item() for k, v in gathered.items()),
        "changed": max(
            (v - make_model().state_dict()[k]).abs().max().item() for k, v in gathered.items()
        ),
    }


def _best_model(out: Path) -> dict[str, Any]:
    trainer = _trainer(
        out,
        3,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        learning_rate=0.05,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    gathered = _gathered(trainer)
    dist.barrier()
    from safetensors.torch import load_file

    saved = load_file(Path(best) / "model.safetensors")
    return {
        "best": Path(best).name,
        "kept": sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")),
        "evals": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e],
        "max_diff": max((saved[k] - v).abs().max().item() for k, v in gathered.items()),
    }


def resume_one_rank(out: str) -> dict[str, Any]:
    """Resume the 2-rank stage-2 checkpoint-3 on this single rank, same global batch."""
    _warm()
    trainer = _trainer(Path(out) / "resume_1rank", 2, model=make_model(seed=7))
    trainer.add_callback(recorder := logged())
    trainer.train(resume_from_checkpoint=str(Path(out) / "s2" / "checkpoint-3"))
    return {"steps": recorder.steps, "state": _gathered(trainer)}


def bad_arguments(out: str) -> dict[str, str]:
    """The message of every construction-time refusal (each rank raises by itself)."""
    import zerolite
    from zerolite.hf import ZeroTrainer

    cases: dict[str, tuple[dict[str, Any], Any]] = {
        "deepspeed": ({}, None),
        "fsdp": ({"fsdp": "full_shard"}, None),
        "auto_find_batch_size": ({"auto_find_batch_size": True}, None),
        "bf16_full_eval": ({"bf16_full_eval": True}, None),
        "fp16_full_eval": ({"fp16_full_eval": True}, None),
        "parallelism_config": ({}, None),
        "device_map": ({}, None),
        "contradiction": ({"bf16": True}, zerolite.ZeroConfig(param_dtype=torch.float16)),
        "optim": ({"optim": "adafactor"}, None),
        "fp16_cpu": ({"fp16": True}, None),
        "stage0": ({}, zerolite.ZeroConfig(stage=0)),
        "user_optimizer": ({}, None),
    }
    messages: dict[str, str] = {}
    for name, (overrides, config) in cases.items():
        try:
            model = make_model()
            if name == "user_optimizer":
                overrides = {"optimizers": (torch.optim.Adafactor(model.parameters()), None)}
            if name == "parallelism_config":
                from accelerate import ParallelismConfig

                overrides = {"parallelism_config": ParallelismConfig()}
            if name == "device_map":
                # What from_pretrained(device_map=...) leaves on a model spread over two GPUs
                # (none here: the attribute is what Trainer reads).
                model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}
            optimizers = overrides.pop("optimizers", (None, None))
            args = make_args(Path(out) / name, **overrides)
            if name == "deepspeed":  # the package is absent here: TrainingArguments refuses a path
                args.deepspeed = "ds_config.json"
            ZeroTrainer(
                model=model,
                args=args,
                train_dataset=TokenData(),
                zero_config=config,
                optimizers=optimizers,
            )
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    messages["cpu_launch"] = _cpu_launch_without_use_cpu(out)
    return messages


def _cpu_launch_without_use_cpu(out: str) -> str:
    """torchrun on CPU without ``--use_cpu``: Accelerate sees one process from 1.13, all of
    them before (last: it resets Accelerate's process state, which every Trainer of this
    launch shares)."""
    from accelerate.state import AcceleratorState

    from zerolite.hf import ZeroTrainer

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        trainer = ZeroTrainer(model=make_model(), train_dataset=TokenData(),
                              args=make_args(Path(out) / "cpu", use_cpu=False))
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return f"no error: Accelerate sees {trainer.accelerator.num_processes} processes"
