"""Checkpoint integrity on real gloo groups and real files:

1. ``save(overwrite=True)`` killed (SIGKILL) at every step, and again inside the next
   save's recovery: ``latest`` always names a complete checkpoint that verifies and loads
   exactly, and the next save puts the overwritten one back and cleans up;
2. an edited ``index.json`` (checksum stale, or recomputed) is refused by verify, inspect,
   consolidate and load (every rank, nothing changed), naming the problem;
5. a consolidated file loads with ``load_state_dict(strict=True)``: tied names are written,
   also for frozen tied weights;
3. a second job saving into a locked root is refused on every rank, nothing written;
4. checkpoint names are stored and read exactly: whitespace, separators and hidden names
   are refused at save, and ``latest`` refuses a pointer that is not a plain name.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zerolite
from tests.checkpoint.test_checkpoint import CFG, build, differences, make_model, snapshot, train
from tests.support import parity
from zerolite import checkpoint as ckpt
from zerolite.checkpoint import CheckpointError
from zerolite.checkpoint.commit import LOCK_FILE, SaveLock
from zerolite.checkpoint.format import INDEX, INDEX_DIGEST, index_digest_text
from zerolite.checkpoint.save import FAULT_ENV
from zerolite.testing import run_ranks

# ---------------------------------------------------------------- 1. overwrite crashes

# case -> (faults armed in turn, one per save: the overwrite of "ck", then the next save;
# what `latest` names right after the crash ("old": the hidden copy `.ck.old-…`), the step
# it holds, the step "ck" holds after the next save in the root).
CRASHES = {
    "before_rename": (["before_rename"], "ck", 1, 1),
    "overwrite_copied": (["overwrite_copied"], "ck", 1, 1),
    "overwrite_pointed_to_copy": (["overwrite_pointed_to_copy"], "old", 1, 1),
    "overwrite_moved_aside": (["overwrite_moved_aside"], "old", 1, 1),
    "before_latest": (["before_latest"], "old", 1, 2),
    "before_cleanup": (["before_cleanup"], "ck", 2, 2),
    # `latest` names another checkpoint "m": the moved-aside "ck" is still put back.
    "pointer_elsewhere": (["overwrite_moved_aside"], "m", 1, 1),
    # Killed again in the next save, while it puts back what the first crash moved aside.
    "restore_copied": (["overwrite_moved_aside", "restore_copied"], "old", 1, 1),
    "restore_renamed": (["overwrite_moved_aside", "restore_renamed"], "old", 1, 1),
}


def _killed_in_child(fault: str, action) -> int:
    """Run ``action`` in a forked child with ``fault`` armed; the signal that ended it.

    World size 1 runs no collectives, so a forked copy of this rank can save on its own:
    one launch covers every crash point."""
    pid = os.fork()
    if pid == 0:
        try:
            os.environ[FAULT_ENV] = fault
            action()
        finally:
            os._exit(3)  # the kill did not happen (or the save failed)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


def _crash_matrix(base: str) -> dict:
    base = Path(base)
    data = parity.batches(2, cfg=CFG)
    references = {}
    for steps in (1, 2):  # replay: the state a checkpoint of that step must hold
        model, opt, _ = build(CFG, stage=2)
        train(model, opt, data[:steps])
        references[steps] = snapshot(model, opt)
    model, opt, _ = build(CFG, stage=2)
    train(model, opt, data[:1])
    for case in CRASHES:
        ckpt.save(base / case / "ck", model, opt, extra={"step": 1})
        if case == "pointer_elsewhere":
            ckpt.save(base / case / "m", model, opt, extra={"step": 1})
    train(model, opt, data[1:])
    rng = torch.get_rng_state()  # saved with step 2; the loads below reseed
    out = {}
    for case, (faults, *_) in CRASHES.items():
        root = base / case
        torch.set_rng_state(rng)
        saves = [
            lambda r=root: ckpt.save(r / "ck", model, opt, extra={"step": 2}, overwrite=True),
            lambda r=root: ckpt.save(r / "next", model, opt),
        ]
        signals = [_killed_in_child(f"{fault}:0", save) for fault, save in zip(faults, saves)]
        latest = ckpt.latest(root)
        fresh, fresh_opt, _ = build(CFG, stage=2, seed=1, rng_seed=555)
        extra = ckpt.load(latest, fresh, fresh_opt)
        out[case] = {
            "signals": signals,
            "latest": latest.name,
            "verified": ckpt.verify(latest)["extra"],
            "extra": extra,
            "diff": differences(snapshot(fresh, fresh_opt), references[extra["step"]]),
            "ck_before_next": (root / "ck").is_dir(),
        }
        ckpt.save(root / "next", fresh, fresh_opt, extra={"step": 3}, overwrite=True)
    return out


def test_overwrite_killed_at_every_step_keeps_latest_complete(tmp_path):
    result = run_ranks(_crash_matrix, 1, str(tmp_path), timeout=120)[0]
    problems = []
    for case, got in result.items():
        _, named, step, final = CRASHES[case]
        root = tmp_path / case
        if any(sig != 9 for sig in got["signals"]):
            problems.append(f"{case}: the saves ended with {got['signals']}, not SIGKILL")
        ok_name = got["latest"].startswith(".ck.old-") if named == "old" else got["latest"] == named
        if not ok_name or got["verified"] != {"step": step} or got["extra"] != {"step": step}:
            problems.append(f"{case}: latest named {got['latest']!r} holding {got['verified']}")
        if got["diff"]:
            problems.append(f"{case}: latest did not load as saved: {got['diff'][:4]}")
        if case == "restore_renamed" and not got["ck_before_next"]:
            problems.append(f"{case}: 'ck' was not put back before the pointer moved")
        names = sorted(p.name for p in root.iterdir())
        expected = [LOCK_FILE, "ck", "latest", "next"] + (
            ["m"] if case == "pointer_elsewhere" else []
        )
        if names != sorted(expected):
            problems.append(f"{case}: after the next save the root holds {names}")
        elif ckpt.latest(root) != root / "next" or ckpt.verify(root / "ck")["extra"] != {
            "step": final
        }:
            problems.append(
                f"{case}: after the next save 'ck' holds {ckpt.verify(root / 'ck')['extra']}"
            )
    assert list(result) == list(CRASHES)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- 2. edited index


def _reverse_shape(index: dict) -> None:
    entry = next(p for p in index["params"] if len(set(p["shape"])) == 2)
    entry["shape"] = entry["shape"][::-1]  # same number of elements


def _outside(index: dict, d: Path) -> None:
    shutil.copy(d / index["files"][1]["file"], d.parent / "outside.safetensors")
    index["files"][1]["file"] = "../outside.safetensors"


def _drop(*keys):
    def edit(index: dict) -> None:
        obj = index
        for key in keys[:-1]:
            obj = obj[key]
        del obj[keys[-1]]

    return edit


def _set(value, *keys):
    def edit(index: dict) -> None:
        obj = index
        for key in keys[:-1]:
            obj = obj[key]
        obj[keys[-1]] = value

    return edit


def _piece_past_end(index: dict) -> None:
    index["files"][0]["pieces"][0][2] = 10**9


# case -> (edit of the parsed index, what the error names when the checksum is recomputed;
# None: a consistent edit only the checksum can catch).
INDEX_EDITS = {
    "shape": (_reverse_shape, None),
    "bogus_dtype": (_set("float33", "params", 0, "dtype"), "'dtype' is 'float33'"),
    "other_dtype": (_set("bfloat16", "params", 0, "dtype"), "param_dtype is 'float32'"),
    "stage": (_set(7, "stage"), "'stage' is 7"),
    "world_size": (_set(3, "world_size"), "'world_size' is 3"),
    "one_file": (lambda i: (_set(1, "world_size")(i), _drop("files", 1)(i)), "rank-00000-of-00001"),
    "outside": (_outside, "'../outside.safetensors'"),
    "no_files": (_drop("files"), "missing key 'files'"),
    "no_sha256": (_drop("files", 0, "sha256"), "missing key 'sha256'"),
    "no_params": (_drop("params"), "missing key 'params'"),
    "no_shape": (_drop("params", 0, "shape"), "missing key 'shape'"),
    "no_world_size": (_drop("world_size"), "missing key 'world_size'"),
    "piece_past_end": (_piece_past_end, "pieces[0]"),
    "group": (_set(5, "params", 0, "group"), "'group' is 5"),
    "not_an_object": (lambda i: i.clear(), "not a zerolite checkpoint index"),
}


def _edited_copies(good: Path) -> dict[str, tuple[Path, str]]:
    """case -> (directory, what the error must name)."""
    out = {}
    for case, (edit, needle) in INDEX_EDITS.items():
        for sealed in (False, True) if needle else (False,):
            d = good.parent / f"{case}-{'sealed' if sealed else 'plain'}"
            shutil.copytree(good, d)
            index = json.loads((d / INDEX).read_text())
            edit(index) if edit is not _outside else edit(index, d)
            data = json.dumps(index, indent=1).encode()
            (d / INDEX).write_bytes(data)
            if sealed:  # the checksum recomputed too: the schema must catch it
                (d / INDEX_DIGEST).write_text(index_digest_text(data))
            out[d.name] = (d, needle if sealed else f"sha256 does not match {INDEX_DIGEST}")
    d = good.parent / "no_digest"
    shutil.copytree(good, d)
    (d / INDEX_DIGEST).unlink()
    out[d.name] = (d, f"no {INDEX_DIGEST}")
    return out


def _attempt_load(path: Path, model, opt) -> dict:
    before = snapshot(model, opt)
    try:
        ckpt.load(path, model, opt)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "diff": differences(snapshot(model, opt), before)}


def _save_edit_load(root: str) -> dict:
    root = Path(root)
    model, opt, _ = build(CFG, stage=2)
    train(model, opt, parity.batches(2, cfg=CFG))
    ckpt.save(root / "good", model, opt, extra={"step": 2})
    cases = _edited_copies(root / "good") if dist.get_rank() == 0 else None
    cases = _bcast(cases)
    out = {name: _attempt_load(d, model, opt) for name, (d, _) in cases.items()}
    out["__good__"] = ckpt.load(root / "good", model, opt)
    out["__full__"] = zerolite.full_state_dict(model, rank0_only=False)
    # Tied and frozen (LoRA-style): the tie is recorded outside the optimizer's table.
    frozen = make_model(CFG, seed=3)
    frozen.wte.requires_grad_(False)
    frozen_opt = zerolite.shard(
        frozen,
        torch.optim.AdamW([p for p in frozen.parameters() if p.requires_grad]),
        zerolite.ZeroConfig(stage=3),
    )
    ckpt.save(root / "frozen_tied", frozen, frozen_opt)
    out["__frozen_full__"] = zerolite.full_state_dict(frozen, rank0_only=False)
    # A consolidated file (both tied names) goes back into a sharded model with strict=True.
    if dist.get_rank() == 0:
        ckpt.consolidate(root / "good", root / "good.safetensors")
    dist.barrier()
    again = make_model(CFG, seed=4)
    zerolite.shard(again, parity.make_optimizer("AdamW", again), zerolite.ZeroConfig(stage=3))
    ckpt.load_pretrained(again, root / "good.safetensors", strict=True)
    out["__pretrained_full__"] = zerolite.full_state_dict(again, rank0_only=False)
    return {
        "cases": {k: str(v[0]) for k, v in cases.items()},
        "needles": {k: v[1] for k, v in cases.items()},
        "loads": out,
    }


def _bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    return run_ranks(_save_edit_load, 2, str(tmp_path_factory.mktemp("edits")), timeout=120)


def test_edited_index_is_refused_everywhere(edited, tmp_path):
    results = edited
    cases, needles = results[0]["cases"], results[0]["needles"]
    # every edit plain and (where the schema can tell) with its checksum redone; no checksum
    assert len(cases) == 2 * len(INDEX_EDITS) - 1 + 1
    problems = []
    for name, d in cases.items():
        needle = needles[name]
        for tool in (
            ckpt.verify,
            ckpt.inspect,
            lambda p, n=name: ckpt.consolidate(p, tmp_path / f"{n}.safetensors"),
        ):
            try:
                tool(d)
                problems.append(f"{name}: {tool} accepted it")
            except CheckpointError as exc:
                if needle not in str(exc):
                    problems.append(f"{name}: {needle!r} not in {exc}")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
        if (tmp_path / f"{name}.safetensors").exists():
            problems.append(f"{name}: consolidate wrote a file")
        for rank, result in enumerate(results):
            load = result["loads"][name]
            if (
                load["error"] is None
                or not load["error"].startswith("CheckpointError")
                or needle not in load["error"]
            ):
                problems.append(f"{name} rank {rank}: load raised {load['error']}")
            if load["diff"]:
                problems.append(f"{name} rank {rank}: load changed {load['diff'][:4]}")
    assert not problems, "\n".join(problems)
    assert all(r["loads"]["__good__"] == {"step": 2} for r in results)


# ---------------------------------------------------------------- 5. consolidated tied weights


def test_consolidated_file_loads_strictly(edited, tmp_path):
    results = edited
    root = Path(results[0]["cases"]["stage-plain"]).parent
    for name, full in {
        "good": results[0]["loads"]["__full__"],
        "frozen_tied": results[0]["loads"]["__frozen_full__"],
    }.items():
        sd = load_file(ckpt.consolidate(root / name, tmp_path / f"{name}.safetensors"))
        assert set(sd) == set(full), name
        model = make_model(seed=5)
        model.load_state_dict(sd)  # strict=True
        assert model.head.weight is model.wte.weight
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, full[key]), (name, key)
    for rank, result in enumerate(results):  # load_pretrained(strict=True) of the same file
        for key, tensor in result["loads"]["__pretrained_full__"].items():
            assert torch.equal(tensor, results[0]["loads"]["__full__"][key]), (rank, key)


# ---------------------------------------------------------------- 3-4. lock and names


def _listing(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    )


def _try(action, root: Path) -> dict:
    listing = _listing(root)
    try:
        action()
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = f"{type(exc).__name__}: {exc}"
    outcome = {"error": error, "listing_unchanged": _listing(root) == listing}
    dist.barrier()
    return outcome


def _hold_lock_in_child(root: Path) -> tuple[int, int]:
    """Another process holding the root's save lock, as a job in the middle of a save
    would: (pid, write end of the pipe that releases it when closed)."""
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(release_w)
            SaveLock(root)
            os.write(ready_w, b"1")
            os.read(release_r, 1)  # returns when the parent closes its end
        finally:
            os._exit(0)
    os.close(release_r)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1", "the lock holder did not start"
    return pid, release_w


BAD_NAMES = {
    "trailing_space": "step1 ",
    "leading_space": " step1",
    "newline": "step1\n",
    "backslash": "a\\b",
    "hidden": ".step1",
    "dot": ".",
}


def _lock_and_names(root: str) -> dict:
    root = Path(root)
    model, opt, _ = build(CFG, stage=2)
    train(model, opt, parity.batches(1, cfg=CFG))
    out = {}
    ckpt.save(root / "step1", model, opt, extra={"step": 1})
    holder = _hold_lock_in_child(root) if dist.get_rank() == 0 else None
    dist.barrier()
    out["locked"] = _try(lambda: ckpt.save(root / "step2", model, opt), root)
    if holder is not None:
        os.close(holder[1])
        os.waitpid(holder[0], 0)
    dist.barrier()
    for case, name in BAD_NAMES.items():
        out[case] = _try(lambda n=name: ckpt.save(root / n, model, opt), root)
    ckpt.save(root / "step2", model, opt, extra={"step": 2})  # the lock is free again
    out["latest"] = ckpt.latest(root).name
    return out


def test_locked_root_and_bad_names_are_refused_before_writing(tmp_path):
    results = run_ranks(_lock_and_names, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        locked = result["locked"]
        assert locked["error"] and locked["error"].startswith("CheckpointError"), (rank, locked)
        assert "is locked by another save in progress (pid" in locked["error"], (rank, locked)
        assert locked["listing_unchanged"], rank
        for case in BAD_NAMES:
            outcome = result[case]
            assert outcome["error"] and outcome["error"].startswith("ValueError"), (
                rank,
                case,
                outcome,
            )
            assert outcome["listing_unchanged"], (rank, case)
        assert result["latest"] == "step2", rank
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [LOCK_FILE, "latest", "step1", "step2"]
    )
    # The pointer is read exactly: whatever it holds must be a plain checkpoint name.
    pointer = tmp_path / "latest"
    for text, needle in {
        "step1\n": "whitespace",
        "../step1": "separator",
        ".step1": "hidden",
    }.items():
        pointer.write_text(text)
        with pytest.raises(CheckpointError, match=needle):
            ckpt.latest(tmp_path)
    pointer.write_text("step1")
    assert ckpt.latest(tmp_path) == tmp_path / "step1"


def _save_while_another_saves(root: str) -> dict:
    """A real save (a forked copy of this one-rank job) paused just before its commit, and
    a second save into the same root meanwhile."""
    # the module whose commit() a save calls (zerolite.checkpoint.commit.commit_checkpoint)
    save_module = importlib.import_module("zerolite.checkpoint.commit")
    root = Path(root)
    model, opt, _ = build(CFG, stage=2)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            commit = save_module.commit

            def paused(*args, **kwargs) -> None:
                os.write(ready_w, b"1")
                os.read(go_r, 1)  # until the parent closes its end
                commit(*args, **kwargs)

            save_module.commit = paused
            ckpt.save(root / "first", model, opt, extra={"job": 1})
            os._exit(0)
        finally:
            os._exit(3)
    os.close(go_r)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1", "the first save did not reach its commit"
    second = _try(lambda: ckpt.save(root / "second", model, opt, extra={"job": 2}), root)
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    third = _try(lambda: ckpt.save(root / "third", model, opt, extra={"job": 3}), root)
    return {"second": second, "first_exit": os.waitstatus_to_exitcode(status), "third": third}


def test_a_save_in_progress_refuses_another_job(tmp_path):
    result = run_ranks(_save_while_another_saves, 1, str(tmp_path), timeout=120)[0]
    assert result["second"]["error"].startswith("CheckpointError"), result
    assert "locked by another save in progress" in result["second"]["error"], result
    assert result["second"]["listing_unchanged"], result
    assert result["first_exit"] == 0 and result["third"]["error"] is None, result
    assert ckpt.verify(tmp_path / "first")["extra"] == {"job": 1}
    assert ckpt.latest(tmp_path) == tmp_path / "third"
    assert not (tmp_path / "second").exists()
