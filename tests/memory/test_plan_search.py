"""The pruned search of `zerolite.memory.plan` against the exhaustive one, computed in the
same run: the same pick at budgets on both sides of each pick's peak and where nothing
fits; every entry it predicted equal to the exhaustive entry; every entry it rejected
without a prediction over the budget in the exhaustive search too, by at least the bound
it gave; every entry it skipped no cheaper than the pick; with checkpointing searched too,
where the optimizer step of a configuration rejects it ([Note: step floor]). And
`predict_peak`'s shortened accumulation against simulating every micro-step, and offload
fractions with one offload plan against predicting each.

A tiny GPT keeps each prediction near a third of a second; the search covers stages 1
and 3, no offload and a disk tier, at 2 ranks and a batch of 2 (micro-batches 2 and 1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerolite
from examples.gpt import GPT, GPTConfig
from zerolite.memory import budget_search, plan, predict_peak
from zerolite.memory.budget_bounds import shared_fractions, state_bounds
from zerolite.memory.estimate import estimate_planned

SEQ = 8


def tiny() -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=64, seq_len=SEQ, n_layer=1, n_head=1, d_model=16))


def tiny_batch(micro_batch: int) -> dict[str, torch.Tensor]:
    idx = torch.zeros(micro_batch, SEQ, dtype=torch.long)
    return {"idx": idx, "targets": idx}


def wide() -> torch.nn.Module:
    """Wider and shorter than `tiny`: at stage 1 in bf16 its optimizer step holds more
    than its backward."""
    return GPT(GPTConfig(vocab_size=64, seq_len=2, n_layer=1, n_head=1, d_model=64))


def wide_batch(micro_batch: int) -> dict[str, torch.Tensor]:
    idx = torch.zeros(micro_batch, 2, dtype=torch.long)
    return {"idx": idx, "targets": idx}


SEARCH = dict(stages=(1, 3), param_dtypes=(torch.float32,), offloads=(None, "disk"),
              offload_fractions=(1.0,), checkpointing=(False,))


def _plan(memory: int, tmp_path, exhaustive: bool, search: dict, model=(tiny, tiny_batch)) -> list:
    return plan(*model, 2, memory, 2, offload_dir=str(tmp_path), exhaustive=exhaustive,
                **search)


def _key(entry) -> tuple:
    return (tuple(sorted(entry.config.items(), key=str)), entry.activation_checkpointing)


def _check(memory: int, tmp_path, search: dict = SEARCH, reasons: list | None = None,
           first_rejection: bool = True, model=(tiny, tiny_batch)) -> list:
    """Both searches at ``memory``; the exhaustive entries (the pruned search's reasons
    are appended to ``reasons``). Where nothing fits, the first entries are the same
    rejection only if ``first_rejection``: an entry rejected unpredicted is ordered by
    its bound, which may be under its peak."""
    full = _plan(memory, tmp_path, True, search, model)
    fast = _plan(memory, tmp_path, False, search, model)
    if reasons is not None:
        reasons += [e.reason for e in fast if e.reason]
    assert len(full) == len(fast)
    if first_rejection or full[0].fits:
        assert full[0] == fast[0], (memory, full[0], fast[0])
    assert not fast[0].fits or full[0].fits
    by_key = {_key(e): e for e in full}
    for entry in fast:
        same = by_key[_key(entry)]
        reason = entry.reason or ""
        if reason.startswith("skipped"):
            assert fast[0].fits and same.cost() >= fast[0].cost(), (entry, same)
        elif "not predicted" in reason:
            assert not same.fits and same.peak_bytes >= entry.peak_bytes > memory, (entry, same)
        else:
            assert entry == same
    return full


def test_pruned_search_picks_what_the_exhaustive_search_picks(tmp_path):
    roomy = _check(1 << 30, tmp_path)
    assert roomy[0].fits and roomy[0].config == {"stage": 1, "param_dtype": torch.float32}
    assert _check(roomy[0].peak_bytes, tmp_path)[0] == roomy[0]  # at the peak: still fits
    # Just under each pick's peak, the next pick; until nothing fits (or three changes of pick).
    picks, memory = [roomy[0]], roomy[0].peak_bytes - 1
    while picks[-1].fits and len(picks) < 4:
        picks.append(_check(memory, tmp_path)[0])
        memory = picks[-1].peak_bytes - 1
    fitting = [(_key(p), p.micro_batch) for p in picks if p.fits]
    assert len(set(fitting)) == len(fitting) >= 2, picks
    if picks[-1].fits:
        assert not _check(min(e.peak_bytes for e in roomy) // 4, tmp_path)[0].fits


def test_step_floor_rejects_only_what_the_exhaustive_search_rejects(tmp_path, monkeypatch):
    """[Note: step floor]: with checkpointing searched, a combination whose optimizer step
    (simulated without checkpointing, and stopped there) is over the budget is rejected
    unpredicted; the pick is the exhaustive search's at budgets just under the step peaks
    and each pick's peak. `wide` in bf16 at stage 1 holds the most in its step, so a
    budget under that peak stops its simulation in the step. (Where nothing fits, the
    least-over entries are then predicted after all: the reasons are read before that.)"""
    search = dict(SEARCH, param_dtypes=(torch.bfloat16,), offloads=(None,),
                  offload_params=(None,), checkpointing=(False, True))
    model = (wide, wide_batch)
    before: list[str] = []
    settle = budget_search._predict_least_over

    def recorded(entries, *args, **kwargs):
        before.extend(e.reason for e in entries if e is not None and e.reason)
        return settle(entries, *args, **kwargs)

    monkeypatch.setattr(budget_search, "_predict_least_over", recorded)
    predicted = [predict_peak(wide, wide_batch, zerolite.ZeroConfig(
        stage=stage, param_dtype=torch.bfloat16), 2, micro_batch=1, accumulation=2)
        for stage in (1, 3)]
    assert predicted[0].phase == "step", predicted[0]  # what the test needs of `wide`
    steps = [p.by_phase["step"] for p in predicted]
    reasons: list[str] = []
    picks = [_check(1 << 30, tmp_path, search, reasons, model=model)[0]]
    for memory in sorted({*(n - 1 for n in steps), picks[0].peak_bytes - 1}, reverse=True):
        picks.append(_check(memory, tmp_path, search, reasons, first_rejection=False,
                            model=model)[0])
    assert any("its optimizer step" in r for r in reasons + before), reasons
    assert picks[0].fits and not all(p.fits for p in picks), picks


@pytest.mark.parametrize("config", [
    dict(stage=2, param_dtype=torch.bfloat16),
    dict(stage=3, offload="host"),
])
def test_fewer_micro_steps_predict_what_every_micro_step_does(config):
    kwargs = dict(micro_batch=2, accumulation=5, activation_checkpointing=True)
    args = (tiny, tiny_batch, zerolite.ZeroConfig(**config), 2)
    short = dataclasses.replace(predict_peak(*args, **kwargs), seconds=0.0)
    full = dataclasses.replace(predict_peak(*args, **kwargs, every_micro_step=True), seconds=0.0)
    assert short == full


@pytest.mark.parametrize("stage", [1, 3])
def test_fractions_with_one_offload_plan_predict_the_same(stage):
    """[Note: shared fractions]: fractions whose offload plans are equal predict the same
    step, field for field (but the config); `shared_fractions` asks once for them."""
    with torch.device("meta"):
        model = tiny()
    fractions = (0.1, 0.25, 0.5, 0.75, 1.0)
    configs = {f: zerolite.ZeroConfig(stage=stage, offload="host", offload_fraction=f)
               for f in fractions}
    plans = {f: estimate_planned(model, world_size=2, config=c)[1] for f, c in configs.items()}
    pairs = [(a, b) for a in fractions for b in fractions if a < b]
    same = [(a, b) for a, b in pairs if plans[a] == plans[b]]
    assert same and len(same) < len(pairs), plans  # both kinds of pair are in the test
    kwargs = dict(micro_batch=2, accumulation=2)
    predicted = {f: dataclasses.replace(predict_peak(tiny, tiny_batch, c, 2, **kwargs),
                                        seconds=0.0, config=None)
                 for f, c in configs.items()}
    for a, b in pairs:
        assert (predicted[a] == predicted[b]) == ((a, b) in same), (a, b)

    asked: list[float] = []

    def predict(kw, micro, accumulation, ckpt, stop_above):
        asked.append(kw["offload_fraction"])
        return predicted[kw["offload_fraction"]]

    kws = [dict(stage=stage, offload="host", offload_fraction=f) for f in fractions]
    bounds = state_bounds(tiny, [zerolite.ZeroConfig(**kw) for kw in kws], 2, "adamw", "cpu")
    shared = shared_fractions(predict, kws, bounds)
    for kw in kws:
        assert shared(kw, 2, 1, False, None) == predicted[kw["offload_fraction"]]
    assert len(asked) == len({plans[f] for f in fractions})


@pytest.mark.parametrize("config", [
    dict(stage=1),
    dict(stage=2, param_dtype=torch.bfloat16),
    dict(stage=3, offload="host"),
])
def test_a_stopped_simulation_is_a_lower_bound(config):
    """[Note: stopped simulation]: stopped at budgets in each phase of the whole
    prediction, the prediction is marked incomplete, is over the budget and under the
    whole peak in every phase it reached; at the peak itself it is the whole prediction.
    A stopped simulation leaves nothing behind: the next one is unchanged."""
    args = (tiny, tiny_batch, zerolite.ZeroConfig(**config), 2)
    kwargs = dict(micro_batch=1, accumulation=3, activation_checkpointing=True)

    def predicted(stop_above=None):
        p = predict_peak(*args, **kwargs, stop_above=stop_above)
        return dataclasses.replace(p, seconds=0.0)

    whole = predicted()
    assert whole.complete
    stopped_in = set()
    for phase, peak in whole.by_phase.items():
        for limit in (peak // 2, peak - 1):
            p = predicted(limit)
            assert not p.complete and limit < p.peak <= whole.peak, (phase, limit, p)
            assert p.communication_bytes == 0
            assert all(n <= whole.by_phase[q] for q, n in p.by_phase.items()), (p, whole)
            assert sum(p.breakdown.values()) == p.peak
            stopped_in.add(p.phase)
    # Stopped in two phases at least, once inside the autograd engine.
    assert "backward" in stopped_in and len(stopped_in) >= 2, stopped_in
    assert predicted(whole.peak) == whole
    assert predicted() == whole
