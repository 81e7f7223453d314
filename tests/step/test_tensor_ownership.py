"""Whole-tensor ownership (``partition="tensor"``) and several optimizers in one model.

On real gloo groups of 2 and 4 ranks, one launch per world size running every case:

1. Muon (hidden 2-D matrices) + AdamW (the rest), stages 1 and 2, against single-process
   and DDP training with the same two optimizers (tests/support/parity.py's per-tensor metric);
   the native (reduce / broadcast per owner) path too; with ``clip_grad_norm_`` (one
   global norm over both) against torch's clipping of the whole model.
2. Adafactor, stage 2, the same way.
3. AdamW under ``"tensor"`` trains as under ``"flat"``: bit for bit at 2 ranks (an
   elementwise step does not care how parameters are split), within the parity metric at
   4 (an owner sums the ranks' gradients starting from its own rank, as the flat path
   does, so another owner means another summation order).
4. Ownership: every parameter whole on exactly one rank; the imbalance `footprint` reports
   equals `estimate`'s and the owners' element counts; model-state bytes byte-exact against
   `estimate`; bf16 parameters with owned fp32 masters stay equal on every rank;
   `load_pretrained` fills masters owned whole; a meta-device build equals the normal one.
5. Refusals, before anything changes: LBFGS, overlapping parameter sets, ``"flat"`` with
   Muon naming ``"tensor"``.

Checkpoints and state dicts of owned tensors: tests/checkpoint/test_tensor_checkpoint.py; stage 3:
tests/stage3/test_stage3_tensor.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.support import parity
from zerolite.checkpoint import load_pretrained
from zerolite.memory import estimate, footprint
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 6
MUON_LR = 0.02


class Both:
    """The reference's two optimizers stepped together (independent of zerolite's code)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def muon_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The usual recipe: Muon for the blocks' 2-D matrices, AdamW for embeddings, norms, biases."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    rest = [
        p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("blocks."))
    ]
    return [
        torch.optim.Muon(hidden, lr=MUON_LR, weight_decay=0.01),
        torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0),
    ]


