"""The ``zerolite`` command's errors: every mistake a user can make on the command line --
a bad value, a path that is not a checkpoint, an output that cannot or must not be
written -- ends with exit code 2 and exactly one line on stderr that names the path or
value, and nothing is written.

Most cases call `zerolite.cli.main` in this process (the same parse, run and error
handling as the console script, without paying for a torch import per case); a few run
``python -m zerolite`` and the ``zerolite`` console script as real processes.
The checkpoints are real: saved by `zerolite.checkpoint.save` in a one-rank gloo group.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zerolite
import zerolite.cli
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.plan.optimizers import NAMED
from zerolite.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
COUNT = ("--params", "1e9", "--world-size", "2")


def _save(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = zerolite.shard(model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(stage=2))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ckpt.save(path, model, opt)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """``root/ckpt`` (a checkpoint; ``root/latest`` points at it), an Accelerate project
    laid out as `ZeroAccelerator.save_state` writes it (``checkpoints/checkpoint_N/zerolite_i``),
    an empty folder, an unrelated folder, a plain file and a would-be output folder."""
    root = tmp_path_factory.mktemp("cli")
    state = run_ranks(_save, 1, str(root / "ckpt"), timeout=120)[0]
    torch.save(state, root / "state.pt")
    for n in (9, 10):  # the newest is found by number, not by name
        shutil.copytree(root / "ckpt", root / f"proj/checkpoints/checkpoint_{n}/zerolite_0")
    (root / "empty").mkdir()
    (root / "other").mkdir()
    (root / "other/README.md").write_text("some other folder")
    (root / "notes.txt").write_text("not a checkpoint")
    (root / "outdir").mkdir()
    return root


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``zerolite ARGV`` run in this process."""
    capsys.readouterr()
    try:
        code = zerolite.cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse exits while parsing
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line(result: tuple[int, str, str], command: str, *needles: str) -> str:
    code, out, err = result
    assert (code, out) == (2, ""), result
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"zerolite {command}: error: "), err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    return err


def _listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1)
                  for p in root.rglob("*"))


# ---------------------------------------------------------------- consolidate: the output


def test_consolidate_output_is_a_directory_or_missing_or_unwritable(tree, capsys):
    before = _listing(tree)
    _assert_one_line(_main(capsys, "consolidate", tree / "ckpt", tree / "outdir"),
                     "consolidate", tree / "outdir", "is a directory")
    missing = tree / "nosuchdir" / "model.safetensors"
    _assert_one_line(_main(capsys, "consolidate", tree / "ckpt", missing),
                     "consolidate", tree / "nosuchdir", "does not exist")
    under_file = tree / "notes.txt" / "model.safetensors"
    _assert_one_line(_main(capsys, "consolidate", tree / "ckpt", under_file),
                     "consolidate", tree / "notes.txt")
    if Path("/proc").is_dir():  # no file can be created there, whoever runs the test
        _assert_one_line(_main(capsys, "consolidate", tree / "ckpt", "/proc/model.safetensors"),
                         "consolidate", "/proc/model.safetensors", "cannot write")
    assert _listing(tree) == before  # no output, no temporary file left behind


def test_consolidate_refuses_output_inside_the_checkpoint(tree, capsys):
    shard = next((tree / "ckpt").glob("rank-*.safetensors"))
    (tree / "alias").symlink_to(tree / "ckpt", target_is_directory=True)
    try:
        before = _listing(tree / "ckpt")
        for out in (shard, tree / "ckpt" / "model.safetensors", tree / "alias" / shard.name):
            _assert_one_line(_main(capsys, "consolidate", tree / "ckpt", out),
                             "consolidate", out, "inside the checkpoint")
        assert _listing(tree / "ckpt") == before
        assert _main(capsys, "verify", tree / "ckpt")[0] == 0  # the shard was not overwritten
    finally:
        (tree / "alias").unlink()


