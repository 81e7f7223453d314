"""What `checkpoint.load` restores, beyond tensors, on real gloo groups and real files:

1. LR schedulers: every `torch.optim.lr_scheduler` class, saved at 2 ranks and resumed at
   1, continues the un-interrupted run's LR (and momentum) sequence exactly, past its
   milestones; ``extra`` comes back with its types; a scheduler of another class or
   number, or an ``extra`` that cannot round-trip, is refused before anything changes.
2. Param groups listed in another order are refused by name (checkpoint and in-memory
   state dict), naming both groupings, before anything changes.
3. Loaded optimizer state holds exactly a fresh shard's memory after a change of world
   size or stage (no view of the saved tensors keeps them alive).
4. `load_pretrained` honours the index's ``weight_map``: a tensor in a file the map does
   not name for it is an error naming the tensor and both files.
5. The typed JSON codec itself (one process).

Launches are batched: one module fixture saves at 2 ranks and resumes at 1, 2 (stage 3)
and 3 ranks; another runs every refusal case in one 2-rank launch.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.optim import lr_scheduler as L

import zerolite
from tests.checkpoint.test_checkpoint import NO_DROPOUT, build, differences, snapshot, train
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.checkpoint import load_pretrained
from zerolite.checkpoint.json_codec import decode, encode
from zerolite.testing import run_ranks

# ---------------------------------------------------------------- 1. schedulers

STEPS, SAVE_AT = 10, 4  # milestones below lie after SAVE_AT


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def tiny_optimizer(model: nn.Module, *, swapped: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on weights only and half the LR on biases."""
    decay = {
        "params": [p for n, p in model.named_parameters() if n.endswith("weight")],
        "weight_decay": 0.1,
    }
    no_decay = {
        "params": [p for n, p in model.named_parameters() if n.endswith("bias")],
        "weight_decay": 0.0,
        "lr": 5e-3,
    }
    groups = [no_decay, decay] if swapped else [decay, no_decay]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.5 ** (e // 3)),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.9 if e % 2 else 1.0),
    "StepLR": lambda o: L.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[6, 8, 8], gamma=0.5),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=6),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.2, total_iters=7),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "SequentialLR": lambda o: L.SequentialLR(  # warm-up, then decay at epochs 5 and 7
        o,
        [
            L.LinearLR(o, start_factor=0.1, total_iters=3),
            L.MultiStepLR(o, milestones=[2, 4], gamma=0.1),
        ],
        milestones=[3],
    ),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=8),
    "ChainedScheduler": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, factor=0.5, total_iters=6), L.ExponentialLR(o, gamma=0.9)]
    ),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(
        o, base_lr=1e-3, max_lr=1e-2, step_size_up=3, base_momentum=0.8, max_momentum=0.9
    ),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=1e-2, total_steps=12),
}
EXTRA = {
    7: "seven",
    "t": (1, 2),
    "seen": Counter({6: 2}),
    "best": math.inf,
    "order": OrderedDict([((1, "a"), [None, 1.5])]),
    "$type": "a user key",
}


def test_json_codec_round_trips_exactly_or_refuses_naming_the_place():
    values = {
        **EXTRA,
        "nan": math.nan,
        "-inf": -math.inf,
        "nested": [{(2, 3): (None, [1.5])}],
        "lr": torch.tensor([1e-3, math.inf], dtype=torch.bfloat16),
        10**30: True,
    }
    text = json.dumps(encode(values, "extra"), allow_nan=False)  # strict JSON
    back = decode(json.loads(text), "extra")
    assert list(back) == list(values)
    for key, value in values.items():
        got = back[key]
        assert type(got) is type(value), key
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value), key
        elif key == "nan":
            assert math.isnan(got)
        else:
            assert got == value, key
    for bad, where in [
        ({"run": [1, {2: object()}]}, "extra['run'][1][2]"),
        ({"s": {1}}, "extra['s']"),
        ({"p": nn.Parameter(torch.zeros(1))}, "extra['p']"),
    ]:
        with pytest.raises(ValueError, match=re.escape(where)):
            encode(bad, "extra")
    with pytest.raises(ValueError, match="unknown"):
        decode({"$type": "pickle", "items": []}, "extra")


