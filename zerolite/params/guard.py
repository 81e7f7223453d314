"""The guard `shard()` puts on the model's conversions (in place, never a wrapper).

A guard on ``Module._apply`` (behind ``.to()``, ``.half()``, ``.cuda()``, ...) of every
module owning a managed parameter: a conversion that would give a managed parameter new
storage (another dtype or device) would silently detach it from the flat buffers, so it is
refused before anything is converted. A conversion that returns the tensor unchanged
(``model.to(same_device)``) passes. (The other change `shard()` makes on the model,
``model.no_sync()``, is the reducer's: `zerolite.grads.reducer.install_no_sync`.)
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["guard_conversions"]


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
