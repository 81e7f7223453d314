"""Hybrid sharding's checkpoints and bad input, 4 gloo ranks as 2 "nodes" x 2 (k = 2).

- hybrid 2x2 -> flat 4 -> 1 rank -> hybrid 2x2, each loading the previous save and saving
  again: masters and optimizer state are bitwise equal in all four, and a hybrid save has
  k files (the first replica group writes).
- Bad input: k = 3 (does not divide 4), k = 8 (> 4), a 1-D and a 3-D mesh, each a
  ValueError naming the value; a rank with another k raises on every rank (the divergence
  guard); ``"node"`` takes k from ``LOCAL_WORLD_SIZE``.
- A model built on the meta device shards at stage 3 with k = 2 into bitwise the normal
  build's parameters, before and after a step.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh

import zerolite
from tests.comm.test_hybrid import TIMEOUT, K, N, R, _hybrid, _train_steps
from tests.stage3.test_meta_init import _build as build_plain_gpt
from tests.support import parity
from tests.support.rank_reports import SMALL_BUCKETS_MB, guarded
from zerolite import ZeroConfig, checkpoint
from zerolite.errors import RankMismatchError
from zerolite.testing import run_ranks


def _checkpoint_rank(root: str) -> dict:
    report = {}
    root_path = Path(root)
    rank = dist.get_rank()
    # hybrid 2x2 -> flat 4 -> 1 rank -> hybrid 2x2
    model, opt = _hybrid(2)
    _train_steps(model, opt)
    checkpoint.save(root_path / "a-hybrid", model, opt)
    report["a_files"] = sorted(p.name for p in (root_path / "a-hybrid").glob("*.safetensors"))
    model, opt = _hybrid(3, k=None)
    checkpoint.load(root_path / "a-hybrid", model, opt)
    checkpoint.save(root_path / "b-flat", model, opt)
    solo = dist.new_group([0])
    if rank == 0:
        model, opt = _hybrid(1, process_group=solo, k=None)
        checkpoint.load(root_path / "b-flat", model, opt)
        checkpoint.save(root_path / "c-one", model, opt)
    dist.barrier()
    model, opt = _hybrid(1)
    checkpoint.load(root_path / "c-one", model, opt)
    checkpoint.save(root_path / "d-hybrid", model, opt)
    _train_steps(model, opt, 1)  # and it trains on
    report["errors"] = _bad_inputs()
    report["meta_equal"] = _meta_equals_normal()
    return report


def _meta_equals_normal() -> list[bool]:
    """Per moment (built, after a step): the meta build's full parameters equal the normal
    build's."""
    config = ZeroConfig(stage=3, bucket_size_mb=SMALL_BUCKETS_MB, shard_group_size=K)
    fulls: list[list[dict]] = []
    for meta in (False, True):
        model = build_plain_gpt(meta)
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
        fulls.append([zerolite.full_state_dict(model, rank0_only=False)])
        _train_steps(model, opt, 1)
        fulls[-1].append(zerolite.full_state_dict(model, rank0_only=False))
    return [all(torch.equal(a[n], b[n]) for n in a) for a, b in zip(*fulls)]


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _bad_inputs() -> dict:
    rank = dist.get_rank()
    out = {
        "k=3": _raises(lambda: _hybrid(2, k=3)),
        "k=8": _raises(lambda: _hybrid(2, k=8)),
        # Every rank builds a 1-D mesh (collective), the config refuses it.
        "mesh 1-D": _raises(lambda: ZeroConfig(process_group=init_device_mesh("cpu", (N,)))),
        "mesh 3-D": _raises(
            lambda: ZeroConfig(process_group=init_device_mesh("cpu", (1, R, K)))),
        "rank 3 flat": _raises(lambda: _hybrid(2, k=None if rank == 3 else K)),
    }
    os.environ["LOCAL_WORLD_SIZE"] = str(K)
    model, opt = _hybrid(2, k="node")
    out["node"] = (opt.group.size, opt.group.replicas.size)
    return out


def _saved_state(path: Path) -> dict[str, torch.Tensor]:
    """Every master and optimizer-state tensor of a checkpoint, whole, by key and name."""
    pieces: dict[str, list] = defaultdict(list)
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.startswith(("master/", "state/")):
                    head, span = key.rsplit("/", 1)
                    start = int(span.split("-")[0])
                    pieces[head].append((start, f.get_tensor(key)))
    out = {}
    for head, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        if parts[0][1].dim() == 0:  # a scalar per piece (Adam's step): equal in every piece
            assert all(torch.equal(p[1], parts[0][1]) for p in parts), head
            out[head] = parts[0][1]
        else:
            out[head] = torch.cat([p[1] for p in parts])
    return out


def test_checkpoint_topology_round_trip_and_bad_input(tmp_path):
    reports = run_ranks(guarded, N, _checkpoint_rank, str(tmp_path), timeout=TIMEOUT)
    for r, rep in enumerate(reports):
        assert "error" not in rep, f"rank {r}: {rep['error']}"
    assert reports[0]["a_files"] == [f"rank-{i:05d}-of-{K:05d}.safetensors" for i in range(K)]
    saved = {name: _saved_state(tmp_path / name)
             for name in ("a-hybrid", "b-flat", "c-one", "d-hybrid")}
    a = saved["a-hybrid"]
    assert any(k.startswith("state/exp_avg/") for k in a) and len(a) > 10
    for name, state in saved.items():
        assert state.keys() == a.keys(), name
        for key, tensor in state.items():
            assert torch.equal(tensor, a[key]), (name, key)
    # Bad input: every rank raises, naming the value.
    for r, rep in enumerate(reports):
        errors = rep["errors"]
        assert errors["k=3"].startswith("ValueError") and "got 3" in errors["k=3"], errors
        assert "does not divide the world size 4" in errors["k=3"], errors
        assert errors["k=8"].startswith("ValueError") and "got 8" in errors["k=8"], errors
        assert "larger than the world size 4" in errors["k=8"], errors
        assert errors["mesh 1-D"].startswith("ValueError") and "1 dimension" in errors["mesh 1-D"]
        assert errors["mesh 3-D"].startswith("ValueError") and "3 dimension" in errors["mesh 3-D"]
        # Another k on one rank: a RankMismatchError on every rank (the divergence guard).
        assert errors["rank 3 flat"].startswith(RankMismatchError.__name__), errors
        assert "shard_group_size" in errors["rank 3 flat"], errors
        assert errors["node"] == (K, R)
        assert rep["meta_equal"] == [True, True], rep["meta_equal"]
