"""Run a function on every rank of a real ``torch.distributed`` process group, for tests.

Design: `run_ranks` starts one process per rank with the ``forkserver`` start method. The
forkserver starts once per interpreter with ``torch``, ``torch.distributed``,
``torch.distributed.tensor`` and ``zerolite`` preloaded, so a launch costs a ``fork()`` of
that warm process plus importing ``fn``'s module (~0.2 s), not an interpreter start and the
imports (about 4 s of CPU per rank: ``zerolite`` alone brings in ``torch._dynamo``). Its
environment and fds 1/2 are frozen when it starts, so each rank gets the caller's current
``os.environ`` and stdout/stderr (variables torch reads at import time stay the
forkserver's). Ranks rendezvous through a fresh ``FileStore`` in a private temporary
directory (no TCP port to pick) with gloo pinned to loopback.

Each rank sends exactly one message through its own pipe: the return value serialised with plain
``pickle.dumps`` (tensors travel as bytes, not via ``multiprocessing``'s shared-memory
reducers) or its formatted traceback. The parent waits on pipes and process sentinels together
(``multiprocessing.connection.wait``), so it reacts at once to a rank that raises, one that
dies without reporting (SIGKILL, segfault, ``os._exit``) and the deadline. After a rank raises,
the others get a short grace period to report their own errors (a peer blocked in a collective
usually fails once the failed rank's sockets close); then whatever is alive is SIGKILLed and
joined, so no rank outlives the call.
"""

import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

__all__ = [
    "FootprintMismatch", "PeakMismatch", "RankFailure", "RankTimeout", "assert_footprint",
    "assert_peak", "run_ranks",
]

_T = TypeVar("_T")
logger = logging.getLogger(__name__)

# Imports only: the forkserver must not run a parallel op, or forked ranks would inherit a
# dead OpenMP pool.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "zerolite"]
_GRACE_S = 5.0  # how long surviving ranks may keep running after another rank raised


class RankFailure(RuntimeError):
    """One or more ranks launched by `run_ranks` failed.

    Attributes:
        failures: Maps each rank that did not return normally to a description: its formatted
            traceback, how its process died, or why it was killed.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.failures)


class RankTimeout(RankFailure):
    """Not every rank finished within the ``timeout`` given to `run_ranks`."""


class _CallerStdio:
    """Pickles (only while a process starts) as duplicates of the caller's current fds 1, 2.

    Ranks would otherwise write wherever fds 1 and 2 pointed when the forkserver started: under
    pytest possibly an earlier test's ``capfd`` file, where their output is silently lost.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            os.fstat(1), os.fstat(2)
        except OSError:  # the caller has no stdout/stderr to share: keep the forkserver's
            return list, ()
        return _detach, (reduction.DupFd(1), reduction.DupFd(2))


def _detach(*fds: Any) -> list[int]:
    return [fd.detach() for fd in fds]


def _rank_main(job: bytes, rank: int, world_size: int, store_path: str, timeout: float,
               backend: str | None, env: dict[str, str], stdio: list[int],
               conn: Connection) -> None:
    """Body of one rank process: join the group, run ``fn`` and send one message back."""
    for target, fd in enumerate(stdio, start=1):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args = pickle.loads(job)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        options: dict[str, Any] = {} if backend is None else {"backend": backend}
        if _uses_accelerator(backend):  # rank r on device r, current and bound to the group
            from zerolite.ground import runtime

            device = torch.device(runtime.gpu_type(), rank)
            runtime.set_current_device(device)
            options["device_id"] = device
        dist.init_process_group(store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), **options)
        # Every peer has connected before any runs fn: one that fails at once and exits
        # (below) would break a peer still connecting ("connectFullMesh failed ...
        # Connection closed by peer") and hide the failure behind that one. On the store:
        # a group may have no backend for a barrier here (e.g. "cuda:gloo" on a CPU).
        if store.add("zerolite.testing/connected", 1) == world_size:
            store.set("zerolite.testing/all connected", "1")
        store.wait(["zerolite.testing/all connected"], timedelta(seconds=timeout))
        message: tuple[str, Any] = ("ok", pickle.dumps(fn(*args), pickle.HIGHEST_PROTOCOL))
    except BaseException:  # noqa: BLE001 - SystemExit/KeyboardInterrupt in fn fail it too
        message = ("err", traceback.format_exc())
    conn.send_bytes(pickle.dumps(message))  # report first: a rank waiting below is not hung
    conn.close()
    if message[0] == "ok":
        try:  # no rank may tear the group down while a peer still uses it, e.g. is still
            # connecting ("connectFullMesh failed ... Connection closed by peer") or receiving
            dist.barrier()
            dist.destroy_process_group()
            return
        except Exception:  # noqa: BLE001, S110 - a peer failed and reports that itself
            pass
    # Leave at once: a normal exit may block tearing down a group whose peers are mid-collective,
    # and closing our sockets lets those peers fail fast.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _pickle_job(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """Pickle ``(fn, args)`` in the parent, turning unpicklable input into ``TypeError``."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        if "<lambda>" in name or "<locals>" in name:
            raise TypeError("it is a lambda or local function")
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types
        raise TypeError(f"run_ranks needs fn picklable by reference and {name!r} is not ({exc}); "
                        "define it at module level") from None
    try:
        return pickle.dumps((fn, args), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"run_ranks arguments must be picklable: {exc}") from exc


