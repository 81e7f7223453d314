"""The estimator, assert_footprint, track() and the estimate CLI (real gloo groups)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
from tests.support import parity
from zerolite.memory import STATE_BYTES_PER_PARAM, estimate, footprint, formula, track
from zerolite.optim import ELEMENTWISE_OPTIMIZERS
from zerolite.plan.optimizers import SUPPORTED, build_named
from zerolite.testing import FootprintMismatch, assert_footprint, run_ranks

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("params", "grads", "master", "optimizer_state")


class OddModel(nn.Module):
    """Odd sizes (nothing divides evenly), a frozen layer and a weight tied across modules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 7)
        self.blocks = nn.ModuleList([nn.Linear(7, 7), nn.Linear(7, 5), nn.Linear(5, 7)])
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(7, 13, bias=True)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = torch.tanh(block(x))
        x = x + self.frozen(x)
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1).float(), targets.flatten())


def _odd_batches(steps: int = 2):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 13, (8, 5), generator=g), torch.randint(0, 13, (8, 5), generator=g))
        for _ in range(steps)
    ]


def _estimate_matches_footprint() -> list[tuple]:
    """Every stage, fp32 and bf16, three optimizers, two models: estimate vs footprint."""
    n, rank = dist.get_world_size(), dist.get_rank()
    mismatches = []
    for model_name in ("gpt", "odd"):
        for stage in (1, 2, 3):
            for dtype in (torch.float32, torch.bfloat16):
                if model_name == "odd" and dtype != torch.float32:
                    continue  # the frozen layer stays fp32: bf16 activations would not mix with it
                for opt_name in ("AdamW", "SGD", "Adagrad"):
                    model = parity.make_model() if model_name == "gpt" else OddModel()
                    data = parity.batches(2) if model_name == "gpt" else _odd_batches()
                    opt = parity.OPTIMIZERS[opt_name](
                        [{"params": [p for p in model.parameters() if p.requires_grad]}]
                    )
                    config = zerolite.ZeroConfig(
                        stage=stage, param_dtype=dtype, bucket_size_mb=0.01
                    )
                    expected = estimate(
                        model, world_size=n, config=config, optimizer=opt, rank=rank
                    )
                    sharded = zerolite.shard(model, opt, config)
                    parity.train(model, sharded, data, sliced=True)
                    measured = footprint(sharded)
                    for field in FIELDS:
                        if getattr(measured, field) != getattr(expected, field):
                            mismatches.append((model_name, stage, str(dtype), opt_name, field,
                                               getattr(measured, field), getattr(expected, field)))
    return mismatches


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_estimate_is_byte_exact(world_size):
    for mismatches in run_ranks(_estimate_matches_footprint, world_size, timeout=240):
        assert mismatches == []


# Hyperparameters that change what an optimizer keeps, beyond its registry names.
_STATE_VARIANTS = {
    "Adam": [{"amsgrad": True}],
    "AdamW": [{"amsgrad": True}],
    "SGD": [{"momentum": 0.9, "nesterov": True}],
    "RMSprop": [{"momentum": 0.9}, {"centered": True}, {"momentum": 0.9, "centered": True}],
}


