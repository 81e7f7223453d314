"""`ShardedOptimizer`: the user's optimizer, stepping only this rank's shard.

One `step()` runs in three phases (docs/design.md, "The data path of a step"):

1. **Reduce**: every bucket's gradients are averaged over ranks into this rank's
   shard (stage 2 did most of this during backward; stage 1 does it now).
2. **Update**: the shard's gradient (upcast to fp32 if needed, one bucket at a time)
   is attached to the fp32 master pieces, the user's optimizer steps them, the master
   is cast down into the parameter shard, and (stages 1-2) the bucket's all-gather is
   launched -- so it overlaps the next bucket's update. Where nothing would overlap and
   nothing is upcast (stage 3 in fp32), one optimizer step covers every bucket.
3. **Gather**: wait for the all-gathers; every rank holds the full updated parameters.

The user's optimizer object is kept: ``param_groups`` are the same dicts (schedulers
holding them keep working), with ``"params"`` re-pointed at master pieces.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerolite.comm.collectives import Group
from zerolite.config import ZeroConfig
from zerolite.grads.bucket import GradBucket
from zerolite.grads.hooks import KeepFullGrads, ShardGradsInBackward
from zerolite.grads.reducer import GradReducer
from zerolite.optim.grad_clip import GradNorm, clip_coefficient
from zerolite.optim.loss_scale import DynamicLossScaler
from zerolite.optim.optimizer_hooks import init_optimizer_hooks
from zerolite.optim.parked_step import copy_tensors, fetch_bucket, park_bucket
from zerolite.optim.state_dict import load_sharded_state_dict, sharded_state_dict
from zerolite.optim.streamed_step import stream_step
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.tiered_shard import one_at_a_time
from zerolite.plan.inputs import check_model
from zerolite.state.master import MasterShard
from zerolite.state.shard_state import ShardState, state_of

__all__ = ["ShardedOptimizer", "check_not_sharded", "require_sharded_optimizer"]

logger = logging.getLogger(__name__)


class ShardedOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose state lives in shards across data-parallel ranks.

    Built by `zerolite.shard`; not constructed directly. Every rank of the process
    group must call `step`, `zero_grad` and `clip_grad_norm_` together.

    Attributes:
        optimizer: the wrapped user optimizer (its ``param_groups`` are shared).
        config: the `ZeroConfig` it was built with.
        flats: the flat parameter buffers, in bucket order.
        masters: one `MasterShard` per flat buffer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: ShardState) -> None:
        # Optimizer.__init__ would rebuild param groups: share the wrapped optimizer's.
        init_optimizer_hooks(self)
        self.optimizer = optimizer
        # Everything shard() built for the model: flat buffers, masters, buckets, scheduler.
        self.shard_state = state
        config = state.config
        # fp16 only: scales the loss, unscales gradients, decides skipped steps.
        self.loss_scaler = DynamicLossScaler() if config.param_dtype == torch.float16 else None
        # True when the last step() was skipped because gradients overflowed (fp16).
        self.step_was_skipped = False
        self._prepared: list[torch.Tensor] | None = None
        self._overflow = False
        # 0-dim fp32: 1/loss scale times the clip coefficient, applied to gradients after
        # their fp32 upcast (see _fp32_gradient); `_clipped` says a clip coefficient is in it.
        self._grad_factor = torch.ones((), dtype=torch.float32)
        self._clipped = False
        # The global gradient norm's fixed summation order, built at the first clip.
        self._norm: GradNorm | None = None
        # What each group's "params" held after shard(): a change is refused at step().
        self._group_params = [list(group["params"]) for group in optimizer.param_groups]

    # -- shared with the wrapped optimizer -------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # -- the model's ShardState (zerolite.state.shard_state) ----------------------------------
    @property
    def config(self) -> ZeroConfig:
        return self.shard_state.config

    @property
    def group(self) -> Group:
        return self.shard_state.group

    @property
    def flats(self) -> list[FlatParamBuffer]:
        return self.shard_state.flats

    @property
    def masters(self) -> list[MasterShard]:
        return self.shard_state.masters

    @property
    def frozen_flats(self) -> list[FlatParamBuffer]:
        """Stage 3: flat buffers of frozen parameters (sharded; no master, no gradients)."""
        return self.shard_state.frozen_flats

    @property
    def layout_digest(self) -> str:
        """sha256 of what shard() agreed on (config, params, buffers): identifies the layout."""
        return self.shard_state.layout_digest

    @property
    def _reducer(self) -> GradReducer:
        return self.shard_state.reducer

    @property
    def _grads(self) -> KeepFullGrads | ShardGradsInBackward:
        return self.shard_state.grads

    @property
    def model(self) -> torch.nn.Module | None:
        """The model this optimizer was sharded with (None once it was garbage-collected)."""
        return self.shard_state.model

    @property
    def buckets(self) -> list[GradBucket]:
        return self._reducer.buckets

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        """zerolite's small internal tensors (used-gradient flags, the unscale factor)."""
        return [*self._reducer.local_used, *self._reducer.global_used, self._grad_factor]

    def __repr__(self) -> str:
        return (
            f"ShardedOptimizer(stage={self.config.stage}, "
            f"rank={self.group.rank}/{self.group.size}, "
            f"buffers={len(self.flats)}, optimizer={self.optimizer!r})"
        )

    # -- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Reduce gradients, step this rank's shard, all-gather the updated parameters.

        Every rank must call. Parameters are fully updated when this returns. With fp16
        loss scaling, a step whose gradients overflowed on any rank is skipped on every
        rank (`step_was_skipped`), leaving parameters and optimizer state unchanged.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled
                before the reduction), as for any torch optimizer.
        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_bound()
        used = self._prepare_gradients()
        self.step_was_skipped = self._overflow
        if self.loss_scaler is not None:
            self.loss_scaler.update(self._overflow)
        if not self._overflow:
            self._update_and_gather(used)
        self._reducer.after_step()
        self.group.step += 1
        self._prepared = None
        self._clipped = False
        return loss

    def _update_and_gather(self, used: list[torch.Tensor]) -> None:
        """Phases 2 and 3. The user's optimizer steps bucket by bucket where that pays:
        replicated buffers (each all-gather overlaps the next bucket's update) and 16-bit
        gradients (the fp32 upcast stays one bucket's shard). Otherwise (stage 3 in fp32)
        one step covers every bucket, saving the optimizer's per-call pass over all groups."""
        gathers = []
        waiting: list[MasterShard] = []
        tiered = self.shard_state.params_tier is not None
        for b, (master, bucket) in enumerate(zip(self.masters, self.buckets)):
            if bucket.shard is None:
                raise RuntimeError(
                    f"{self.group.prefix()} bucket {b} has no reduced gradient shard"
                )
            if tiered:  # one bucket's shards in memory at a time, the next one's read ahead
                shard = fetch_bucket(self.buckets, b)
            else:
                shard = bucket.shard
            master.set_grads(self._fp32_gradient(shard), used[b])
            waiting.append(master)
            if master.flat.replicated or shard.dtype != torch.float32 or tiered:
                self._step_masters(waiting)
                waiting = []
            if tiered:  # written back only if the unscale/clip factor was applied in place
                park_bucket(bucket, grad_changed=shard.dtype == torch.float32
                            and self._factor_pending)
            if master.flat.replicated:  # stage 3 keeps parameters sharded: nothing to gather
                gathers.append(master.flat.all_gather())
        self._step_masters(waiting)
        for gather in gathers:
            gather.wait()

    def _step_masters(self, masters: list[MasterShard]) -> None:
        if not masters:
            return
        self.optimizer.step()
        if self.shard_state.offload is not None:  # the offloaded pieces, chunk by chunk
            stream_step(self.shard_state.offload, masters, self.optimizer)
        for master in masters:
            master.clear_grads()
            master.write_back()

    def _prepare_gradients(self) -> list[torch.Tensor]:
        """Phase 1, once per step: reduce, then (fp16) detect overflow and plan the unscale.

        Returns, per bucket, which params some rank produced a gradient for.
        """
        if self._prepared is None:
            if not self._reducer.reduced:
                self._grads.collect()
            used = self._reducer.reduce()
            self._overflow = False
            self._grad_factor = torch.ones((), dtype=torch.float32)
            if self.loss_scaler is not None:
                self._overflow = self.loss_scaler.found_overflow(self._grad_shards(), self.group)
                self._grad_factor /= self.loss_scaler.scale
            self._prepared = used
        return self._prepared

    def _fp32_gradient(self, shard: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient the master steps with: the shard itself (fp32) or a transient
        fp32 copy of one bucket's shard (16-bit), times the pending unscale/clip factor.
        The factor is applied after the upcast: in 16 bits, 1/scale would flush small
        gradients to zero (what loss scaling exists to prevent)."""
        grad = shard if shard.dtype == torch.float32 else shard.float()
        if self._factor_pending:
            grad.mul_(self._grad_factor)  # a CPU scalar: no copy to the device, no sync
        return grad

    @property
    def _factor_pending(self) -> bool:
        """Whether `_fp32_gradient` multiplies by ``_grad_factor`` (fp16, or a norm clip)."""
        return self.loss_scaler is not None or self._clipped

    def _grad_shards(self, changes: bool = False) -> Sequence[torch.Tensor]:
        """Every bucket's gradient shard, in bucket order, for one walk over them: with
        ``offload_params`` one at a time (`one_at_a_time`; ``changes``: the walk writes
        into them)."""
        if self.shard_state.params_tier is not None:
            return one_at_a_time([b.tiered for b in self.buckets if b.tiered is not None],
                                 dirty=changes)
        return [b.shard for b in self.buckets if b.shard is not None]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (fp16); ``loss`` itself otherwise.

        Use as ``opt.scale_loss(loss).backward()``; `step` and `clip_grad_norm_` unscale.
        """
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients of every managed parameter (all ranks must call).

        Args:
            set_to_none: stage 1: ``param.grad`` becomes None (True) or a zeroed view of
                the persistent gradient buffer (False). Stage 2 keeps no full-size
                gradients between steps, so ``param.grad`` is None either way; the
                gradient shard is zeroed in place in both cases.
        """
        self._grads.zero_grad(set_to_none)
        self._prepared = None
        self._clipped = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all ranks' shards; all ranks must call.

        Call after backward and before `step`. Equivalent to
        ``torch.nn.utils.clip_grad_norm_`` on the unsharded model's gradients (which
        under sharding would see only local, unreduced gradients). With fp16 loss
        scaling, gradients are unscaled first and an overflow returns ``inf`` (the step
        will be skipped).

        Args:
            max_norm: the largest allowed norm.
            norm_type: p of the p-norm (> 0), or ``math.inf``.
        Returns:
            0-dim fp32 tensor: the total norm before clipping, equal on every rank.
        """
        self._prepare_gradients()
        if self._overflow:
            return torch.tensor(float("inf"))
        # The norm of the (still scaled) shards, times the pending factor: exact, since the
        # norm is homogeneous, and computed in fp32 whatever the gradient dtype.
        if self._norm is None:
            self._norm = GradNorm(self.flats, self.group)
        total = self._norm(self._grad_shards(), norm_type) * self._grad_factor
        self._grad_factor = self._grad_factor * clip_coefficient(total, max_norm)
        self._clipped = True
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``; all ranks must call.

        Call after backward and before `step`. Equivalent to
        ``torch.nn.utils.clip_grad_value_`` on the unsharded model's reduced gradients
        (under sharding ``param.grad`` holds local, unreduced gradients, or nothing). With
        fp16 loss scaling the bound applies to the unscaled gradients, and after an
        overflow nothing is clamped (the step will be skipped). Elementwise: no
        communication beyond the gradient reduction the step needs anyway.

        Args:
            clip_value: the largest allowed magnitude, a finite number >= 0.
        Raises:
            ValueError: ``clip_value`` is negative, infinite or not a number.
        """
        value = float(clip_value)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"clip_grad_value_(): clip_value must be a finite number >= 0, got {clip_value!r}"
            )
        self._prepare_gradients()
        factor = float(self._grad_factor)  # a CPU scalar: no sync
        if self._overflow or factor == 0.0:  # skipped, or every gradient is scaled to 0
            return
        # The shards still carry the pending factor (the loss scale, a norm clip): bound
        # them in their own units, so the bound holds once the factor is applied.
        bound = value / factor
        for shard in self._grad_shards(changes=True):
            shard.clamp_(-bound, bound)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: optimizer state and hyperparameters, fp32 masters, loss scale.

        Carries rank, world size, stage and a layout digest; see `load_state_dict`.
        Tensors are references (as with any torch optimizer): copy before mutating.
        """
        if self.shard_state.params_tier is None:
            return sharded_state_dict(self.shard_state, self.loss_scaler)
        # offload_params: copies, since the shards they would view are parked again after.
        with self.shard_state.resident():
            return copy_tensors(sharded_state_dict(self.shard_state, self.loss_scaler))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the dict this same rank saved, at the same world size, stage and layout.

        Every rank must call, each with its own rank's dict. Refused on every rank,
        before anything changes, if any rank got another rank's dict or another layout.
        """
        with self.shard_state.resident(writes=True):
            load_sharded_state_dict(self.shard_state, state_dict, self.loss_scaler)

    def publish_masters(self) -> None:
        """Make the parameters show masters and shards written outside `step` (by a load).

        Frees stage-3 units that were gathered (their full copies predate the write; the
        next use gathers them again), casts the masters into the parameter shards and
        all-gathers replicated (stage 1-2) buffers. Every rank must call.
        """
        self.shard_state.publish()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after `zerolite.shard`: add every group before sharding."""
        raise RuntimeError(
            "add_param_group() after zerolite.shard() is not supported: the flat buffers and "
            "shards are fixed at shard(). Add every parameter group to your optimizer before "
            "calling zerolite.shard()."
        )

    def _check_bound(self) -> None:
        for g, (group, expected) in enumerate(zip(self.param_groups, self._group_params)):
            current = group["params"]
            if len(current) != len(expected) or any(a is not b for a, b in zip(current, expected)):
                raise RuntimeError(
                    f"{self.group.prefix()} param group {g} "
                    f"(optimizer.param_groups[{g}]['params']) changed after "
                    f"zerolite.shard() (it holds {len(current)} tensors, zerolite gave it "
                    f"{len(expected)}): zerolite shards the parameters the optimizer held at "
                    "shard(). Put every parameter in its group before calling shard()."
                )
        if len(self.param_groups) != len(self._group_params):
            raise RuntimeError(
                f"{self.group.prefix()} the optimizer has {len(self.param_groups)} param groups, "
                f"{len(self._group_params)} at zerolite.shard(); add every group before shard()"
            )
        moved = [name for flat in self.flats for name in flat.unbound()]
        if moved:
            raise RuntimeError(
                f"{self.group.prefix()} parameters {moved[:5]} no longer live in zerolite's flat "
                "buffers: they were moved, cast or re-assigned after zerolite.shard(). Move and "
                "cast the model before calling shard()."
            )


def require_sharded_optimizer(opt: object, caller: str) -> ShardedOptimizer:
    """``opt`` itself if it is a `ShardedOptimizer`; else a `TypeError` for ``caller``."""
    if not isinstance(opt, ShardedOptimizer):
        raise TypeError(
            f"{caller} needs the ShardedOptimizer that zerolite.shard() returned, got "
            f"{type(opt).__name__}; pass opt = zerolite.shard(model, optimizer, config)"
        )
    return opt


def require_model_of(model: object, opt: ShardedOptimizer, caller: str) -> None:
    """Refuse a ``model`` that is not the one ``opt`` was sharded with, nor a wrapper
    holding its parameters (``caller``: the API, for the message).

    Raises:
        ValueError: ``model`` is another model (or not a module).
    """
    if opt.model is model:
        return
    own = {id(p) for p in model.parameters()} if isinstance(model, torch.nn.Module) else set()
    if not all(id(p) in own for flat in opt.flats for p in flat.params):
        raise ValueError(
            f"{caller}: model is not the model this optimizer was sharded with; pass the "
            "model given to zerolite.shard() together with the optimizer it returned"
        )


def check_not_sharded(model: object, optimizer: object) -> None:
    """Refuse to shard ``model`` or ``optimizer`` a second time (`shard()` and ``estimate``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``optimizer`` is a `ShardedOptimizer`.
        RuntimeError: ``model`` was sharded already.
    """
    check_model(model)
    if isinstance(optimizer, ShardedOptimizer):
        raise TypeError("this optimizer is already a ShardedOptimizer; call shard() once per model")
    if state_of(model) is not None:
        raise RuntimeError(
            "this model was already sharded by zerolite.shard(); shard() may be called once per "
            "model (build a new model and optimizer to shard again)"
        )
