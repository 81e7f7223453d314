"""Hugging Face Trainer integration: `ZeroTrainer` and `ZeroTrainerMixin` (one-line change).

    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds,
                          zero_config=zerolite.ZeroConfig(stage=3))

Needs ``pip install zerolite[hf]``; ``import zerolite`` never imports transformers.

Trainer drives the model and the optimizer through its Accelerator, so this is the
Accelerate integration (`zerolite.accelerate.ZeroAccelerator`) plus Trainer's files:

- The Accelerator that Trainer builds becomes a ``ZeroAccelerator``: ``prepare(model,
  optimizer)`` shards the optimizer Trainer built (``args.optim`` with its weight-decay
  groups, ``optimizer_cls_and_kwargs`` or ``optimizers=``) with `zerolite.shard` and never
  wraps the model in DDP (``trainer.model_wrapped is trainer.model``). Its
  ``clip_grad_norm_`` is the global norm over all shards, so ``max_grad_norm`` clips as
  DDP does and the logged ``grad_norm`` is DDP's; its ``backward`` applies zerolite's fp16
  loss scale. Trainer's own gradient accumulation, LR schedulers, evaluation and
  prediction run unchanged.
- ``save_model`` gathers the parameters unit by unit to rank 0 and writes them with the
  model's ``save_pretrained``: ``from_pretrained`` loads the result. It writes what the
  stock Trainer writes for that model (``save_dtype=None``, `zerolite.integrations.outputs`): each
  parameter in the dtype it was loaded in, from the fp32 masters, so fp32 for an fp32
  model also under zerolite's bf16 parameters, bf16 for a model loaded in bf16; and
  ``config.json`` names the dtype written.
- ``args.torch_compile``: the model is compiled after zerolite has sharded it
  (`zerolite.accelerate.ZeroAccelerator.prepare_model`).
- ``checkpoint-N/`` keeps Trainer's files (weights as above, ``trainer_state.json``,
  ``scheduler.pt``, ``rng_state_*.pth``) but holds the optimizer as ``zerolite/``, a
  `zerolite.checkpoint` (fp32 masters and optimizer state, every rank its own file) instead
  of ``optimizer.pt`` (rank 0's pickle, which is wrong for sharded state). Resuming works at
  any world size or stage; the data position comes from ``trainer_state.json`` as usual.
  ``ZeroTrainer(..., async_save=True)`` writes ``zerolite/`` in the background
  (``zerolite.checkpoint.save(..., blocking=False)``).
- Parameters keep the model's own dtype (``ZeroConfig.param_dtype=None``,
  `zerolite.plan.precision`). So ``args.bf16`` with an fp32 model follows the stock
  Trainer's recipe: fp32 parameters (their own fp32 masters) under the Accelerator's bf16
  autocast, at every stage, so the one-line change gives the stock run's numbers; a model
  loaded in bf16 (``SFTConfig(model_init_kwargs={"dtype": "bfloat16"})``) keeps bf16
  parameters, with fp32 master shards. zerolite's 16-bit recipe for an fp32 model (bf16
  parameters, fp32 master shards) is an explicit choice:
  ``ZeroConfig(param_dtype=torch.bfloat16)`` or ``ZEROLITE_PARAM_DTYPE=bf16``.
  ``args.fp16``: fp16 parameters with zerolite's loss scaler (CUDA only).

Trainer methods overridden: public ``create_accelerator_and_postprocess``, ``save_model``;
private (no public hook exists; checked against transformers 5.24)
``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_best_model``. ``save_model`` calls the private
``_save`` (Trainer's writer of weights, config, processing class and ``training_args.bin``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

import zerolite.checkpoint
from zerolite.accelerate import ZeroAccelerator, check_launch
from zerolite.checkpoint.pending_save import finish_in_flight_everywhere
from zerolite.checkpoint.run_folders import RunFolders
from zerolite.checkpoint.trainer_resume import check_steps, newest_complete
from zerolite.config import ZeroConfig
from zerolite.ground import runtime
from zerolite.integrations.outputs import check_save_dtype, weights_for_saving
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.optimizers import check_optimizer

__all__ = ["ZERO_CHECKPOINT_DIR", "ZeroTrainer", "ZeroTrainerMixin", "zero_config_for_args"]

ZERO_CHECKPOINT_DIR = "zerolite"
"""The sharded zerolite checkpoint's directory inside Trainer's ``checkpoint-N/``."""

_UNSUPPORTED = (
    ("deepspeed", "DeepSpeed shards the model itself; use ZeroTrainer or DeepSpeed, not both"),
    ("fsdp", "FSDP shards the model itself; use ZeroTrainer or FSDP, not both"),
    ("parallelism_config", "tensor, context and sequence parallelism are not supported"),
    ("auto_find_batch_size", "a retry would re-wrap a model that is already sharded in place"),
    (
        "fp16_full_eval",
        (
            "it casts the model with .to(dtype), which a sharded model refuses; "
            "use args.fp16 or ZeroConfig(param_dtype=torch.float16)"
        ),
    ),
    (
        "bf16_full_eval",
        (
            "it casts the model with .to(dtype), which a sharded model refuses; "
            "use args.bf16 or ZeroConfig(param_dtype=torch.bfloat16)"
        ),
    ),
)


def zero_config_for_args(args: Any, zero_config: ZeroConfig | None) -> ZeroConfig:
    """The `ZeroConfig` a Trainer with ``args`` (``TrainingArguments``) trains with.

    ``zero_config=None`` means ``ZeroConfig()`` (stage 2, ``ZEROLITE_*`` variables).
    Unless the config sets ``param_dtype`` (an argument or ``ZEROLITE_PARAM_DTYPE``),
    parameters keep the model's own dtype (``args.bf16`` with an fp32 model: fp32 parameters
    under the Accelerator's bf16 autocast, the stock Trainer's recipe) and ``args.fp16``
    means fp16 parameters with zerolite's loss scaler. An explicit bfloat16 with
    ``args.bf16`` is zerolite's 16-bit recipe (bf16 parameters, fp32 master shards, under
    the same autocast).

    Raises:
        ValueError: the config contradicts ``args`` (float16 parameters with ``args.bf16``,
            anything but float16 with ``args.fp16``) or has ``stage=0``; ``args.fp16`` off CUDA.
    """
    if args.fp16 and not runtime.is_accelerator(args.device):
        raise ValueError(
            f"args.fp16=True needs a CUDA device (zerolite's loss scaler runs there), but the "
            f"device is {args.device}; use args.bf16=True or ZeroConfig(param_dtype=torch.bfloat16)"
        )
    wanted = torch.float16 if args.fp16 else None  # args.bf16: the model's dtype, autocast
    if zero_config is not None and not isinstance(zero_config, ZeroConfig):
        raise TypeError(
            f"zero_config must be a zerolite.ZeroConfig or None, got {type(zero_config).__name__}"
        )
    config = ZeroConfig() if zero_config is None else zero_config
    if wanted is not None and config.param_dtype is None:
        config = config.with_param_dtype(wanted)  # is_set: False, args chose it
    if config.stage == 0:  # also reachable through ZEROLITE_STAGE=0
        raise ValueError(
            "ZeroConfig.stage=0 is plain DDP: use transformers.Trainer, or stage 1, 2 or 3"
        )
    dtype = config.param_dtype
    if (args.bf16 and dtype == torch.float16) or (args.fp16 and dtype != torch.float16):
        flag = "args.bf16=True" if args.bf16 else "args.fp16=True"
        raise ValueError(
            f"zero_config.param_dtype={dtype} contradicts {flag}: drop one of them, or set "
            f"param_dtype={wanted or 'torch.float32 or torch.bfloat16'} (or leave "
            "zero_config=None to follow args)"
        )
    return config


def _refuse_unsupported(args: Any) -> None:
    for name, why in _UNSUPPORTED:
        if getattr(args, name, None):
            raise ValueError(
                f"ZeroTrainer cannot honour args.{name}={getattr(args, name)!r}: {why}"
            )
    if args.n_gpu > 1:
        raise ValueError(
            "ZeroTrainer needs one process per device, but this process sees "
            f"args.n_gpu={args.n_gpu} "
            "(Trainer would use nn.DataParallel): launch with torchrun --nproc-per-node N"
        )


# How a Trainer launched by torchrun runs its processes on CPU (the Accelerator reads both).
_TRAINER_CPU_HINT = (
    "On CPU, pass --use_cpu (TrainingArguments(use_cpu=True)) or set ACCELERATE_USE_CPU=1 "
    "for torchrun; with accelerate launch, use a config with distributed_type: MULTI_GPU, "
    "use_cpu: true, num_processes: N (see examples/accelerate/)."
)


def _follow_trainer_log_level(args: Any) -> None:
    """zerolite's info lines (the one ``shard()`` logs) at the Trainer's log level.

    Scripts such as transformers' ``run_clm.py`` configure transformers' logger from
    ``args.log_level`` and leave the root logger at WARNING, which would drop zerolite's
    info line. Like Trainer for transformers' logger, ZeroTrainer sets the ``zerolite``
    logger's level from ``args.get_process_log_level()`` -- unless the user set it.
    """
    zerolite_logger = logging.getLogger("zerolite")
    if zerolite_logger.level == logging.NOTSET:
        zerolite_logger.setLevel(args.get_process_log_level())


def _adopt(
    accelerator: Accelerator, config: ZeroConfig, save_dtype: torch.dtype | None
) -> ZeroAccelerator:
    """Turn the Accelerator that Trainer built into a `ZeroAccelerator`, in place.

    [Note: why not a new ZeroAccelerator] Trainer builds its Accelerator inside
    ``create_accelerator_and_postprocess`` from about fifteen settings (dataloader config,
    gradient-accumulation plugin, dynamo plugin, ...) through a private helper; building
    a second one would duplicate that logic or diverge from it. ``ZeroAccelerator`` only
    adds methods and the attributes set below, so switching the instance's class
    keeps everything Trainer configured and stored (e.g. its bound ``gather_function``).
    A Trainer subclass that builds its own Accelerator subclass keeps it, under zerolite's
    methods.
    """
    cls = type(accelerator)
    if not issubclass(cls, ZeroAccelerator):
        zero_cls = (
            ZeroAccelerator
            if cls is Accelerator
            else type(f"Zero{cls.__name__}", (ZeroAccelerator, cls), {})
        )
        accelerator.__class__ = zero_cls
    adopted: Any = accelerator
    adopted.zero_config = config
    adopted.zero_framework = "Trainer"
    adopted.scaler = None  # fp16 loss scaling is zerolite's (per shard, agreed across ranks)
    adopted.save_dtype = save_dtype
    adopted._zero_sharded = []
    adopted._zero_models = {}
    adopted._zero_pending = ()
    adopted._zero_runs = RunFolders()
    check_launch(adopted, _TRAINER_CPU_HINT)
    return adopted


class ZeroTrainerMixin:
    """Turns a ``transformers.Trainer`` subclass into one that trains with zerolite.

    Put it first: ``class MySFTTrainer(ZeroTrainerMixin, SFTTrainer): ...``. Every rank
    must construct the trainer and call ``train``, ``evaluate``, ``predict`` and
    ``save_model`` (stage 3 gathers parameters in all of them).

    Args:
        zero_config: the `ZeroConfig`; ``None`` means stage 2 (or ``ZEROLITE_STAGE``);
            parameters keep the model's own dtype (``args.bf16`` with an fp32 model: fp32
            parameters under autocast, as the stock Trainer), unless the config sets
            ``param_dtype`` (`zero_config_for_args`).
        async_save: write ``checkpoint-N/zerolite/`` in the background
            (``zerolite.checkpoint.save(..., blocking=False)``): training resumes once each
            rank's shard is copied into its staging area; the next checkpoint (or the end of
            the process) waits for it. Trainer's other files are written as usual. The
            staging area is made after the first step, in the background
            (`zerolite.checkpoint.prepare_async_save`), so the first checkpoint blocks no
            longer than later ones; it is held from then on.
        save_dtype: dtype of the weights ``save_model`` writes (and so each
            ``checkpoint-N/``'s), from the fp32 masters: None (default) each parameter in
            the dtype it was loaded in, as the stock Trainer (fp32 for an fp32 model under
            ``args.bf16``, bf16 for a model loaded in bf16); ``torch.float32`` the masters
            as they are; ``torch.bfloat16`` half the bytes of fp32.
        *args: the Trainer's own arguments, unchanged.
        **kwargs: the Trainer's own keyword arguments, unchanged.
    Raises:
        ValueError: at construction, on every rank, for Trainer arguments zerolite cannot
            honour (``deepspeed``, ``fsdp``, ``parallelism_config``,
            ``auto_find_batch_size``, ``fp16_full_eval``, ``bf16_full_eval``, several GPUs
            per process, a model spread over devices), naming the argument; a
            ``zero_config`` that contradicts ``args``; ``async_save`` with
            ``args.save_total_limit=1`` (Trainer deletes the previous checkpoint right
            after starting the next, so a crash during the background write would leave
            no complete one); a ``save_dtype`` other than None, float32, bfloat16 or
            float16.
        TypeError: the optimizer (``args.optim``, ``optimizers=`` or
            ``optimizer_cls_and_kwargs``) is not elementwise, so it cannot step shards.
    """

    args: Any
    model: Any
    optimizer: Any
    optimizer_cls_and_kwargs: Any
    accelerator: Any
    lr_scheduler: Any
    state: Any
    zero_config: ZeroConfig

    def __init__(
        self, *args: Any, zero_config: ZeroConfig | None = None, async_save: bool = False,
        save_dtype: torch.dtype | None = None, **kwargs: Any,
    ) -> None:
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be a bool, got {async_save!r}")
        self.save_dtype = check_save_dtype(save_dtype)
        self._zero_requested = zero_config
        self._async_save = async_save
        super().__init__(*args, **kwargs)
        if async_save and self.args.save_total_limit == 1:
            raise ValueError(
                "async_save=True with save_total_limit=1: Trainer deletes the previous "
                "checkpoint right after starting the next save, so a crash during the "
                "background write would leave no complete checkpoint; use save_total_limit "
                ">= 2 (or None), or async_save=False"
            )
        self._refuse_model_layout()
        self._check_optimizer_choice()

    # ---- construction ------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """Check the arguments, build Trainer's Accelerator, and make it a ZeroAccelerator."""
        _refuse_unsupported(self.args)
        self.zero_config = zero_config_for_args(self.args, self._zero_requested)
        _follow_trainer_log_level(self.args)
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        self.accelerator = _adopt(self.accelerator, self.zero_config, self.save_dtype)
        # The first asynchronous checkpoint then blocks as little as later ones.
        self.accelerator._zero_async_saves = self._async_save

    def _refuse_model_layout(self) -> None:
        if getattr(self, "is_model_parallel", False):
            raise ValueError(
                "ZeroTrainer cannot train a model dispatched over devices "
                "(from_pretrained(device_map=...)): "
                "load it on one device per process and let zerolite shard it"
            )
        if getattr(self, "is_distributed_loading_by_transformers", False):
            raise ValueError(
                "ZeroTrainer cannot train a model sharded at load time "
                "(from_pretrained(distributed_config=...)): "
                "load it unsharded and let zerolite shard it"
            )

    def _check_optimizer_choice(self) -> None:
        """Refuse a non-elementwise optimizer now rather than at the first ``train()``."""
        declared = self.zero_config.elementwise_optimizers
        if self.optimizer is not None:
            source, cls = "optimizers=", type(self.optimizer)
        elif self.optimizer_cls_and_kwargs is not None:
            source, cls = "optimizer_cls_and_kwargs=", self.optimizer_cls_and_kwargs[0]
        else:
            resolve = self.get_optimizer_cls_and_kwargs  # type: ignore[attr-defined]
            cls = resolve(self.args, self.model)[0]
            source = f"args.optim={getattr(self.args.optim, 'value', self.args.optim)!r}"
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(
                f"{source} builds {cls!r}, not a torch.optim.Optimizer class, "
                "so zerolite cannot shard it"
            )
        try:
            # check_optimizer reads only the instance's type: an uninitialised instance is
            # enough, and building a real one would allocate the optimizer (or import bnb).
            check_optimizer(cls.__new__(cls), declared)
        except TypeError as exc:
            raise TypeError(f"{source}: {exc}") from None

    # ---- training ----------------------------------------------------------------------

    def _sharded_optimizer(self) -> ShardedOptimizer:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(inner, ShardedOptimizer):
            message = "the optimizer is not sharded yet: train() shards it"
            raise RuntimeError(message)  # noqa: TRY004 - a state error, not a bad argument
        return inner

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write what ``from_pretrained`` loads: HF names, safetensors, config (all ranks call).

        Parameters are gathered unit by unit to rank 0 (on CPU), from the fp32 masters in
        ``save_dtype`` (`zerolite.integrations.outputs.weights_for_saving`); rank 0 writes
        them with the model's ``save_pretrained`` (``model.safetensors``, or shards and an
        index above its ``max_shard_size``), with ``config.json`` (whose ``dtype`` names what
        was written) and the processing class.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = weights_for_saving(self.model, self.save_dtype, keep=self.args.should_save)
        # Only the writer calls _save: transformers 5.17's writes on every rank that calls it
        # (5.25's returns on the others), so another rank's {} could replace rank 0's file.
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)  # type: ignore[attr-defined]
        if self.args.push_to_hub and not _internal_call:
            push: Any = self.push_to_hub  # type: ignore[attr-defined]
            push(commit_message="Model save", revision=self.args.hub_revision)

    # ---- checkpoints (private Trainer hooks: see the module docstring) ---------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``checkpoint-N/zerolite/`` (every rank its shard) instead of rank 0's optimizer.pt;
        the scheduler as Trainer saves it (all ranks call)."""
        zerolite.checkpoint.save(
            Path(output_dir) / ZERO_CHECKPOINT_DIR,
            self.model,
            self._sharded_optimizer(),
            extra={"global_step": self.state.global_step},
            overwrite=True,
            blocking=not self._async_save,
        )
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """Trainer's ``train``; ``resume_from_checkpoint=True`` takes the newest *complete*
        ``checkpoint-N`` (`zerolite.checkpoint.trainer_resume.newest_complete`)."""
        if resume_from_checkpoint is True:
            newest = newest_complete(self.args.output_dir, ZERO_CHECKPOINT_DIR)
            resume_from_checkpoint = True if newest is None else newest
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Called before the optimizer exists: only check. Weights and optimizer state are
        # loaded together, after sharding, by _load_optimizer_and_scheduler.
        if not (Path(resume_from_checkpoint) / ZERO_CHECKPOINT_DIR).is_dir():
            raise ValueError(
                f"cannot resume from {resume_from_checkpoint}: it holds no zerolite checkpoint "
                f"({ZERO_CHECKPOINT_DIR}/), so it was not written by a ZeroTrainer, was saved "
                "with args.save_only_model=True, or its asynchronous save did not finish. "
                "Resume from an earlier checkpoint-N, or start a new run from its weights "
                "with from_pretrained"
            )
        check_steps(resume_from_checkpoint, ZERO_CHECKPOINT_DIR)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Weights, fp32 masters and optimizer state from ``zerolite/`` at any world size or
        stage, then the scheduler (all ranks call, after train() has sharded the model)."""
        if checkpoint is None:
            return
        optimizer = self._sharded_optimizer()
        finish_in_flight_everywhere(optimizer.group)  # a save of this process in flight
        zerolite.checkpoint.load(
            Path(checkpoint) / ZERO_CHECKPOINT_DIR, self.model, optimizer
        )
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        """The best checkpoint's HF weights into the shards (Trainer would call
        ``load_state_dict`` on the sharded model). All ranks call."""
        best = Path(self.state.best_model_checkpoint)
        index = best / SAFE_WEIGHTS_INDEX_NAME
        files = index if index.is_file() else best / SAFE_WEIGHTS_NAME
        zerolite.checkpoint.load_pretrained(self.model, files)


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """``transformers.Trainer`` with zerolite sharding: change ``Trainer(`` to
    ``ZeroTrainer(`` and optionally pass ``zero_config=zerolite.ZeroConfig(stage=3)``.

    See `ZeroTrainerMixin` for the arguments, errors and which ranks must call what.
    """