def _kept_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[int, int]:
    """(bytes per element, bytes of 0-dim scalars) of what ``opt`` keeps for ``p``."""
    state = [t for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    per_element = sum(t.element_size() for t in state if t.shape == p.shape)
    return per_element, sum(t.element_size() for t in state if t.dim() == 0)


@pytest.mark.parametrize("spec", SUPPORTED, ids=lambda spec: spec.cls.__name__)
def test_optimizer_registry_matches_what_torch_keeps(spec):
    """Each row's state bytes, and so `STATE_BYTES_PER_PARAM` of its names, are what
    torch's optimizer holds after a step."""
    assert spec.cls in ELEMENTWISE_OPTIMIZERS
    for hyper in [{}, *_STATE_VARIANTS.get(spec.cls.__name__, [])]:
        p = nn.Parameter(torch.zeros(5))
        opt = spec.cls([p], **{"lr": 0.1, **hyper})
        p.grad = torch.ones(5)
        opt.step()
        assert _kept_bytes(opt, p) == spec.state_bytes(opt.param_groups[0]), hyper
    for name in spec.names:
        p = nn.Parameter(torch.zeros(5))
        opt = build_named(name, [p])
        p.grad = torch.ones(5)
        opt.step()
        assert _kept_bytes(opt, p)[0] == STATE_BYTES_PER_PARAM[name], name


def test_zero_paper_example_formula_and_cli():
    expected = {0: "120", 1: "31.4", 2: "16.6", 3: "1.88"}
    for stage, gb in expected.items():
        got = formula(
            7_500_000_000, world_size=64, stage=stage, param_dtype=torch.bfloat16
        ).model_states
        assert f"{got / 1e9:.3g}" == gb
    out = subprocess.run(
        [sys.executable, "-m", "zerolite", "estimate", "--params", "7.5e9", "--world-size", "64"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    states = [line.split()[-2] for line in out.splitlines() if re.match(r"^[0-3] ", line)]
    assert states == list(expected.values()), out
    assert estimate(
        7_500_000_000,
        world_size=64,
        config=zerolite.ZeroConfig(stage=3, param_dtype=torch.bfloat16),
    ) == formula(7_500_000_000, world_size=64, stage=3, param_dtype=torch.bfloat16)


def _planted_leak() -> dict:
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=2))
    parity.train(model, opt, parity.batches(1), sliced=True)
    assert_footprint(opt)  # clean: passes
    piece = opt.param_groups[0]["params"][0]
    opt.state[piece]["leak"] = torch.zeros(1000)
    try:
        assert_footprint(opt)
    except FootprintMismatch as exc:
        return {"message": str(exc), "differences": exc.differences}
    return {"message": None}


def test_assert_footprint_names_a_planted_leak():
    result = run_ranks(_planted_leak, 2, timeout=60)[0]
    assert result["message"] is not None
    assert set(result["differences"]) == {"optimizer_state"}
    measured, expected = result["differences"]["optimizer_state"]
    assert measured - expected == 4000
    assert "optimizer_state" in result["message"] and "+4,000 B" in result["message"]


def _track_case(stage: int, plant: bool) -> dict:
    model = parity.make_model()
    opt = zerolite.shard(
        model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=stage)
    )
    planted: list[torch.Tensor] = []

    def allocate(_: torch.Tensor) -> None:
        if plant and not planted:
            planted.append(torch.ones(40_000_000 // 4))  # 40 MB, touched

    model.blocks[1].fc.weight.register_post_accumulate_grad_hook(allocate)
    x, y = (parity.local_slice(t) for t in parity.batches(1)[0])
    for _ in range(2):  # warm up allocator and the unit order
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        planted.clear()
    # RSS to the megabyte: without the live-tensor mode, whose own bookkeeping (an entry
    # and a weak reference per live storage) is process memory too, a few MB here.
    with track(opt, tensors=False) as tracker:
        model(x, y).backward()
        planted.clear()  # freed before the step
        opt.step()
        opt.zero_grad()
    sizes = [f.layout.padded_numel * f.data.element_size() for f in opt.flats]
    at_rest = footprint(opt).total  # model states + flag bookkeeping, nothing gathered
    return {
        "process": {k: v.process for k, v in tracker.peaks.items()},
        "forward_gathered": tracker.peaks["forward"].zerolite - at_rest,
        "bound": (opt.config.prefetch + 1) * max(sizes[:-1], default=0) + sizes[-1],
    }


def _track_cases() -> list[dict]:
    return [_track_case(2, False), _track_case(2, True), _track_case(3, False)]


def test_track_attributes_a_backward_allocation_to_backward_only():
    clean, planted, stage3 = run_ranks(_track_cases, 2, timeout=60)[0]
    growth = {
        phase: planted["process"][phase] - clean["process"][phase] for phase in clean["process"]
    }
    assert abs(growth["backward"] - 40_000_000) <= 1_000_000, growth
    assert abs(growth["forward"]) <= 1_000_000 and abs(growth["step"]) <= 1_000_000, growth
    # Stage 3: the gathered parameters seen in forward stay within the live-unit bound.
    assert 0 < stage3["forward_gathered"] <= stage3["bound"], stage3


def test_track_labels_follow_the_model_not_cuda_initialisation(monkeypatch):
    """A CPU model on a machine where CUDA is initialised (as on any GPU machine that ran
    a CUDA op): every phase measures and labels RSS growth, and the tracker touches none
    of CUDA's memory counters (it never resets the user's peaks)."""
    touched: list[str] = []
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: touched.append(_n) or 0)
    model = parity.make_model()
    opt = parity.make_optimizer("AdamW", model)
    with track() as tracker:
        with monkeypatch.context() as cuda_machine:
            cuda_machine.setattr(torch.cuda, "is_available", lambda: True)
            cuda_machine.setattr(torch.cuda, "is_initialized", lambda: True)
            opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))
        x, y = parity.batches(1)[0]
        model(x, y).backward()
        opt.step()
    assert touched == [], touched
    assert {phase: p.kind for phase, p in tracker.peaks.items()} == dict.fromkeys(
        tracker.peaks, "RSS growth"
    )
    text = str(tracker)
    assert "CUDA" not in text and text.count("RSS growth") == len(tracker.peaks), text
    assert tracker.peaks["build"].process >= 0 and tracker.peaks["backward"].zerolite > 0


def test_example_footprint_test_file_passes():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(ROOT / "examples" / "test_memory_footprint.py")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
