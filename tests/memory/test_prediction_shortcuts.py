"""[Note: dispatch cost] in `zerolite.memory.fake_step`: a prediction made with the fake
mode's shortcuts (``prim.device`` answered first, the dispatch cache keyed by one tuple per
fake tensor) against the same prediction dispatched as the plain fake mode does, computed
in the same run, each from an empty dispatch cache: equal field for field, on the example
GPT, transformers' GPT-2 and Llama, through every stage, both dtypes, checkpointing,
accumulation, the offload tiers and parameters on a tier.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import zerolite
from tests.support.peak_cases import MODELS
from zerolite.memory import fake_step, predict_peak

CASES = [
    ("gpt", dict(stage=1, param_dtype=torch.float32), dict(accumulation=4)),
    ("gpt2", dict(stage=2, param_dtype=torch.bfloat16, offload="disk", offload_fraction=0.5),
     dict(accumulation=2)),
    ("llama", dict(stage=3, param_dtype=torch.bfloat16),
     dict(accumulation=4, activation_checkpointing=True)),
    ("llama", dict(stage=2, param_dtype=torch.float32, offload="host"), dict(accumulation=1)),
    ("gpt", dict(stage=3, param_dtype=torch.bfloat16, offload_params="disk"),
     dict(accumulation=2)),
]


def _predict(name: str, config: dict, kwargs: dict, shortcuts: bool, tmp_path,
             monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(fake_step, "SHORTCUTS", shortcuts)
    FakeTensorMode.cache_clear()  # each run fills the cache with its own keys
    if "disk" in (config.get("offload"), config.get("offload_params")):
        config = dict(config, offload_dir=str(tmp_path))
    model_fn, batch_fn = MODELS[name]
    p = predict_peak(model_fn, batch_fn, zerolite.ZeroConfig(**config), 2, micro_batch=2,
                     **kwargs)
    return dataclasses.replace(p, seconds=0.0)


@pytest.mark.parametrize("name,config,kwargs", CASES, ids=[
    f"{n}-stage{c['stage']}-{c.get('offload')}-{c.get('offload_params')}" for n, c, _ in CASES])
def test_shortcuts_predict_what_the_plain_fake_mode_does(name, config, kwargs, tmp_path,
                                                         monkeypatch):
    plain = _predict(name, config, kwargs, False, tmp_path, monkeypatch)
    fast = _predict(name, config, kwargs, True, tmp_path, monkeypatch)
    assert fast == plain
    assert plain.peak > 0 and plain.by_phase.keys() == {"forward", "backward", "step"}


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_cache_hit_s_tensor_is_the_one_torch_s_constructor_makes(device):
    """`_FakeFields.made` against ``FakeTensor(mode, elem, device)``, the same run: the
    same Python fields (its mode among them), dispatch keys, device and flags (a CUDA
    device is faked)."""
    mode = fake_step._LedgerMode(fake_step.StorageLedger("cpu"))
    assert mode._fields is not None  # else every prediction takes torch's constructor
    for requires_grad in (False, True):
        elem = torch.empty(3, 4, device="meta", requires_grad=requires_grad)
        made = mode._fields.made(elem, torch.device(device))
        torch_s = FakeTensor(mode, elem, torch.device(device))
        assert type(made) is FakeTensor and made.__dict__ == torch_s.__dict__
        assert torch._C._dispatch_keys(made) == torch._C._dispatch_keys(torch_s)
        assert (made.device, made.requires_grad, made.shape) == (
            torch_s.device, torch_s.requires_grad, torch_s.shape)
