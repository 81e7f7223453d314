"""What each ZeRO stage shards: one table, read by `shard()` and by the memory accounting.

Stages compose: stage 1 shards the optimizer state (fp32 masters and moments), stage 2
adds the gradients, stage 3 adds the parameters. Stage 0 is plain DDP, which shards
nothing; only the memory estimator knows it. Code asks the table what a stage has
(``STAGES[config.stage].shards_gradients``), never which stage it is, so
`zerolite.assemble` (the wiring), `zerolite.memory.estimate` and `zerolite.memory.formula`
cannot disagree on it.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["STAGES", "StagePolicy"]


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    """What one stage shards; a rank holds 1/N of each sharded kind, all of the others.

    Attributes:
        stage: the ``ZeroConfig.stage`` number.
        shards_optimizer_state: fp32 master copies and optimizer state.
        shards_gradients: a rank keeps its reduced gradient shard (in the reduce dtype)
            instead of the full gradient (in the parameter dtype, which ``.grad`` views).
        shards_parameters: a rank keeps its parameter shard; units are gathered for use.
    """

    stage: int
    shards_optimizer_state: bool
    shards_gradients: bool
    shards_parameters: bool

    def kept_grad_dtype(self, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
        """dtype of the gradients a rank keeps until the step: its reduced shards in
        ``reduce_dtype`` (`zerolite.config.ZeroConfig.grad_dtype`) when the stage shards
        gradients, else full gradients in ``param_dtype`` (which ``.grad`` views)."""
        return reduce_dtype if self.shards_gradients else param_dtype


STAGES: dict[int, StagePolicy] = {
    policy.stage: policy
    for policy in (
        #          stage, shards: optimizer state, gradients, parameters
        StagePolicy(0, False, False, False),  # DDP: for the memory estimator only
        StagePolicy(1, True, False, False),
        StagePolicy(2, True, True, False),
        StagePolicy(3, True, True, True),
    )
}
