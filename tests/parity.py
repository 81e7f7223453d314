"""Parity oracles (DESIGN §7): train the same model on the same global batch three ways.

- the reference: one process, the whole global batch;
- DDP on the launch's ranks, each rank a slice of the batch;
- zerolite on the same ranks.

Per tensor, rel = ||a - b|| / ||b|| (absolute where ||b|| = 0) against the reference;
zerolite must reach <= max(2 x DDP's own error on that tensor, 1e-6), and its loss
(averaged over ranks) must be within 1e-5 relative of the reference's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zerolite
from examples.gpt import GPT, GPTConfig, param_groups, random_batch

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 10

OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95)),
    "Adam": lambda groups: torch.optim.Adam(groups, lr=3e-3),
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    # Without an initial accumulator, Adagrad's first step is lr * sign(g): rounding noise
    # in gradients that are ~0 becomes lr-sized steps, and the oracle would measure noise.
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1),
}


def make_model(seed: int = 0, cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def make_groups(model: nn.Module) -> list[dict]:
    """Two groups with different hyperparameters."""
    decay, no_decay = param_groups(model, weight_decay=0.1)
    no_decay["lr_scale"] = 0.5  # an extra key must survive sharding untouched
    return [decay, no_decay]


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    opt = OPTIMIZERS[name](make_groups(model))
    opt.param_groups[1]["lr"] *= 0.5
    return opt


def batches(
    steps: int = STEPS, cfg: GPTConfig = TINY, batch: int = GLOBAL_BATCH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [random_batch(cfg, batch, seed=1000 + s) for s in range(steps)]


def local_slice(t: torch.Tensor) -> torch.Tensor:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def mean_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data,
    *,
    sliced: bool,
    set_to_none: bool = True,
    before_step: Callable[[], None] | None = None,
) -> list[float]:
    """Plain loop; returns the per-step loss averaged over ranks."""
    losses = []
    for x, y in data:
        if sliced:
            x, y = local_slice(x), local_slice(y)
        loss = model(x, y)
        loss.backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(mean_over_ranks(loss.item()) if sliced else loss.item())
    return losses


def reference_run(name: str, data) -> tuple[GPT, list[float]]:
    model = make_model()
    return model, train(model, make_optimizer(name, model), data, sliced=False)


def ddp_run(name: str, data) -> tuple[nn.Module, list[float]]:
    model = make_model()
    ddp = DistributedDataParallel(model)
    return model, train(ddp, make_optimizer(name, model), data, sliced=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else d


def tensor_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per parameter name; reads full values (stage 3 gathers them: every rank must call)."""
    full = zerolite.full_state_dict(model, rank0_only=False)
    return {n: rel_err(full[n], p) for n, p in reference.named_parameters()}


def check_parity(label: str, model: nn.Module, losses: list[float], reference: nn.Module,
                 ref_losses: list[float], ddp_errors: dict[str, float]) -> float:
    """Assert the parity criteria; return the worst per-tensor error reached."""
    errors = tensor_errors(model, reference)
    bad = {
        n: (e, ddp_errors[n]) for n, e in errors.items() if not e <= max(2 * ddp_errors[n], 1e-6)
    }  # NaN fails
    if bad:
        raise AssertionError(f"{label}: tensors beyond max(2 x DDP error, 1e-6): {bad}")
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > 1e-5 * abs(b):
            raise AssertionError(f"{label}: loss at step {step} is {a}, reference {b}")
    return max(errors.values())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's current values, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
