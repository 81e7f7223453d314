"""Stage 3 and Hugging Face ``generate()``: ranks that finish early keep forwarding.

With sharded parameters every forward is a sequence of collectives (each unit's
all-gather), so all ranks must run the same number of forwards. Batched generation
breaks this: a rank whose sequences all hit EOS (or a stopping criterion) leaves its
decoding loop while the others still gather, and they wait forever. transformers has
the cure, ``generate(synced_gpus=True)``: a finished rank keeps running forwards (and
discards them) until an all-reduce says every rank is done. It turns it on by itself
only for DeepSpeed ZeRO-3 and FSDP (``is_deepspeed_zero3_enabled()`` or
``is_fsdp_managed_module(model)``, which reads ``module._is_fsdp_managed_module``).

That attribute is not borrowed here: torch.compile (dynamo) also reads it and then
treats the module as FSDP's. Instead `install_synced_generate` gives each module of a
stage-3 model whose ``generate`` takes ``synced_gpus`` an instance attribute
``generate`` that passes ``synced_gpus=True`` when the caller left it unset (``None``),
and calls the class's method otherwise unchanged. Nothing global is patched; deleting
the attribute (`SyncedGenerate.remove`) restores the class's method. A wrapper such as
peft's ``PeftModel.generate`` reaches the inner model's ``generate`` and so is covered.

transformers' all-reduce runs on the default process group, so this is installed only
when zerolite's group is the whole default group (otherwise pass ``synced_gpus``
yourself).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch.distributed as dist
from torch import nn

from zerolite.comm.collectives import Group

__all__ = ["SyncedGenerate", "install_synced_generate"]


class SyncedGenerate:
    """The ``generate`` attribute installed on one module; `remove` takes it off again."""

    def __init__(self, module: nn.Module, method: Any) -> None:
        # A weak reference: the module holds this object in its __dict__.
        self._module = weakref.ref(module)
        self._method = method
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise RuntimeError("generate() called on a module that no longer exists")
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        return self._method(module, *args, **kwargs)

    def remove(self) -> None:
        module = self._module()
        if module is not None and module.__dict__.get("generate") is self:
            del module.__dict__["generate"]


def _takes_synced_gpus(method: Any) -> bool:
    try:
        return "synced_gpus" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # builtins or C callables without a signature
        return False


def install_synced_generate(model: nn.Module, group: Group) -> list[SyncedGenerate]:
    """Make ``generate()`` of ``model`` and its submodules default to ``synced_gpus=True``.

    Called by `zerolite.shard` for stage 3; a no-op with one rank or when zerolite's
    group is not the whole default group.

    Args:
        model: the stage-3 model (changed in place).
        group: zerolite's data-parallel group.
    Returns:
        One handle per module changed (`SyncedGenerate.remove` undoes it).
    """
    group = group.world  # hybrid: a generation step syncs every rank, not a shard group
    if group.size <= 1 or not dist.is_initialized() or dist.get_world_size() != group.size:
        return []
    installed = []
    for module in model.modules():
        method = getattr(type(module), "generate", None)
        if callable(method) and "generate" not in module.__dict__ and _takes_synced_gpus(method):
            wrapper = SyncedGenerate(module, method)
            module.__dict__["generate"] = wrapper
            installed.append(wrapper)
    return installed
