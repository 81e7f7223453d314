"""What `shard()` changes on the model itself (in place, never wrapped).

- A guard on ``Module._apply`` (behind ``.to()``, ``.half()``, ``.cuda()``, ...) of every
  module owning a managed parameter: a conversion that would give a managed parameter
  new storage (another dtype or device) would silently detach it from the flat
  buffers, so it is refused before anything is converted. A conversion that returns
  the tensor unchanged (``model.to(same_device)``) passes.
- ``model.no_sync()``: the context manager frameworks look for (DDP's name) to skip
  gradient synchronisation on accumulation micro-steps.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zerolite.grads.reducer import GradReducer

__all__ = ["guard_conversions", "install_no_sync"]


def guard_conversions(
    model: nn.Module, managed: dict[int, tuple[torch.dtype, torch.device]]
) -> None:
    """Refuse conversions that would give a managed parameter new storage.

    Every module with a managed parameter in its subtree is guarded, and each guard
    checks its whole subtree before the real conversion starts, so a refused
    ``model.to(...)`` changes nothing at all.

    Args:
        model: the sharded model (changed in place).
        managed: ``id()`` of every parameter living in a flat buffer -> its buffer's
            dtype and device (in stage 3 the parameter itself may be a meta placeholder).
    """
    for module in model.modules():
        if any(id(p) in managed for p in module.parameters()):
            _guard(module, managed)


def _guard(module: nn.Module, managed: dict[int, tuple[torch.dtype, torch.device]]) -> None:
    original = module._apply

    def _apply(
        self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any
    ) -> nn.Module:
        # Probe the conversion on an empty tensor of each managed parameter's kind: cheap,
        # and it decides before the real conversion touches anything. A conversion that
        # keeps the tensor returns the very same object.
        for name, p in self.named_parameters():
            if id(p) not in managed:
                continue
            dtype, device = managed[id(p)]
            probe = torch.empty(0, dtype=dtype, device=device)
            out = fn(probe)
            if out is not probe:
                raise RuntimeError(
                    f"parameter {name!r} of {type(self).__name__} is sharded by zerolite and "
                    f"cannot be converted after zerolite.shard() (it is {dtype} on {device}; the "
                    f"conversion gives {out.dtype} on {out.device} in new storage, detaching it "
                    f"from zerolite's flat buffers). Move or cast the model before shard(), or "
                    f"choose the compute dtype with ZeroConfig(param_dtype=...). Nothing was "
                    f"converted."
                )
        return original(fn, *args, **kwargs)

    module._apply = types.MethodType(_apply, module)  # type: ignore[method-assign]


def install_no_sync(model: nn.Module, reducer: GradReducer) -> None:
    """Give ``model`` a ``no_sync()`` context manager (as DDP's) driving ``reducer``.

    Inside it, backward only accumulates gradients locally; the first backward after
    it reduces the sum. In stage 1 gradients are only reduced at ``step()`` anyway, so
    it changes nothing there.
    """

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        previous = reducer.sync_disabled
        reducer.sync_disabled = True
        try:
            yield
        finally:
            reducer.sync_disabled = previous

    model.no_sync = no_sync  # type: ignore[assignment]