def muon_adafactor_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Three optimizers: Muon (blocks' matrices), Adafactor (embeddings: factored state of a
    2-D tensor), AdamW (norms and biases)."""
    muon, _ = muon_adamw(model)
    embeddings = [model.wte.weight, model.wpe.weight]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [
        muon,
        torch.optim.Adafactor(embeddings, lr=1e-2),
        torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.0),
    ]


BUILDERS = {
    "muon+adamw": muon_adamw,
    "muon+adafactor+adamw": muon_adafactor_adamw,
    "adafactor": lambda model: [torch.optim.Adafactor(model.parameters(), lr=1e-2)],
    "adamw": lambda model: [parity.make_optimizer("AdamW", model)],
}


def shard(name: str, model: torch.nn.Module, **config) -> zerolite.ShardedOptimizer:
    optimizers = BUILDERS[name](model)
    arg = optimizers if len(optimizers) > 1 else optimizers[0]
    return zerolite.shard(model, arg, zerolite.ZeroConfig(**config))


CLIP = 0.5  # below the tiny GPT's gradient norms: clipping is active on every step


def oracle(
    name: str, data, clip: bool = False
) -> tuple[torch.nn.Module, list[float], parity.DdpDeviation]:
    """Reference (one process, whole batch) and the envelope of DDP's deviation from it over
    every summation order (`parity.summation_orders`; with ``clip``, the other orders also
    sum the norm over the concatenated gradient): Muon orthogonalises in bf16, so one ulp of
    difference in a gradient or a clipping coefficient moves its loss, and zerolite sums in
    its own order (an owner adds the ranks' gradients from its own rank; the norm is summed
    over shards). ``clip``: clip to CLIP before each step, over all parameters as torch does."""
    def clipper(model: torch.nn.Module, order: str):
        if not clip:
            return None
        params = list(model.parameters())
        if order == "plain":
            return lambda: torch.nn.utils.clip_grad_norm_(params, CLIP)
        return lambda: torch.nn.utils.clip_grads_with_norm_(
            params, CLIP, torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])))

    ref = parity.make_model()
    ref_losses = parity.train(
        ref, Both(BUILDERS[name](ref)), data, sliced=False, before_step=clipper(ref, "plain")
    )
    ddp = None
    world = dist.get_world_size()
    for order in ["plain", *parity.summation_orders(world, data[0][0].shape[0] // world)]:
        model = parity.make_model()
        wrapped = DistributedDataParallel(model)
        opt = Both(BUILDERS[name](model))
        losses = parity.train_ddp(wrapped, opt, data, order, clipper(model, order))
        sample = parity.ddp_deviation(model, losses, ref, ref_losses)
        ddp = sample if ddp is None else ddp.widen(sample)
    return ref, ref_losses, ddp


def _parity_cases() -> dict:
    data = parity.batches(STEPS)
    report: dict = {}
    for name, configs in {
        "muon+adamw": [
            dict(stage=1),
            dict(stage=2, bucket_size_mb=0.01),
            dict(stage=2, bucket_size_mb=0.01, collectives="native"),
        ],
        "adafactor": [dict(stage=2, bucket_size_mb=0.01)],
    }.items():
        ref, ref_losses, ddp = oracle(name, data)
        report[f"{name}/DDP"] = max(ddp.tensors.values())
        for config in configs:
            model = parity.make_model()
            opt = shard(name, model, **config)
            assert opt.shard_state.masters[0].shaped, "auto must pick whole-tensor ownership"
            losses = parity.train(model, opt, data, sliced=True)
            label = f"{name}/{config}"
            report[label] = parity.check_parity(
                label, model, losses, ref, ref_losses, ddp
            )
    # One global norm over both optimizers' gradients, as torch's over the whole model.
    ref, ref_losses, ddp = oracle("muon+adamw", data, clip=True)
    model = parity.make_model()
    opt = shard("muon+adamw", model, stage=2, bucket_size_mb=0.01)
    losses = parity.train(
        model, opt, data, sliced=True, before_step=lambda: opt.clip_grad_norm_(CLIP)
    )
    label = "muon+adamw/clipped"
    report[label] = parity.check_parity(label, model, losses, ref, ref_losses, ddp)
    # AdamW: "tensor" trains as "flat" does. Bit for bit at 2 ranks; beyond, the owner of a
    # parameter sums the ranks' gradients starting from its own (the flat path does the
    # same), so a parameter owned by another rank sums in another order: the parity metric.
    ref, ref_losses, ddp = oracle("adamw", data)
    finals = {}
    for partition in ("flat", "tensor"):
        model = parity.make_model()
        opt = shard("adamw", model, stage=2, bucket_size_mb=0.01, partition=partition)
        losses = parity.train(model, opt, data, sliced=True)
        label = f"adamw/{partition}"
        report[label] = parity.check_parity(label, model, losses, ref, ref_losses, ddp)
        finals[partition] = zerolite.full_state_dict(model, rank0_only=False)
    report["adamw tensor == flat"] = all(
        torch.equal(finals["flat"][k], finals["tensor"][k]) for k in finals["flat"]
    )
    return report


def _ownership_cases() -> dict:
    world = dist.get_world_size()
    model = parity.make_model()
    opt = shard("muon+adamw", model, stage=2, bucket_size_mb=0.01)
    owned = {p.name: p.master.numel() for p in opt.shard_state.pieces()}
    whole = all(
        p.param_start == 0 and p.param_end == p.flat.layout.numels[p.index]
        and tuple(p.master.shape) == tuple(p.flat.shapes[p.index])
        for p in opt.shard_state.pieces()
    )
    counts = [None] * world
    dist.all_gather_object(counts, owned)
    merged: dict[str, int] = {}
    for c in counts:
        for n, k in c.items():
            assert n not in merged, f"{n} owned by two ranks"
            merged[n] = k
    loads = [sum(c.values()) for c in counts]
    expected = max(loads) / min(loads)
    # docs/design.md's rule, written here (not zerolite.plan.owners's code): largest tensor first,
    # each to the least-loaded rank; the loads it gives, whatever the tie-breaks.
    greedy = [0] * world
    for n in sorted((p.numel() for p in model.parameters()), reverse=True):
        greedy[greedy.index(min(greedy))] += n
    x, y = (parity.local_slice(t) for t in parity.batches(1)[0])
    model(x, y).backward()
    opt.step()  # optimizer state exists from the first step on
    fresh = parity.make_model()
    estimated = estimate(
        fresh, world_size=world, optimizer=zerolite.optim.multi.MultiOptimizer(
            BUILDERS["muon+adamw"](fresh)
        ),
        config=zerolite.ZeroConfig(stage=2, bucket_size_mb=0.01), rank=dist.get_rank(),
    )
    return {
        "whole": whole,
        "all_owned": set(merged) == {n for n, _ in model.named_parameters()},
        "imbalance": footprint(opt).ownership_imbalance,
        "expected": expected,
        "greedy": max(greedy) / min(greedy),
        "loads": (sorted(loads), sorted(greedy)),
        "estimated": estimated.ownership_imbalance,
        "model_states": (footprint(opt).model_states, estimated.model_states),
        "bf16_replicas_equal": _bf16_replicas_equal(),
        "pretrained_loads": _pretrained_loads(),
        "meta_equals_normal": _meta_equals_normal(),
    }


def _meta_equals_normal() -> bool:
    """A meta-device build laid out by owner equals the normal build, before and after steps."""
    from tests.stage3.test_meta_init import _build as build_plain

    states = []
    for meta in (False, True):
        model = build_plain(meta)
        opt = shard("muon+adamw", model, stage=2, bucket_size_mb=0.01)
        before = zerolite.full_state_dict(model, rank0_only=False)
        parity.train(model, opt, parity.batches(2), sliced=True)
        states.append((before, zerolite.full_state_dict(model, rank0_only=False)))
    return all(
        torch.equal(a[k], b[k]) for a, b in zip(states[0], states[1]) for k in a
    )


def _pretrained_loads() -> bool:
    """load_pretrained reads a plain safetensors file into masters owned whole."""
    source = parity.make_model(seed=7)
    path = Path(tempfile.mkdtemp()) / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()
               if k != "head.weight"}, str(path))
    model = parity.make_model()
    shard("muon+adamw", model, stage=2, bucket_size_mb=0.01)
    load_pretrained(model, [str(path)])
    loaded = zerolite.full_state_dict(model, rank0_only=False)
    return all(torch.equal(loaded[k], v) for k, v in source.state_dict().items() if k in loaded)


def _bf16_replicas_equal() -> bool:
    """bf16 parameters, fp32 masters owned whole: every rank ends with the same weights."""
    model = parity.make_model()
    opt = shard("muon+adamw", model, stage=2, bucket_size_mb=0.01, param_dtype=torch.bfloat16)
    for x, y in parity.batches(2):
        x, y = parity.local_slice(x), parity.local_slice(y)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return bool(torch.isfinite(flat).all()) and all(torch.equal(e, flat) for e in every)


def _refusal_cases() -> dict:
    messages = {}

    def refused(label: str, build, **config) -> None:
        model = parity.make_model()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            zerolite.shard(model, build(model), zerolite.ZeroConfig(**{"stage": 2, **config}))
        except (TypeError, ValueError) as exc:
            messages[label] = f"{type(exc).__name__}: {exc}"
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), label
            assert zerolite.state.shard_state.state_of(model) is None, label
        else:
            messages[label] = "accepted"

    refused("lbfgs", lambda m: torch.optim.LBFGS(m.parameters()), partition="tensor")
    refused("lbfgs_auto", lambda m: torch.optim.LBFGS(m.parameters()))
    refused("overlap", lambda m: [
        torch.optim.Muon([m.blocks[0].fc.weight]), torch.optim.AdamW(m.parameters())
    ])
    refused("flat_muon", muon_adamw, partition="flat")
    return messages


def _all_cases() -> dict:
    return {
        "parity": _parity_cases(),
        "ownership": _ownership_cases(),
        "refusals": _refusal_cases(),
    }


@pytest.fixture(scope="module", params=[2, 4])
def runs(request) -> list[dict]:
    return run_ranks(_all_cases, request.param, timeout=300)


def test_muon_adamw_and_adafactor_match_ddp(runs) -> None:
    for report in runs:
        labels = [k for k in report["parity"] if "/" in k and not k.endswith("/DDP")]
        assert len(labels) == 7, report["parity"]


def test_adamw_tensor_equals_flat(runs) -> None:
    if len(runs) == 2:  # a sum of two gradients does not depend on their order
        assert all(r["parity"]["adamw tensor == flat"] for r in runs)
    for r in runs:  # the parity metric held for both (check_parity raises otherwise)
        assert {"adamw/flat", "adamw/tensor"} <= set(r["parity"])


def test_every_parameter_whole_on_one_owner_and_imbalance_reported(runs) -> None:
    for r in runs:
        own = r["ownership"]
        assert own["whole"] and own["all_owned"], own
        assert own["imbalance"] == pytest.approx(own["expected"]), own
        assert own["estimated"] == pytest.approx(own["expected"]), own
        assert own["loads"][0] == own["loads"][1], own  # the owners' loads follow the rule
        assert own["imbalance"] == pytest.approx(own["greedy"]), own
        measured, estimated = own["model_states"]
        assert measured == estimated, own  # byte-exact, as under "flat"
        assert own["bf16_replicas_equal"], own
        assert own["pretrained_loads"], own
        assert own["meta_equals_normal"], own


def test_refusals_name_the_reason_and_the_fix(runs) -> None:
    msg = runs[0]["refusals"]
    assert msg["lbfgs"].startswith("TypeError") and "closure" in msg["lbfgs"], msg["lbfgs"]
    assert msg["lbfgs_auto"].startswith("TypeError") and "LBFGS" in msg["lbfgs_auto"]
    assert "disjoint" in msg["overlap"] and "optimizers[0] (Muon)" in msg["overlap"], msg
    assert "Muon" in msg["flat_muon"] and "partition='tensor'" in msg["flat_muon"], msg


def test_partition_config_and_environment(monkeypatch) -> None:
    with pytest.raises(ValueError, match="ZeroConfig.partition: got 'rows'"):
        zerolite.ZeroConfig(partition="rows")
    monkeypatch.setenv("ZEROLITE_PARTITION", "tensor")
    assert zerolite.ZeroConfig().partition == "tensor"
    assert zerolite.ZeroConfig(partition="flat").partition == "flat"  # argument beats env
    monkeypatch.delenv("ZEROLITE_PARTITION")
    assert zerolite.ZeroConfig().partition == "auto"


def test_owners_are_greedy_deterministic_and_laid_out_whole() -> None:
    from zerolite.plan.layout import FlatLayout
    from zerolite.plan.owners import balance, imbalance

    sizes = [5, 100, 7, 100, 3, 60]
    owners = balance(sizes, 3)
    assert owners == balance(sizes, 3) == [2, 0, 2, 1, 2, 2]  # largest first, least loaded
    order = sorted(range(len(sizes)), key=lambda i: owners[i])
    layout = FlatLayout(tuple(sizes[i] for i in order), 3, tuple(owners[i] for i in order))
    assert layout.chunk_sizes == (100, 100, 75) and layout.padding == 0
    for rank in range(3):
        pieces = layout.spans(rank)
        assert all(p.param_start == 0 and p.numel == layout.numels[p.index] for p in pieces)
        assert sum(p.numel for p in pieces) == layout.shard_size(rank)
    assert imbalance([layout.chunk_sizes], 3) == pytest.approx(100 / 75)
    with pytest.raises(ValueError, match="non-decreasing"):
        FlatLayout((1, 2), 2, (1, 0))
