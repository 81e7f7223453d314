"""Keep ``torch.compile`` out of zerolite's hooks.

zerolite's hooks are Python bookkeeping around collectives: which gradient arrived, which
bucket is complete, which unit to gather or free. TorchDynamo must not trace them:

- A traced hook is compiled once per distinct closure value or integer argument. One
  gradient hook per parameter index recompiles until ``torch._dynamo.config.recompile_limit``
  (8) is hit, then falls back to eager with a warning (a "recompile storm"). Any hook that
  runs under an active compiled frame is traced: the forward hooks inside
  ``torch.compile(model)``, and every backward hook and autograd callback when a compiled
  function calls ``loss.backward()``.
- Traced stage-3 gathers (``param.data`` swaps, storage resizes) break tracing outright:
  "incorrect fake (aka meta) kernel" (inductor, reported) or "modified by an inplace
  operation" in backward (``aot_eager``, measured).

So every hook and autograd callback zerolite installs is wrapped with
``torch.compiler.disable`` (`not_compiled`): in a compiled forward it is a graph break and
runs eagerly, and dynamo never compiles a frame of it or of anything it calls. Hooks already
registered are wrapped in place (`exclude_from_compile`): the hook dicts torch reads at call
time hold the wrapper under the same handle id, so ``handle.remove()`` keeps working.

What the model computes still compiles: in stages 1-2 the whole forward in one graph (with
``torch.compile(model)`` the root's hooks stay outside it, so ``fullgraph=True`` holds); in
stage 3 each unit's forward (a unit's gather is a graph break, so a loop over units runs
eagerly and each block's ``forward`` compiles, one graph shared by identical blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["exclude_from_compile", "not_compiled"]

_F = TypeVar("_F", bound=Callable[..., Any])

_REASON = (
    "zerolite's hooks run eagerly (bookkeeping and collectives): a graph break, so fullgraph=True "
    "cannot span one. Stages 1-2: compile the model itself (its hooks stay outside the graph); "
    "stage 3 gathers each unit inside the forward: compile with fullgraph=False"
)


def not_compiled(fn: _F) -> _F:
    """``fn`` wrapped with ``torch.compiler.disable``: never traced, nor anything it calls.

    Args:
        fn: a hook, callback or bound method.
    Returns:
        The wrapper (``fn`` itself if it is one already).
    """
    if getattr(fn, "_zerolite_not_compiled", False):
        return fn
    wrapped = torch.compiler.disable(fn, reason=_REASON)
    wrapped._zerolite_not_compiled = True  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


def exclude_from_compile(handles: Iterable[RemovableHandle]) -> None:
    """Wrap the hook behind each of ``handles`` with `not_compiled`, in place.

    Args:
        handles: handles returned by ``register_*_hook`` (module forward hooks, tensor
            post-accumulate-grad hooks, ...); hooks removed already are skipped.
    """
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = not_compiled(hooks[handle.id])