def _build_tiny(name: str, seed: int = 0, swapped: bool = False):
    model = tiny(seed)
    opt = zerolite.shard(
        model, tiny_optimizer(model, swapped=swapped), zerolite.ZeroConfig(stage=2)
    )
    return model, opt, (SCHEDULERS[name](opt) if name else None)


def _steps(model, opt, sched, first: int, last: int) -> list:
    """Train steps [first, last); per step, every group's (lr, betas) after the scheduler."""
    out = []
    for step in range(first, last):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step(1.0)  # a flat metric: the LR is cut after every `patience` epochs
        else:
            sched.step()
        opt.zero_grad()
        out.append([(g["lr"], g["betas"]) for g in opt.param_groups])
    return out


def _sched_save(root: str) -> dict:
    out = {}
    for name in SCHEDULERS:
        model, opt, sched = _build_tiny(name)
        lrs = _steps(model, opt, sched, 0, SAVE_AT)
        ckpt.save(Path(root) / name, model, opt, schedulers=[sched], extra=EXTRA)  # reads only
        out[name] = lrs + _steps(model, opt, sched, SAVE_AT, STEPS)  # the uninterrupted run
    return out


def _sched_resume(root: str) -> dict:
    out = {}
    for name in SCHEDULERS:
        model, opt, sched = _build_tiny(name, seed=1)
        extra = ckpt.load(Path(root) / name, model, opt, schedulers=[sched])
        out[name] = {"lrs": _steps(model, opt, sched, SAVE_AT, STEPS), "extra": extra}
    return out


def _resume_at_2(root: str) -> dict:
    """Saves at 2 ranks (schedulers, memory case) and resumes the stage-3 memory case."""
    return {"schedulers": _sched_save(root), "memory": _memory_save(root, load_stage=3)}


