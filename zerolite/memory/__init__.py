"""Memory accounting: measured footprint, the ZeRO formulas, a byte-exact estimator.

- `footprint(opt)`: bytes this rank holds, by category, counted from real storages.
- `formula(num_params, ...)`: the ZeRO paper's accounting (docs/design.md, "Memory per rank").
- `estimate(model_or_count, ...)`: what `shard()` will hold, byte-exact for a model.
- `MemoryBreakdown`: the one dataclass all three return.
- `track(opt)`: peak memory per phase (forward, backward, step), live tensor bytes included.
- `predict_peak(model_fn, batch_fn, config, world_size)`: the peak of a training step,
  simulated on fake tensors before the run (`PeakPrediction`).
- `measure_peak(model_fn, batch_fn, config)`: the same step run for real, measured by
  `track` (every rank calls it): what a prediction is held against.
- `plan(model_fn, batch_fn, world_size, memory, batch)`: the configurations that fit a
  budget, cheapest first (``zerolite plan``).
- `checkpoint_blocks(model)`: activation checkpointing as the prediction means it.

Its place among the layers (what it may import): docs/design.md, "Layers".
"""

from zerolite.memory.activations import checkpoint_blocks
from zerolite.memory.budget import PlanEntry, plan
from zerolite.memory.estimate import estimate
from zerolite.memory.footprint import STATE_BYTES_PER_PARAM, MemoryBreakdown, footprint, formula
from zerolite.memory.ledger import CATEGORIES
from zerolite.memory.measure import measure_peak
from zerolite.memory.peak_report import PeakPrediction
from zerolite.memory.predict import predict_peak
from zerolite.memory.track import MemoryTracker, PhasePeak, track

__all__ = [
    "CATEGORIES",
    "MemoryBreakdown",
    "MemoryTracker",
    "PeakPrediction",
    "PlanEntry",
    "PhasePeak",
    "STATE_BYTES_PER_PARAM",
    "checkpoint_blocks",
    "estimate",
    "footprint",
    "formula",
    "measure_peak",
    "plan",
    "predict_peak",
    "track",
]
