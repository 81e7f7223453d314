"""`MasterShard`: the fp32 copy of this rank's shard that the optimizer actually steps.

With fp32 parameters the master *is* the parameter shard (a view: no second copy, and
the optimizer's update lands in the parameters directly). With 16-bit parameters it is
an fp32 copy, and `write_back` casts it down into the parameter shard after each step.

The user's optimizer does not step the master as one tensor but as one *view* per piece
(a parameter's part of this shard, where `zerolite.plan.layout.Span` says). Each view
carries its parameter's optimizer state, step count and param group, so a
parameter that received no gradient is skipped exactly as torch skips it, and a
checkpoint can name state by parameter and element range. Under whole-tensor ownership
(``ZeroConfig.partition="tensor"``) a piece is a whole parameter and its view has the
parameter's shape, so shape-aware optimizers (Muon, Adafactor) step it as the matrix it is.

With an offload tier (`zerolite.state.offload`) the first ``offloaded`` pieces step by
streaming instead (`zerolite.optim.streamed_step`): they get no ``.grad`` here, and with
16-bit parameters their master is not kept at all (a meta placeholder stands in the
param group; the tier holds the values).
"""

from __future__ import annotations

import torch

from zerolite.params.flat_buffer import FlatParamBuffer
from zerolite.plan.layout import Span

__all__ = ["MasterShard"]


class MasterShard:
    """fp32 master of one flat buffer's shard and its views, one per piece.

    Args:
        flat: the flat parameter buffer whose shard this rank owns.
        offloaded: how many leading pieces of ``flat.spans`` live on an offload tier.
        copy: keep an fp32 copy even when the parameters are fp32 (a quantized all-gather
            overwrites a replicated buffer's own shard with dequantized values).
    """

    def __init__(self, flat: FlatParamBuffer, offloaded: int = 0, *, copy: bool = False) -> None:
        self.flat = flat
        self.offloaded = offloaded
        fp32 = flat.data.dtype == torch.float32
        # Where `data` starts in the shard: after the offloaded masters (16-bit only).
        spans = flat.spans
        last = spans[offloaded - 1] if offloaded else None
        self._start = 0 if fp32 or last is None else last.shard_start + last.numel
        # 1-D, fp32: a view of flat.shard when params are fp32 (and no copy is asked for),
        # else a copy of flat.shard[_start:] (the resident masters, and the padding).
        self.data: torch.Tensor = (
            flat.shard
            if fp32 and not copy
            else flat.shard[self._start :].to(torch.float32, copy=True)
        )
        # fp32 views of `data`, one per piece (flat.spans): what the optimizer steps. 1-D,
        # or in the parameter's shape when pieces are whole parameters (whole-tensor
        # ownership); an offloaded 16-bit master is a meta tensor of its size (the tier
        # holds it).
        self.shaped = flat.layout.owners is not None
        self.views: list[torch.Tensor] = [
            torch.empty(self._shape(span), dtype=torch.float32, device="meta")
            if j < self._offloaded_masters()
            else self._view(self.data, span, self._start)
            for j, span in enumerate(spans)
        ]
        # Set by set_grads for the streamed step: the gradient shard, the used flags.
        self.grad_shard: torch.Tensor | None = None
        self.used: torch.Tensor | None = None

    def _offloaded_masters(self) -> int:
        return 0 if self.flat.data.dtype == torch.float32 else self.offloaded

    def _shape(self, span: Span) -> tuple[int, ...]:
        """The shape the optimizer steps the piece in: 1-D, or its parameter's."""
        return tuple(self.flat.shapes[span.index]) if self.shaped else (span.numel,)

    def _view(self, shard: torch.Tensor, span: Span, start: int = 0) -> torch.Tensor:
        """The slice of ``shard`` (which begins at shard element ``start``) at ``span``."""
        view = shard[span.shard_start - start : span.shard_start - start + span.numel]
        return view.view(self.flat.shapes[span.index]) if self.shaped else view

    @property
    def is_view(self) -> bool:
        """True when the master is the parameter shard itself (fp32 training)."""
        # Identity, not data pointers: a parked shard's storage may be freed by the tier's
        # writer thread at any moment ([Note: tier threads]).
        return self.data is self.flat.shard

    def write_back(self) -> None:
        """Cast the updated master into the parameter shard (no-op when it is a view)."""
        if not self.is_view:
            self.flat.shard[self._start :].copy_(self.data)

    def set_grads(self, grad_shard: torch.Tensor, used: torch.Tensor) -> None:
        """Point each view's ``.grad`` at its slice of ``grad_shard``; None if unused.

        Args:
            grad_shard: 1-D, fp32, shard_numel: this rank's reduced gradients.
            used: bool per param of the flat buffer: some rank produced a gradient.
        """
        self.grad_shard, self.used = grad_shard, used
        for j, (span, view) in enumerate(zip(self.flat.spans, self.views)):
            offloaded = j < self.offloaded
            keep = used[span.index] and not offloaded
            view.grad = self._view(grad_shard, span) if keep else None

    def clear_grads(self) -> None:
        self.grad_shard = self.used = None
        for view in self.views:
            view.grad = None