def _resume_at_1(root: str) -> dict:
    return {"schedulers": _sched_resume(root), "memory": _memory_load(root, stage=2)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """One launch per world size: save at 2 ranks, resume at 1, 2 (stage 3) and 3 ranks."""
    root = str(tmp_path_factory.mktemp("resume"))
    at_2 = run_ranks(_resume_at_2, 2, root, timeout=180)
    at_1 = run_ranks(_resume_at_1, 1, root, timeout=120)
    return {
        "uninterrupted": at_2[0]["schedulers"],
        "resumed": at_1[0]["schedulers"],
        "memory": {
            "ws 2->2, stage 2->3": [r["memory"] for r in at_2],
            "ws 2->1": [r["memory"] for r in at_1],
            "ws 2->3": run_ranks(_memory_load, 3, root, 2, timeout=180),
        },
    }


def test_every_scheduler_resumes_exactly_at_another_world_size(resumed):
    uninterrupted, resumed = resumed["uninterrupted"], resumed["resumed"]
    problems = []
    for name, lrs in uninterrupted.items():
        if len({lr for step in lrs[SAVE_AT:] for lr, _ in step[:1]}) < 2:
            problems.append(
                f"{name}: the LR never changes after the save; the test would not notice"
            )
        if resumed[name]["lrs"] != lrs[SAVE_AT:]:
            problems.append(
                f"{name}: after resuming {resumed[name]['lrs']}, uninterrupted {lrs[SAVE_AT:]}"
            )
        extra = resumed[name]["extra"]
        if extra != EXTRA or [type(v) for v in extra.values()] != [type(v) for v in EXTRA.values()]:
            problems.append(f"{name}: extra came back as {extra!r}")
    assert not problems, "\n".join(problems)
    assert list(resumed["MultiStepLR"]["extra"]["order"]) == [(1, "a")]


def _attempt(action, model, opt, sched) -> dict:
    before = snapshot(model, opt), (sched.state_dict() if sched is not None else None)
    try:
        action()
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = {"type": type(exc).__name__, "message": str(exc)}
    after = snapshot(model, opt), (sched.state_dict() if sched is not None else None)
    return {
        "error": error,
        "diff": differences(after[0], before[0]) + differences(after[1], before[1], "sched"),
    }


def _scheduler_refusals(root: Path) -> dict:
    model, opt, sched = _build_tiny("MultiStepLR")
    _steps(model, opt, sched, 0, SAVE_AT)
    ckpt.save(root / "multistep", model, opt, schedulers=[sched])
    ckpt.save(root / "none", model, opt)
    seq_model, seq_opt, seq = _build_tiny("SequentialLR")
    ckpt.save(root / "sequential", seq_model, seq_opt, schedulers=[seq])
    out = {}
    other_model, other_opt, cosine = _build_tiny("CosineAnnealingLR", seed=1)
    _steps(other_model, other_opt, cosine, 0, 2)
    out["other class"] = _attempt(
        lambda: ckpt.load(root / "multistep", other_model, other_opt, schedulers=[cosine]),
        other_model,
        other_opt,
        cosine,
    )
    out["checkpoint lacks it"] = _attempt(
        lambda: ckpt.load(root / "none", other_model, other_opt, schedulers=[cosine]),
        other_model,
        other_opt,
        cosine,
    )
    out["not given"] = _attempt(
        lambda: ckpt.load(root / "multistep", other_model, other_opt), other_model, other_opt, None
    )
    out["not a list"] = _attempt(
        lambda: ckpt.load(root / "multistep", other_model, other_opt, schedulers=cosine),
        other_model,
        other_opt,
        cosine,
    )
    nested = L.SequentialLR(
        other_opt,
        [L.LinearLR(other_opt, start_factor=0.1, total_iters=3), L.StepLR(other_opt, step_size=2)],
        milestones=[3],
    )
    out["other nested class"] = _attempt(
        lambda: ckpt.load(root / "sequential", other_model, other_opt, schedulers=[nested]),
        other_model,
        other_opt,
        nested,
    )
    out["extra"] = _attempt(
        lambda: ckpt.save(root / "bad", model, opt, extra={"run": {"obj": object()}}),
        model,
        opt,
        sched,
    )
    out["plain optimizer"] = _attempt(
        lambda: ckpt.load(root / "none", other_model, other_opt.optimizer),
        other_model,
        other_opt,
        None,
    )
    out["other model"] = _attempt(
        lambda: ckpt.load(root / "none", model, other_opt), other_model, other_opt, None
    )
    out["root"] = _attempt(
        lambda: ckpt.load(root, other_model, other_opt), other_model, other_opt, None
    )
    out["bad exists"] = (root / "bad").exists()
    return out


REFUSALS = {  # case: (exception type, words the message must hold)
    "other class": ("CheckpointError", ["scheduler 0", "MultiStepLR", "CosineAnnealingLR"]),
    "checkpoint lacks it": ("CheckpointError", ["0 LR scheduler", "got 1", "CosineAnnealingLR"]),
    "not given": ("CheckpointError", ["1 LR scheduler", "[MultiStepLR]", "got 0"]),
    "not a list": ("TypeError", ["schedulers=[scheduler]", "CosineAnnealingLR"]),
    "other nested class": ("CheckpointError", ["MultiStepLR", "StepLR"]),
    "extra": ("ValueError", ["extra['run']['obj']", "JSON"]),
    "plain optimizer": ("TypeError", ["ShardedOptimizer", "AdamW"]),
    "other model": ("ValueError", ["model", "sharded"]),
    "root": ("CheckpointError", ["latest("]),
}


def _refusals(root: str) -> dict:
    """Every refusal case of this module in one 2-rank launch, each in its own directory."""
    out = {}
    for part, fn in {
        "schedulers": _scheduler_refusals,
        "groups": _swapped_groups,
        "pretrained": _pretrained,
    }.items():
        directory = Path(root) / part
        if dist.get_rank() == 0:
            directory.mkdir()
        dist.barrier()
        out[part] = fn(directory)
    return out


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> list[dict]:
    return run_ranks(_refusals, 2, str(tmp_path_factory.mktemp("refused")), timeout=180)


def test_scheduler_and_argument_mistakes_are_refused_before_anything_changes(refused):
    problems = []
    for rank, result in enumerate(r["schedulers"] for r in refused):
        assert not result["bad exists"]
        for case, (kind, needles) in REFUSALS.items():
            error, diff = result[case]["error"], result[case]["diff"]
            if error is None:
                problems.append(f"rank {rank} {case}: accepted")
                continue
            if error["type"] != kind or not all(n in error["message"] for n in needles):
                got = f"{error['type']} {error['message']!r}"
                problems.append(f"rank {rank} {case}: {got}, expected {kind} {needles}")
            if diff:
                problems.append(f"rank {rank} {case}: changed {diff[:6]}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- 2. param groups


def _swapped_groups(root: Path) -> dict:
    model, opt, _ = _build_tiny("")
    _steps(model, opt, L.ConstantLR(opt), 0, 2)
    ckpt.save(root / "ckpt", model, opt)
    saved_dict = opt.state_dict()
    other, other_opt, _ = _build_tiny("", seed=1, swapped=True)
    out = {
        "checkpoint": _attempt(
            lambda: ckpt.load(root / "ckpt", other, other_opt), other, other_opt, None
        ),
        "state_dict": _attempt(
            lambda: other_opt.load_state_dict(saved_dict), other, other_opt, None
        ),
    }
    same, same_opt, _ = _build_tiny("", seed=1)
    ckpt.load(root / "ckpt", same, same_opt)  # the same grouping still loads
    out["same"] = [{k: v for k, v in g.items() if k != "params"} for g in same_opt.param_groups]
    out["saved"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def test_param_groups_in_another_order_are_refused_by_name(refused):
    for rank, result in enumerate(r["groups"] for r in refused):
        for case in ("checkpoint", "state_dict"):
            error = result[case]["error"]
            assert error is not None, f"rank {rank}: {case} with swapped groups was accepted"
            assert error["type"] in ("CheckpointError", "ValueError"), error
            for needle in ("param groups", "group 0: [", "group 1: ["):
                assert needle in error["message"], (
                    f"rank {rank} {case}: {needle!r} not in {error['message']!r}"
                )
            assert not result[case]["diff"], (
                f"rank {rank} {case}: changed {result[case]['diff'][:6]}"
            )
        assert (
            "'0.bias' is in group 0 here and in group 1 in the checkpoint"
            in result["checkpoint"]["error"]["message"]
        )
        assert result["same"] == result["saved"]


# ---------------------------------------------------------------- 3. memory after resharding

MEMORY_FIELDS = ("params", "grads", "master", "optimizer_state")


def _fields(opt) -> dict[str, int]:
    measured = zerolite.memory.footprint(opt)
    return {f: getattr(measured, f) for f in MEMORY_FIELDS}


def _memory_save(root: str, load_stage: int) -> dict:
    data = parity.batches(1, cfg=NO_DROPOUT)
    model, opt, _ = build(NO_DROPOUT, stage=2)
    train(model, opt, data)
    ckpt.save(Path(root) / "ws2-stage2", model, opt)
    return _memory_load(root, load_stage)


def _memory_load(root: str, stage: int) -> dict:
    data = parity.batches(1, cfg=NO_DROPOUT)
    fresh, fresh_opt, _ = build(NO_DROPOUT, stage=stage)
    train(fresh, fresh_opt, data)
    model, opt, _ = build(NO_DROPOUT, stage=stage, seed=1)
    ckpt.load(Path(root) / "ws2-stage2", model, opt)
    return {"fresh": _fields(fresh_opt), "loaded": _fields(opt)}


def test_loaded_optimizer_state_holds_a_fresh_shards_memory(resumed):
    problems = []
    for case, results in resumed["memory"].items():
        for rank, r in enumerate(results):
            if r["loaded"] != r["fresh"] or not r["fresh"]["optimizer_state"]:
                problems.append(
                    f"{case} rank {rank}: loaded {r['loaded']}, fresh shard {r['fresh']}"
                )
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- 4. load_pretrained and weight_map


def _write(
    directory: Path, files: dict[str, dict[str, torch.Tensor]], mapping: dict[str, str]
) -> None:
    directory.mkdir()
    for file, tensors in files.items():
        save_file(tensors, str(directory / file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": mapping}))


def _pretrained(root_dir: Path) -> dict:
    state = {
        k: v.contiguous()
        for k, v in parity.make_model(7).state_dict().items()
        if k != "head.weight"
    }
    names = sorted(state)  # ends with "wte.weight"
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    a_map = {n: "a.safetensors" for n in names}
    cases = {
        # The map puts wte.weight in a; b, read last, holds a stale copy (zeros).
        "stray copy": (
            {
                "a.safetensors": {k: state[k] for k in [*first, "wte.weight"]},
                "b.safetensors": {
                    **{k: state[k] for k in second},
                    "wte.weight": torch.zeros_like(state["wte.weight"]),
                },
            },
            {
                **{n: "b.safetensors" for n in second},
                **{n: "a.safetensors" for n in first},
                "wte.weight": "a.safetensors",
            },
        ),
        "missing from its file": ({"a.safetensors": {k: state[k] for k in names[1:]}}, a_map),
        "not in the map": (
            {"a.safetensors": state},
            {n: f for n, f in a_map.items() if n != names[0]},
        ),
    }
    model = parity.make_model()
    zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=2))
    before = zerolite.full_state_dict(model, rank0_only=False)
    if dist.get_rank() == 0:
        for case, (files, mapping) in cases.items():
            _write(root_dir / case.replace(" ", "_"), files, mapping)
        save_file(state, str(root_dir / "plain1.safetensors"))
        save_file(
            {"wte.weight": torch.zeros_like(state["wte.weight"])},
            str(root_dir / "plain2.safetensors"),
        )
        (root_dir / "no_map.index.json").write_text(json.dumps({"files": []}))
        (root_dir / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not safetensors")
    dist.barrier()
    attempts = {
        case: [root_dir / case.replace(" ", "_") / "model.safetensors.index.json"] for case in cases
    }
    attempts["two plain files"] = [root_dir / "plain1.safetensors", root_dir / "plain2.safetensors"]
    attempts["index without weight_map"] = [root_dir / "no_map.index.json"]
    attempts["not safetensors"] = [root_dir / "pytorch_model.bin"]
    attempts["no files"] = []
    out = {}
    for case, files_arg in attempts.items():
        try:
            load_pretrained(model, files_arg)
            out[case] = None
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            out[case] = f"{type(exc).__name__}: {exc}"
    out["changed"] = differences(zerolite.full_state_dict(model, rank0_only=False), before)
    return out


def test_load_pretrained_honours_the_weight_map(refused):
    expected = {
        "stray copy": ["'wte.weight'", "b.safetensors", "a.safetensors", "weight_map"],
        "missing from its file": ["'blocks.0.fc.bias'", "a.safetensors", "does not hold it"],
        "not in the map": ["'blocks.0.fc.bias'", "a.safetensors", "weight_map"],
        "two plain files": ["'wte.weight'", "plain1.safetensors", "plain2.safetensors"],
        "index without weight_map": ["no_map.index.json", "weight_map"],
        "not safetensors": ["pytorch_model.bin", "safetensors"],
        "no files": ["no files given"],
    }
    for rank, result in enumerate(r["pretrained"] for r in refused):
        for case, needles in expected.items():
            message = result[case]
            assert message is not None, f"rank {rank}: {case} was accepted"
            assert message.startswith("CheckpointError: "), f"rank {rank} {case}: {message}"
            for needle in needles:
                assert needle in message, f"rank {rank} {case}: {needle!r} not in {message!r}"
        assert not result["changed"], f"rank {rank}: a refused load changed {result['changed'][:6]}"
