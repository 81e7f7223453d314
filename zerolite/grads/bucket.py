"""`GradBucket`: the gradients of one flat buffer, on their way to this rank's shard.

A bucket has two tensors:

- ``full``: 1-D, the flat buffer's padded size, where local gradients are gathered.
  In stage 1 it is persistent and every ``param.grad`` is a view of it (autograd
  accumulates straight into it). In stage 2 it exists only while gradients are in
  flight: allocated when the first gradient of a backward arrives, freed once the
  reduce-scatter that consumed it has finished.
- ``shard``: 1-D, ``shard_numel`` elements in the reduce dtype: the average over ranks
  of this rank's chunk of ``full``, accumulated over reduce-scatters until `zero` (with
  hybrid sharding, over every rank: see `zerolite.comm.hybrid`).

`launch` starts the reduce-scatter of ``full``; `wait` finishes it and adds the result
into ``shard``. Exactly one of the two persists between steps (``keep_full``): stage 1
keeps ``full`` (the accumulator users see as ``param.grad``) and derives ``shard`` from
it at each step boundary (`consume` drops it); stage 2 keeps ``shard`` (the
accumulator) and frees ``full`` after each reduce-scatter. The mechanics are shared.
"""

from __future__ import annotations

import torch

from zerolite.comm.collectives import Pending
from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.params.tiered_shard import TieredTensor

__all__ = ["GradBucket"]


