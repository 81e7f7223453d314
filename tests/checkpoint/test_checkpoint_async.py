"""Asynchronous checkpoint saves (``save(..., blocking=False)``) on real gloo groups and files:

1. what is written is the state at the call, bitwise, while 2 more steps run during the
   write (held open by the test-only HOLD_ENV); ``latest`` names the previous checkpoint
   until the save commits; stages 2 and 3 (parameter and frozen shards); the staging area
   is one copy of the rank's file data, reused by the next save, and `track` reports it;
2. two saves in a row (the second waits for the first);
3. a write error in the background (a directory rank 1 may not write): raised by ``wait()``
   on every rank naming rank 1 and its file, or else by the next ``save``; the previous
   checkpoint stays ``latest`` and loads bitwise;
4. SIGKILL of one rank, of both, and of rank 0 in its commit, during the background write:
   the previous checkpoint stays ``latest``, passes ``zerolite verify`` and loads bitwise;
5. an asynchronously saved checkpoint loads exactly at another world size and stage;
6. at normal interpreter exit a save in flight is completed;
7. ``ZeroAccelerator.save_state(..., async_save=True)`` and ``ZeroTrainer(async_save=True)``
   save the state at the call (the Trainer's step-2 checkpoint, held open while step 3
   trains, against the state at step 2's end, after 2 more steps); the Trainer's staging
   area is made after its first step, at the size its saves then use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

import zerolite
import zerolite.cli
from tests.checkpoint.test_checkpoint import (
    CFG,
    NO_DROPOUT,
    _after_crash,
    assemble,
    build,
    differences,
    make_model,
    pieces,
    snapshot,
    train,
)
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.checkpoint import CheckpointError, PendingSave
from zerolite.checkpoint.commit import FAULT_ENV, HOLD_ENV, LOCK_FILE, MARKER, remove_leftovers
from zerolite.checkpoint.format import rank_file_name
from zerolite.checkpoint.pending_save import in_flight
from zerolite.checkpoint.run_folders import accelerate_staging
from zerolite.checkpoint.staging import staging_area
from zerolite.testing import RankFailure, run_ranks

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- 1-2. state at the call


def _file_data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's data section (the file less its header)."""
    with open(path, "rb") as f:
        return path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


def _held_save(root: str, stage: int) -> dict:
    root = Path(root) / f"stage{stage}"
    release = root / "release"
    data = parity.batches(6, cfg=NO_DROPOUT)
    model, opt, _ = build(NO_DROPOUT, stage)
    train(model, opt, data[:1])
    ckpt.save(root / "first", model, opt, extra={"step": 1})
    train(model, opt, data[1:3])
    at_call = snapshot(model, opt)
    os.environ[HOLD_ENV] = f"writing:{release}"
    with zerolite.memory.track(opt) as tracker:
        start = time.perf_counter()
        pending = ckpt.save(root / "held", model, opt, extra={"step": 3}, blocking=False)
        blocked = time.perf_counter() - start
    train(model, opt, data[3:5])  # the live state moves on during the write
    out = {
        "type": isinstance(pending, PendingSave),
        "done_while_held": pending.done(),
        "latest_while_held": ckpt.latest(root).name,
        "blocked": blocked,
        "staging": tracker.staging,
        "staging_line": "checkpoint staging area" in str(tracker),
        "staging_peak": tracker.peaks["staging"].zerolite,
        "after_steps": snapshot(model, opt),
    }
    dist.barrier()
    if dist.get_rank() == 0:
        release.touch()
    out["wait"] = str(pending.wait())
    out["wait_again"] = str(pending.wait())
    del os.environ[HOLD_ENV]
    out["done"] = pending.done()
    out["latest"] = ckpt.latest(root).name
    area = staging_area(opt)
    out["area_bytes"] = area.nbytes
    out["file_bytes"] = _file_data_bytes(root / "held" / rank_file_name(dist.get_rank(), 2))
    fresh, fresh_opt, _ = build(NO_DROPOUT, stage, seed=1, rng_seed=555)
    out["extra"] = ckpt.load(root / "held", fresh, fresh_opt)
    out["loaded"] = snapshot(fresh, fresh_opt)
    out["at_call"] = at_call
    # 2. two saves in a row: the second waits for the first; same layout, same buffer
    buffer = area.buffer.data_ptr()
    row = {"a": snapshot(model, opt)}
    first = ckpt.save(root / "a", model, opt, extra={"step": 5}, blocking=False)
    train(model, opt, data[5:])
    row["b"] = snapshot(model, opt)
    second = ckpt.save(root / "b", model, opt, extra={"step": 6}, blocking=False)
    row["first_done_at_second"] = first.done()
    row["paths"] = [first.wait().name, second.wait().name]
    row["same_buffer"] = area.buffer.data_ptr() == buffer
    row["latest"] = ckpt.latest(root).name
    for name in ("a", "b"):
        fresh, fresh_opt, _ = build(NO_DROPOUT, stage, seed=1, rng_seed=555)
        row[f"extra_{name}"] = ckpt.load(root / name, fresh, fresh_opt)
        row[f"diff_{name}"] = differences(snapshot(fresh, fresh_opt), row[name])
        del row[name]
    out["row"] = row
    return out


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    return root, {stage: run_ranks(_held_save, 2, str(root), stage, timeout=120)
                  for stage in (2, 3)}


