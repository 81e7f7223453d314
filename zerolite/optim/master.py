"""`MasterShard`: the fp32 copy of this rank's shard that the optimizer actually steps.

With fp32 parameters the master *is* the parameter shard (a view: no second copy, and
the optimizer's update lands in the parameters directly). With 16-bit parameters it is
an fp32 copy, and `write_back` casts it down into the parameter shard after each step.

The user's optimizer does not step the master as one tensor but as *pieces*: one 1-D
view per parameter intersecting this shard (see `zerolite.layout.ParamPiece`). Each
piece carries its parameter's optimizer state, step count and param group, so a
parameter that received no gradient is skipped exactly as torch skips it, and a
checkpoint can name state by parameter and element range. Under whole-tensor ownership
(``ZeroConfig.partition="tensor"``) a piece is a whole parameter and is viewed in the
parameter's shape, so shape-aware optimizers (Muon, Adafactor) step it as the matrix it is.
"""

from __future__ import annotations

import torch

from zerolite.flat_buffer import FlatParamBuffer
from zerolite.layout import ParamPiece

__all__ = ["MasterShard"]


class MasterShard:
    """fp32 master of one flat buffer's shard and its per-parameter pieces.

    Args:
        flat: the flat parameter buffer whose shard this rank owns.
    """

    def __init__(self, flat: FlatParamBuffer) -> None:
        self.flat = flat
        # 1-D, fp32, shard_numel: a view of flat.shard when params are fp32, else a copy.
        self.data: torch.Tensor = (
            flat.shard if flat.data.dtype == torch.float32 else flat.shard.float()
        )
        # fp32 views of `data`, one per flat.pieces entry: what the optimizer steps. 1-D, or
        # in the parameter's shape when pieces are whole parameters (whole-tensor ownership).
        self.shaped = flat.layout.owners is not None
        self.pieces: list[torch.Tensor] = [self._view(self.data, pc) for pc in flat.pieces]

    def _view(self, shard: torch.Tensor, piece: ParamPiece) -> torch.Tensor:
        view = shard[piece.shard_start : piece.shard_start + piece.numel]
        return view.view(self.flat.shapes[piece.index]) if self.shaped else view

    @property
    def is_view(self) -> bool:
        """True when the master is the parameter shard itself (fp32 training)."""
        return (
            self.data.data_ptr() == self.flat.shard.data_ptr()
            and self.data.dtype == self.flat.shard.dtype
        )

    def write_back(self) -> None:
        """Cast the updated master into the parameter shard (no-op when it is a view)."""
        if not self.is_view:
            self.flat.shard.copy_(self.data)

    def set_grads(self, grad_shard: torch.Tensor, used: torch.Tensor) -> None:
        """Point each piece's ``.grad`` at its slice of ``grad_shard``; None if unused.

        Args:
            grad_shard: 1-D, fp32, shard_numel: this rank's reduced gradients.
            used: bool per param of the flat buffer: some rank produced a gradient.
        """
        for piece, tensor in zip(self.flat.pieces, self.pieces):
            tensor.grad = self._view(grad_shard, piece) if used[piece.index] else None

    def clear_grads(self) -> None:
        for tensor in self.pieces:
            tensor.grad = None
