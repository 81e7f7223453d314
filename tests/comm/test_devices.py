"""Where buffers and small collectives live, and what a process group can carry (CPU side).

`zerolite.comm.devices` decides from the group's device -> backend map, never from its name:

- torch 2.13's own strings, read from real groups: ``"gloo"``, a backend-less
  ``init_process_group()`` (``"undefined"``; ``"cpu:gloo"`` here, ``"cuda:nccl"`` on a GPU
  machine) and a CUDA-only group (``"cuda:gloo"``, which refuses CPU tensors as NCCL does);
- a backend-less group trains as a gloo group does, bit for bit (point-to-point exchanges,
  small collectives on the CPU), and a meta model materialises on its CPU;
- a CPU model with a group that carries no CPU tensors is refused at ``shard()`` with
  zerolite's message, on every rank, instead of failing deep inside torch;
- the decisions for CUDA groups (NCCL, ``cpu:gloo,cuda:nccl``) as pure functions: what
  only a GPU can run is in ``tests/gpu/test_cuda.py``;
- ``run_ranks(backend="nccl")`` without a GPU per rank is refused in the caller.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.support import parity
from zerolite.comm.collectives import Group
from zerolite.comm.devices import (
    backends_of,
    buffer_device,
    check_buffer_device,
    communication_device,
    meta_device,
    parse_backend_config,
)
from zerolite.testing import run_ranks

CUDA1 = torch.device("cuda", 1)
CPU = torch.device("cpu")


def test_backend_strings_parse_to_device_maps():
    assert parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend_config("cuda:nccl") == {"cuda": "nccl"}
    assert parse_backend_config("CPU:Gloo") == {"cpu": "gloo"}
    # A bare name (older torch): the device types torch gives that backend.
    assert parse_backend_config("nccl") == {"cuda": "nccl"}
    assert parse_backend_config("gloo") == {"cpu": "gloo", "cuda": "gloo"}


def test_communication_device_follows_the_buffers_backend():
    mixed = {"cpu": "gloo", "cuda": "nccl"}
    assert communication_device(CUDA1, mixed) == CUDA1  # NCCL: the buffers' own device
    assert communication_device(CUDA1, {"cuda": "nccl"}) == CUDA1
    assert communication_device(CPU, mixed) == CPU
    # gloo carries CUDA tensors slowly: small collectives stay on the CPU, as before.
    assert communication_device(CUDA1, {"cpu": "gloo", "cuda": "gloo"}) == CPU
    assert communication_device(CPU, {}) == CPU  # no process group


def test_meta_models_go_where_the_group_computes():
    # A backend-less init on a GPU machine reports "cuda:nccl"; older torch and explicit
    # specs give "cpu:gloo,cuda:nccl". Both must build on the GPU, not silently on the CPU.
    assert meta_device({"cuda": "nccl"}, CUDA1) == CUDA1
    assert meta_device({"cpu": "gloo", "cuda": "nccl"}, CUDA1) == CUDA1
    assert meta_device({"cpu": "gloo"}, None) == CPU
    assert meta_device({"cpu": "gloo", "cuda": "gloo"}, None) == CPU
    assert meta_device({}, None) == CPU
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    assert buffer_device(meta.parameters(), torch.device("cpu"), None) == CPU
    assert buffer_device(torch.nn.Linear(2, 2).parameters(), None, None) == CPU
    assert buffer_device([], None, None) == CPU


def test_devices_the_group_cannot_carry_are_refused_by_name():
    with pytest.raises(ValueError, match=r"live on cpu.*\(cuda:nccl\) carries only cuda"):
        check_buffer_device(CPU, {"cuda": "nccl"}, "auto")
    with pytest.raises(ValueError, match="collectives='point_to_point' is refused over NCCL"):
        check_buffer_device(CUDA1, {"cpu": "gloo", "cuda": "nccl"}, "point_to_point")
    check_buffer_device(CUDA1, {"cuda": "nccl"}, "native")
    check_buffer_device(CUDA1, {"cuda": "nccl"}, "auto")
    check_buffer_device(CPU, {"cpu": "gloo", "cuda": "nccl"}, "point_to_point")
    check_buffer_device(CPU, {}, "point_to_point")  # a group of one


def _group_facts() -> dict:
    group = Group()
    return {
        "backend": str(dist.get_backend()),
        "config": dist.get_backend_config(),
        "map": backends_of(None),
        "point_to_point": group.point_to_point,
        "device": str(group.device),
        "bounded": group.bounded_waits,
    }


def _train(config: zerolite.ZeroConfig) -> dict[str, torch.Tensor]:
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    for x, y in parity.batches(2):
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    return zerolite.full_state_dict(model, rank0_only=False)


def _backendless_rank() -> dict:
    out = _group_facts()
    out["trained"] = _train(zerolite.ZeroConfig(stage=2))
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    zerolite.shard(meta, torch.optim.AdamW(meta.parameters()), zerolite.ZeroConfig(stage=3))
    out["meta_device"] = str(next(meta.parameters()).device)
    return out


def _gloo_rank() -> dict:
    return {**_group_facts(), "trained": _train(zerolite.ZeroConfig(stage=2))}


def test_a_backendless_group_is_a_gloo_group():
    backendless = run_ranks(_backendless_rank, 2, backend=None, timeout=120)
    gloo = run_ranks(_gloo_rank, 2, timeout=120)
    for rank, (b, g) in enumerate(zip(backendless, gloo)):
        assert (b["backend"], b["config"], b["map"]) == ("undefined", "cpu:gloo", {"cpu": "gloo"})
        assert (g["backend"], g["config"]) == ("gloo", "cpu:gloo,cuda:gloo")
        for facts in (b, g):
            assert (facts["point_to_point"], facts["device"], facts["bounded"]) == (
                True, "cpu", True
            ), (rank, facts)
        assert b["meta_device"] == "cpu"  # no CUDA backend here
        assert b["trained"].keys() == g["trained"].keys()
        assert all(torch.equal(b["trained"][k], g["trained"][k]) for k in g["trained"]), rank


def _cpu_model_on_cuda_only_group() -> str:
    assert backends_of(None) == {"cuda": "gloo"}  # carries CUDA tensors only, like NCCL
    model = parity.make_model()
    try:
        zerolite.shard(model, parity.make_optimizer("AdamW", model))
    except ValueError as exc:
        return str(exc)
    return "not refused"


def test_a_cpu_model_with_a_group_for_cuda_tensors_is_refused_at_shard():
    for message in run_ranks(_cpu_model_on_cuda_only_group, 2, backend="cuda:gloo", timeout=60):
        assert "flat buffers would live on cpu" in message, message
        assert "(cuda:gloo) carries only cuda tensors" in message, message
        assert "model.to(f'cuda:{local_rank}')" in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_run_ranks_refuses_nccl_without_a_gpu_per_rank():
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        with pytest.raises(ValueError, match=r"each rank runs on its own GPU.*has 0"):
            run_ranks(_group_facts, 2, backend=backend)