@pytest.mark.parametrize("stage", [2, 3])
def test_async_save_writes_the_state_at_the_call(held, stage):
    for rank, out in enumerate(held[1][stage]):
        assert out["type"], "save(blocking=False) did not return a PendingSave"
        assert not out["done_while_held"] and out["latest_while_held"] == "first", (rank, out)
        assert out["done"] and out["wait"] == out["wait_again"] and out["latest"] == "held"
        assert out["extra"] == {"step": 3}
        assert differences(out["at_call"], out["after_steps"]), "the steps changed nothing"
        diff = differences(out["loaded"], out["at_call"])
        assert not diff, f"rank {rank}: saved state is not the state at the call: {diff[:8]}"
        # one copy of this rank's file data, held between saves, reported by track()
        assert out["area_bytes"] == out["file_bytes"] > 0, (rank, out["area_bytes"])
        assert out["staging"] == out["area_bytes"] and out["staging_line"]
        assert out["staging_peak"] >= out["area_bytes"]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_async_saves_in_a_row(held, stage):
    root = held[0] / f"stage{stage}"
    for rank, out in enumerate(held[1][stage]):
        row = out["row"]
        assert row["paths"] == ["a", "b"] and row["latest"] == "b", (rank, row)
        assert row["first_done_at_second"], "the second save did not wait for the first"
        assert row["same_buffer"], "the staging area was not reused"
        assert row["extra_a"] == {"step": 5} and row["extra_b"] == {"step": 6}
        assert not row["diff_a"] and not row["diff_b"], (rank, row["diff_a"], row["diff_b"])
    assert ckpt.verify(root / "a")["extra"] == {"step": 5}
    assert not [p for p in root.iterdir() if MARKER.fullmatch(p.name) or ".tmp-" in p.name]


# ---------------------------------------------------------------- 3. background write error


def _unwritable_for_rank1(root: str) -> dict:
    """Rank 1 cannot write into the hidden directory rank 0 creates: rank 0 creates it
    read-only (umask), and as root (which ignores modes) rank 1 runs as nobody."""
    root = Path(root)
    model, opt, _ = build(CFG, stage=2)
    train(model, opt, parity.batches(1, cfg=CFG))
    reference = snapshot(model, opt)
    ckpt.save(root / "good", model, opt, extra={"step": 1})
    dist.barrier()
    out = {}
    for case in ("wait", "next_save"):
        umask = os.umask(0o222) if dist.get_rank() == 0 else None
        if dist.get_rank() == 1 and os.geteuid() == 0:
            os.seteuid(65534)
        try:
            pending = ckpt.save(root / f"bad-{case}", model, opt, blocking=False)
        finally:
            if umask is not None:
                os.umask(umask)
        if case == "wait":
            try:
                pending.wait()
                out[case] = None
            except CheckpointError as exc:
                out[case] = str(exc)
        else:
            while not pending.done():
                time.sleep(0.01)
        if os.geteuid() != os.getuid():
            os.seteuid(os.getuid())
        out[f"{case}_latest"] = ckpt.latest(root).name
    try:
        ckpt.save(root / "after", model, opt, extra={"step": 2})
        out["next_save"] = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out["next_save"] = f"{type(exc).__name__}: {exc}"
    ckpt.save(root / "after", model, opt, extra={"step": 2})  # reported once: goes through
    fresh, fresh_opt, _ = build(CFG, stage=2, seed=1, rng_seed=555)
    out["extra"] = ckpt.load(root / "good", fresh, fresh_opt)
    out["diff"] = differences(snapshot(fresh, fresh_opt), reference)
    return out


