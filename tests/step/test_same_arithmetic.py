"""The same arithmetic at every stage: stages 1, 2 and 3 train bitwise alike at one world size.

The guarantee (README, "Stages and memory"; docs/choosing-a-stage.md): at one world size,
on the point-to-point collectives (gloo's default), stages 1, 2 and 3 give bit for bit the
same parameters, in fp32 and bf16, with ``clip_grad_norm_``, other bucket sizes, hybrid
sharding, ``partition="tensor"`` and accumulation under ``no_sync()``. Two
orders make it so:

- every reduced gradient element is the sum of the ranks' contributions in rank order,
  whichever rank receives it ([Note: rank order] in `zerolite.comm.collectives`; with the
  receiver's own chunk first, as before, stage 3 ends 6.7e-5 away from stage 1 after these
  6 steps at 4 ranks in fp32 without clipping, 6.7e-6 with it: fp32 addition of three or
  more terms depends on the order);
- the gradient norm is summed in one order fixed by the parameters, not by the shards
  ([Note: norm tree] in `zerolite.plan.norm_tree`; with a sum of the ranks' local sums, as
  before, clipping moves stage 3 4.1e-6 away from stage 1 at 2 ranks, 6.9e-6 at 4).

The run: a transformers GPT-2 (held out: no test tuned zerolite on it), 6 AdamW steps,
against stage 1 of the same launch, compared with ``torch.equal`` on every parameter of
``full_state_dict``. Both runs do the same additions in the same order, so "bitwise" is a
claim about the code, not about a CPU: it holds under every kernel family.

Accumulation without ``no_sync()`` is not covered, by design: stage 1 sums the micro-steps
on each rank and reduces once at the step (its one reduce-scatter per step), stages 2-3
reduce every micro-step (what keeps their gradients sharded); these add the same numbers in
two orders. Under ``no_sync()`` every stage sums locally first.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.support.rank_reports import guarded
from zerolite.optim.grad_clip import _combine, _local_sums
from zerolite.plan.layout import FlatLayout
from zerolite.plan.norm_tree import PieceRange, norm_programs
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

pytest.importorskip("transformers")

STEPS = 6
BATCH = 8  # global: 2 rows per rank at 4 ranks, split in 2 micro-batches when accumulating
SEQ = 8
VOCAB = 64
MAX_NORM = 0.05  # below the gradients' norm at every step: clipping acts


def _gpt2() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(cfg)


def _train(stage: int, case: dict) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``case``'s run at ``stage``: the final full parameters and the clip norms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    config = zerolite.ZeroConfig(
        stage=stage, param_dtype=case.get("dtype", torch.float32),
        bucket_size_mb=case.get("bucket_mb", 25.0), shard_group_size=case.get("k"),
        partition=case.get("partition", "flat"),
    )
    opt = zerolite.shard(model, opt, config)
    norms = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        per = BATCH // world
        mine = ids[rank * per:(rank + 1) * per]
        micro = 2 if case.get("accumulate") else 1
        for m in range(micro):
            rows = mine[m * per // micro:(m + 1) * per // micro]
            sync = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with sync:
                (model(input_ids=rows, labels=rows).loss / micro).backward()
        if case.get("clip"):
            norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return zerolite.full_state_dict(model, rank0_only=False), norms


def _stages_rank(cases: dict[str, dict]) -> dict:
    """Per case: for stages 2 and 3, the parameters that differ from stage 1's (names), the
    largest difference, and whether the clip norms are the same bits."""
    out = {}
    for label, case in cases.items():
        stages = case.get("stages", (1, 2, 3))
        runs = {stage: _train(stage, case) for stage in stages}
        (base, base_norms) = runs[1]
        for stage in stages[1:]:
            params, norms = runs[stage]
            differ = [n for n, p in base.items() if not torch.equal(p, params[n])]
            worst = max((p.double() - params[n].double()).abs().max().item()
                        for n, p in base.items())
            out[label, stage] = {"differ": differ, "worst": worst, "norms": norms == base_norms,
                                 "clipped": any(n > MAX_NORM for n in norms)}
    return out


CASES_2 = {"fp32 clip": {"clip": True}, "bf16 clip": {"dtype": torch.bfloat16, "clip": True}}
CASES_4 = {
    "fp32 clip": {"clip": True},
    "bf16 clip": {"dtype": torch.bfloat16, "clip": True},
    "fp32 clip, small buckets": {"clip": True, "bucket_mb": 0.01},
    "bf16 clip, accumulate under no_sync": {"dtype": torch.bfloat16, "clip": True,
                                            "accumulate": True},
    "fp32 clip, hybrid k=2": {"clip": True, "k": 2},
    "fp32 clip, hybrid k=1 (4 replicas)": {"clip": True, "k": 1},
    "fp32 clip, partition tensor": {"clip": True, "partition": "tensor"},
}


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2 ranks", "4 ranks"])
def test_stages_train_bitwise_alike(world, cases):
    reports = run_ranks(guarded, world, _stages_rank, cases, timeout=300)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
        for (label, stage), got in rep.items():
            where = f"{world} ranks, {label}, stage {stage} against stage 1"
            assert not got["differ"], (where, got["worst"], got["differ"])
            assert got["norms"], where
            if cases[label].get("clip"):
                assert got["clipped"], where  # else clipping would not be tested
    assert reports[0] == reports[-1]


# -- the norm tree alone, in one process -------------------------------------------------


def _norm(grads: list[torch.Tensor], buckets: list[list[int]], world: int, p: float,
          owners: list[int] | None) -> torch.Tensor:
    """The norm `zerolite.optim.grad_clip.GradNorm` computes for ``grads`` (canonical order)
    laid out in ``buckets`` over ``world`` ranks (flat, or whole tensors to ``owners``), every
    rank's part computed here and the all-gather done by hand."""
    ranks: list[list[list[PieceRange]]] = [[] for _ in range(world)]
    shards: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for bucket in buckets:
        layout = FlatLayout(tuple(grads[q].numel() for q in bucket), world,
                            None if owners is None else tuple(owners[q] for q in bucket))
        full = torch.zeros(layout.padded_numel)
        for i, q in enumerate(bucket):
            start, end = layout.param_range(i)
            full[start:end] = grads[q]
        for r in range(world):
            ranks[r].append([PieceRange(bucket[s.index], layout.numels[s.index], s.param_start,
                                        s.param_end, s.shard_start) for s in layout.spans(r)])
            lo, hi = layout.shard_range(r)
            shards[r].append(full[lo:hi])
    local, combine = norm_programs(ranks, [g.numel() for g in grads])
    wire = torch.zeros(world, combine.width)
    for r in range(world):
        sent = _local_sums(local[r], shards[r], p, torch.device("cpu"))
        wire[r, :sent.numel()] = sent
    return _combine(combine, wire.reshape(-1)) ** (1 / p)


