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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerolite.grad_reducer import GradReducer

__all__ = ["KeepFullGrads", "ShardGradsInBackward"]


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
            for bucket, used in zip(self.reducer.buckets, self.reducer.local_used):
                for i, p in enumerate(bucket.flat.params):
                    view = bucket.grad_view(i)
                    if p.grad is None:
                        view.zero_()  # stale since zero_grad(set_to_none=True)
                    elif p.grad is not view:
                        view.copy_(p.grad)
                        p.grad = view
                    used[i] = p.grad is not None
                bucket.unreduced = True

    def zero_grad(self, set_to_none: bool) -> None:
        self.reducer.zero()
        for bucket in self.reducer.buckets:
            if not set_to_none:
                bucket.full_buffer().zero_()
            for i, p in enumerate(bucket.flat.params):
                p.grad = None if set_to_none else bucket.grad_view(i)


class ShardGradsInBackward(_GradHooks):
    """Stage 2: gradients move into buckets as they arrive and are reduce-scattered in backward."""

    def __init__(self, reducer: GradReducer) -> None:
        super().__init__(reducer)
        self._callback_queued = False
        # Stage 3 listens: a bucket's gradients are all in (its unit can be freed), and
        # backward has ended.
        self.on_bucket_complete: Callable[[int], None] | None = None
        self.on_backward_end: Callable[[], None] | None = None

    def on_grad(self, b: int, i: int, param: nn.Parameter) -> None:
        bucket = self.reducer.buckets[b]
        if bucket.in_flight:
            raise RuntimeError(
                f"{self.reducer.group.prefix()} parameter {bucket.flat.names[i]!r} received a second "
                "gradient in one backward after its bucket was reduce-scattered (reentrant "
                "checkpointing or a hook calling backward?); use non-reentrant checkpointing"
            )
        with torch.no_grad():
            bucket.add_grad(i, param.grad)
        param.grad = None
        self.reducer.local_used[b][i] = True
        bucket.unreduced = True
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        if not self.reducer.sync_disabled:
            bucket.ready += 1
            complete = bucket.ready == len(bucket.flat.params)
            self.reducer.launch_ready()
            if complete and self.on_bucket_complete is not None:
                self.on_bucket_complete(b)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if not self.reducer.sync_disabled:
            self.reducer.flush()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def collect(self) -> None:
        """Step boundary: gradients assigned by hand to ``param.grad`` join the buckets."""
        with torch.no_grad():
            for b, bucket in enumerate(self.reducer.buckets):
                for i, p in enumerate(bucket.flat.params):
                    if p.grad is not None:
                        bucket.add_grad(i, p.grad)
                        p.grad = None
                        self.reducer.local_used[b][i] = True
                        bucket.unreduced = True

    def zero_grad(self, set_to_none: bool) -> None:
        # Full-size gradients do not exist between steps in stage 2, whatever set_to_none says.
        self.reducer.zero()
        for bucket in self.reducer.buckets:
            for p in bucket.flat.params:
                p.grad = None
