"""Stage 3's ``model.state_dict()``: full parameters, gathered unit by unit to the CPU.

Outside a gather a stage-3 parameter is a NaN placeholder ([Note: freed parameters] in
`zerolite.params.flat_buffer`), so torch's own ``state_dict()`` would return placeholders.
Scripts call it anyway, on every rank, through ``save_pretrained`` (transformers' example
scripts do, with ``is_main_process=``) or ``accelerator.get_state_dict``. So when the
state dict of the whole model -- or of a module that contains it -- is taken, the root
unit's post-hook replaces each managed parameter's entry by a CPU copy of its full values,
gathering one unit at a time: the device never holds more than one extra unit, and the
result is what an unsharded model's ``state_dict()`` holds (in the parameter dtype), as
copies on the CPU instead of views.

That is a collective, so every rank must call it. A small collective comes first and names
the call: a rank that does not take part makes the others raise `zerolite.CollectiveTimeout`
("model.state_dict() ...") after ``ZeroConfig.timeout_s``, before any unit is gathered.

Refused, naming the fix: ``state_dict(keep_vars=True)`` (the entries would be copies, not
the parameters) and the state dict of one unit's module on its own (only the whole
model's gathers). zerolite's own readers (`zerolite.full_state_dict`) set
``UnitScheduler.allow_state_dict`` and get torch's entries unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerolite.comm.small_collectives import small_collective

__all__ = ["StateDictHooks"]

_WHAT = (
    "model.state_dict() on a stage-3 model (it gathers every unit to the CPU, so every "
    "rank must call it)"
)


class StateDictHooks:
    """The ``state_dict`` hooks of a stage-3 model's units.

    Args:
        scheduler: the model's `zerolite.params.unit_scheduler.UnitScheduler` (its
            modules, flat buffers, group, gather and free).
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # One entry per root state_dict() in progress: whether it gathers (False for
        # zerolite's own reads, which want torch's entries).
        self._calls: list[bool] = []

    def install(self) -> list[Any]:
        """Register the hooks on every unit's module; returns the handles."""
        s = self.scheduler
        handles = []
        for i, module in enumerate(s.modules):
            if i == s.root:
                handles.append(module.register_state_dict_pre_hook(self._root_pre))
                # (a function, not a bound method: torch sets an attribute on post-hooks)
                def post(*args: Any) -> None:
                    self._root_post(*args)

                handles.append(module.register_state_dict_post_hook(post))
            else:
                handles.append(module.register_state_dict_pre_hook(self._unit_pre))
        return handles

    def _root_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.scheduler.allow_state_dict:
            self._calls.append(False)
            return
        if keep_vars:
            raise RuntimeError(
                "model.state_dict(keep_vars=True) on a stage-3 model would return parameters "
                "whose storage is freed (each rank holds only its shard). Call "
                "model.state_dict() on every rank (full values, gathered to the CPU), or "
                "zerolite.full_state_dict(model)."
            )
        self._calls.append(True)

    def _root_post(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any
    ) -> None:
        if self._calls.pop():
            self._fill(module, state_dict, prefix)

    def _unit_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self._calls and not self.scheduler.allow_state_dict:
            raise RuntimeError(
                f"{type(module).__name__}.state_dict() of one stage-3 unit on its own would "
                "return parameters whose storage is freed (each rank holds only its shard). "
                "Call the whole model's state_dict() on every rank (full values, gathered to "
                "the CPU), or zerolite.full_state_dict(model)."
            )

    @torch.no_grad()
    def _fill(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        """Replace each managed parameter's entry by a CPU copy of its full values."""
        s = self.scheduler
        keys: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state_dict:
                keys.setdefault(id(p), []).append(prefix + name)
        # Every rank is here, or the others learn so now, naming the call.
        small_collective(torch.zeros(1), s.group, "sum", what=_WHAT)
        for i in range(len(s.flats)):
            s.refresh_stale(i)
            was_gathered = s.is_unsharded(i)
            s.unshard(i)
            try:
                for p in (p for flat in s.flats[i] for p in flat.params):
                    copy = p.detach().to("cpu", copy=True)
                    for key in keys.get(id(p), []):
                        state_dict[key] = copy
            finally:
                if not was_gathered:
                    s.reshard(i)