def test_the_norm_is_the_same_bits_for_every_layout():
    """Random parameter sizes (around the tree's 256-value rows and 65536-value blocks),
    random buffers and orders, 1-4 ranks, flat and whole-tensor layouts, p in {1, 2, 3}:
    one norm, bit for bit, within 1e-5 of the float64 sum (the tree is a pairwise sum)."""
    rng = random.Random(0)
    torch.manual_seed(0)
    sizes = [1, 2, 3, 7, 255, 256, 257, 1000, 65536, 65537, 70000]
    for trial in range(12):
        n = rng.randint(1, 10)
        grads = [torch.randn(rng.choice(sizes)) * rng.choice([1e-3, 1.0, 100.0])
                 for _ in range(n)]
        p = rng.choice([1.0, 2.0, 3.0])
        exact = sum((g.double().abs() ** p).sum() for g in grads).item() ** (1 / p)
        first = None
        for world in (1, 2, 3, 4):
            for layout in ("flat", "flat", "tensor"):
                order = list(range(n))
                rng.shuffle(order)
                cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
                buckets = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
                owners = None
                if layout == "tensor":
                    owners = [rng.randrange(world) for _ in range(n)]
                    buckets = [sorted(b, key=lambda q: owners[q]) for b in buckets]
                got = _norm(grads, buckets, world, p, owners)
                first = got if first is None else first
                assert torch.equal(got, first), (trial, world, layout, got, first)
        assert math.isclose(first.item(), exact, rel_tol=1e-5), (trial, first.item(), exact)
