"""`PeakPrediction`: what `predict_peak` found, and how it prints."""

from __future__ import annotations

import dataclasses

from zerolite.config import ZeroConfig
from zerolite.memory.ledger import CATEGORIES, PHASES

__all__ = ["PeakPrediction", "human_bytes"]


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units, three significant digits (``"1.25 GiB"``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class PeakPrediction:
    """The predicted peak of live tensor bytes on one rank during a training step.

    Attributes:
        peak: bytes, the most this rank holds at once during the simulated steps (the
            second optimizer step is the steady state: optimizer state exists from its
            start); model construction and `zerolite.shard` are not part of a step.
        phase: where the peak is: ``"forward"``, ``"backward"`` or ``"step"``.
        by_phase: the peak of each phase, bytes.
        breakdown: what is alive at the peak, bytes per category (`CATEGORIES` says what
            each one holds); the values sum to ``peak``.
        phase_breakdowns: the same at each phase's own peak.
        communication_bytes: bytes this rank sends in one optimizer step (all its
            micro-steps), as its exchanges send them (ring or point-to-point).
        offloaded: bytes on the offload tier (disk or host), outside ``peak`` for a disk
            tier; the streamed step reads and writes them once per step.
        config: the `ZeroConfig` simulated (as given; ``param_dtype`` as `shard()` chose it).
        world_size: N.
        rank: the rank simulated.
        micro_batch: samples per forward.
        accumulation: forwards (micro-steps) per optimizer step.
        activation_checkpointing: whether `checkpoint_blocks` was applied.
        device: the device type simulated (``"cpu"``: gloo's exchanges; ``"cuda"``: NCCL's,
            storages rounded up to the CUDA allocator's 512 bytes).
        seconds: how long the prediction took.
        activations_peak: the most bytes of activations (`CATEGORIES`) alive at once
            during the steps, wherever the peak is. They are the model's own forward
            tensors: the same for every stage, offload and shard group at the same
            ``param_dtype``, micro-batch and checkpointing ([Note: activation floor] in
            `zerolite.memory.budget_search`).
        complete: False when the simulation stopped as soon as the rank held more than
            `predict_peak`'s ``stop_above`` ([Note: stopped simulation] in
            `zerolite.memory.predict`): ``peak``, ``by_phase``, ``activations_peak`` are
            then lower bounds, the breakdowns are at the moment it stopped, and
            ``communication_bytes`` is 0.
    """

    peak: int
    phase: str
    by_phase: dict[str, int]
    breakdown: dict[str, int]
    phase_breakdowns: dict[str, dict[str, int]]
    communication_bytes: int
    offloaded: int
    config: ZeroConfig
    world_size: int
    rank: int
    micro_batch: int
    accumulation: int
    activation_checkpointing: bool
    device: str
    seconds: float
    activations_peak: int = 0
    complete: bool = True

    def __int__(self) -> int:
        return self.peak

    def __str__(self) -> str:
        c = self.config
        head = (
            f"predicted peak on rank {self.rank} of {self.world_size}: "
            f"{'' if self.complete else 'more than '}"
            f"{human_bytes(self.peak)} ({self.peak:,} B) in {self.phase}; stage {c.stage}, "
            f"{str(c.param_dtype).removeprefix('torch.')}, micro-batch {self.micro_batch} x "
            f"{self.accumulation}, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}"
        )
        rows = [head, f"{'phase':10s} {'peak':>12s}"]
        rows += [f"{p:10s} {human_bytes(self.by_phase.get(p, 0)):>12s}" for p in PHASES]
        rows.append("at the peak:")
        rows += [
            f"  {name:22s} {human_bytes(n):>12s}  {CATEGORIES[name]}"
            for name, n in sorted(self.breakdown.items(), key=lambda kv: -kv[1])
        ]
        rows.append(f"sent per optimizer step: {human_bytes(self.communication_bytes)}")
        if self.offloaded:
            rows.append(f"offload tier ({c.offload}): {human_bytes(self.offloaded)}")
        return "\n".join(rows)