def test_background_write_error_is_raised_and_previous_checkpoint_kept():
    # Not under tmp_path: rank 1 may run as nobody, who must reach the root (pytest's
    # base directory is private), and rank 1's markers go into the root.
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        root.chmod(0o777)
        results = run_ranks(_unwritable_for_rank1, 2, str(root), timeout=120)
        latest = ckpt.latest(root)
        names = sorted(p.name for p in root.iterdir())
    file = rank_file_name(1, 2)
    for rank, out in enumerate(results):
        assert out["wait"] is not None, f"rank {rank}: wait() did not raise"
        assert "rank 1: writing" in out["wait"] and file in out["wait"], (rank, out["wait"])
        assert "Permission" in out["wait"], out["wait"]
        assert out["next_save"] is not None and "bad-next_save" in out["next_save"], out
        assert "rank 1: writing" in out["next_save"] or rank != 1, out["next_save"]
        assert out["wait_latest"] == out["next_save_latest"] == "good"
        assert out["extra"] == {"step": 1} and not out["diff"], (rank, out["diff"][:8])
    assert latest == root / "after"
    assert names == sorted([LOCK_FILE, "after", "good", "latest"]), names


# ---------------------------------------------------------------- 4. SIGKILL while writing

KILLS = {
    "one rank": "writing:1",
    "both ranks": "writing:0,1",
    "rank 0 committing": "before_latest:0",
}


def _async_then_crash(root: str, fault: str) -> str:
    """The history `tests.checkpoint.test_checkpoint._after_crash` expects (step-1 saved after one
    step), then an asynchronous save of step 2 killed while training goes on."""
    model, opt, _ = build(CFG, stage=2)
    data = parity.batches(4, cfg=CFG)
    train(model, opt, data[:1])
    ckpt.save(Path(root) / "step-1", model, opt, extra={"step": 1})
    train(model, opt, data[1:2])
    os.environ[FAULT_ENV] = fault
    pending = ckpt.save(Path(root) / "step-2", model, opt, extra={"step": 2}, blocking=False)
    train(model, opt, data[2:])
    pending.wait()
    return "the injected kill did not happen"


@pytest.mark.parametrize("case", list(KILLS))
def test_sigkill_during_background_write_keeps_previous_checkpoint(tmp_path, case):
    fault = KILLS[case]
    with pytest.raises(RankFailure) as info:
        run_ranks(_async_then_crash, 2, str(tmp_path), fault, timeout=60)
    # With several ranks killed, whichever dies first makes the harness stop the others: at
    # least one of them must show the injected SIGKILL.
    killed = [int(r) for r in fault.split(":")[1].split(",")]
    assert any("SIGKILL" in info.value.failures.get(r, "") for r in killed), info.value.failures
    assert ckpt.latest(tmp_path) == tmp_path / "step-1"
    assert zerolite.cli.main(["verify", str(tmp_path / "step-1")]) == 0
    committed = fault.startswith("before_latest")  # renamed into place, not named yet
    assert (tmp_path / "step-2").exists() == committed
    after = run_ranks(_after_crash, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(after):
        assert result["latest"] == "step-1" and result["extra"] == {"step": 1}, result
        assert not result["diff"], f"rank {rank}: step-1 did not load as saved: {result['diff']}"
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_FILE)
    assert names == sorted(["latest", "step-1", "step-3"] + (["step-2"] if committed else []))


