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

Which request a free worker takes matters as much as how many there are: the search is
sequential, so a prediction it waits for while a worker runs one it may never ask for
is the plan's time lost. So the queue keeps the search's order -- a request's follow-ups
(a combination's larger micro-batches) take its place, ahead of every later
combination's -- what the search asks for goes first, and the worker that answers the
request the search waits for stays free until the search has asked its next one. (On
the 7B Llama of `benchmarks/plan_time.py` with 2 workers, a micro-batch the search
needed had waited 3.7 s behind another combination's, queued first when a worker
answered: the search took 20.1 s, and 17.2 s in this order.)

The workers are forked, so the model and batch functions need not be picklable, and
they share what the parent had built; each keeps its own fake-tensor cache. A worker
that dies has its request made again in this process.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
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

    Call it as ``predict``; `ahead` queues requests it will probably ask, in the order
    it will ask them; ``follow(request, prediction)`` names more once a worker answers
    (queued in that request's place); `close` ends the workers (what they are doing is
    thrown away)."""

    def __init__(self, predict: Predict, workers: int,
                 follow: Callable[[tuple, PeakPrediction], list[tuple]] | None = None) -> None:
        self._predict = predict
        self._follow = follow
        self._done: dict[_Key, tuple[bool, Any]] = {}
        self._queue: list[_Key] = []  # in `_place` order
        # (the search's order, then arrival); -1: what the search asked for
        self._place: dict[_Key, tuple[int, int]] = {}
        self._orders = itertools.count()
        self._arrivals = itertools.count()
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

    def ahead(self, requests: Iterable[tuple]) -> None:
        """Queue ``requests`` (``predict``'s arguments), after those queued already; those
        known or under way are left out."""
        if self._workers:
            self._enqueue(requests, None)
            self._dispatch()

    def __call__(self, kwargs: dict[str, Any], micro: int, accumulation: int, ckpt: bool,
                 stop_above: int | None) -> PeakPrediction:
        key = _key(kwargs, micro, accumulation, ckpt, stop_above)
        if self._workers and self._answer(key) is None and not {
                key, _whole(key)} & {*self._busy.values()}:
            self._queue = [key, *(k for k in self._queue if k != key)]  # first of all
            self._place[key] = (-1, next(self._arrivals))
        self._dispatch()  # workers left free for this request ([Note: predictions ahead])
        while (answer := self._answer(key)) is None:
            if not self._workers:
                self._done[key] = _attempt(self._predict, key)
            else:
                self._receive(key)
        ok, value = answer
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

    def _enqueue(self, requests: Iterable[tuple], after: _Key | None) -> None:
        """Queue ``requests`` in the search's order: at the end (``after`` None), or as
        ``after``'s follow-ups, in its place, after those already there."""
        known = {*self._done, *self._busy.values(), *self._queue}
        for key in dict.fromkeys(_key(*r) for r in requests):
            if key not in known:
                order = next(self._orders) if after is None else self._place[after][0]
                self._place[key] = (order, next(self._arrivals))
                self._queue.append(key)
        self._queue.sort(key=self._place.__getitem__)

    def _dispatch(self) -> None:
        for conn in self._workers:
            if conn not in self._busy and self._queue:
                key = self._queue.pop(0)
                conn.send(key)
                self._busy[conn] = key

    def _receive(self, awaited: _Key) -> None:
        """Wait for a worker's answer and store it; a worker that died is dropped and its
        request queued first again (made here once no worker is left). Workers are given
        more only if the answer is not ``awaited``: the search asks its next request
        first."""
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
                self._done[_whole(key)] = (ok, value)
            if ok and self._follow is not None:
                kwargs, *rest = key
                self._enqueue(self._follow((dict(kwargs), *rest), value), key)
        if self._answer(awaited) is None:
            self._dispatch()

    def _answer(self, key: _Key) -> tuple[bool, Any] | None:
        """``key``'s answer, or a whole prediction's of the same request (it answers a
        stopped one too); None while there is neither."""
        return self._done.get(key) or self._done.get(_whole(key))


def _whole(key: _Key) -> _Key:
    """The request for the same prediction made whole (no ``stop_above``)."""
    return key[:-1] + (None,)


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
    # What the parent built is never garbage here: the collector skips it (and leaves
    # its pages shared). A prediction makes some 100,000 objects in reference cycles,
    # so collections run 30 times less often than by default.
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
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
