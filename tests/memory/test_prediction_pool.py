"""[Note: predictions ahead]: `plan` with worker processes makes the very plan it makes
alone; a worker's error reaches the search where it asks; a worker that dies has its
request made in the searching process. Real forked processes, real predictions."""

from __future__ import annotations

import os
import time
import types

import pytest
import torch

from tests.memory.test_plan_search import tiny, tiny_batch
from zerolite.memory import plan, predict_peak
from zerolite.memory.budget_search import larger_after_fit
from zerolite.memory.prediction_pool import PredictionPool, prediction_pool

SEARCH = dict(stages=(1, 3), param_dtypes=(torch.float32,), offloads=(None, "host"),
              offload_fractions=(1.0,), offload_params=(None,), checkpointing=(False, True))


def _entries(memory: int, workers: int) -> list:
    return plan(tiny, tiny_batch, 2, memory, 4, workers=workers, **SEARCH)


def test_the_plan_is_the_same_at_any_number_of_workers():
    alone = _entries(1 << 30, 1)
    roomy = min(e.peak_bytes for e in alone if e.fits)
    # the cheapest pick; one that fits only after rejections (stopped simulations); none
    reasons = []
    for memory in (1 << 30, roomy - 1, roomy // 3):
        one = alone if memory == 1 << 30 else _entries(memory, 1)
        assert _entries(memory, 2) == one, memory
        reasons += [e.reason for e in one if e.reason]
    assert not one[0].fits
    assert any("simulation stopped" in r for r in reasons), reasons


def _predict(kw, micro, accumulation, ckpt, stop_above):
    return predict_peak(tiny, tiny_batch, __import__("zerolite").ZeroConfig(**kw), 2,
                        micro_batch=micro, accumulation=accumulation,
                        activation_checkpointing=ckpt, stop_above=stop_above)


def _same(a, b) -> bool:
    return a.peak == b.peak and a.by_phase == b.by_phase and a.complete == b.complete


def test_an_error_in_a_worker_is_raised_where_the_search_asks():
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    def predict(kw, micro, accumulation, ckpt, stop_above):
        if kw["stage"] == 2:
            raise ValueError("stage 2 refused here")
        if kw["stage"] == 3:
            raise Unpicklable("stage 3 cannot travel")
        return _predict(kw, micro, accumulation, ckpt, stop_above)

    with prediction_pool(predict, 2) as pool:
        pool.ahead([({"stage": s}, 1, 2, False, None) for s in (1, 2, 3)])
        assert _same(pool({"stage": 1}, 1, 2, False, None),
                     _predict({"stage": 1}, 1, 2, False, None))
        with pytest.raises(ValueError, match="stage 2 refused here"):
            pool({"stage": 2}, 1, 2, False, None)
        with pytest.raises(RuntimeError, match="Unpicklable: stage 3 cannot travel"):
            pool({"stage": 3}, 1, 2, False, None)


def test_a_worker_that_dies_has_its_request_made_here():
    parent = os.getpid()

    def predict(kw, micro, accumulation, ckpt, stop_above):
        if os.getpid() != parent:
            os._exit(3)  # every worker dies at its first request
        return _predict(kw, micro, accumulation, ckpt, stop_above)

    pool = PredictionPool(predict, 2)
    try:
        pool.ahead([({"stage": 1}, 1, 2, False, None), ({"stage": 3}, 1, 2, False, None)])
        for stage in (3, 1):
            assert _same(pool({"stage": stage}, 1, 2, False, None),
                         _predict({"stage": stage}, 1, 2, False, None))
    finally:
        pool.close()


def test_a_fitting_micro_batch_1_brings_the_larger_ones_ahead():
    """`larger_after_fit`: what `search` asks once micro-batch 1 fits, and nothing after a
    rejection or for another micro-batch."""
    fits = _predict({"stage": 1}, 1, 8, False, None)
    stopped = _predict({"stage": 1}, 1, 8, False, fits.peak - 1)
    request = ({"stage": 1}, 1, 8, False, fits.peak)
    assert larger_after_fit(request, fits) == [
        ({"stage": 1}, m, 8 // m, False, fits.peak) for m in (8, 4, 2)]
    assert larger_after_fit(request[:-1] + (fits.peak - 1,), stopped) == []
    assert larger_after_fit(({"stage": 1}, 2, 4, False, None), fits) == []


def test_the_search_s_request_goes_first_and_follow_ups_keep_their_place(tmp_path):
    """[Note: predictions ahead]'s order, seen from the order one worker starts requests
    (the other is held on B until the end): a request the search waits for goes before
    a queued one's follow-ups; the worker that answers it takes nothing more until the
    search asks again; then what the search asked and its follow-ups come first, then
    the rest in the search's order."""
    started, release = tmp_path / "started", tmp_path / "release"

    def predict(kw, micro, accumulation, ckpt, stop_above):
        with open(started, "a") as log:
            log.write(f"{kw['name']}{micro}\n")
        while kw["name"] == "B" and not release.exists():
            time.sleep(0.01)
        return types.SimpleNamespace(complete=True)

    def follow(request, answer):  # micro-batch 1 of A and C brings larger ones
        kw, micro = request[:2]
        return [(kw, m, 1, False, None) for m in (2, 4)] if micro == 1 and kw["name"] in "AC" \
            else []

    def request(name, micro=1):
        return ({"name": name}, micro, 1, False, None)

    def order():
        return [line for line in started.read_text().split() if line != "B1"]

    with prediction_pool(predict, 2, follow) as pool:
        pool.ahead([request(n) for n in "ABCD"])  # A on the first worker, B held
        pool(*request("C"))
        assert order() == ["A1", "C1"]  # not A's follow-ups, answered meanwhile
        pool(*request("D"))
        assert order() == ["A1", "C1", "D1"]  # not C's follow-ups, queued first
        for name, micro in [("C", 2), ("C", 4), ("A", 2), ("A", 4)]:
            pool.ahead([])
            pool(*request(name, micro))
        assert order() == ["A1", "C1", "D1", "C2", "C4", "A2", "A4"]
        release.touch()
