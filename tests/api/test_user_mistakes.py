"""Small mistakes get zerolite's own error, before anything changes, or the right answer.

- ``checkpoint.save()`` with a plain torch optimizer, with another model's sharded optimizer,
  or with a different path on each rank (refused at once, not after ``timeout_s``);
- a checkpoint named ``latest``, or a ``latest`` directory in the root (refused before the
  save, not after its commit);
- an ``object()`` in a param group (no false ``RankMismatchError`` from its repr's address);
- ``zerolite inspect`` of a hybrid checkpoint names its replica groups;
- ``zerolite estimate --offload-fraction`` without ``--offload`` (refused, not ignored);
- a hand-edited, re-sealed index whose hyperparameter has the wrong kind (``betas: "oops"``)
  is refused at load, naming the key, with the optimizer unchanged;
- ``shard()`` of a model whose trained parameters have mixed dtypes (a bf16 layer in an fp32
  model), or are float64, without an explicit ``param_dtype`` is refused on every rank with
  the model untouched (nothing is cast to fp32 silently); with ``param_dtype`` set, the cast
  is what was asked for and happens; one dtype shared by every trained parameter is kept.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerolite
from tests.api.test_cli import COUNT, _assert_one_line, _main
from zerolite import checkpoint as ckpt
from zerolite.checkpoint import CheckpointError
from zerolite.checkpoint.format import INDEX, INDEX_DIGEST, index_digest_text
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _trained(stage: int = 2, **config):
    model = _model()
    opt = zerolite.shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), zerolite.ZeroConfig(stage=stage,
                                                                                   **config)
    )
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save_refusals(root: Path) -> None:
    model, opt = _trained()
    other, other_opt = _trained()
    with pytest.raises(TypeError, match=r"^zerolite.checkpoint.save\(\) needs the "
                       r"ShardedOptimizer that zerolite.shard\(\) returned, got AdamW"):
        ckpt.save(root / "plain", model, torch.optim.AdamW(_model().parameters()))
    with pytest.raises(ValueError, match=r"^zerolite.checkpoint.save\(\): model is not the "
                       r"model this optimizer was sharded with"):
        ckpt.save(root / "mixed", other, opt)
    with pytest.raises(ValueError, match=r"'latest' is the name of the pointer file"):
        ckpt.save(root / "latest", model, opt)
    if dist.get_rank() == 0:
        (root / "in_the_way" / "latest").mkdir(parents=True)
    dist.barrier()
    with pytest.raises(ValueError, match=r"in_the_way/latest exists and is not a file"):
        ckpt.save(root / "in_the_way" / "step1", model, opt)
    dist.barrier()
    assert sorted(p.name for p in root.iterdir()) == ["in_the_way"]  # nothing written
    assert [p.name for p in (root / "in_the_way").iterdir()] == ["latest"]
    ckpt.save(root / "good", other, other_opt)  # the right pair still saves
    assert ckpt.latest(root) == root / "good"


def _different_paths(root: Path) -> None:
    """Each rank its own path, blocking and not: refused at the call on every rank (an
    asynchronous save used to wait timeout_s, 600 s here, for the others' files)."""
    model, opt = _trained()
    rank = dist.get_rank()
    for blocking in (True, False):
        mine = root / f"rank{rank}-{blocking}"
        with pytest.raises(ValueError, match=r"the ranks passed different paths \(rank 0: "
                           r".*rank0-.*, rank 1: .*rank1-"):
            ckpt.save(mine, model, opt, blocking=blocking)
        assert not mine.exists()


def _object_in_group() -> str:
    """Equal objects whose repr differs between processes: the ranks agree."""
    model = _model()
    # The ranks' histories differ, as a real job's do: the object lands at another address.
    history = [object() for _ in range(1 + 997 * dist.get_rank())]
    tag = object()
    opt = torch.optim.AdamW([{"params": model.parameters(), "tag": tag}])
    opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return f"{tag!r} {len(history)}"


def _edited_hyperparameters(root: Path) -> list[str]:
    """betas "oops" (a str for a pair), lr [1, 2] (a list for a number), amsgrad 1 (a number
    for a bool): each re-sealed, each refused naming it, the optimizer unchanged."""
    model, opt = _trained()
    ckpt.save(root / "base", model, opt)
    errors = []
    for key, value in (("betas", "oops"), ("lr", [1, 2]), ("amsgrad", 1)):
        d = root / f"edited-{key}"
        if dist.get_rank() == 0:
            shutil.copytree(root / "base", d)
            index = json.loads((d / INDEX).read_text())
            index["optimizer"]["param_groups"][0][key] = value
            data = json.dumps(index, indent=1).encode()
            (d / INDEX).write_bytes(data)
            (d / INDEX_DIGEST).write_text(index_digest_text(data))  # re-sealed
        dist.barrier()
        before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        named = re.escape(f"param group 0's '{key}' is {value!r}")
        with pytest.raises(CheckpointError, match=named) as e:
            ckpt.load(d, model, opt)
        assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == before
        errors.append(str(e.value))
    assert ckpt.load(root / "base", model, opt) is None  # the sealed original loads
    return errors


def _dtype_refusals() -> list[str]:
    errors = []
    for convert, needle in (
        (lambda m: m[0].to(torch.bfloat16), r"mixed dtypes \('0.weight' is torch.bfloat16, "
                                            r"'1.weight' is torch.float32"),
        (lambda m: m.double(), r"parameters are torch.float64 \('0.weight' is torch.float64"),
    ):
        model = _model()
        convert(model)
        before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=needle) as e:
            zerolite.shard(model, torch.optim.AdamW(model.parameters()))
        assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == before
        assert state_of(model) is None  # shardable again
        errors.append(str(e.value))
        zerolite.shard(  # asked for: cast
            model, torch.optim.AdamW(model.parameters()),
            zerolite.ZeroConfig(param_dtype=torch.float32),
        )
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    uniform = _model().to(torch.bfloat16)  # one dtype: sharded in it (tests/api/test_own_dtype.py)
    zerolite.shard(uniform, torch.optim.AdamW(uniform.parameters()))
    assert {p.dtype for p in uniform.parameters()} == {torch.bfloat16}
    return errors


