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
  dataloader, RNG and registered-object states. A folder this run saved (or resumed from)
  is replaced crash-safely, as stock Accelerate replaces it; another run's is refused
  (`zerolite.integrations.outputs.RunFolders`).
- ``get_state_dict`` and the model's ``save_pretrained`` (called on every rank, as
  transformers' example scripts do) write the full weights, from the fp32 masters, by
  default each parameter in the model's own dtype, as the stock run (``save_dtype``,
  `zerolite.integrations.outputs`).
- ``torch.compile`` (Accelerate's dynamo plugin) wraps the model after zerolite has
  sharded it, never before (the wrapper would hide the model from zerolite).
- ``accumulate()`` enters ``model.no_sync()``: honoured in stage 1 (full gradients are
  kept anyway); stages >= 2 reduce-scatter every micro-step instead, keeping their
  memory saving (as Accelerate does for DeepSpeed ZeRO >= 2).
- a model built under ``torch.device("meta")`` is not moved by ``prepare()``:
  `zerolite.shard` materialises it on the accelerator's device (`zerolite.params.meta_init`).
- parameters keep the model's own dtype (``ZeroConfig.param_dtype=None``,
  `zerolite.plan.precision`). So ``mixed_precision: bf16`` with an fp32 model follows
  Accelerate's own recipe: fp32 parameters (their own fp32 masters) under Accelerate's
  bf16 autocast, which ``prepare()`` puts on the model's forward at every stage, and the
  one-line change gives the stock run's numbers. A model loaded in bf16 keeps bf16
  parameters, with fp32 master shards. zerolite's 16-bit recipe for an fp32 model (bf16
  parameters, fp32 master shards, still under the autocast) is an explicit choice:
  ``ZeroConfig(param_dtype=torch.bfloat16)`` or ``ZEROLITE_PARAM_DTYPE=bf16``. ``fp16``
  means fp16 parameters with zerolite's loss scaler (CUDA only). `shard()`'s log line
  says where the recipe differs from the stock run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DynamoBackend
from torch import nn

from zerolite.checkpoint.pending_save import PendingSave
from zerolite.checkpoint.prepare import prepare_async_save
from zerolite.checkpoint.run_folders import RunFolders
from zerolite.config import ZeroConfig
from zerolite.ground import runtime
from zerolite.integrations.outputs import (
    StateFolderMethods,
    check_save_dtype,
    install_save_pretrained,
)
from zerolite.optim.sharded_optimizer import ShardedOptimizer
from zerolite.plan.precision import HostPrecision
from zerolite.sharding import announcing_host, shard

__all__ = ["ZeroAccelerator", "setup", "zero_config_for"]


def zero_config_for(accelerator: Accelerator, zero_config: ZeroConfig | None) -> ZeroConfig:
    """The `ZeroConfig` to use: ``zero_config`` (default ``ZeroConfig()``, which reads
    ``ZEROLITE_*``). Unless the config sets ``param_dtype`` (an argument or
    ``ZEROLITE_PARAM_DTYPE``), parameters keep the model's own dtype: with
    ``mixed_precision='bf16'`` an fp32 model keeps fp32 parameters (Accelerate's autocast
    computes in bf16, as in the stock run); ``'fp16'`` means fp16 parameters with zerolite's
    loss scaler (CUDA only)."""
    config = ZeroConfig() if zero_config is None else zero_config
    if config.param_dtype is not None:
        return config
    if str(accelerator.mixed_precision) == "fp16":
        if not runtime.is_accelerator(accelerator.device):
            raise ValueError(
                "mixed_precision='fp16' needs a CUDA device (zerolite scales the fp16 loss there); "
                "on CPU use mixed_precision='bf16' or 'no'"
            )
        return config.with_param_dtype(torch.float16)  # is_set: False, the host chose it
    return config