def test_consolidate_dtype_must_be_floating(tree, capsys):
    for bad in ("int8", "bogus", "bool"):
        out = tree / f"{bad}.safetensors"
        _assert_one_line(_main(capsys, "consolidate", tree / "ckpt", out, "--dtype", bad),
                         "consolidate", repr(bad), "bf16, fp16, fp32")
        assert not out.exists()
    with pytest.raises(
        ValueError, match=r"dtype must be a floating torch.dtype or None, got torch.int8"
    ):
        # the library too
        ckpt.consolidate(tree / "ckpt", tree / "lib.safetensors", dtype=torch.int8)
    assert not (tree / "lib.safetensors").exists()


def test_consolidate_progress_and_dtype(tree, capsys):
    state = torch.load(tree / "state.pt")
    out = tree / "half.safetensors"
    code, text, err = _main(capsys, "consolidate", tree / "ckpt", out, "--dtype", "fp16",
                            "--progress")
    assert code == 0 and text == f"wrote {out}\n", (code, text, err)
    n = len(state)
    assert f"{n}/{n} tensors (100%)" in err.splitlines()[-1], err
    label = f"zerolite consolidate {out.name}: "
    assert all(line.startswith(label) for line in err.splitlines()), err
    written = load_file(out)
    assert {k: v.dtype for k, v in written.items()} == {k: torch.float16 for k in state}
    for name, tensor in state.items():
        assert torch.equal(written[name], tensor.half()), name
    code, _, err = _main(capsys, "consolidate", tree / "ckpt", tree / "quiet.safetensors")
    assert (code, err) == (0, "")  # stderr is not a terminal and no --progress: silent
    out.unlink(), (tree / "quiet.safetensors").unlink()


# ---------------------------------------------------------------- the checkpoint path


@pytest.mark.parametrize("command", ["verify", "inspect", "consolidate"])
def test_checkpoint_path_is_not_a_checkpoint(tree, capsys, command):
    extra = [tree / "model.safetensors"] if command == "consolidate" else []
    accel = tree / "proj/checkpoints/checkpoint_10"
    cases = {
        tree / "missing": "no such directory",
        tree / "notes.txt": "a file, not a checkpoint directory",
        tree / "empty": "empty directory",
        tree / "other": "not a zerolite checkpoint (no index.json, no rank-*.safetensors)",
        accel: "this is an Accelerate checkpoint folder; "
               f"the zerolite checkpoint is at {accel / 'zerolite_0'}",
        tree / "proj/checkpoints": f"the newest zerolite checkpoint is at {accel / 'zerolite_0'}",
        tree: f"a folder of checkpoints; the newest is {tree / 'ckpt'}",
        tree / "ckpt/index.json": f"pass its directory {tree / 'ckpt'}",
    }
    for path, message in cases.items():
        err = _assert_one_line(_main(capsys, command, path, *extra), command, path, message)
        assert "interrupted" not in err
    assert not (tree / "model.safetensors").exists()
    if command != "consolidate":  # where the message points is a checkpoint
        assert _main(capsys, command, accel / "zerolite_0")[0] == 0


# ---------------------------------------------------------------- estimate


def test_estimate_bad_values(capsys):
    for flag, value in [("--params", "-5"), ("--params", "0"), ("--params", "abc"),
                        ("--params", "nan"), ("--params", "1.5"),
                        ("--world-size", "0"), ("--world-size", "two")]:
        argv = {"--params": "1e9", "--world-size": "2", flag: value}
        _assert_one_line(_main(capsys, "estimate", *[x for kv in argv.items() for x in kv]),
                         "estimate", flag, repr(value))
    _assert_one_line(_main(capsys, "estimate", *COUNT, "--dtype", "bogus"),
                     "estimate", "'bogus'", "bf16")


def test_estimate_optimizer_names_come_from_the_estimator(capsys):
    err = _assert_one_line(_main(capsys, "estimate", *COUNT, "--optimizer", "lion"),
                           "estimate", "'lion'")
    for name in NAMED:
        assert repr(name) in err, err
    for name in NAMED:  # and every one of them works
        code, out, err = _main(capsys, "estimate", *COUNT, "--optimizer", name)
        assert code == 0 and err == "", (name, out, err)
        assert "1,000,000,000 parameters, 2 ranks" in out, out