def _hybrid_inspect(root: Path) -> dict:
    model, opt = _trained(shard_group_size=1)
    ckpt.save(root / "hybrid", model, opt)
    return ckpt.inspect(root / "hybrid")


def _cases(root: str) -> dict:
    root = Path(root) / "ranks"
    if dist.get_rank() == 0:
        (root / "save").mkdir(parents=True)
    dist.barrier()
    _save_refusals(root / "save")
    _different_paths(root)
    return {
        "object": _object_in_group(),
        "dtypes": _dtype_refusals(),
        "edited": _edited_hyperparameters(root),
        "hybrid": _hybrid_inspect(root),
    }


def test_small_mistakes_get_clear_errors(tmp_path):
    results = run_ranks(_cases, 2, str(tmp_path), timeout=180)
    for result in results:
        assert all("this optimizer holds" in e for e in result["edited"]), result["edited"]
        assert result["hybrid"]["replicas"] == 2 and result["hybrid"]["world_size"] == 1
    reprs = {result["object"].split()[-2] for result in results}
    assert len(reprs) == 2, reprs  # the ranks' objects had different addresses: they agreed


def test_inspect_names_replicas_of_a_flat_checkpoint(tmp_path):
    model, opt = _trained()
    ckpt.save(tmp_path / "flat", model, opt)
    assert ckpt.inspect(tmp_path / "flat")["replicas"] == 1


def test_estimate_offload_fraction_needs_offload(capsys):
    _assert_one_line(_main(capsys, "estimate", *COUNT, "--offload-fraction", "0.5"),
                     "estimate", "--offload-fraction 0.5 needs --offload")
    code, out, _ = _main(capsys, "estimate", *COUNT, "--offload", "host",
                         "--offload-fraction", "0.5")
    assert code == 0 and "0.5 of each rank's optimizer state offloaded" in out
