"""Memory accounting: measured footprint, the ZeRO formulas, a byte-exact estimator.

- `footprint(opt)`: bytes this rank holds, by category, counted from real storages.
- `formula(num_params, ...)`: the ZeRO paper's accounting (docs/design.md, "Memory per rank").
- `estimate(model_or_count, ...)`: what `shard()` will hold, byte-exact for a model.
- `MemoryBreakdown`: the one dataclass all three return.
- `track(opt)`: peak memory per phase (forward, backward, step).
"""

from zerolite.memory.estimate import estimate
from zerolite.memory.footprint import STATE_BYTES_PER_PARAM, MemoryBreakdown, footprint, formula
from zerolite.memory.track import MemoryTracker, PhasePeak, track

__all__ = [
    "MemoryBreakdown",
    "MemoryTracker",
    "PhasePeak",
    "STATE_BYTES_PER_PARAM",
    "estimate",
    "footprint",
    "formula",
    "track",
]