_CPU_HINT = (
    "On CPU, launch with ACCELERATE_USE_CPU=1 and a config with distributed_type: MULTI_GPU, "
    "use_cpu: true, num_processes: N (see examples/accelerate/); on GPUs check num_processes in "
    "the config."
)


def check_launch(accelerator: Accelerator, cpu_hint: str = _CPU_HINT) -> None:
    """Refuse a launch where Accelerate sees fewer processes than the launcher started;
    ``cpu_hint`` says how to launch on CPU (the Trainer's differs)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate "
            f"sees {accelerator.num_processes}: every process would train alone. {cpu_hint}"
        )


def host_precision(accelerator: Accelerator, framework: str) -> HostPrecision:
    """What `shard()`'s log line compares its recipe with: the stock run of ``framework``
    (``"Accelerate"``, ``"Trainer"``) and the autocast ``accelerator`` puts around the
    model."""
    precision = str(accelerator.mixed_precision)
    autocast = precision in ("bf16", "fp16") and getattr(accelerator, "native_amp", False)
    return HostPrecision(framework, precision if autocast else None)


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _materialise_on(accelerator: Accelerator, model: nn.Module, config: ZeroConfig) -> ZeroConfig:
    """A model built on the meta device is materialised on the accelerator's device."""
    if _on_meta(model) and config.device is None:
        return dataclasses.replace(config, device=accelerator.device)
    return config


class _ZeroMethods(StateFolderMethods):
    """The overrides, shared by `ZeroAccelerator` and instances patched by `setup` (the
    saving ones in `zerolite.integrations.outputs.StateFolderMethods`)."""

    zero_config: ZeroConfig
    _zero_sharded: list[tuple[nn.Module, ShardedOptimizer]]
    pending_save: PendingSave | None  # the last save_state(async_save=True)'s
    # Whether every sharded optimizer's staging area is made ahead of the first
    # asynchronous save (`zerolite.checkpoint.prepare_async_save`): ZeroTrainer(async_save=True).
    _zero_async_saves: bool = False

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
            the other ``ZEROLITE_*`` variables). Parameters keep the model's own dtype (an
            fp32 model under ``mixed_precision='bf16'`` stays fp32 under Accelerate's
            autocast, as in the stock run) unless the config sets ``param_dtype``
            (`zero_config_for`).
        save_dtype: dtype of the full weights that ``get_state_dict`` returns and the
            model's ``save_pretrained`` writes, from the fp32 masters: None (default) saves
            each parameter in the model's own dtype, as the stock run does (fp32 for an
            fp32 model, bf16 for one loaded in bf16); ``torch.float32`` the masters as they
            are; ``torch.bfloat16`` or ``torch.float16`` half the bytes of fp32.
        *args: passed to ``Accelerator``.
        **kwargs: passed to ``Accelerator``.
    Raises:
        RuntimeError: the launch started more processes than Accelerate sees (e.g. on CPU
            without ``ACCELERATE_USE_CPU=1``).
        ValueError: ``save_dtype`` is not float32, bfloat16 or float16.
    """

    zero_framework = "Accelerate"  # whose autocast `shard()`'s log line names

    def __init__(
        self,
        *args: Any,
        zero_config: ZeroConfig | None = None,
        save_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        self.save_dtype = check_save_dtype(save_dtype)
        super().__init__(*args, **kwargs)
        check_launch(self)
        self.zero_config = zero_config_for(self, zero_config)
        self.scaler = None  # fp16 loss scaling is zerolite's (per shard, agreed across ranks)
        self._zero_sharded = []
        # id(user's model) -> (the module zerolite shards, what prepare() returned for it)
        self._zero_models: dict[int, tuple[nn.Module, nn.Module]] = {}
        self._zero_pending: tuple[Any, ...] = ()
        self.pending_save = None
        self._zero_runs = RunFolders()

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        self._zero_pending = args
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._zero_pending = ()

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Device placement and autocast as Accelerate does, but never a DDP wrapper; with
        Accelerate's dynamo plugin, a ``torch.compile`` wrapper around the model, which
        zerolite shards in `prepare_optimizer` (before the first call compiles it)."""
        if id(model) in self._zero_models:
            return self._zero_models[id(model)][1]
        if _on_meta(model):  # built on meta: shard() materialises it on self.device
            device_placement = False
        plugin = self.state.dynamo_plugin
        backend, plugin.backend = plugin.backend, DynamoBackend.NO  # compiled below, not here
        try:
            prepared = super().prepare_model(
                model, device_placement=device_placement, evaluation_mode=True
            )
        finally:
            plugin.backend = backend
        returned = prepared
        if backend != DynamoBackend.NO:
            returned = torch.compile(prepared, **plugin.to_kwargs())
            returned._is_accelerate_prepared = True
        self._zero_models[id(model)] = (prepared, returned)
        return returned

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Shard ``optimizer`` over the prepared model that holds its parameters."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        prepared = [m for m, _ in self._zero_models.values()]
        pending = [a for a in self._zero_pending if isinstance(a, nn.Module)]
        model = next(
            (m for m in [*prepared, *pending] if owned & {id(p) for p in m.parameters()}), None
        )
        if model is None:
            raise ValueError(
                "prepare() needs the model together with its optimizer (or prepare the model first)"
            )
        if not any(model is m for m in prepared):
            self.prepare_model(model)
            model = self._zero_models[id(model)][0]
        with announcing_host(host_precision(self, self.zero_framework)):
            sharded = shard(model, optimizer, _materialise_on(self, model, self.zero_config))
        install_save_pretrained(model, self.save_dtype)
        self._zero_sharded.append((model, sharded))
        if self._zero_async_saves:
            prepare_async_save(model, sharded)
        wrapped = _SkipAwareOptimizer(sharded, device_placement=False, scaler=None)
        self._optimizers.append(wrapped)
        return wrapped