class GradBucket:
    """Gradient storage and reduction for one `FlatParamBuffer`.

    Args:
        flat: the parameters' flat buffer (gives layout, params, device, and the exchange
            that reduce-scatters, `zerolite.comm.exchange`).
        full_dtype: dtype of ``full`` (must equal the param dtype when ``keep_full``,
            since ``param.grad`` views it).
        shard_dtype: dtype of the reduced ``shard`` (``ZeroConfig.grad_dtype``).
        keep_full: keep ``full`` alive between steps with ``param.grad`` viewing it
            (stage 1), instead of freeing it after each reduce-scatter (stage 2).
    """

    def __init__(
        self,
        flat: FlatParamBuffer,
        *,
        full_dtype: torch.dtype,
        shard_dtype: torch.dtype,
        keep_full: bool,
    ) -> None:
        self.flat = flat
        self.full_dtype = full_dtype
        self.keep_full = keep_full
        device = flat.data.device
        n = flat.layout.shard_size(flat.rank)
        # 1-D, full_dtype, padded_numel: local gradients (None while not needed).
        self.full: torch.Tensor | None = (
            torch.zeros(flat.layout.padded_numel, dtype=full_dtype, device=device)
            if keep_full
            else None
        )
        self.shard_dtype = shard_dtype
        # 1-D, shard_dtype, shard_numel: reduced gradients of this rank's shard
        # (stage 1: only from a step boundary's launch until `consume`).
        self.shard: torch.Tensor | None = (
            None if keep_full else torch.zeros(n, dtype=shard_dtype, device=device)
        )
        self.shard_is_zero = True
        # Whether `full` holds gradients that no reduce-scatter has consumed yet.
        self.unreduced = False
        self._pending: Pending | None = None
        # Per param of the bucket: a gradient reached `full` since it was allocated.
        self._written = [False] * len(flat.params)
        # Per param: a gradient arrived in a synced backward since the last launch; counted
        # once per param, so a parameter that autograd reaches twice (reentrant
        # checkpointing) cannot make the bucket look complete early.
        self._arrived = [False] * len(flat.params)
        self._arrived_count = 0
        self._result: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None
        # Stage 3 with offload_params: `shard`'s home on the tier, parked after each
        # reduce-scatter lands in it (`zerolite.params.tiered_shard`).
        self.tiered: TieredTensor | None = None

    def fetch_shard(self) -> torch.Tensor:
        """``shard``, resident (with ``offload_params`` it may be parked)."""
        assert self.shard is not None
        return self.shard if self.tiered is None else self.tiered.fetch()

    def park_shard(self, changed: bool = False) -> None:
        """``offload_params``: park ``shard`` again (writing it if ``changed`` or not yet
        on the tier); no-op otherwise."""
        if self.tiered is not None:
            self.tiered.park(dirty=changed)

    def full_buffer(self) -> torch.Tensor:
        """``full``, allocated on first use (padding zeroed; parameter regions are written by
        `add_grad`, and any region no gradient reached is zeroed at `launch`)."""
        if self.full is None:
            layout = self.flat.layout
            self.full = torch.empty(
                layout.padded_numel, dtype=self.full_dtype, device=self.flat.data.device
            )
            self.full[layout.numel :].zero_()
            self._written = [False] * len(self.flat.params)
        return self.full

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Add param ``index``'s gradient into ``full`` (the first one since allocation is a
        copy: cheaper than zeroing the whole buffer and adding)."""
        view = self.grad_view(index)
        if self._written[index]:
            view.add_(grad)
        else:
            view.copy_(grad)
            self._written[index] = True
        self.unreduced = True

    def mark_unreduced(self) -> None:
        """Stage 1: autograd wrote gradients into ``full`` directly (through the
        ``param.grad`` views, not `add_grad`); they await a reduce-scatter."""
        self.unreduced = True

    def mark_arrived(self, index: int) -> bool:
        """Param ``index``'s gradient of a synced backward is in; True once every param's is."""
        if not self._arrived[index]:
            self._arrived[index] = True
            self._arrived_count += 1
        return self._arrived_count == len(self._arrived)

    @property
    def complete(self) -> bool:
        """Every param's gradient of the current synced backward has arrived."""
        return self._arrived_count == len(self._arrived)

    def grad_view(self, index: int) -> torch.Tensor:
        """Param ``index``'s region of ``full``, in the param's shape."""
        return self.flat.param_view(self.full_buffer(), index)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def launch(self) -> None:
        """Start reducing ``full`` into this rank's shard. Every rank must launch each
        bucket the same number of times, in the same order relative to other buckets."""
        if self._pending is not None:
            raise RuntimeError(
                f"{self.flat.exchange.group.prefix()} bucket {self.flat.index} launched twice "
                "without wait()"
            )
        full = self.full_buffer()
        if not self.keep_full:
            for i, written in enumerate(self._written):
                if not written:  # no gradient on this rank: contributes zeros
                    self.grad_view(i).zero_()
        send = full if full.dtype == self.shard_dtype else full.to(self.shard_dtype)
        if self.shard is None:
            self.shard = torch.empty(
                self.flat.layout.shard_size(self.flat.rank), dtype=self.shard_dtype,
                device=full.device,
            )
            self.shard_is_zero = True
        # Reduce straight into the shard when it holds nothing yet.
        if self.shard_is_zero and self.tiered is not None:
            self.tiered.fetch(read=False)
        out = self.shard if self.shard_is_zero else torch.empty_like(self.shard)
        what = f"the reduce-scatter of gradient bucket {self.flat.index}"
        self._pending = self.flat.exchange.reduce_scatter(send, out, what=what)
        self._result, self._sent = out, send
        self._reset_arrivals()
        self.unreduced = False

    def _reset_arrivals(self) -> None:
        self._arrived = [False] * len(self._arrived)
        self._arrived_count = 0

    def wait(self) -> None:
        """Finish the launched reduce-scatter and accumulate it into ``shard``."""
        if self._pending is None:
            return
        self._pending.wait()
        if self._result is not self.shard:
            self.fetch_shard().add_(self._result)
        self.shard_is_zero = False
        self.park_shard(changed=True)
        self._pending = self._result = self._sent = None
        if not self.keep_full:
            self.full = None

    def consume(self) -> None:
        """After a step: stage 1 drops the derived shard (``full`` stays the accumulator)."""
        if self.keep_full:
            self.shard = None
            self.shard_is_zero = True

    def zero(self) -> None:
        """Forget reduced gradients and, in stage 2, unreduced local ones (``zero_grad``)."""
        self.wait()
        self.consume()
        if self.shard is not None and not self.shard_is_zero:
            if self.tiered is None:
                self.shard.zero_()
            else:  # parked: zeroed when next fetched, the tier untouched
                self.tiered.clear()
            self.shard_is_zero = True
        self._reset_arrivals()
        if not self.keep_full:
            self.full = None
            self.unreduced = False
