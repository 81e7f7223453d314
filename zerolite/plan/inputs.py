"""What `shard()` refuses in its inputs before it decides anything.

Each check reads the model, the optimizers and the config and raises a `TypeError` or
`ValueError` naming the argument, the value and what to do; none changes anything. They run
inside `shard()`'s agreement (`zerolite.comm.consensus`), so a rank that refuses its input
makes every rank raise instead of hanging.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from zerolite.config import ZeroConfig

__all__ = [
    "check_meta_build",
    "check_model",
    "check_nothing_on_meta",
    "check_one_device",
    "refuse_sparse_gradients",
    "trained_parameters",
]


def check_model(model: object) -> None:
    """Raise unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() needs an nn.Module as model, got {type(model).__name__}")


def trained_parameters(
    model: nn.Module, param_groups: Sequence[dict]
) -> tuple[dict[int, int], list[tuple[int, nn.Parameter]]]:
    """The optimizer's parameters, checked: ``(param_group_of, frozen)``.

    Args:
        model: the model to shard.
        param_groups: every param group of the user's optimizers, in order.
    Returns:
        ``id(param) -> group index`` of the trainable ones, and ``(group index, param)`` of
        those that do not require grad.
    Raises:
        ValueError: a parameter that is not the model's, listed twice, or not floating.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    param_group_of: dict[int, int] = {}
    frozen: list[tuple[int, nn.Parameter]] = []
    for g, param_group in enumerate(param_groups):
        for i, p in enumerate(param_group["params"]):
            where = f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
            if id(p) not in names:
                raise ValueError(
                    f"{where} is not a parameter of the model passed to shard(); build the "
                    "optimizer from this model's parameters"
                )
            if id(p) in param_group_of:
                raise ValueError(
                    f"{where} ({names[id(p)]!r}) appears in more than one place in the optimizer"
                )
            if not p.is_floating_point():
                raise ValueError(
                    f"{where} ({names[id(p)]!r}) has dtype {p.dtype}; only floating parameters "
                    f"can be sharded"
                )
            if p.requires_grad:
                param_group_of[id(p)] = g
            else:
                frozen.append((g, p))
    return param_group_of, frozen


def refuse_sparse_gradients(model: nn.Module, trained: dict[int, int]) -> None:
    """Raise if a trained embedding has ``sparse=True``: a sparse gradient cannot enter a
    dense flat gradient bucket (without this check it fails deep inside the first backward)."""
    for name, module in model.named_modules():
        sparse = isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
        if sparse and id(module.weight) in trained:
            raise ValueError(
                f"{name or 'the model'} ({type(module).__name__}) has sparse=True, so its weight "
                "gets sparse gradients, which zerolite cannot shard; build it with sparse=False, "
                "or freeze it"
            )


def check_one_device(managed: Sequence[tuple[str, nn.Parameter]]) -> torch.device:
    """The one device of the trained parameters ``managed`` (name, param)."""
    devices = {p.device for _, p in managed}
    if len(devices) > 1:
        by_device: dict[torch.device, str] = {}
        for n, p in managed:
            by_device.setdefault(p.device, n)
        listed = ", ".join(f"{n!r} on {d}" for d, n in by_device.items())
        raise ValueError(
            f"parameters are on mixed devices ({listed}); move the whole model to one device "
            "before shard()"
        )
    return devices.pop()


def check_meta_build(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], config: ZeroConfig
) -> None:
    """A model built on the meta device can be given storage in place
    (`zerolite.params.meta_init`)."""
    for name, p in model.named_parameters():
        if p.is_meta and (weakref.getweakrefs(p) or p._use_count() > 1):
            raise ValueError(
                f"meta parameter {name!r} is referenced elsewhere (a view of it, an autograd graph "
                f"or a weak reference), so zerolite cannot give it storage in place; pass the "
                f"model to shard() as built, before running it or taking views of its parameters"
            )
    if config.device is not None and config.device.type == "meta":
        raise ValueError(
            "ZeroConfig.device is 'meta'; name the device to materialise the model on, e.g. 'cpu' "
            "or 'cuda'"
        )
    if any(
        o.state.get(p) for o in optimizers for group in o.param_groups for p in group["params"]
    ):
        raise ValueError(
            "the optimizer has state for parameters on the meta device (it has stepped on a meta "
            "model?); build the optimizer on the meta model and pass it to shard() before any step"
        )


def check_nothing_on_meta(model: nn.Module, device: torch.device) -> None:
    """A model that is not a meta build must have nothing on the meta device."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"{kind} {name!r} is on the meta device while the trained parameters are on "
                    f"{device}; build the whole model under torch.device('meta') (shard() then "
                    f"materialises it) or give it storage before shard()"
                )
