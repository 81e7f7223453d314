"""Parity oracles: train the same model on the same global batch three ways.

- the reference: one process, the whole global batch;
- DDP on the launch's ranks, each rank a slice of the batch;
- zerolite on the same ranks.

DDP is the yardstick: how far DDP itself ends from the reference (`DdpDeviation`) is how far
data parallelism moves this model on this CPU, so every rule is stated against it, never as a
constant tuned on one machine. The CPU's matrix kernels (oneDNN picks AVX2, AVX-512 or AMX at
run time; ``ONEDNN_MAX_CPU_ISA`` forces one) change the rounding of every run alike, DDP's too.

- Per tensor, rel = ||a - b|| / ||b|| (absolute where ||b|| = 0) against the reference:
  zerolite's <= max(2 x DDP's on that tensor, 1e-6).
- Per step, the loss averaged over ranks, rel = |a - b| / |b| against the reference's:
  zerolite's <= max(2 x E, 1e-6), E the largest loss deviation DDP reached over the run. The
  run's largest, not the step's: the loss of one step is a single sample of rounding noise
  that an optimizer amplifies step by step (Muon orthogonalises in bf16, where one ulp of
  difference in a gradient flips roundings), and it can pass through zero by chance while
  the weights still differ. The floor 1e-6 is a few fp32 roundings of the loss (eps 1.2e-7):
  the slices' mean loss and the whole batch's differ by that much at step 0.
- Where zerolite's summation order necessarily differs from DDP's (an owner sums 4 ranks'
  gradients in its own order; a norm summed over shards) and the optimizer amplifies
  rounding, one DDP run is one sample of that noise: `widen` takes the envelope of DDP runs
  that differ from each other only in summation order (`summation_orders`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zerolite
from examples.gpt import GPT, GPTConfig, param_groups, random_batch

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 6  # enough for a wrong state, step count or scale to show in every tensor

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


def summation_orders(world: int, local_batch: int) -> list[str]:
    """The ways `train_ddp` can sum the same gradient in another order, for this launch:
    ``"rotated"`` (rank r trains slice r+1: the all-reduce adds the slices in another order;
    the same as plain at 2 ranks, where a + b == b + a) and ``"micro{k}"`` (each rank's slice
    as k micro-batches accumulated under ``no_sync``)."""
    orders = ["rotated"] if world > 2 else []
    return orders + [f"micro{k}" for k in (2, 3) if local_batch % k == 0]


def train_ddp(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, data, order: str,
              before_step: Callable[[], None] | None = None) -> list[float]:
    """`train(ddp, opt, data, sliced=True)` (``order="plain"``) or the same with the gradient
    summed in another ``order`` (see `summation_orders`); returns the per-step loss averaged
    over ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shift = 1 if order == "rotated" else 0
    micro = int(order.removeprefix("micro")) if order.startswith("micro") else 1
    losses = []
    for x, y in data:
        per = x.shape[0] // world
        r = (rank + shift) % world
        x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        m, total = per // micro, 0.0
        for k in range(micro):
            with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                loss = ddp(x[k * m:(k + 1) * m], y[k * m:(k + 1) * m]) / micro
                loss.backward()
            total += loss.item()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(total))
    return losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else d


def tensor_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per parameter name; reads full values (stage 3 gathers them: every rank must call)."""
    full = zerolite.full_state_dict(model, rank0_only=False)
    return {n: rel_err(full[n], p) for n, p in reference.named_parameters()}


@dataclass
class DdpDeviation:
    """How far DDP on the same ranks ended from the single-process reference."""

    tensors: dict[str, float]  # parameter name -> rel error of DDP's final value
    losses: list[float]  # per step: |DDP's loss - reference's| / |reference's|

    def widen(self, other: DdpDeviation) -> DdpDeviation:
        """The envelope of two DDP runs: per tensor and per step, the larger deviation."""
        if self.tensors.keys() != other.tensors.keys() or len(self.losses) != len(other.losses):
            raise AssertionError("the envelope of DDP runs of different models or lengths")
        return DdpDeviation({n: max(e, other.tensors[n]) for n, e in self.tensors.items()},
                            [max(a, b) for a, b in zip(self.losses, other.losses)])


def loss_deviations(losses: list[float], reference: list[float]) -> list[float]:
    """Per step |a - b| / |b|; NaN where either is not finite (so any bound fails), and an
    AssertionError when the lists differ in length (a truncated run must not pass)."""
    if len(losses) != len(reference):
        raise AssertionError(f"{len(losses)} losses against {len(reference)} reference losses")
    return [abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) else math.nan
            for a, b in zip(losses, reference)]


def ddp_deviation(ddp_model: nn.Module, ddp_losses: list[float], reference: nn.Module,
                  ref_losses: list[float]) -> DdpDeviation:
    """DDP's per-tensor and per-step loss deviation from the reference (every rank calls
    when ``ddp_model`` is sharded at stage 3; a plain module reads locally)."""
    return DdpDeviation(tensor_errors(ddp_model, reference),
                        loss_deviations(ddp_losses, ref_losses))


def ddp_oracle(name: str, data) -> tuple[GPT, list[float], DdpDeviation]:
    """The reference run and DDP's deviation from it, for optimizer ``name``."""
    ref_model, ref_losses = reference_run(name, data)
    ddp_model, ddp_losses = ddp_run(name, data)
    return ref_model, ref_losses, ddp_deviation(ddp_model, ddp_losses, ref_model, ref_losses)


def loss_bound(ddp_losses: list[float]) -> float:
    """max(2 x DDP's largest loss deviation over the run, 1e-6) (module docstring); NaN when
    DDP's own run went non-finite, so that nothing passes against it."""
    if any(math.isnan(d) for d in ddp_losses):
        return math.nan
    return max(2 * max(ddp_losses, default=0.0), 1e-6)


def check_losses(label: str, losses: list[float], ref_losses: list[float],
                 ddp: DdpDeviation) -> float:
    """Assert the per-step loss rule; return the worst rel loss deviation."""
    devs = loss_deviations(losses, ref_losses)
    bound = loss_bound(ddp.losses)
    for step, dev in enumerate(devs):
        if not dev <= bound:  # NaN fails
            raise AssertionError(
                f"{label}: loss at step {step} is {losses[step]}, reference {ref_losses[step]}: "
                f"rel {dev:.3e} beyond max(2 x DDP's {max(ddp.losses):.3e}, 1e-6)")
    return max(devs, default=0.0)


def check_parity(label: str, model: nn.Module, losses: list[float], reference: nn.Module,
                 ref_losses: list[float], ddp: DdpDeviation) -> float:
    """Assert the parity criteria; return the worst per-tensor error reached (stage 3
    gathers the parameters: every rank must call)."""
    return check_values(label, zerolite.full_state_dict(model, rank0_only=False), losses,
                        reference, ref_losses, ddp)


def check_values(label: str, full: dict[str, torch.Tensor], losses: list[float],
                 reference: nn.Module, ref_losses: list[float], ddp: DdpDeviation) -> float:
    """`check_parity` on final parameter values ``full`` (name -> full tensor)."""
    errors = {n: rel_err(full[n], p) for n, p in reference.named_parameters()}
    bad = {
        n: (e, ddp.tensors[n]) for n, e in errors.items()
        if not e <= max(2 * ddp.tensors[n], 1e-6)
    }  # NaN fails
    if bad:
        raise AssertionError(f"{label}: tensors beyond max(2 x DDP error, 1e-6): {bad}")
    check_losses(label, losses, ref_losses, ddp)
    return max(errors.values())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's current values, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
