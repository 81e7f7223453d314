"""An asynchronous save that fills the disk, on a real full file system.

The checkpoint root is a small tmpfs, mounted in a private mount namespace (``unshare``: no
mount is visible outside the test, and it goes away with it). A 2-rank job saves a good
checkpoint, then starts an asynchronous save with one rank's background write held (the
test-only HOLD_ENV); once the other rank's file is written, the held rank fills the disk
(a filler file written until ENOSPC) and lets its write go, which fails with
``[Errno 28] No space left on device``. For "rank 0 fails" and "rank 1 fails":

1. every rank's ``wait()`` raises within a few seconds, naming the failing rank and the real
   cause -- not after ``timeout_s`` (60 s here) with "did it die?". The markers through
   which the ranks report were reserved at the call, so they need no space when written;
2. with the filler gone, the next save into the same root (same name for one case, another
   for the other) succeeds although the disk could not also hold the failed save's partial
   directory: the save removes those leftovers first;
3. the good checkpoint stays ``latest`` until then and loads bitwise.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.checkpoint.test_checkpoint import CFG, differences, make_model, snapshot, train
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.checkpoint import CheckpointError
from zerolite.checkpoint.commit import HOLD_ENV
from zerolite.checkpoint.format import rank_file_name
from zerolite.testing import run_ranks

# ZeroConfig.timeout_s: a rank told nothing would wait this long. Long, so that the bound on
# the error's arrival (a third of it) leaves a loaded machine room and still rules it out.
TIMEOUT_S = 60.0
# Bytes of each case's tmpfs, in 4 KiB pages: a checkpoint takes 83 (files of 42 and 38, the
# index), so two fit with room to spare (21 pages), but not also a failed save's file.
SIZE = 190 * 4096
CASES = {"rank 0 fails": (0, "bad"), "rank 1 fails": (1, "next")}


def _build():
    model = make_model(CFG)
    opt = parity.make_optimizer("AdamW", model)
    opt = zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2, timeout_s=TIMEOUT_S))
    torch.manual_seed(100 + dist.get_rank())
    return model, opt


def _fill(root: Path) -> None:
    """Write into ``root/filler`` until the file system is full."""
    chunk = bytes(4096)
    with open(root / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with open(root / "filler", "ab", buffering=0) as f:
        try:  # the last partial page
            while f.write(b"\0"):
                pass
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def _written(root: Path, rank: int) -> bool:
    """Whether ``rank``'s file of the save in flight is complete (as large as in ``good``)."""
    name = rank_file_name(rank, 2)
    size = (root / "good" / name).stat().st_size
    return any(f.stat().st_size == size for f in root.glob(f".bad.tmp-*/{name}"))


def _full_disk(roots: dict[str, str]) -> dict:
    return {case: _one_case(Path(roots[case]), *CASES[case]) for case in CASES}


def _one_case(root: Path, failing: int, next_name: str) -> dict:
    model, opt = _build()
    data = parity.batches(3, cfg=CFG)
    train(model, opt, data[:1])
    reference = snapshot(model, opt)
    ckpt.save(root / "good", model, opt, extra={"step": 1})
    train(model, opt, data[1:2])
    rank = dist.get_rank()
    release = root / "release"
    if rank == failing:
        os.environ[HOLD_ENV] = f"writing:{release}"
    pending = ckpt.save(root / "bad", model, opt, extra={"step": 2}, blocking=False)
    if rank == failing:
        deadline = time.monotonic() + TIMEOUT_S
        while not _written(root, 1 - failing):
            assert time.monotonic() < deadline, "the other rank's file was never written"
            time.sleep(0.005)
        _fill(root)
        del os.environ[HOLD_ENV]
        release.touch()
    start = time.monotonic()
    try:
        pending.wait()
        out = {"error": None}
    except CheckpointError as exc:
        out = {"error": str(exc)}
    out["seconds"] = time.monotonic() - start
    out["latest_after_failure"] = ckpt.latest(root).name
    dist.barrier()
    if rank == failing:
        (root / "filler").unlink()
        release.unlink()
    dist.barrier()
    train(model, opt, data[2:])
    try:
        ckpt.save(root / next_name, model, opt, extra={"step": 3}, overwrite=True)
        out["next_save"] = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out["next_save"] = f"{type(exc).__name__}: {exc}"
    out["latest"] = ckpt.latest(root).name
    fresh = make_model(CFG, seed=1)
    fresh_opt = zerolite.shard(fresh, parity.make_optimizer("AdamW", fresh),
                               zerolite.ZeroConfig(stage=2, timeout_s=TIMEOUT_S))
    out["extra"] = ckpt.load(root / "good", fresh, fresh_opt)
    out["diff"] = differences(snapshot(fresh, fresh_opt), reference)
    dist.barrier()
    out["names"] = sorted(p.name for p in root.iterdir())
    return out


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """Both cases, each on a tmpfs of its own. The tmpfs are mounted in a private mount
    namespace held by a ``sleep`` (no privileges needed: ``unshare --user``); the ranks reach
    them through ``/proc/PID/root``, so they run from here like any other test's."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs mount")
    base = tmp_path_factory.mktemp("full_disk")
    mounts = {case: base / f"case{failing}" for case, (failing, _) in CASES.items()}
    script = "".join(f"mkdir {m} && mount -t tmpfs -o size={SIZE} zerolite-test {m} && "
                     for m in mounts.values()) + "echo mounted && exec sleep 600"
    holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "mounted":
            pytest.skip(f"cannot mount a private tmpfs here: {holder.stderr.read()[:300]}")
        roots = {case: f"/proc/{holder.pid}/root{m}" for case, m in mounts.items()}
        results = run_ranks(_full_disk, 2, roots, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    return {case: [r[case] for r in results] for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_full_disk_reaches_every_rank_within_seconds(full_disk, case):
    failing, _ = CASES[case]
    for rank, out in enumerate(full_disk[case]):
        error = out["error"]
        assert error is not None, f"rank {rank}: wait() did not raise"
        assert f"rank {failing}: writing" in error and "No space left on device" in error, (
            rank, error)
        assert "did it die" not in error, (rank, error)
        assert out["seconds"] < TIMEOUT_S / 3, (rank, out["seconds"], error)
        assert out["latest_after_failure"] == "good"


@pytest.mark.parametrize("case", list(CASES))
def test_next_save_after_full_disk_succeeds_and_good_checkpoint_loads(full_disk, case):
    _, name = CASES[case]
    for rank, out in enumerate(full_disk[case]):
        assert out["next_save"] is None, (rank, out["next_save"])
        assert out["latest"] == name
        assert out["extra"] == {"step": 1} and not out["diff"], (rank, out["diff"][:8])
        leftovers = [n for n in out["names"] if n.startswith(".") and n != ".zerolite-save.lock"]
        assert not leftovers, (rank, out["names"])
