"""load_pretrained: plain safetensors files straight into shards, any stage."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zerolite
from examples.gpt import GPT
from tests.support import parity
from zerolite.checkpoint import CheckpointError, load_pretrained
from zerolite.testing import run_ranks


def _write_pretrained(directory: str) -> None:
    """A 'pretrained' GPT (seed 7), saved as two files plus an index, head alias dropped."""
    torch.manual_seed(7)
    state = {
        k: v.contiguous() for k, v in GPT(parity.TINY).state_dict().items() if k != "head.weight"
    }
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, f"{directory}/model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in names[half:]}, f"{directory}/model-00002-of-00002.safetensors")
    weight_map = {
        k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)
    }
    with open(f"{directory}/model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": weight_map}, f)


def _case(directory: str) -> dict:
    x, _ = parity.batches(1)[0]
    torch.manual_seed(7)
    reference = GPT(parity.TINY).eval()
    expected = reference(x)
    out = {}
    for stage in (1, 2, 3):
        model = parity.make_model().eval()  # different initial weights (seed 0)
        zerolite.shard(
            model,
            parity.make_optimizer("AdamW", model),
            zerolite.ZeroConfig(stage=stage, bucket_size_mb=0.01),
        )
        model(x)  # a forward with grad and no backward: stage 3 keeps the root unit gathered
        load_pretrained(model, f"{directory}/model.safetensors.index.json")
        with torch.no_grad():
            out[stage] = bool(torch.equal(model(x), expected))
    # Bad input: a name the model lacks, and a shape that differs; nothing changes,
    # every rank raises.
    model = parity.make_model()
    zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    before = zerolite.full_state_dict(model, rank0_only=False)
    if dist.get_rank() == 0:
        save_file(
            {"wte.weight": torch.zeros(64, 32), "extra.bias": torch.zeros(3)},
            f"{directory}/bad_name.safetensors",
        )
        save_file({"wte.weight": torch.zeros(65, 32)}, f"{directory}/bad_shape.safetensors")
    dist.barrier()
    messages = []
    for name in ("bad_name", "bad_shape"):
        with pytest.raises(CheckpointError) as info:
            load_pretrained(model, f"{directory}/{name}.safetensors", strict=name == "bad_name")
        messages.append(str(info.value))
    after = zerolite.full_state_dict(model, rank0_only=False)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["messages"] = messages
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_load_pretrained_into_every_stage(tmp_path, world_size):
    _write_pretrained(str(tmp_path))
    for r in run_ranks(_case, world_size, str(tmp_path), timeout=120):
        assert r[1] and r[2] and r[3], r
        assert r["unchanged"]
        assert "not in the model" in r["messages"][0] or "not in the files" in r["messages"][0]
        assert "'wte.weight': shape [65, 32]" in r["messages"][1]
