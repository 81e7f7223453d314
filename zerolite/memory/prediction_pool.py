"""Predictions on worker processes, asked for before `plan` needs them.

[Note: predictions ahead] `plan`'s pruned search is sequential: which prediction it asks
for next depends on the answers so far (floors, bisection, a group that fits ends the
search). Most of what it will ask is still known early -- every traced combination's
micro-batch 1, and once one fits, its larger micro-batches -- so `PredictionPool` runs
those on ``workers`` forked processes while the search goes on, in the order given, and
the search takes each answer when it asks, or waits for it, or has it made next. The
search itself is unchanged and its answers are the same predictions (a prediction is a
function of its arguments alone), so the plan is the same at any number of workers;
predictions the search never asks for are wasted work, which costs time only where no
core was idle.

The workers are forked, so the model and batch functions need not be picklable, and
they share what the parent had built; each keeps its own fake-tensor cache. A worker
that dies has its request made again in this process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from zerolite.memory.peak_report import PeakPrediction

__all__ = ["MOST_WORKERS", "PredictionPool", "default_workers", "prediction_pool"]

# (ZeroConfig keyword arguments, micro-batch, accumulation, checkpointing, stop_above)
Predict = Callable[[dict[str, Any], int, int, bool, int | None], PeakPrediction]
_Key = tuple  # a request: (sorted keyword arguments, micro-batch, accumulation, ckpt, stop)


def _key(kwargs: dict[str, Any], micro: int, accumulation: int, ckpt: bool,
         stop_above: int | None) -> _Key:
    return (tuple(sorted(kwargs.items())), micro, accumulation, ckpt, stop_above)


class PredictionPool:
    """``predict`` (`plan`'s, with ``stop_above``), answered by ``workers`` processes
    ([Note: predictions ahead]); with fewer than 2, or where processes cannot be forked
    (Windows), by this process when asked.

    Call it as ``predict``; `ahead` queues requests it will probably ask; ``follow(request,
    prediction)`` names more once a worker answers (queued first); `close` ends the
    workers (what they are doing is thrown away)."""

    def __init__(self, predict: Predict, workers: int,
                 follow: Callable[[tuple, PeakPrediction], list[tuple]] | None = None) -> None:
        self._predict = predict
        self._follow = follow
        self._done: dict[_Key, tuple[bool, Any]] = {}
        self._queue: list[_Key] = []
        self._busy: dict[Connection, _Key] = {}
        self._workers: dict[Connection, multiprocessing.process.BaseProcess] = {}
        if workers < 2 or not _CAN_FORK:
            return
        context = multiprocessing.get_context("fork")
        for _ in range(workers):
            mine, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(predict, theirs), daemon=True)
            process.start()
            theirs.close()
            self._workers[mine] = process

    def ahead(self, requests: Iterable[tuple], first: bool = False) -> None:
        """Queue ``requests`` (``predict``'s arguments), before the queued ones when
        ``first``; those known or under way are left out."""
        if not self._workers:
            return
        known = {*self._done, *self._busy.values()}
        new = [k for k in (_key(*r) for r in requests) if k not in known]
        rest = [k for k in self._queue if k not in new]
        self._queue = new + rest if first else rest + new
        self._dispatch()

    def __call__(self, kwargs: dict[str, Any], micro: int, accumulation: int, ckpt: bool,
                 stop_above: int | None) -> PeakPrediction:
        key = _key(kwargs, micro, accumulation, ckpt, stop_above)
        whole = key[:-1] + (None,)  # a whole prediction answers a stopped request too
        while key not in self._done and whole not in self._done:
            if not self._workers:
                self._done[key] = _attempt(self._predict, key)
                break
            if key not in self._busy.values():
                self._queue = [key, *(k for k in self._queue if k != key)]
                self._dispatch()
            self._receive()
        ok, value = self._done.get(key) or self._done[whole]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the workers now."""
        for conn, process in self._workers.items():
            process.kill()
            process.join()
            conn.close()
        self._workers.clear()
        self._busy.clear()

    def _dispatch(self) -> None:
        for conn in self._workers:
            if conn not in self._busy and self._queue:
                key = self._queue.pop(0)
                conn.send(key)
                self._busy[conn] = key

    def _receive(self) -> None:
        """Wait for a worker's answer and store it; a worker that died is dropped and its
        request queued first again (made here once no worker is left)."""
        for conn in wait(list(self._busy)):
            key = self._busy.pop(conn)  # type: ignore[arg-type]
            try:
                ok, value = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                self._workers.pop(conn).join()  # type: ignore[arg-type]
                self._queue.insert(0, key)
                continue
            self._done[key] = (ok, value)
            if ok and value.complete:
                self._done[key[:-1] + (None,)] = (ok, value)
            if ok and self._follow is not None:
                kwargs, *rest = key
                self.ahead(self._follow((dict(kwargs), *rest), value), True)
        self._dispatch()


def _attempt(predict: Predict, key: _Key) -> tuple[bool, Any]:
    kwargs, micro, accumulation, ckpt, stop_above = key
    try:
        return True, predict(dict(kwargs), micro, accumulation, ckpt, stop_above)
    except Exception as exc:  # noqa: BLE001 - raised where the search asks for it
        return False, exc


def _serve(predict: Predict, conn: Connection) -> None:
    """A worker: answer requests until the pool kills it. Ctrl-C reaches the parent,
    which ends the workers. One intra-op thread: the parent's OpenMP team (its real
    small tensors, e.g. an attention mask, may have started one) is not the child's, and
    a parallel region would wait for it forever; the workers are the parallelism."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    while True:
        key = conn.recv()
        ok, value = _attempt(predict, key)
        if not ok:
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - an error that cannot travel: its text does
                value = RuntimeError(f"{type(value).__name__}: {value}")
        conn.send((ok, value))


@contextlib.contextmanager
def prediction_pool(
    predict: Predict, workers: int,
    follow: Callable[[tuple, PeakPrediction], list[tuple]] | None = None,
) -> Iterator[PredictionPool]:
    """A `PredictionPool` for the block; its workers end with it."""
    pool = PredictionPool(predict, workers, follow)
    try:
        yield pool
    finally:
        pool.close()


def default_workers() -> int:
    """`plan`'s CLI default: the CPUs this process may run on, at most `MOST_WORKERS`; 1
    where processes cannot be forked."""
    if not _CAN_FORK:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return min(cpus, MOST_WORKERS)


# Each worker holds about 150 MB of its own (measured on the 7B Llama's search), and a
# search rarely has more than a few predictions to make ahead at once.
MOST_WORKERS = 8
_CAN_FORK = "fork" in multiprocessing.get_all_start_methods()