def _describe_exit(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _uses_accelerator(backend: str | None) -> bool:
    """Whether ranks of this backend run on GPUs: NCCL (alone or per device, as
    ``"cpu:gloo,cuda:nccl"``), or no backend on a GPU machine (torch then picks NCCL)."""
    if backend is None or backend.lower() == "undefined":
        from zerolite.ground import runtime

        return runtime.accelerator_type() is not None
    return "nccl" in backend.lower()


def _check_devices(backend: str | None, world_size: int) -> None:
    """Refuse, in the parent, a CUDA backend without a GPU for every rank."""
    if not _uses_accelerator(backend):
        return
    from zerolite.ground import runtime

    count = runtime.device_count()
    if count < world_size:
        raise ValueError(
            f"run_ranks(backend={backend!r}, world_size={world_size}): each rank runs on its own "
            f"GPU (NCCL refuses two ranks on one device) and this machine has {count}; use at "
            f"most {count} ranks, or backend='gloo'"
        )


def run_ranks(fn: Callable[..., _T], world_size: int, *args: Any, timeout: float = 120.0,
              backend: str | None = "gloo") -> list[_T]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes forming a process group.

    Each rank runs in its own process, inside an initialised default process group (rank ``r``
    of ``world_size``), with ``torch.set_num_threads(1)`` and ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set; ``fn`` starts once every rank has joined
    the group. The group is destroyed after ``fn`` returns.
    With a CUDA backend (NCCL), rank ``r`` runs on ``cuda:r``: it is the rank's current
    device and the group's bound device (``init_process_group(device_id=...)``).

    Args:
        fn: Module-level function to run on every rank (it is pickled by reference).
        world_size: Number of ranks, an int >= 1.
        *args: Picklable positional arguments passed to ``fn`` on every rank.
        timeout: Seconds allowed for the whole launch; also the process group's timeout.
        backend: ``torch.distributed`` backend to initialise (``"gloo"``, ``"nccl"``,
            ``"cpu:gloo,cuda:nccl"``, ...); ``None`` calls ``init_process_group()`` without
            one, which torch 2.13 reports as ``"undefined"`` (gloo for CPU tensors, or
            NCCL for CUDA tensors on a CUDA machine).

    Returns:
        The values returned by ``fn``, ordered by rank. They are sent back with plain
        ``pickle``, so they may contain CPU tensors.

    Raises:
        ValueError: ``world_size`` is not an int >= 1; a CUDA backend with fewer GPUs
            than ranks.
        TypeError: ``fn`` is a lambda or local function, or ``fn``/``args`` cannot be pickled.
        RankFailure: A rank raised or its process died; the message holds each failing
            rank's traceback labelled ``[rank r/N]``.
        RankTimeout: Some ranks had not finished after ``timeout`` seconds; they are named.

    Example:
        In a test module (``fn`` is imported by every rank, so it lives at module level)::

            def total(x: float) -> float:
                t = torch.tensor([x])
                dist.all_reduce(t)
                return t.item()

            def test_total() -> None:
                assert run_ranks(total, 2, 1.5) == [3.0, 3.0]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    _check_devices(backend, world_size)
    job = _pickle_job(fn, args)
    start = time.monotonic()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # only takes effect before the forkserver starts
    tmpdir = tempfile.mkdtemp(prefix="zerolite-ranks-")
    env = dict(os.environ)
    stdio = _CallerStdio()
    procs: list[Any] = []
    readers: list[Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            proc = ctx.Process(target=_rank_main, name=f"zerolite-rank-{rank}",
                               args=(job, rank, world_size, os.path.join(tmpdir, "store"),
                                     timeout, backend, env, stdio, writer))
            proc.start()
            writer.close()
            procs.append(proc)
        logger.debug("launched %d ranks of %s in %.3fs", world_size, fn, time.monotonic() - start)
        return _collect(fn, procs, readers, start + timeout, timeout)
    finally:
        _kill(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(fn: Callable[..., Any], procs: list[Any], readers: list[Connection],
             deadline: float, timeout: float) -> list[Any]:
    """Wait for every rank's message, reacting to failures, deaths and the deadline."""
    n = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first: int | None = None  # first rank to fail
    grace_end = float("inf")
    open_readers = {reader: rank for rank, reader in enumerate(readers)}
    live = {proc.sentinel: rank for rank, proc in enumerate(procs)}

    def receive(reader: Connection, rank: int) -> None:
        nonlocal first, grace_end
        del open_readers[reader]
        try:
            status, payload = pickle.loads(reader.recv_bytes())
            if status == "ok":
                results[rank] = pickle.loads(payload)
                return
        except EOFError:
            return  # died without reporting; its sentinel tells how
        except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
            payload = f"its return value could not be unpickled in the parent: {exc!r}"
        failures[rank] = payload
        if first is None:
            first, grace_end = rank, time.monotonic() + _GRACE_S
            logger.debug("rank %d/%d failed; giving the others %.1fs", rank, n, _GRACE_S)

    silent_death = False
    while len(results) + len(failures) < n and not silent_death:
        remaining = min(deadline, grace_end) - time.monotonic()
        if remaining <= 0:
            break
        for obj in wait([*open_readers, *live], timeout=remaining):
            if obj in open_readers:
                receive(obj, open_readers[obj])
            elif obj in live:
                rank = live.pop(obj)
                reader = readers[rank]
                if reader in open_readers and reader.poll():
                    receive(reader, rank)  # it reported just before exiting
                if rank not in results and rank not in failures:
                    code = procs[rank].exitcode
                    failures[rank] = (f"process died with {_describe_exit(code)} "
                                      "without reporting a result")
                    first = rank if first is None else first
                    silent_death = True

    unfinished = [r for r in range(n) if r not in results and r not in failures]
    if unfinished:
        logger.warning("killing unfinished rank(s) %s of %s", unfinished, fn)
    if first is None and unfinished:
        failures.update((r, f"still running after {timeout}s (hung); killed") for r in unfinished)
        summary = f"timed out after {timeout}s; ranks still running (hung): {unfinished}"
        raise RankTimeout(_message(fn, n, failures, summary), failures)
    if first is not None:
        for rank in unfinished:
            failures[rank] = f"killed after rank {first} failed"
        raise RankFailure(_message(fn, n, failures, f"rank {first} failed first"), failures)
    # Every rank reported success; give stragglers the grace period to exit (then _kill reaps).
    end = min(time.monotonic() + _GRACE_S, deadline)
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    return [results[rank] for rank in range(n)]


def _message(fn: Callable[..., Any], n: int, failures: dict[int, str], summary: str) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    parts = [f"run_ranks({name}, world_size={n}): {summary}"]
    parts += [f"[rank {r}/{n}] {failures[r].rstrip()}" for r in sorted(failures)]
    return "\n\n".join(parts)


def _kill(procs: list[Any]) -> None:
    """SIGKILL every rank still alive and reap them all."""
    for proc in procs:
        if proc.exitcode is None and proc.is_alive():
            logger.debug("killing %s (pid %s)", proc.name, proc.pid)
            proc.kill()
    for proc in procs:
        proc.join()
        proc.close()


# Re-exported here: users' memory-footprint regression tests import it with run_ranks.
from zerolite.memory.assertions import (  # noqa: E402
    FootprintMismatch,
    PeakMismatch,
    assert_footprint,
    assert_peak,
)