def setup(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    zero_config: ZeroConfig | None = None,
    save_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, AcceleratedOptimizer]:
    """Shard ``model`` and ``optimizer`` for an existing, stock ``Accelerator``.

    For scripts that cannot change their Accelerator class. It prepares the model
    without DDP, shards the optimizer and patches this accelerator instance's
    ``clip_grad_norm_``, ``clip_grad_value_``, ``unscale_gradients``, ``no_sync``,
    ``backward``, ``get_state_dict``, ``save_state`` and ``load_state`` with zerolite's, and
    gives the model zerolite's ``save_pretrained`` (``save_dtype``: as `ZeroAccelerator`'s).
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
    save_dtype = check_save_dtype(save_dtype)
    model = accelerator.prepare_model(
        model, device_placement=False if _on_meta(model) else None, evaluation_mode=True
    )
    patched: Any = accelerator
    patched.zero_config = zero_config_for(accelerator, zero_config)
    patched.scaler = None
    patched.save_dtype = save_dtype
    with announcing_host(host_precision(accelerator, "Accelerate")):
        sharded = shard(model, optimizer, _materialise_on(accelerator, model, patched.zero_config))
    install_save_pretrained(model, save_dtype)
    patched._zero_sharded = [*getattr(patched, "_zero_sharded", []), (model, sharded)]
    patched.pending_save = getattr(patched, "pending_save", None)
    patched._zero_runs = getattr(patched, "_zero_runs", None) or RunFolders()
    for name in ("_sharded_optimizer", "no_sync", "clip_grad_norm_", "clip_grad_value_",
                 "unscale_gradients", "backward", "get_state_dict", "_refuse_another_runs",
                 "_checkpoint_dir", "_save_accelerate_files", "_finish_pending_save",
                 "save_state", "load_state"):
        setattr(patched, name, types.MethodType(getattr(_ZeroMethods, name), accelerator))
    wrapped = _SkipAwareOptimizer(sharded, device_placement=False, scaler=None)
    accelerator._optimizers.append(wrapped)
    return model, wrapped