# ---------------------------------------------------------------- 5. another world size


def _load_at(root: str, case: str, source: str, stage: int) -> dict:
    model, opt, _ = build(NO_DROPOUT, stage, seed=1)
    extra = ckpt.load(Path(root) / source, model, opt)
    return {"extra": extra, **snapshot(model, opt)}


# case -> (world size and stage to load at, the held save to load)
RESHARD = {"ws 2->3, stage 3": (3, 3, "stage3/held"), "ws 2->1, stage 2->1": (1, 1, "stage2/held")}


@pytest.mark.parametrize("case", list(RESHARD))
def test_async_checkpoint_loads_at_another_world_size(held, case):
    root, saved = held
    ws, stage, source = RESHARD[case]
    after = run_ranks(_load_at, ws, str(root), case, source, stage, timeout=120)
    before = [saved[int(source[5])][r]["at_call"] for r in range(2)]
    diff = differences(assemble([a["pieces"] for a in after]),
                       assemble([b["pieces"] for b in before]))
    assert not diff, f"{case}: masters/optimizer state differ: {diff[:8]}"
    for r, a in enumerate(after):
        assert a["extra"] == {"step": 3}
        diff = differences(a["full"], before[0]["full"])
        assert not diff, f"{case} rank {r}: parameters/buffers differ: {diff[:8]}"


# ---------------------------------------------------------------- 6. interpreter exit

_AT_EXIT = """
import atexit, os, sys
from pathlib import Path
import torch
import zerolite
from zerolite import checkpoint as ckpt
from zerolite.checkpoint.commit import HOLD_ENV
from examples.gpt import GPT, GPTConfig

root, release = Path(sys.argv[1]), Path(sys.argv[1]) / "release"
os.environ[HOLD_ENV] = f"writing:{release}"
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
opt = zerolite.shard(model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(stage=2))
pending = ckpt.save(root / "at-exit", model, opt, extra={"exit": True}, blocking=False)
atexit.register(release.touch)  # runs before zerolite's handler (registered earlier)
print("done before exit:", pending.done(), "latest before exit:", ckpt.latest(root))
"""


def test_save_in_flight_completes_at_interpreter_exit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _AT_EXIT, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "done before exit: False latest before exit: None" in proc.stdout, proc.stdout
    assert ckpt.latest(tmp_path) == tmp_path / "at-exit"
    assert ckpt.verify(tmp_path / "at-exit")["extra"] == {"exit": True}


# ---------------------------------------------------------------- 7. Accelerate and Trainer


def _accelerate_async(root: str) -> dict:
    os.environ["ACCELERATE_USE_CPU"] = "1"  # two CPU processes (docs/design.md, "Accelerate")
    from zerolite.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(zero_config=zerolite.ZeroConfig(stage=2))
    model = make_model(NO_DROPOUT)
    model, opt = accelerator.prepare(model, parity.make_optimizer("AdamW", model))
    ckpt.prepare_async_save(model, opt)  # what prepare() returned: the wrapped optimizer
    data = parity.batches(3, cfg=NO_DROPOUT)
    train(model, opt, data[:1])
    prepared = staging_area(opt.optimizer).nbytes
    at_call = pieces(opt.optimizer)
    folder = accelerator.save_state(str(Path(root) / "acc"), async_save=True)
    pending = accelerator.pending_save
    train(model, opt, data[1:])
    moved = pieces(opt.optimizer)
    accelerator.load_state(folder)  # waits for the save first
    return {
        "pending": isinstance(pending, PendingSave) and pending.done(),
        "latest": ckpt.latest(Path(folder)).name,
        "diff": differences(pieces(opt.optimizer), at_call),
        "moved": bool(differences(moved, at_call)),
        "prepared": (prepared, staging_area(opt.optimizer).nbytes),
    }


