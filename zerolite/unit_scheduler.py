"""Stage 3: gather each unit's parameters just before they are used, free them after.

Forward: a unit's pre-hook waits for (or launches) its all-gather and launches the
next ``prefetch`` units' all-gathers, in the order units ran in the first forward; its
post-hook frees the full parameters (``reshard_after_forward``) and arms a hook on its
outputs that fires when backward reaches the unit. Backward: that hook gathers the
unit again and prefetches the units that come next in backward (reverse forward
order). Once every gradient of a unit has been moved into its bucket (the
reduce-scatter is launched from the same hook), the unit is freed.

The root unit (the model itself, holding embeddings, head, final norm, ...) is gathered
at the start of forward and stays gathered until its gradients are complete, since it
is used at both ends of the network. Forwards without gradients (``torch.no_grad()``,
inference) free every unit at the end of the root's forward.

Live full units are therefore bounded by ``prefetch + 1`` non-root units plus the root.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zerolite.collectives import Group, Pending
from zerolite.flat_buffer import FlatParamBuffer

__all__ = ["UNITS_ATTR", "UnitScheduler"]

UNITS_ATTR = "_zerolite_units"  # on a sharded model: its UnitScheduler (None in stages 1-2)


class UnitScheduler:
    """Unshard/reshard hooks for stage-3 units.

    Args:
        modules: each unit's module; the root (the model) last.
        flats: each unit's flat buffers (trained, then frozen; empty for a root without any).
        group: the data-parallel group.
        prefetch: units gathered ahead of use.
        reshard_after_forward: free non-root units after their forward.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        flats: list[list[FlatParamBuffer]],
        group: Group,
        *,
        prefetch: int,
        reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.flats = flats
        self.group = group
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.root = len(modules) - 1
        # Non-root units in the order the first forward ran them.
        self.order: list[int] = []
        self._order_fixed = False
        self._pending: dict[int, list[Pending]] = {}
        self._handles: list[Any] = []
        # Set while zerolite itself reads the model's state dict (see full_state_dict).
        self.allow_state_dict = False
        for i, module in enumerate(modules):
            if i == self.root:
                self._handles.append(module.register_forward_pre_hook(self._root_pre_forward, prepend=True))
                self._handles.append(module.register_forward_hook(self._root_post_forward))
            else:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(i)))
                self._handles.append(module.register_forward_hook(self._make_post_forward(i)))
            self._handles.append(module.register_state_dict_pre_hook(self._refuse_state_dict))

    # -- unshard / reshard -------------------------------------------------------------
    def gather(self, i: int) -> None:
        """Launch unit ``i``'s all-gathers unless it is gathered or on its way."""
        if i not in self._pending and not self.is_unsharded(i):
            self._pending[i] = [flat.unshard(self.group) for flat in self.flats[i]]

    def unshard(self, i: int) -> None:
        """Unit ``i``'s parameters hold their full values when this returns."""
        self.gather(i)
        for pending in self._pending.pop(i, []):
            pending.wait()

    def reshard(self, i: int) -> None:
        """Free unit ``i``'s full parameters (after any all-gather in flight lands)."""
        for pending in self._pending.pop(i, []):
            pending.wait()
        for flat in self.flats[i]:
            flat.reshard()

    def reshard_all(self) -> None:
        for i in range(len(self.modules)):
            self.reshard(i)

    def is_unsharded(self, i: int) -> bool:
        return any(flat.unsharded for flat in self.flats[i])

    def unsharded_units(self) -> list[int]:
        return [i for i in range(len(self.flats)) if self.is_unsharded(i)]

    # -- forward -----------------------------------------------------------------------
    def _make_pre_forward(self, i: int) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if not self._order_fixed and i not in self.order:
                self.order.append(i)
            self.unshard(i)
            if self._order_fixed and i in self.order:
                pos = self.order.index(i)
                for j in self.order[pos + 1 : pos + 1 + self.prefetch]:
                    self.gather(j)

        return pre_forward

    def _make_post_forward(self, i: int) -> Any:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                self._arm_backward(i, output)
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self.reshard(i)

        return post_forward

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.unshard(self.root)
        if self._order_fixed:
            for j in self.order[: self.prefetch]:
                self.gather(j)

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._order_fixed = True
        if torch.is_grad_enabled():
            self._arm_backward(self.root, output)
        else:
            self.reshard_all()

    # -- backward ----------------------------------------------------------------------
    def _arm_backward(self, i: int, output: Any) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(i), mode="any")

    def _pre_backward(self, i: int) -> None:
        # Backward has left every unit that ran after i: free those still gathered (a
        # unit without trained parameters has no gradient hook to free it).
        if i in self.order:
            for j in self.order[self.order.index(i) + 1 :]:
                if self.is_unsharded(j):
                    self.reshard(j)
        self.unshard(i)
        if i == self.root:
            later = list(reversed(self.order))
        elif i in self.order:
            later = list(reversed(self.order[: self.order.index(i)]))
        else:
            later = []
        for j in later[: self.prefetch]:
            self.gather(j)

    def on_unit_gradients_ready(self, i: int) -> None:
        """Every gradient of unit ``i`` is in its bucket: its full parameters can go."""
        self.reshard(i)

    def on_backward_end(self) -> None:
        self.reshard_all()

    # -- misuse ------------------------------------------------------------------------
    def _refuse_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self.allow_state_dict:
            raise RuntimeError(
                "model.state_dict() on a stage-3 model would return parameters whose storage is "
                "freed (each rank holds only its shard). Use zerolite.full_state_dict(model) to "
                "gather full tensors unit by unit, or zerolite.checkpoint to save shards."
            )
