"""`FlatParamBuffer`: parameters packed into one padded 1-D tensor, viewed back out.

Each managed parameter keeps its identity (the optimizer, hooks and user code hold the
same ``nn.Parameter`` object) but its ``.data`` becomes a view of the buffer, so a
write into the buffer (an all-gather, a cast-down from the fp32 master) is a write into
the parameters, and this rank's shard of the buffer is one contiguous slice.

[Note: binding]
A parameter is "bound" while its storage is the buffer at its layout offset. Anything
that replaces ``param.data`` (``model.to(other_dtype)``, ``.half()``, ``.cuda()``, a
user assignment) unbinds it; `unbound` detects this and `zerolite.params.guard` refuses
the conversions before they happen.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolite.comm.collectives import Pending
from zerolite.comm.exchange import Exchange
from zerolite.params.tiered_shard import ShardTier, TieredTensor
from zerolite.plan.layout import FlatLayout, Span

__all__ = ["FlatParamBuffer"]


class FlatParamBuffer:
    """A padded flat buffer holding ``params`` end to end, each param's ``.data`` a view.

    Args:
        params: the parameters, in buffer order; each appears once.
        names: their fully-qualified names (for errors and checkpoints).
        layout: where each parameter and each rank's shard lie (`zerolite.plan.layout`).
        rank: this rank (its shard is ``layout.shard_range(rank)``).
        dtype, device: of the buffer; parameters are copied (cast) into it.
        index: position of this buffer among all of the model's buffers.
        exchange: how the buffer crosses ranks (`zerolite.comm.exchange`); the flat buffer
            all-gathers through it, its gradient bucket reduce-scatters through it.
        params_tier: stage 3 with ``offload_params``: where `shard_only` parks the shard
            (`zerolite.params.tiered_shard`).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        layout: FlatLayout,
        *,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        index: int,
        exchange: Exchange,
        params_tier: ShardTier | None = None,
    ) -> None:
        self.params = params
        self.names = names
        self.index = index
        self.rank = rank
        self.layout = layout
        self.exchange = exchange
        self.shapes = [p.shape for p in params]
        # 1-D, dtype, padded_numel elements; padding is zero and never read.
        self.data = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        lo, hi = self.layout.shard_range(rank)
        # 1-D, dtype, this rank's shard of `data` (a view).
        self.shard = self.data[lo:hi]
        # Where this rank's pieces lie (one per parameter meeting its shard), buffer order.
        self.spans: list[Span] = self.layout.spans(rank)
        # True while every rank holds the full buffer between steps (stages 1-2).
        self.replicated = True
        self._full_bytes = self.data.untyped_storage().nbytes()
        # Each parameter's view of `data`, made once: `bind` and every stage-3 `unshard`
        # bind the parameters to them (`reshard` only resizes the storage they view).
        self._views = [self.param_view(self.data, i) for i in range(len(params))]
        # Stage 3 with offload_params: `shard`'s home on the tier (parked between uses).
        self._params_tier = params_tier
        self.tiered: TieredTensor | None = None

    def bind(self) -> None:
        """Copy each parameter's values into the buffer and make ``param.data`` a view of it."""
        with torch.no_grad():
            for p, view in zip(self.params, self._views):
                view.copy_(p.data)
                p.data = view

    def shard_only(self) -> None:
        """Stage 3: keep only this rank's shard (own storage) and free the full buffer.

        [Note: freed parameters] Between gathers a parameter keeps its identity, shape,
        dtype and device, but its ``.data`` is one NaN broadcast to the full shape (a
        zero-stride view of a single element): no memory, writes into it raise, and
        anything computed from it is NaN -- never stale or shard-sized values. (A meta
        tensor cannot replace a CPU/CUDA parameter's data, and a view of freed storage
        crashes the process when read.) The full buffer's storage is resized to 0 bytes
        rather than dropped, so tensors autograd saved during forward (views of the
        weights, e.g. ``weight.t()``) see the values again when `unshard` re-allocates
        the same storage for backward.
        """
        self.shard = self.shard.clone()
        self.replicated = False
        if self._params_tier is not None:
            self.tiered = self._params_tier.add(
                self.shard, f"the parameter shard of flat buffer {self.index}"
            )
        self._nan = torch.full((1,), float("nan"), dtype=self.data.dtype, device=self.data.device)
        # Expanded from a 0-dim view, so that a 0-dim parameter gets a placeholder too.
        self._placeholders = [self._nan[0].expand(shape) for shape in self.shapes]
        self.reshard()

    def placeholder_written(self) -> torch.Tensor:
        """A 0-dim bool tensor on the buffer's device (read it when convenient: no sync
        here): True if something wrote into the freed parameters (``fill_`` and ``zero_``
        accept a broadcast tensor, so the write landed in the shared NaN and is lost)."""
        if self.replicated:
            return torch.zeros((), dtype=torch.bool, device=self.data.device)
        return ~torch.isnan(self._nan[0])

    @property
    def unsharded(self) -> bool:
        """True while the full buffer (and so every parameter) holds values."""
        return self.data.untyped_storage().nbytes() > 0

    def unshard(self, what: str = "") -> Pending:
        """Launch the all-gather of the full buffer from every rank's shard (stage 3).

        Parameters are bound to the buffer at once; their values are valid after the
        returned handle's ``wait()``. ``what`` names the exchange in errors.
        """
        if self.unsharded:
            return Pending()
        self.data.untyped_storage().resize_(self._full_bytes)
        lo, hi = self.layout.shard_range(self.rank)
        if self.tiered is not None:  # the shard is needed only for this copy
            self.tiered.fetch()
        self.data[lo:hi].copy_(self.shard)
        if self.tiered is not None:
            self.tiered.park()
        for p, view in zip(self.params, self._views):
            p.data = view
        return self.all_gather(what)

    def read_ahead(self) -> None:
        """With ``offload_params``: start reading the parked shard (the next `unshard` finds
        it in memory); otherwise nothing."""
        if self.tiered is not None and not self.unsharded:
            self.tiered.read_ahead()

    def all_gather(self, what: str = "") -> Pending:
        """Launch the in-place all-gather of ``data`` from every rank's chunk, through the
        buffer's exchange (a quantized one overwrites this rank's own chunk with its
        dequantized values too)."""
        return self.exchange.all_gather(
            self.data, what=what or f"the all-gather of flat buffer {self.index}"
        )

    def reshard(self) -> None:
        """Free the full buffer (stage 3; see [Note: freed parameters]); no-op when replicated."""
        if not self.replicated:
            for p, placeholder in zip(self.params, self._placeholders):
                p.data = placeholder
            self.data.untyped_storage().resize_(0)

    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s region of any buffer of this layout, in the param's shape."""
        start, end = self.layout.param_range(index)
        return flat[start:end].view(self.shapes[index])

    def unbound(self) -> list[str]:
        """Names of parameters whose storage is no longer this buffer (see [Note: binding])."""
        if not self.replicated and not self.unsharded:
            nan_ptr = self._placeholders[0].data_ptr() if self._placeholders else 0
            return [
                n
                for n, p in zip(self.names, self.params)
                if p.data_ptr() != nan_ptr or p.dtype != self.data.dtype
            ]
        base = self.data.data_ptr()
        size = self.data.element_size()
        out = []
        for i, p in enumerate(self.params):
            start, _ = self.layout.param_range(i)
            if (
                p.dtype != self.data.dtype
                or p.device != self.data.device
                or p.data_ptr() != base + start * size
            ):
                out.append(self.names[i])
        return out

    @property
    def numel(self) -> int:
        return self.layout.numel
