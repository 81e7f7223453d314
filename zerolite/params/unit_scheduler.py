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
inference) free every unit at the end of the root's forward -- unless
``reshard_after_forward=False``: then they keep every unit gathered, so that the next
forward (the next token of a generation loop) communicates nothing, until the next
backward ends. A unit kept gathered across an optimizer step is gathered again before its
next use (`Group.step` tells), never read stale.

Live full units are therefore bounded by ``prefetch + 1`` non-root units plus the root
(with ``reshard_after_forward=True``).

[Note: pinned units] Inside `zerolite.gathered_parameters` every unit is pinned: the
hooks still run (they cost a few attribute checks) but neither gather nor free, so a
generation loop inside the block gathers once in all. Only explicit `reshard` calls free
a pinned unit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zerolite.comm.collectives import Group, Pending
from zerolite.ground.compile_guard import not_compiled
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.generation import install_synced_generate
from zerolite.params.state_dict_hooks import StateDictHooks

__all__ = ["UnitScheduler"]


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
        # Per unit: the value of `Group.step` when it was last gathered.
        self._gathered_at_step = [-1] * len(modules)
        # Open `pin` blocks; while > 0 the hooks free nothing ([Note: pinned units]).
        self.pinned = 0
        # [Note: frozen parameters in backward] A trained weight's last gradient arrives
        # after every backward node that reads the weight (the node that reads it also
        # produces its gradient), so the last gradient of a unit frees it safely. A frozen
        # weight gets no gradient: the nodes that read it (input gradients through a frozen
        # LoRA base) run in no particular order relative to the trained ones. Such a unit
        # stays gathered until backward reaches the unit before it (`_pre_backward` frees
        # every later unit) or backward ends, which bounds live units just the same.
        self._holds_frozen = [any(not p.requires_grad for f in fs for p in f.params)
                              for fs in flats]
        self._handles: list[Any] = []
        # Set while zerolite itself reads the model's state dict (see full_state_dict): then
        # model.state_dict() returns torch's entries (placeholders) instead of gathering.
        self.allow_state_dict = False
        for i, module in enumerate(modules):
            if i == self.root:
                self._handles.append(
                    module.register_forward_pre_hook(self._root_pre_forward, prepend=True)
                )
                self._handles.append(module.register_forward_hook(self._root_post_forward))
            else:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(i)))
                self._handles.append(module.register_forward_hook(self._make_post_forward(i)))
            self._handles.append(module.register_load_state_dict_pre_hook(self._refuse_load_state_dict))
        # model.state_dict() gathers unit by unit to the CPU (zerolite.params.state_dict_hooks).
        self._handles += StateDictHooks(self).install()
        # Ranks must forward in lockstep: see zerolite.params.generation (`remove()` undoes each).
        self.synced_generate = install_synced_generate(modules[self.root], group)

    # -- unshard / reshard -------------------------------------------------------------
    def gather(self, i: int) -> None:
        """Launch unit ``i``'s all-gathers unless it is gathered or on its way."""
        if i not in self._pending and not self.is_unsharded(i):
            self._pending[i] = [flat.unshard() for flat in self.flats[i]]
            self._gathered_at_step[i] = self.group.step

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

    def _release(self, i: int) -> None:
        """A hook is done with unit ``i``: free it unless pinned ([Note: pinned units])."""
        if not self.pinned:
            self.reshard(i)

    def refresh_stale(self, i: int | None = None) -> None:
        """Gather unit ``i`` (default: every unit) again if it is full (or on its way)
        from before the last optimizer step, whose updates reached only the shards.
        Pinned units too: inside `gathered_parameters` parameters stay full and current."""
        for j in range(len(self.modules)) if i is None else (i,):
            stale = self._gathered_at_step[j] != self.group.step
            if stale and (j in self._pending or self.is_unsharded(j)):
                self.reshard(j)
                self.unshard(j)

    def _refresh(self, i: int) -> None:
        """Before a forward uses unit ``i``: gather it, never from a stale copy."""
        self.refresh_stale(i)
        self.unshard(i)

    def is_unsharded(self, i: int) -> bool:
        return any(flat.unsharded for flat in self.flats[i])

    def unsharded_units(self) -> list[int]:
        return [i for i in range(len(self.flats)) if self.is_unsharded(i)]

    # -- forward -----------------------------------------------------------------------
    def _make_pre_forward(self, i: int) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if not self._order_fixed and i not in self.order:
                self.order.append(i)
            self._refresh(i)
            if self._order_fixed and i in self.order:
                pos = self.order.index(i)
                for j in self.order[pos + 1 : pos + 1 + self.prefetch]:
                    self.gather(j)
                self._read_ahead(self.order[pos + 1 + self.prefetch : pos + 2 + self.prefetch])

        return pre_forward

    def _make_post_forward(self, i: int) -> Any:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                self._arm_backward(i, output)
            if self.reshard_after_forward:
                self._release(i)

        return post_forward

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._refresh(self.root)
        if self._order_fixed:
            for j in self.order[: self.prefetch]:
                self.gather(j)
            self._read_ahead(self.order[self.prefetch : self.prefetch + 1])

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._order_fixed = True
        if torch.is_grad_enabled():
            self._arm_backward(self.root, output)
        elif self.reshard_after_forward:
            for i in range(len(self.modules)):
                self._release(i)

    # -- backward ----------------------------------------------------------------------
    def _arm_backward(self, i: int, output: Any) -> None:
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            # Never traced: under a compiled backward dynamo would recompile per unit index.
            hook = not_compiled(lambda grads: self._pre_backward(i))
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")

    def _pre_backward(self, i: int) -> None:
        # Backward has left every unit that ran after i: free those still gathered (a
        # unit without trained parameters has no gradient hook to free it).
        if i in self.order:
            for j in self.order[self.order.index(i) + 1 :]:
                if self.is_unsharded(j):
                    self._release(j)
        self.unshard(i)
        if i == self.root:
            later = list(reversed(self.order))
        elif i in self.order:
            later = list(reversed(self.order[: self.order.index(i)]))
        else:
            later = []
        for j in later[: self.prefetch]:
            self.gather(j)
        self._read_ahead(later[self.prefetch : self.prefetch + 1])

    def _read_ahead(self, units: list[int]) -> None:
        """``offload_params``: start reading the shards of the unit gathered after the
        prefetched ones, so that its read overlaps this unit's compute
        (`zerolite.params.tiered_shard`). Nothing otherwise."""
        for j in units:
            if j not in self._pending and not self.is_unsharded(j):
                for flat in self.flats[j]:
                    flat.read_ahead()

    def on_unit_gradients_ready(self, i: int) -> None:
        """Every gradient of unit ``i`` is in its bucket: its full parameters can go,
        unless the unit holds frozen parameters (see [Note: frozen parameters in backward])."""
        if not self._holds_frozen[i]:
            self._release(i)

    def on_backward_end(self) -> None:
        for i in range(len(self.modules)):
            self._release(i)

    # -- misuse ------------------------------------------------------------------------
    def _refuse_load_state_dict(self, module: nn.Module, *args: Any) -> None:
        # Without this, torch reports a shape mismatch against the freed placeholders.
        # Outside gathered_parameters, even units that happen to be gathered (kept by
        # reshard_after_forward=False) would lose the values at their next reshard.
        if not self.pinned:
            raise RuntimeError(
                "model.load_state_dict() on a stage-3 model would copy into parameters whose "
                "storage is freed (each rank holds only its shard). On every rank, load inside "
                "`with zerolite.gathered_parameters(model, modifier_rank=0):` (rank 0's values are "
                "kept), or use zerolite.checkpoint.load_pretrained / zerolite.checkpoint.load."
            )
