"""``zerolite plan``'s pick feeds straight back in: the ``config`` of its ``--json`` output
is ``ZeroConfig(**config)`` unchanged (dtypes by name) and `shard()` trains with it on a
real gloo group; the ``ZEROLITE_*`` lines it prints for ``accelerate launch`` make the same
config through the variables' parsers. The command runs as a real process (``python -m
zerolite``), its output read as a script would read it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

import zerolite
from tests.support.peak_cases import MODELS
from zerolite.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
# One combination (its search stays short) that has a value of every kind the lines write:
# a dtype, a choice, a path (with a space: it must be quoted), a float, an int.
SEARCH = ["--model", "tests.support.peak_cases:gpt",
          "--inputs", "tests.support.peak_cases:gpt_batch", "--world-size", "2",
          "--batch", "4", "--stages", "2", "--param-dtypes", "bf16",
          "--offload", "disk", "--offload-fractions", "0.5", "--checkpointing", "off",
          "--memory", "1GiB"]


def _plan(*extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("ZEROLITE_")}
    done = subprocess.run([sys.executable, "-m", "zerolite", "plan", *SEARCH, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _train_with(config: dict) -> dict:
    model_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    model = model_fn()
    opt = zerolite.shard(model, torch.optim.AdamW(model.parameters()),
                         zerolite.ZeroConfig(**config))
    model(**batch_fn(2)).backward()
    opt.step()
    return {"dtypes": {str(p.dtype) for p in model.parameters()},
            "offloaded": opt.shard_state.offload is not None
            and opt.shard_state.offload.arena.nbytes > 0,
            "dir": os.path.isdir(config["offload_dir"])}


def test_plan_json_config_builds_the_config_and_shards(tmp_path):
    where = tmp_path / "offload here" / "state"  # missing: shard() creates it
    where.parent.mkdir()
    entries = json.loads(_plan("--offload-dir", str(where), "--json"))
    config = entries[0]["config"]
    assert entries[0]["fits"] and config["param_dtype"] == "bfloat16", entries[0]
    built = zerolite.ZeroConfig(**config)
    assert (built.stage, built.param_dtype, built.offload, built.offload_fraction) == (
        2, torch.bfloat16, "disk", 0.5)
    assert not where.exists()  # building the config creates nothing
    for rank in run_ranks(_train_with, 2, config):
        assert rank == {"dtypes": {"torch.bfloat16"}, "offloaded": True, "dir": True}, rank


def test_plan_prints_the_variables_that_make_the_same_config(tmp_path, monkeypatch):
    where = tmp_path / "a dir; with $pace"
    out = _plan("--offload-dir", str(where)).splitlines()
    json_config = json.loads(_plan("--offload-dir", str(where), "--json"))[0]["config"]
    lines = out[out.index("or, for accelerate launch, in its environment:") + 1:]
    assert lines and all(line.startswith("ZEROLITE_") for line in lines), out
    for var in list(os.environ):
        if var.startswith("ZEROLITE_"):
            monkeypatch.delenv(var)
    for line in lines:
        (assignment,) = shlex.split(line)  # as a POSIX shell reads it
        name, value = assignment.split("=", 1)
        monkeypatch.setenv(name, value)
    from_env = zerolite.ZeroConfig()
    assert from_env == zerolite.ZeroConfig(**json_config)
    assert from_env.offload_dir == str(where) and from_env.param_dtype is torch.bfloat16
    assert all(from_env.is_set(field) for field in json_config)
