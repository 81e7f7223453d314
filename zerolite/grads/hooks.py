"""Where gradients go when autograd produces them: post-accumulate-grad hooks.

Stage 1 (`KeepFullGrads`): ``param.grad`` becomes a view of its bucket's persistent
``full`` buffer, so autograd accumulates micro-steps straight into the buffer and the
step boundary reduce-scatters it once. Nothing is communicated during backward.

Stage 2 (`ShardGradsInBackward`): each gradient is added into its bucket's transient
``full`` buffer and ``param.grad`` is dropped at once; a bucket whose gradients are all
in launches its reduce-scatter while the rest of backward runs, and an end-of-backward
callback launches the rest and waits. Inside ``model.no_sync()`` gradients are only
added up locally, and the next synced backward reduces the sum.

Both expose the same small interface to the optimizer: `collect` (step boundary: bring
gradients the hooks did not see into the buckets), `zero_grad` and `remove`.
The hooks own ``param.grad``; what a gradient's arrival means (bucket counters, which
parameters were used, launches) is the `GradReducer`'s, told with one call: per gradient
in a stage-2 backward (`GradReducer.add_grad`), per bucket or stray gradient at the step
boundary (`GradReducer.set_full_grads`, `GradReducer.add_unhooked_grad`).
After a step, stage 2's shards are forgotten (`GradReducer.after_step`), so loops that
zero with ``model.zero_grad()`` or ``param.grad = None`` behave as with ``opt.zero_grad()``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zerolite.grads.reducer import GradReducer

__all__ = ["KeepFullGrads", "ShardGradsInBackward"]

logger = logging.getLogger(__name__)


class _GradHooks:
    def __init__(self, reducer: GradReducer) -> None:
        self.reducer = reducer
        self._handles: list[RemovableHandle] = []
        for b, bucket in enumerate(reducer.buckets):
            for i, p in enumerate(bucket.flat.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(b, i)))

    def _make_hook(self, b: int, i: int) -> Any:
        # A weak reference: the hook lives on the parameter (outside the garbage
        # collector's view), so a strong one would keep model and buffers alive forever.
        owner = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            hooks = owner()
            if hooks is not None:
                hooks.on_grad(b, i, param)

        return hook

    def on_grad(self, b: int, i: int, param: nn.Parameter) -> None:
        raise NotImplementedError

    def watch_root(self, model: nn.Module) -> None:
        """Hook ``model``'s forward: count forwards that build a graph (see
        `zerolite.comm.group.Group`: ``forwards``) and run `_before_forward`."""
        owner = weakref.ref(self)

        def pre_forward(module: nn.Module, args: Any) -> None:
            hooks = owner()
            if hooks is not None:
                hooks._before_forward()

        # First of all pre-hooks: stage 3's root gather must not run before a discard reshards.
        self._handles.append(model.register_forward_pre_hook(pre_forward, prepend=True))

    def _before_forward(self) -> None:
        if torch.is_grad_enabled() and not _inside_backward():
            self.reducer.group.forwards += 1

    def discard_abandoned_backward(self, warn: bool = True) -> bool:
        """Forget what a backward that raised left behind; True if there was one."""
        return False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class KeepFullGrads(_GradHooks):
    """Stage 1: ``param.grad`` views the bucket's persistent ``full`` buffer."""

    def on_grad(self, b: int, i: int, param: nn.Parameter) -> None:
        view = self.reducer.buckets[b].grad_view(i)
        if param.grad is not view:
            # First gradient after zero_grad(set_to_none=True): autograd made a new tensor.
            with torch.no_grad():
                view.copy_(param.grad)
            param.grad = view

    def collect(self) -> None:
        """Step boundary: what ``param.grad`` holds now is what gets reduced."""
        with torch.no_grad():
            for b, bucket in enumerate(self.reducer.buckets):
                used: list[bool] = []
                for i, p in enumerate(bucket.flat.params):
                    view = bucket.grad_view(i)
                    if p.grad is None:
                        view.zero_()  # stale since zero_grad(set_to_none=True)
                    elif p.grad is not view:
                        view.copy_(p.grad)
                        p.grad = view
                    used.append(p.grad is not None)
                self.reducer.set_full_grads(b, used)

    def zero_grad(self, set_to_none: bool) -> None:
        self.reducer.zero()
        for bucket in self.reducer.buckets:
            if not set_to_none:
                bucket.full_buffer().zero_()
            for i, p in enumerate(bucket.flat.params):
                p.grad = None if set_to_none else bucket.grad_view(i)


