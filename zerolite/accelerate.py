"""Hugging Face Accelerate integration: `ZeroAccelerator` (one-line change) and `setup`.

Accelerate has no plug-in point for a third-party sharding engine, and its defaults
are wrong for sharded state (docs/design.md, "Accelerate"; measured on accelerate 1.15):

- ``prepare()`` wraps the model in DDP whenever there is more than one process:
  gradients would be reduced twice and stage 2's saving would vanish. Here models are
  prepared with ``evaluation_mode=True`` (device placement and autocast, no DDP) and
  optimizers are sharded with `zerolite.shard`.
- ``clip_grad_norm_`` / ``clip_grad_value_`` read ``p.grad`` (local or gone): replaced by
  the global norm and a clamp of the reduced shards; ``unscale_gradients`` (and so both,
  with fp16) would call ``accelerator.scaler``, None here: a no-op.
- ``save_state`` pickles ``optimizer.state_dict()`` from rank 0 and ``load_state``
  loads it on every rank (rank 1 would get rank 0's shard): replaced by
  `zerolite.checkpoint` per rank, keeping Accelerate's directory naming, ``total_limit``,
  dataloader, RNG and registered-object states.
- ``accumulate()`` enters ``model.no_sync()``: honoured in stage 1 (full gradients are
  kept anyway); stages >= 2 reduce-scatter every micro-step instead, keeping their
  memory saving (as Accelerate does for DeepSpeed ZeRO >= 2).
- a model built under ``torch.device("meta")`` is not moved by ``prepare()``:
  `zerolite.shard` materialises it on the accelerator's device (`zerolite.params.meta_init`).
- ``mixed_precision: bf16`` means bf16 parameters with fp32 master shards
  (``param_dtype=torch.bfloat16``); ``fp16`` uses zerolite's loss scaler (CUDA only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

import zerolite.checkpoint
from zerolite.checkpoint.pending_save import PendingSave, finish_in_flight_everywhere
from zerolite.comm import runtime
from zerolite.config import ZeroConfig
from zerolite.gathered import full_state_dict
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.zero import shard

__all__ = ["ZeroAccelerator", "setup", "zero_config_for"]


def zero_config_for(accelerator: Accelerator, zero_config: ZeroConfig | None) -> ZeroConfig:
    """The `ZeroConfig` to use: ``zero_config`` (default ``ZeroConfig()``, which reads
    ``ZEROLITE_*``), with ``param_dtype`` taken from Accelerate's ``mixed_precision`` unless
    the config sets it (an argument or ``ZEROLITE_PARAM_DTYPE``)."""
    config = ZeroConfig() if zero_config is None else zero_config
    if config.is_set("param_dtype"):
        return config
    precision = str(accelerator.mixed_precision)
    if precision == "bf16":
        return dataclasses.replace(config, param_dtype=torch.bfloat16)
    if precision == "fp16":
        if not runtime.is_accelerator(accelerator.device):
            raise ValueError(
                "mixed_precision='fp16' needs a CUDA device (zerolite scales the fp16 loss there); "
                "on CPU use mixed_precision='bf16' or 'no'"
            )
        return dataclasses.replace(config, param_dtype=torch.float16)
    return config


def check_launch(accelerator: Accelerator) -> None:
    """Refuse a launch where Accelerate sees fewer processes than the launcher started."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate "
            f"sees {accelerator.num_processes}: every process would train alone. On CPU, launch "
            f"with ACCELERATE_USE_CPU=1 and a config with distributed_type: MULTI_GPU, use_cpu: "
            f"true, num_processes: N (see examples/accelerate/); on GPUs check num_processes in "
            f"the config."
        )


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _materialise_on(accelerator: Accelerator, model: nn.Module, config: ZeroConfig) -> ZeroConfig:
    """A model built on the meta device is materialised on the accelerator's device."""
    if _on_meta(model) and config.device is None:
        return dataclasses.replace(config, device=accelerator.device)
    return config


