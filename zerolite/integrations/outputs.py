"""What the integrations write: the full weights, and the folders of ``save_state``.

Two concerns that `zerolite.accelerate` and `zerolite.hf` share, kept here so that neither
file grows a second subject (neither imports transformers):

- **Full weights** (`weights_for_saving`, `install_save_pretrained`). A script saves the
  weights it trained with ``model.save_pretrained(dir, is_main_process=...)`` on every
  rank, ``accelerator.get_state_dict(model)`` or Trainer's ``save_model``. A stock run
  never changes a parameter's dtype, so it saves each parameter in the dtype the model was
  loaded in: fp32 for an fp32 model under ``mixed_precision: bf16`` (or ``--bf16``), bf16
  for a model loaded in bf16. zerolite's 16-bit parameters are only the compute copy, and
  the fp32 masters hold the trained values. So by default (``save_dtype=None``) the
  integrations save the masters (`zerolite.full_state_dict(..., masters=True)`) cast to
  each parameter's dtype before `zerolite.shard` (``ShardState.source_dtypes``): what the
  stock run saves for that model. ``config.json``'s ``dtype`` names what was written, so
  that ``from_pretrained`` loads the stock run's dtype. A ``save_dtype`` casts every
  parameter to it instead (``torch.bfloat16``: half the bytes of fp32).
- **save_state folders** (`StateFolderMethods`): Accelerate's ``save_state`` /
  ``load_state`` replaced by sharded `zerolite.checkpoint` saves per model, with
  Accelerate's own files (dataloaders, RNG, registered objects) beside them. A folder this
  run saved or resumed from is replaced crash-safely, as stock Accelerate replaces it;
  another run's is refused (`zerolite.checkpoint.run_folders`).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from torch import nn

import zerolite.checkpoint
from zerolite.checkpoint.pending_save import finish_in_flight_everywhere
from zerolite.checkpoint.run_folders import RunFolders, accelerate_staging, move_into
from zerolite.comm.consensus import agreed
from zerolite.gathered import iter_full_state_dict
from zerolite.ground.config_env import ALLOWED_DTYPES
from zerolite.state.shard_state import state_of

__all__ = [
    "SavePretrained",
    "StateFolderMethods",
    "check_save_dtype",
    "install_save_pretrained",
    "weights_for_saving",
]


def check_save_dtype(save_dtype: object) -> torch.dtype | None:
    """``save_dtype`` if it is None or a floating dtype zerolite trains in, else a
    ValueError."""
    if save_dtype is not None and save_dtype not in ALLOWED_DTYPES:
        raise ValueError(
            f"save_dtype must be None (each parameter in the model's own dtype: what a stock "
            f"run saves), torch.float32 (the fp32 masters), torch.bfloat16 or torch.float16; "
            f"got {save_dtype!r}"
        )
    return save_dtype  # type: ignore[return-value]


def weights_for_saving(
    model: nn.Module, save_dtype: torch.dtype | None, *, keep: bool
) -> dict[str, torch.Tensor]:
    """The model's full weights on the CPU, parameters in ``save_dtype`` (every rank calls).

    Parameters come from the fp32 masters when the compute copy is 16-bit (an exact
    all-gather of the master shards), cast to ``save_dtype``, or with None to the dtype
    each had before `zerolite.shard` (what a stock run saves); buffers keep their dtype.
    Only a rank with ``keep`` holds the result; the others get ``{}`` after taking part.
    """
    state = state_of(model)
    masters = state is not None and state.config.param_dtype != torch.float32
    source = {} if state is None else state.source_dtypes
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_full_state_dict(model, to_cpu=True, masters=masters):
        if keep:
            cast = name in params and tensor.is_floating_point()
            dtype = save_dtype if save_dtype is not None else source.get(name, tensor.dtype)
            out[name] = tensor.to(dtype) if cast else tensor
    return out


class SavePretrained:
    """The ``save_pretrained`` attribute installed on a sharded transformers model.

    Calls the class's method with the weights of `weights_for_saving` when the caller gave
    no ``state_dict`` (every rank must call then, as transformers' example scripts do with
    ``is_main_process=``), and afterwards makes ``config.json`` name the dtype written.
    """

    def __init__(self, model: nn.Module, method: Any, save_dtype: torch.dtype | None) -> None:
        self._model = weakref.ref(model)  # the model holds this object in its __dict__
        self._method = method
        self.save_dtype = save_dtype
        functools.update_wrapper(self, method)

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if model is None:
            raise RuntimeError("save_pretrained() called on a model that no longer exists")
        bound = inspect.signature(self._method).bind(model, save_directory, *args, **kwargs)
        main = bool(bound.arguments.get("is_main_process", True))
        if bound.arguments.get("state_dict") is None:
            bound.arguments["state_dict"] = weights_for_saving(model, self.save_dtype, keep=main)
        # Read before the call: transformers' save_pretrained pops the entries it writes.
        saved = _param_dtype(model, bound.arguments["state_dict"])
        result = self._method(*bound.args, **bound.kwargs)
        if main and saved is not None:
            _name_saved_dtype(model, Path(save_directory), saved)
        return result


def install_save_pretrained(model: nn.Module, save_dtype: torch.dtype | None) -> None:
    """Give ``model`` (if its class has a transformers-style ``save_pretrained`` taking
    ``state_dict`` and ``is_main_process``) the `SavePretrained` attribute."""
    method = getattr(type(model), "save_pretrained", None)
    try:
        parameters = inspect.signature(method).parameters if method is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    if "state_dict" in parameters and "is_main_process" in parameters:
        model.__dict__["save_pretrained"] = SavePretrained(model, method, save_dtype)


def _param_dtype(model: nn.Module, weights: dict[str, Any]) -> torch.dtype | None:
    """The one floating dtype of the parameters' entries in ``weights``, or None (no
    entries, or several dtypes)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    dtypes = {t.dtype for n, t in weights.items() if n in names and t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _name_saved_dtype(model: nn.Module, directory: Path, dtype: torch.dtype) -> None:
    """Rewrite ``config.json`` so that its ``dtype`` names ``dtype``, the parameters' dtype
    written, when that differs from the model's compute dtype (transformers writes the
    latter, and ``from_pretrained`` loads in it by default)."""
    config = getattr(model, "config", None)
    if config is None or not (directory / "config.json").is_file():
        return
    saved = str(dtype).removeprefix("torch.")
    if getattr(config, "dtype", None) in (saved, dtype):
        return
    before = config.dtype
    config.dtype = saved
    try:
        config.save_pretrained(directory)
    finally:
        config.dtype = before


class StateFolderMethods:
    """`zerolite.accelerate.ZeroAccelerator`'s ``get_state_dict``, ``save_state`` and
    ``load_state`` (also patched onto a stock Accelerator by `zerolite.accelerate.setup`)."""

    save_dtype: torch.dtype | None  # of the full weights (None: each parameter's own dtype)
    _zero_runs: RunFolders  # which save_state folders this run may replace

    def get_state_dict(self: Any, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full (gathered, for stage 3) weights on every rank, on the CPU; parameters from
        the fp32 masters in ``self.save_dtype`` (None: each in the model's own dtype, as
        the stock run; `weights_for_saving`). Every rank must call."""
        model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: its module
        return weights_for_saving(model, self.save_dtype, keep=True)

    def _refuse_another_runs(self: Any, target: Path, overwrite: bool) -> None:
        """Refuse, on every rank, a ``target`` holding files this run did not write."""
        if overwrite:
            return
        message = (
            f"save_state(): {target} holds files that this run did not write (another run's "
            "checkpoint, or one of a run this one did not resume from with load_state); choose "
            "a new output_dir, or pass save_state(..., overwrite=True) to replace it"
        )
        if not self._zero_sharded:  # nothing sharded: no group to agree over, no marker
            if target.is_dir() and any(target.iterdir()):
                raise ValueError(message)
            return
        with agreed("save_state()", self._zero_sharded[0][1].group.world, peer_error=ValueError):
            if self.is_main_process and not self._zero_runs.replaceable(target):
                raise ValueError(message)

    def _checkpoint_dir(self: Any, output_dir: str | os.PathLike | None, overwrite: bool) -> Path:
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError(
                    "save_state() needs output_dir unless automatic_checkpoint_naming is set"
                )
            target = Path(output_dir)
            self._refuse_another_runs(target, overwrite)
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

        An explicit ``output_dir`` that this run saved before (or that `load_state` resumed
        from) is replaced, as stock Accelerate replaces it: transformers' example scripts
        save ``step_N`` on two consecutive micro-steps under gradient accumulation. The
        replacement is crash-safe: the sharded checkpoints are committed as
        ``zerolite.checkpoint.save(..., overwrite=True)`` commits, and each of Accelerate's
        files is written aside and renamed into place. Another run's checkpoint is never
        replaced silently: an ``output_dir`` holding files that this run did not write is
        refused unless ``overwrite=True``, and with automatic checkpoint naming an existing
        ``checkpoint_N`` is refused (as stock Accelerate does).

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
            ValueError: the target folder holds another run's files (see above), on every rank,
                before anything is written or pruned.
            zerolite.checkpoint.CheckpointError: the previous asynchronous save failed and
                no ``wait()`` reported it.
        """
        self._finish_pending_save()
        target = self._checkpoint_dir(output_dir, overwrite)
        # Every rank has checked the target (an automatic checkpoint_N must not exist yet)
        # before rank 0 creates it, and rank 0 has pruned old checkpoints.
        self.wait_for_everyone()
        if self.is_main_process:  # the marker first: from now on the folder is this run's
            self._zero_runs.claim(target)
        self.wait_for_everyone()
        target.mkdir(parents=True, exist_ok=True)
        schedulers = [getattr(s, "scheduler", s) for s in self._schedulers]
        for i, (model, opt) in enumerate(self._zero_sharded):
            saved = zerolite.checkpoint.save(
                target / f"zerolite_{i}", model, opt, schedulers=schedulers if i == 0 else (),
                extra={"step": self.step}, overwrite=True, blocking=not async_save,
            )
            self.pending_save = saved if async_save else None
        self._save_accelerate_files(target)
        self.project_configuration.iteration += 1
        self.wait_for_everyone()
        return str(target)

    def _save_accelerate_files(self: Any, target: Path) -> None:
        """Accelerate's own files (dataloaders, RNG, registered objects), written into a
        hidden folder of this rank and renamed into ``target`` one by one."""
        each_node = self.project_configuration.save_on_each_node
        staging = accelerate_staging(target, self.process_index)
        staging.mkdir()
        save_accelerator_state(str(staging), [], [], [], self._dataloaders,
                               self.state.process_index, self.step, None,
                               save_on_each_node=each_node)
        for i, obj in enumerate(self._custom_objects):
            save_custom_state(obj, str(staging), i, save_on_each_node=each_node)
        move_into(staging, target)

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
        if self.is_main_process:  # this run continues the one that saved `source`
            self._zero_runs.adopt(source)
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = (
                int(re.search(r"(\d+)$", source.name).group(1)) + 1
            )