def _trainer_async(root: str) -> dict:
    """ZeroTrainer(async_save=True), 4 steps, a checkpoint every 2: the step-2 save is held
    open while step 3 trains (released before the step-4 save, which waits for it); then
    checkpoint-2 loads bitwise the state at step 2's end (when the save was called), which
    the two later steps changed."""
    from transformers import TrainerCallback

    from tests.support import hf_trainer_cases as cases
    from zerolite.hf import ZeroTrainer

    out = Path(root) / "trainer"
    release = Path(root) / "release"
    seen: dict = {}

    class AtStepEnd(TrainerCallback):  # runs before Trainer's save of the same step
        def on_step_end(self, args, state, control, **kwargs) -> None:
            if state.global_step == 1:  # made after the first step, before any save
                seen["prepared"] = staging_area(trainer._sharded_optimizer()).nbytes
            if state.global_step == 2:
                seen["at_save"] = snapshot(trainer.model, trainer._sharded_optimizer())
            if state.global_step == 3:
                seen["held"] = in_flight() is not None and not in_flight().done()
                dist.barrier()
                if dist.get_rank() == 0:
                    release.touch()

    args = cases.make_args(out, save_strategy="steps", save_steps=2, max_steps=4)
    trainer = ZeroTrainer(model=cases.make_model(), args=args, train_dataset=cases.TokenData(),
                          async_save=True, callbacks=[AtStepEnd()])
    os.environ[HOLD_ENV] = f"writing:{release}"
    try:
        trainer.train()
        result: dict = {"in_flight": in_flight() is not None, "held": seen.get("held")}
        in_flight().wait()
    finally:
        del os.environ[HOLD_ENV]
    opt = trainer._sharded_optimizer()
    result["prepared"], result["area"] = seen["prepared"], staging_area(opt).nbytes
    live = snapshot(trainer.model, opt)
    at_save = {k: v for k, v in seen["at_save"].items() if k != "rng"}
    result["moved"] = bool(differences({k: live[k] for k in at_save}, at_save))
    ckpt.load(out / "checkpoint-2" / "zerolite", trainer.model, opt)  # the state at the call
    loaded = snapshot(trainer.model, opt)
    result["diff"] = differences({k: loaded[k] for k in at_save}, at_save)
    result["verified"] = [ckpt.verify(out / f"checkpoint-{n}" / "zerolite")["extra"]
                          for n in (2, 4)]
    try:
        ZeroTrainer(model=cases.make_model(), args=cases.make_args(out, save_total_limit=1),
                    async_save=True)
        result["refused"] = None
    except ValueError as exc:
        result["refused"] = str(exc)
    return result


def test_a_commit_s_cleanup_leaves_a_rank_s_accelerate_staging_alone(tmp_path):
    """Rank 0's asynchronous save commits into the ``save_state`` folder and removes a
    checkpoint's temporaries there while other ranks still stage Accelerate's files in
    it (seen once: rank 1's `move_into` found its staging folder gone)."""
    staging = accelerate_staging(tmp_path, 1)
    staging.mkdir()
    (staging / "random_states_1.pkl").write_bytes(b"rng")
    failed = tmp_path / f".zerolite_0.tmp-{uuid.uuid4().hex}"  # a failed save's: removed
    failed.mkdir()
    remove_leftovers(tmp_path)
    assert not failed.exists()
    assert (staging / "random_states_1.pkl").read_bytes() == b"rng"


def test_accelerate_save_state_async(tmp_path):
    for rank, out in enumerate(run_ranks(_accelerate_async, 2, str(tmp_path), timeout=120)):
        assert out["pending"] and out["latest"] == "zerolite_0" and out["moved"], (rank, out)
        prepared, used = out["prepared"]
        assert prepared == used > 0, (rank, out["prepared"])
        assert not out["diff"], f"rank {rank}: load_state did not restore the call's state"


def test_trainer_async_save(tmp_path):
    for rank, out in enumerate(run_ranks(_trainer_async, 2, str(tmp_path), timeout=240)):
        assert out["in_flight"] and out["held"] and out["moved"], (rank, out)
        assert out["prepared"] == out["area"] > 0, (rank, out["prepared"], out["area"])
        assert not out["diff"], f"rank {rank}: checkpoint-2 is not the state at its save: " + str(
            out["diff"][:8])
        assert out["verified"] == [{"global_step": 2}, {"global_step": 4}]
        assert out["refused"] and "save_total_limit=1" in out["refused"], out["refused"]