class _ZeroMethods:
    """The overrides, shared by `ZeroAccelerator` and instances patched by `setup`."""

    zero_config: ZeroConfig
    _zero_sharded: list[tuple[nn.Module, ShardedOptimizer]]
    pending_save: PendingSave | None  # the last save_state(async_save=True)'s

    def _sharded_optimizer(
        self: Any, parameters: Iterable[torch.Tensor] | None = None
    ) -> ShardedOptimizer:
        if not self._zero_sharded:
            raise RuntimeError(
                "no optimizer was sharded yet: pass the model and optimizer to prepare() first"
            )
        if parameters is not None and len(self._zero_sharded) > 1:
            wanted = {id(p) for p in parameters}
            for model, opt in self._zero_sharded:
                if wanted <= {id(p) for p in model.parameters()}:
                    return opt
        return self._zero_sharded[0][1]

    @contextlib.contextmanager
    def no_sync(self: Any, model: nn.Module) -> Iterator[None]:
        if self.zero_config.stage >= 2 or not hasattr(model, "no_sync"):
            yield  # reduce-scatter every micro-step: no full-size gradients are kept
        else:
            with model.no_sync():
                yield

    def clip_grad_norm_(
        self: Any, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """The global norm over all ranks' gradient shards (every rank must call)."""
        return self._sharded_optimizer(parameters).clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self: Any, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp the reduced, unscaled gradient shards (every rank must call); see
        `zerolite.ShardedOptimizer.clip_grad_value_`."""
        self._sharded_optimizer(parameters).clip_grad_value_(clip_value)

    def unscale_gradients(self: Any, optimizer: Any = None) -> None:
        """Nothing to do: zerolite unscales fp16 gradients itself when it reads the reduced
        shards (Accelerate's would call ``accelerator.scaler``, None here)."""

    def backward(self: Any, loss: torch.Tensor, **kwargs: Any) -> None:
        loss = loss / self.gradient_accumulation_steps
        loss = self._sharded_optimizer().scale_loss(loss)
        loss.backward(**kwargs)

    def get_state_dict(self: Any, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full (gathered, for stage 3) weights on every rank, as ``model.state_dict()``."""
        return full_state_dict(model, rank0_only=False, to_cpu=True)

    def _checkpoint_dir(self: Any, output_dir: str | os.PathLike | None, overwrite: bool) -> Path:
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError(
                    "save_state() needs output_dir unless automatic_checkpoint_naming is set"
                )
            target = Path(output_dir)
            if not overwrite and target.is_dir() and any(target.iterdir()):
                raise ValueError(
                    f"save_state(): {target} already holds files (an earlier run's checkpoint?); "
                    "choose a new output_dir, or pass save_state(..., overwrite=True) to replace it"
                )
            return target
        root = Path(self.project_dir) / "checkpoints"
        target = root / f"checkpoint_{self.save_iteration}"
        if target.exists():  # checked before pruning, so a refused save deletes nothing
            raise ValueError(
                f"save_state(): checkpoint folder {target} already exists, from an earlier run in "
                f"project_dir {self.project_dir}: resume it with load_state(), choose another "
                "project_dir, or set accelerator.project_configuration.iteration past it"
            )
        root.mkdir(parents=True, exist_ok=True)
        if self.is_main_process and config.total_limit is not None:
            folders = sorted(
                (p for p in root.iterdir() if p.is_dir() and re.search(r"(\d+)$", p.name)),
                key=lambda p: int(re.search(r"(\d+)$", p.name).group(1)),
            )
            for old in folders[: max(0, len(folders) + 1 - config.total_limit)]:
                shutil.rmtree(old)
        return target

    def save_state(
        self: Any,
        output_dir: str | os.PathLike | None = None,
        *,
        overwrite: bool = False,
        async_save: bool = False,
        **kwargs: Any,
    ) -> str:
        """Save models and sharded optimizers with `zerolite.checkpoint` (each rank its shard),
        plus Accelerate's dataloader, RNG and registered-object states. All ranks must call.

        An existing checkpoint is never replaced silently: with automatic checkpoint naming an
        existing ``checkpoint_N`` is refused (as stock Accelerate does), and an explicit
        ``output_dir`` that already holds files is refused unless ``overwrite=True``.

        Every save (and `load_state`) first waits for the previous asynchronous one, before
        old checkpoints are pruned.

        Args:
            async_save: write the sharded checkpoints in the background
                (``zerolite.checkpoint.save(..., blocking=False)``): training resumes once
                each rank's tensors are copied into its staging area. Accelerate's own small
                files are written at once. ``self.pending_save`` is the `PendingSave` of
                the last model's checkpoint (with several models, each waits for the one
                before: at most one save is in flight); ``pending_save.wait()`` returns once
                it is committed.

        Raises:
            ValueError: the target folder exists (see above), before anything is written or
                pruned.
            zerolite.checkpoint.CheckpointError: the previous asynchronous save failed and
                no ``wait()`` reported it.
        """
        self._finish_pending_save()
        target = self._checkpoint_dir(output_dir, overwrite)
        # rank 0 has pruned old checkpoints before anyone creates the new one
        self.wait_for_everyone()
        target.mkdir(parents=True, exist_ok=True)
        schedulers = [getattr(s, "scheduler", s) for s in self._schedulers]
        for i, (model, opt) in enumerate(self._zero_sharded):
            saved = zerolite.checkpoint.save(
                target / f"zerolite_{i}", model, opt, schedulers=schedulers if i == 0 else (),
                extra={"step": self.step}, overwrite=overwrite, blocking=not async_save,
            )
            self.pending_save = saved if async_save else None
        save_accelerator_state(str(target), [], [], [], self._dataloaders, self.state.process_index,
                               self.step, None,
                               save_on_each_node=self.project_configuration.save_on_each_node)
        for i, obj in enumerate(self._custom_objects):
            save_custom_state(
                obj, str(target), i, save_on_each_node=self.project_configuration.save_on_each_node
            )
        self.project_configuration.iteration += 1
        self.wait_for_everyone()
        return str(target)

    def _finish_pending_save(self: Any) -> None:
        """Wait for this process's asynchronous save in flight, on every rank."""
        if self._zero_sharded:
            finish_in_flight_everywhere(self._zero_sharded[0][1].group)
        self.pending_save = None

    def load_state(self: Any, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        """Load what `save_state` wrote, at any world size (all ranks must call); first
        waits for an asynchronous `save_state` in flight."""
        self._finish_pending_save()
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ValueError(
                    "load_state() needs input_dir unless automatic_checkpoint_naming is set"
                )
            root = Path(self.project_dir) / "checkpoints"
            input_dir = max(
                root.iterdir(), key=lambda p: int(re.search(r"(\d+)$", p.name).group(1))
            )
        source = Path(input_dir)
        schedulers = [getattr(s, "scheduler", s) for s in self._schedulers]
        for i, (model, opt) in enumerate(self._zero_sharded):
            zerolite.checkpoint.load(
                source / f"zerolite_{i}", model, opt, schedulers=schedulers if i == 0 else ()
            )
        override = load_accelerator_state(str(source), [], [], [], self._dataloaders,
                                          self.state.process_index, None,
                                          load_kwargs={"weights_only": True})
        if "step" in override:
            self.step = override["step"]
        for i, obj in enumerate(self._custom_objects):
            load_custom_state(obj, str(source), i)
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = (
                int(re.search(r"(\d+)$", source.name).group(1)) + 1
            )


class _SkipAwareOptimizer(AcceleratedOptimizer):
    """Reports zerolite's fp16 skipped steps to Accelerate's scheduler wrapper."""

    @property
    def step_was_skipped(self) -> bool:
        inner = self.optimizer
        return bool(getattr(inner, "step_was_skipped", False))


class ZeroAccelerator(_ZeroMethods, Accelerator):
    """An `accelerate.Accelerator` that shards with zerolite instead of wrapping in DDP.

    Use it where you would use ``Accelerator``; everything else in the loop stays::

        accelerator = ZeroAccelerator(zero_config=zerolite.ZeroConfig(stage=2))
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    Args:
        zero_config: the `ZeroConfig`; by default ``ZeroConfig()`` (``ZEROLITE_STAGE`` and
            the other ``ZEROLITE_*`` variables), with ``param_dtype`` from ``mixed_precision``.
        *args: passed to ``Accelerator``.
        **kwargs: passed to ``Accelerator``.
    Raises:
        RuntimeError: the launch started more processes than Accelerate sees (e.g. on CPU
            without ``ACCELERATE_USE_CPU=1``).
    """

    def __init__(self, *args: Any, zero_config: ZeroConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_launch(self)
        self.zero_config = zero_config_for(self, zero_config)
        self.scaler = None  # fp16 loss scaling is zerolite's (per shard, agreed across ranks)
        self._zero_sharded = []
        self._zero_models: dict[int, nn.Module] = {}
        self._zero_pending: tuple[Any, ...] = ()
        self.pending_save = None

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        self._zero_pending = args
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._zero_pending = ()

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Device placement and autocast as Accelerate does, but never a DDP wrapper."""
        if id(model) in self._zero_models:
            return self._zero_models[id(model)]
        if _on_meta(model):  # built on meta: shard() materialises it on self.device
            device_placement = False
        prepared = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=True
        )
        self._zero_models[id(model)] = prepared
        return prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Shard ``optimizer`` over the prepared model that holds its parameters."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        candidates = [
            *self._zero_models.values(),
            *(a for a in self._zero_pending if isinstance(a, nn.Module)),
        ]
        model = next((m for m in candidates if owned & {id(p) for p in m.parameters()}), None)
        if model is None:
            raise ValueError(
                "prepare() needs the model together with its optimizer (or prepare the model first)"
            )
        model = self.prepare_model(model)
        sharded = shard(model, optimizer, _materialise_on(self, model, self.zero_config))
        self._zero_sharded.append((model, sharded))
        wrapped = _SkipAwareOptimizer(sharded, device_placement=False, scaler=None)
        self._optimizers.append(wrapped)
        return wrapped


def setup(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    zero_config: ZeroConfig | None = None,
) -> tuple[nn.Module, AcceleratedOptimizer]:
    """Shard ``model`` and ``optimizer`` for an existing, stock ``Accelerator``.

    For scripts that cannot change their Accelerator class. It prepares the model
    without DDP, shards the optimizer and patches this accelerator instance's
    ``clip_grad_norm_``, ``clip_grad_value_``, ``unscale_gradients``, ``no_sync``,
    ``backward``, ``get_state_dict``, ``save_state`` and ``load_state`` with zerolite's.
    Call it instead of ``accelerator.prepare(model, optimizer)``; prepare dataloaders and
    schedulers with ``accelerator.prepare`` after it.

    What it cannot cover:

    - ``accelerator.prepare(model, ...)`` called by the script afterwards on the same model
      would wrap it in DDP: do not prepare the model again.
    - ``mixed_precision='fp16'`` set on the Accelerator already created a ``GradScaler``;
      it is disabled here, so only zerolite's loss scaling applies -- through the patched
      ``accelerator.backward`` (a bare ``loss.backward()`` is not scaled).
    - Launch mismatches are checked here, not at ``Accelerator()`` construction.

    Returns:
        ``(model, optimizer)``: the same model (sharded in place) and the sharded
        optimizer wrapped as Accelerate expects.
    """
    check_launch(accelerator)
    model = accelerator.prepare_model(
        model, device_placement=False if _on_meta(model) else None, evaluation_mode=True
    )
    patched: Any = accelerator
    patched.zero_config = zero_config_for(accelerator, zero_config)
    patched.scaler = None
    sharded = shard(model, optimizer, _materialise_on(accelerator, model, patched.zero_config))
    patched._zero_sharded = [*getattr(patched, "_zero_sharded", []), (model, sharded)]
    patched.pending_save = getattr(patched, "pending_save", None)
    for name in ("_sharded_optimizer", "no_sync", "clip_grad_norm_", "clip_grad_value_",
                 "unscale_gradients", "backward", "get_state_dict", "_checkpoint_dir",
                 "_finish_pending_save", "save_state", "load_state"):
        setattr(patched, name, types.MethodType(getattr(_ZeroMethods, name), accelerator))
    wrapped = _SkipAwareOptimizer(sharded, device_placement=False, scaler=None)
    accelerator._optimizers.append(wrapped)
    return model, wrapped