def _not_a_model() -> int:
    return 3


def _broken_model() -> nn.Module:
    raise RuntimeError("needs a config file")


def test_estimate_model_spec_errors(capsys):
    cases = {
        "gpt2": "expected MODULE:FUNCTION",
        "nosuch.module:fn": "cannot import 'nosuch.module'",
        "examples.gpt:nosuch": "has no function 'nosuch'",
        "tests.api.test_cli:_not_a_model": "returned int, not an nn.Module",
        "tests.api.test_cli:_broken_model": "raised RuntimeError: needs a config file",
    }
    for spec, message in cases.items():
        _assert_one_line(_main(capsys, "estimate", "--model", spec, "--world-size", "2"),
                         "estimate", f"--model {spec!r}", message)


def _zero_paper(psi: int, n: int, stage: int, itemsize: int) -> list[float]:
    """Per rank, bytes of params, grads, fp32 master, Adam's two moments and their sum, from
    the ZeRO paper's accounting (README's stage table), written out here."""
    master = 0 if itemsize == 4 else 4 * psi
    full = [itemsize * psi, itemsize * psi, master, 8 * psi]
    sharded = {0: 0, 1: 2, 2: 1, 3: 0}[stage]  # fields (from the right) kept whole
    kept = [f if i < sharded else f / n for i, f in enumerate(full)] if stage else full
    return [*kept, sum(kept)]


def test_estimate_model_success(capsys):
    """``--model`` builds the model on the meta device and prints each stage's bytes per rank:
    for the tiny GPT (every tensor a multiple of 32 elements: no padding at 2 or 4 ranks), the
    ZeRO paper's figures for its parameter count, fp32 and bf16 with fp32 masters (up to the
    printed 3 significant digits: 5e-3 relative)."""
    psi = sum(p.numel() for p in parity.make_model().parameters())  # a real build, tied once
    for n, dtype, itemsize in ((2, "fp32", 4), (4, "bf16", 2)):
        code, out, err = _main(capsys, "estimate", "--model", "tests.support.parity:make_model",
                               "--world-size", str(n), "--dtype", dtype)
        assert code == 0 and err == "", err
        lines = out.splitlines()
        assert lines[0].startswith(f"{psi:,} parameters, {n} ranks, {dtype} parameters"), out
        rows = {line.split()[0]: line.split() for line in lines[2:]}
        assert sorted(rows) == ["0", "1", "2", "3"], out
        for stage in range(4):
            printed = [float(x) * 1e9 for x in rows[str(stage)][1 + (stage == 0):][:5]]
            expected = _zero_paper(psi, n, stage, itemsize)
            assert all(abs(a - b) <= 5e-3 * b for a, b in zip(printed, expected)), (
                n, dtype, stage, printed, expected)


# ---------------------------------------------------------------- real processes


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_real_processes_exit_2_with_one_line(tree):
    """The same errors from ``python -m zerolite`` and the console script (started
    together: each pays for importing torch)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    console = Path(sys.executable).parent / "zerolite"  # the installed [project.scripts] entry
    console_argv = [str(console)] if console.exists() else [sys.executable, "-m", "zerolite"]
    runs = {
        "consolidate": [sys.executable, "-m", "zerolite", "consolidate",
                        tree / "ckpt", tree / "outdir"],
        "estimate": [*console_argv, "estimate", "--params", "-5", "--world-size", "2"],
    }
    procs = {name: subprocess.Popen([str(a) for a in argv], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, argv in runs.items()}
    results = {name: _finish(p) for name, p in procs.items()}
    _assert_one_line(results["consolidate"], "consolidate", tree / "outdir", "is a directory")
    _assert_one_line(results["estimate"], "estimate", "--params", "'-5'")
