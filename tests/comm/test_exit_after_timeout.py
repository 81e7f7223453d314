"""After a `CollectiveTimeout` the job ends: no process outlives the error by more than
``timeout_s`` + 10 s, and zerolite refuses the aborted process group at once.

Each rank is a plain Python process, as a user's ``torchrun`` script is (not `run_ranks`,
whose ranks leave with ``os._exit``): the process group keeps torch's default timeout (30
minutes for gloo), zerolite's is 3 s, and the error propagates out of the script, which
exits as Python does, tearing the process group down. Before the abort, an abandoned gloo
collective kept the group's worker thread busy until the group's own timeout, and the
process hung at exit in the group's destructor for 30 minutes.

The shapes are the stage-1 divergences of ``tests/comm/test_divergence.py`` that used to hang at
exit, in a loop that ends with a checkpoint as training scripts do: a rank that catches an
exception raised in its last forward and moves on, one that skips its last ``step()``
(both then save while the other rank steps: a `CollectiveTimeout` on both; a divergence
earlier in the loop is caught by the next step's lockstep check instead, a
`RankMismatchError` with nothing left pending), and one that saves a checkpoint alone
mid-loop. A rank whose own wait failed also tries one more zerolite operation: it must be
refused at once, naming the abort. A fourth case skips a step under a process group whose own
timeout (3 s) is shorter than ``timeout_s`` (600 s): gloo ends the wait at the group's
timeout, and the error must name that bound, not ``timeout_s``.

The bound is event-based: each rank reports the moment it raised (``time.monotonic``, one
clock for every process of the machine), and the test watches the process from there until
it has exited. What the bound rules out is a process *waiting* after the error (the hang was
the main thread blocked in the group's destructor, asleep): the test counts the time the
process's main thread spends asleep (``S`` in ``/proc/<pid>/stat``) after it raised, and
fails a process asleep for more than ``timeout_s`` + 10 s (the promised bound). The wall
time from the raise to the exit is reported too, and capped at `HARD_S`: on an idle machine
exit follows the raise within about a second (the abandoned gloo operation ended within
``timeout_s`` of its launch, before the raise), but eight interpreters tearing torch down at
once on a loaded 2-core machine were measured taking 26 s of wall time, all of it running,
none of it asleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import zerolite
from tests.support import parity

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0  # zerolite's bound on each wait
EXIT_MARGIN_S = 10.0  # the promised bound: every process exits within TIMEOUT_S + this
HARD_S = 120.0  # wall seconds after the raise: a process still alive then is hung anyway
START_S = 180.0  # generous: six interpreters importing torch on a shared 2-core machine
HOWS = ("forward_raises", "skip_step", "save_alone", "pg_shorter")
# "pg_shorter": zerolite's bound is long, the process group's own timeout is TIMEOUT_S.
LONG_TIMEOUT_S = 600.0


class BadSample(RuntimeError):
    pass


def _raise_bad_sample(module, args, output):
    raise BadSample("bad sample")


def _loop(how: str, root: str) -> None:
    """The divergent loop of ``tests/comm/test_divergence.py`` at stage 1, ending with a save;
    raises a zerolite error on every rank (that test checks which and why)."""
    rank = dist.get_rank()
    model = parity.make_model()
    timeout_s = LONG_TIMEOUT_S if how == "pg_shorter" else TIMEOUT_S
    config = zerolite.ZeroConfig(stage=1, timeout_s=timeout_s)
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    steps = 4
    try:
        for step, (x, y) in enumerate(parity.batches(steps=steps)):
            x, y = parity.local_slice(x), parity.local_slice(y)
            deviant = rank == 1 and step == (1 if how == "save_alone" else steps - 1)
            if deviant and how == "forward_raises":
                handle = model.blocks[1].register_forward_hook(_raise_bad_sample)
                try:
                    model(x, y)
                except BadSample:
                    continue
                finally:
                    handle.remove()
            model(x, y).backward()
            if deviant and how in ("skip_step", "pg_shorter"):
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            if deviant and how == "save_alone":
                zerolite.checkpoint.save(f"{root}/alone", model, opt)
        zerolite.checkpoint.save(f"{root}/final", model, opt)
    except (zerolite.CollectiveTimeout, zerolite.RankMismatchError) as exc:
        report = {"raised": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"}
        if isinstance(exc, zerolite.CollectiveTimeout):
            start = time.monotonic()
            try:  # one more zerolite operation: refused at once, before any collective
                zerolite.checkpoint.save(f"{root}/after-{rank}", model, opt)
            except Exception as again:  # noqa: BLE001 - whatever it is, the test names it
                report["again"] = f"{type(again).__name__}: {again}"
            report["again_s"] = time.monotonic() - start
        print("REPORT " + json.dumps(report), flush=True)
        raise  # out of the script, as an uncaught error ends a user's job


def rank_main(rank: int, how: str, root: str) -> None:
    """One rank of one case (run as its own interpreter by the test)."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(root, "store"), 2)
    # torch's default timeout (30 minutes), or TIMEOUT_S for "pg_shorter"
    timeout = timedelta(seconds=TIMEOUT_S) if how == "pg_shorter" else None
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    _loop(how, root)


