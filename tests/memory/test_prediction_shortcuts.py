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
from torch._subclasses.fake_tensor import FakeTensorMode

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
