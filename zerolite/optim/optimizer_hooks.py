"""What ``torch.optim.Optimizer.__init__`` sets up, for optimizers that share their groups.

`ShardedOptimizer` and `MultiOptimizer` present other optimizers' ``param_groups`` and
``state`` as their own, so they must not run ``Optimizer.__init__`` (it would rebuild the
groups); they still need its hook registries and the patched ``step`` for hooks and
profiling to work.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["init_optimizer_hooks"]


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the step / state-dict hook registries ``Optimizer.__init__`` makes.

    Local to this process (no collective); called from the optimizer's own ``__init__``.
    """
    for name in (
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    ):
        setattr(optimizer, name, OrderedDict())
    optimizer._patch_step_function()