def _launch(how: str, root: Path) -> list[tuple[subprocess.Popen, Path]]:
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    procs = []
    for rank in range(2):
        out = root / f"rank{rank}.log"
        code = (
            "from tests.comm.test_exit_after_timeout import rank_main; "
            f"rank_main({rank}, {how!r}, {str(root)!r})"
        )
        with open(out, "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        procs.append((proc, out))
    return procs


def _report(log: Path) -> dict | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT "):])
    return None


def _asleep(pid: int) -> bool:
    """Whether process ``pid``'s main thread is asleep (waiting), per ``/proc``; a process
    gone between the poll and the read is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "S"  # the state follows "(comm) "


def _watch(cases: dict) -> tuple[dict, dict, dict]:
    """Polls every process until it exits or is killed as hung; returns when each exited,
    how long each slept after it raised, and why any was killed."""
    started = last = time.monotonic()
    exited: dict[tuple[str, int], float] = {}
    slept: dict[tuple[str, int], float] = {}
    killed: dict[tuple[str, int], str] = {}
    while len(exited) + len(killed) < 2 * len(cases):
        now = time.monotonic()
        for how, procs in cases.items():
            for rank, (proc, log) in enumerate(procs):
                key = (how, rank)
                if key in exited or key in killed:
                    continue
                if proc.poll() is not None:
                    exited[key] = now
                    continue
                report = _report(log)
                if report is not None and _asleep(proc.pid):
                    slept[key] = slept.get(key, 0.0) + now - max(last, report["raised"])
                if report is None and now - started > START_S:
                    killed[key] = f"no zerolite error within {START_S:g}s"
                elif report is not None and slept.get(key, 0.0) > TIMEOUT_S + EXIT_MARGIN_S:
                    killed[key] = f"asleep {slept[key]:.1f}s after it raised (hung)"
                elif report is not None and now - report["raised"] > HARD_S:
                    killed[key] = f"still running {HARD_S:g}s after it raised"
                if key in killed:
                    proc.kill()
                    proc.wait()
        last = now
        time.sleep(0.05)
    return exited, slept, killed


def test_every_process_exits_after_a_collective_timeout(tmp_path):
    """All four shapes at once (eight processes), each process watched until it exits."""
    cases = {how: _launch(how, tmp_path / how) for how in HOWS}
    exited, slept, killed = _watch(cases)
    failures = []
    for how, procs in cases.items():
        for rank, (proc, log) in enumerate(procs):
            report = _report(log)
            where = f"{how}, rank {rank}"
            if (how, rank) in killed:
                failures.append(f"{where}: {killed[(how, rank)]}; {report and report['error']}")
                continue
            if report is None:
                failures.append(f"{where}: exited without a zerolite error:\n{log.read_text()}")
                continue
            after = exited[(how, rank)] - report["raised"]
            print(f"{where}: exited {after:.1f}s after it raised, "
                  f"{slept.get((how, rank), 0.0):.1f}s of it asleep")
            assert proc.returncode == 1, (where, proc.returncode)  # the uncaught error
            if report["error"].startswith("CollectiveTimeout"):
                assert "aborted the process group" in report["error"], report["error"]
                assert report["again"].startswith("CollectiveTimeout"), report
                assert "refused: the process group was aborted" in report["again"], report
    assert not failures, "\n".join(failures)
    # Every shape produced at least one CollectiveTimeout (else it tests nothing here).
    for how in HOWS:
        errors = [_report(log)["error"] for _, log in cases[how]]
        assert any(e.startswith("CollectiveTimeout") for e in errors), (how, errors)
    # The rank whose wait ran out names the bound that applied (its peer may see the
    # connection close first); none claims zerolite's 600 s bound ran out.
    errors = [_report(log)["error"] for _, log in cases["pg_shorter"]]
    shorter = f"within the process group's timeout of {TIMEOUT_S:g}s"
    assert any(shorter in e for e in errors), errors
    assert not any(f"within ZeroConfig.timeout_s={LONG_TIMEOUT_S:g}s" in e for e in errors), errors