class ShardGradsInBackward(_GradHooks):
    """Stage 2: gradients move into buckets as they arrive and are reduce-scattered in backward.

    [Note: one backward] The end-of-backward callback that launches the remaining buckets
    is queued on the graph task of the *outermost* backward: from a hook on the root
    module's outputs where there is one (it fires first), else from the first gradient.
    Nested backwards (reentrant activation checkpointing runs one per region) therefore
    belong to the backward that contains them instead of ending it early.

    A backward that raised never runs its callback. The next forward, ``zero_grad`` or
    step finds it still open outside any backward, and discards what it left behind
    (half-filled buckets, arrival counts, reduce-scatters in flight, stage-3 gathers): a
    caught, skipped batch leaves no trace, whichever way the loop zeroes gradients.
    """

    def __init__(self, reducer: GradReducer) -> None:
        super().__init__(reducer)
        # Graph task id of the backward whose end-of-backward callback is queued.
        self._open_task: int | None = None
        # Stage 3 listens: a bucket's gradients are all in (its unit can be freed), and
        # backward has ended (or was abandoned).
        self.on_bucket_complete: Callable[[int], None] | None = None
        self.on_backward_end: Callable[[], None] | None = None

    def watch_root(self, model: nn.Module) -> None:
        """Also check for an abandoned backward before each forward, and arm the
        end-of-backward callback on the outputs after it."""
        super().watch_root(model)
        owner = weakref.ref(self)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            hooks = owner()
            if hooks is None or not torch.is_grad_enabled() or _inside_backward():
                return
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads: hooks._backward_started(), mode="any"
                )

        self._handles.append(model.register_forward_hook(post_forward))

    def _before_forward(self) -> None:
        self.discard_abandoned_backward()
        super()._before_forward()

    def _backward_started(self) -> None:
        if self._open_task is None:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._open_task = torch._C._current_graph_task_id()

    def on_grad(self, b: int, i: int, param: nn.Parameter) -> None:
        self._backward_started()
        complete = self.reducer.add_grad(b, i, param.grad)
        param.grad = None
        if complete and self.on_bucket_complete is not None:
            self.on_bucket_complete(b)

    def _on_backward_end(self) -> None:
        self._open_task = None
        self.reducer.end_backward()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def discard_abandoned_backward(self, warn: bool = True) -> bool:
        """Outside backward: if the last backward raised, forget what it left; True if so."""
        if self._open_task is None or _inside_backward():
            return False
        self._open_task = None
        if warn:
            logger.warning(
                "%s a backward did not complete (it raised); the gradients accumulated since "
                "the last zero_grad() are discarded", self.reducer.group.prefix()
            )
        self.reducer.zero()
        if self.on_backward_end is not None:
            self.on_backward_end()
        return True

    def collect(self) -> None:
        """Step boundary: gradients assigned by hand to ``param.grad`` join the buckets."""
        self.discard_abandoned_backward()
        with torch.no_grad():
            for b, bucket in enumerate(self.reducer.buckets):
                for i, p in enumerate(bucket.flat.params):
                    if p.grad is not None:
                        self.reducer.add_unhooked_grad(b, i, p.grad)
                        p.grad = None

    def zero_grad(self, set_to_none: bool) -> None:
        # Full-size gradients do not exist between steps in stage 2, whatever set_to_none says.
        self.discard_abandoned_backward(warn=False)  # zeroing is what the caller asked for
        self.reducer.zero()
        for bucket in self.reducer.buckets:
            for p in bucket.flat.params:
                p.grad = None


def _inside_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
