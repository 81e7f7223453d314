"""Rank bodies for tests/integrations/test_trl.py: TRL's ``SFTTrainer`` and ``DPOTrainer`` with
``ZeroTrainerMixin`` against the stock trainers under DDP, in one `zerolite.testing.run_ranks`
launch.

Nothing is downloaded: rank 0 writes a tiny Llama (2 layers, width 32, tied head) built from
a config and a character-level tokenizer built with ``tokenizers`` into a folder, and the
trainers load them from that path (as ``SFTTrainer(model="...")`` loads a hub model, with
``model_init_kwargs``). The datasets are built in memory (``datasets.Dataset.from_dict``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.hf_trainer_cases import logged, steps

WORDS = "the cat sat on a mat and saw dog run far away from home".split()
CHARS = "abcdefghijklmnopqrstuvwxyz ."


def _tokenizer() -> Any:
    """One token per character, plus pad and eos (a fast tokenizer, built offline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({c: 3 + i for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def write_model(folder: Path) -> None:
    """The tiny Llama (embedding and head tied) and its tokenizer, saved as a hub model is.

    Not GPT-2: its attention's key bias has no gradient but rounding noise, which AdamW
    turns into full-size steps, so any other summation order (accumulation sums in another
    order than DDP) moves it by 1e-2 and a tolerance would measure noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def _sentences(n: int, words: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (n, words), generator=g).tolist()
    return [" ".join(WORDS[i] for i in row) for row in picks]


def text_data() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"text": _sentences(32, 8, seed=1)})


def preference_data() -> Any:
    from datasets import Dataset

    prompts, chosen, rejected = (_sentences(16, k, seed) for k, seed in ((4, 2), (3, 3), (3, 4)))
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def _config(kind: str, out: Path, **overrides: Any) -> Any:
    """Training arguments: GA=2, clipping (the logged norms are 0.5-1.7), AdamW, 4 steps.

    The learning rate is 1e-3: at 1e-2 this tiny model's AdamW turns last-bit differences
    (another summation order, another CPU kernel family) into 1e-3 weight differences within
    4 steps, for the stock trainer against itself as for zerolite against it."""
    from trl import DPOConfig, SFTConfig

    settings: dict[str, Any] = {
        "output_dir": str(out), "use_cpu": True, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2, "max_steps": 4, "learning_rate": 1e-3,
        "max_grad_norm": 0.5, "logging_steps": 1, "save_strategy": "no", "report_to": [],
        "disable_tqdm": True, "seed": 0, "dataloader_num_workers": 0,
        "max_length": 48 if kind == "sft" else 32,
    }
    settings.update(overrides)
    return (SFTConfig if kind == "sft" else DPOConfig)(**settings)


def _trainer(kind: str, folder: Path, out: Path, stage: int | None, **kwargs: Any) -> Any:
    """The stock trainer (``stage=None``) or ``ZeroTrainerMixin`` on it: the one-line change."""
    from transformers import AutoTokenizer
    from trl import DPOTrainer, SFTTrainer

    import zerolite
    from zerolite.hf import ZeroTrainerMixin

    stock = SFTTrainer if kind == "sft" else DPOTrainer

    class ZeroTRL(ZeroTrainerMixin, stock):  # type: ignore[misc,valid-type]
        pass

    overrides = kwargs.pop("args", {})
    data = text_data() if kind == "sft" else preference_data()
    common = {"model": str(folder), "args": _config(kind, out, **overrides),
              "train_dataset": data, "processing_class": AutoTokenizer.from_pretrained(folder),
              **kwargs}
    if stage is None:
        return stock(**common)
    return ZeroTRL(**common, zero_config=zerolite.ZeroConfig(stage=stage))


def _weights(trainer: Any, stage: int | None, trained_only: bool = False) -> dict[str, Any]:
    """The full weights (gathered under zerolite), on every rank."""
    import zerolite

    model = trainer.model
    if stage is None:
        model = getattr(model, "module", model)
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        full = zerolite.full_state_dict(model, rank0_only=False)
    if trained_only:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        full = {k: v for k, v in full.items() if k in names}
    return full


def _run(
    kind: str, folder: Path, out: Path, stage: int | None, **kwargs: Any
) -> tuple[dict[str, Any], Any]:
    """Train; the logged steps and the weights (only the trained ones with peft), and the
    trainer."""
    trained_only = "peft_config" in kwargs
    trainer = _trainer(kind, folder, out, stage, **kwargs)
    trainer.train()
    result = {"steps": steps(trainer), "state": _weights(trainer, stage, trained_only)}
    if stage is not None:
        result["unwrapped"] = trainer.model_wrapped is trainer.model
    return result, trainer


def _saved(trainer: Any, out: Path) -> dict[str, Any]:
    """save_model()'s files, read back on rank 0: every tensor and the config's dtype."""
    from safetensors.torch import load_file

    trainer.save_model(str(out))
    dist.barrier()
    files = sorted(p.name for p in out.iterdir())
    weights = next(n for n in ("model.safetensors", "adapter_model.safetensors") if n in files)
    config = out / "config.json"
    return {
        "files": files,
        "tensors": load_file(out / weights),
        "config_dtype": json.loads(config.read_text()).get("dtype") if config.is_file() else None,
    }


def _bf16(folder: Path, root: Path, stage: int | None) -> dict[str, Any]:
    """The model loaded in bf16 (``model_init_kwargs``) under ``bf16=True``."""
    from zerolite.memory import footprint

    args = {"bf16": True, "model_init_kwargs": {"dtype": "bfloat16"}, "max_steps": 2}
    trainer = _trainer("sft", folder, root / f"bf16-{stage}", stage, args=args)
    trainer.train()
    model = getattr(trainer.model, "module", trainer.model)
    opt = trainer.optimizer.optimizer
    result = {
        "steps": steps(trainer),
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "optimizer_tensors": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "saved": _saved(trainer, root / f"bf16-{stage}" / "final"),
    }
    if stage is not None:
        import zerolite

        result["held_params"] = footprint(opt).params
        result["masters"] = zerolite.full_state_dict(model, masters=True, rank0_only=False)
    return result


def cases(root: str) -> dict[str, Any]:
    """Every comparison of tests/integrations/test_trl.py, in one launch."""
    import gc

    import datasets
    import transformers.trainer  # noqa: F401
    import trl  # noqa: F401
    from peft import LoraConfig

    datasets.disable_progress_bars()
    gc.freeze()  # Trainer.train() runs gc.collect(): skip the imports' objects
    top = Path(root)
    folder = top / "model"
    if dist.get_rank() == 0:
        write_model(folder)
    dist.barrier()
    results: dict[str, Any] = {}
    # "envelope": the stock trainer on the same 8 samples per step without accumulation, so
    # summed in another order: how far the stock run moves from itself.
    envelope = {"args": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}}
    for name, stage in (("stock", None), ("envelope", None), ("s2", 2), ("s3", 3)):
        save = {"args": {"save_strategy": "steps", "save_steps": 2}} if name == "s2" else {}
        kwargs = envelope if name == "envelope" else save
        results[name], trainer = _run("sft", folder, top / name, stage, **kwargs)
        if name in ("stock", "s2"):
            results[name]["saved"] = _saved(trainer, top / name / "final")
    # Stage 2 -> 3: the stage-2 run's checkpoint-2 resumed at stage 3 (steps 3-4).
    trainer = _trainer("sft", folder, top / "resume", 3)
    trainer.add_callback(recorder := logged())
    trainer.train(resume_from_checkpoint=str(top / "s2" / "checkpoint-2"))
    results["resume"] = {"steps": recorder.steps, "state": _weights(trainer, 3)}
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "task_type": "CAUSAL_LM"}
    for name, stage in (("lora_stock", None), ("lora_s2", 2), ("lora_s3", 3)):
        results[name], trainer = _run("sft", folder, top / name, stage,
                                      peft_config=LoraConfig(**lora))
        results[name]["saved"] = _saved(trainer, top / name / "final")
    for stage in (None, 2, 3):
        results[f"bf16_{stage}"] = _bf16(folder, top, stage)
    # DPO without accumulation and clipping: the reduced gradients are DDP's bit for bit and
    # so is every step. (Clipped, the norms' last-bit difference grows to 8e-4 in q_proj's
    # weights after 3 steps: docs/hf-trainer.md, "The gradient norm".)
    dpo = {"max_steps": 3, "gradient_accumulation_steps": 1, "max_grad_norm": 0.0}
    for name, stage in (("dpo_stock", None), ("dpo_s2", 2)):
        results[name] = _run("dpo", folder, top / name, stage, args=dpo)[0]
    return results
