"""Optimizer state on a slower tier (``ZeroConfig(offload="disk" | "host")``).

On real gloo groups, real files and real safetensors; one 2-rank launch runs the parity
matrix, the accounting, the bad inputs at ``shard()`` and the garbage-collection check,
and one 3-rank launch loads its checkpoints:

1. bitwise parity with the in-memory run (losses and every parameter, ``torch.equal``;
   also fp16 with a step skipped for overflow, its tier holding bytes; and an LR scheduler
   built before ``shard()`` whose lr 0 at one step leaves that step's parameters unchanged):
   stages 1-3 x fp32/bf16 x AdamW/SGD-with-momentum, each against two of the four
   (tier, fraction) settings {disk, host} x {1.0, 0.5}, chosen so that every setting
   meets every stage, dtype and optimizer; gradient clipping in every step; a chunk of
   a few kB, so pieces are split across chunks (and their ``step`` counters shared);
2. accounting: the bytes the tier holds, measured where they live (the disk file's size
   through its descriptor, the host arena's storage), equal the drop in resident master +
   optimizer state (`footprint` of both runs), the offloaded bytes `footprint`, `estimate`
   and `track` report, and with every piece offloaded the trained elements times the bytes
   per element;
3. checkpoints saved offloaded and in memory at 2 ranks, each loaded offloaded and in
   memory at 3 ranks: training goes on bitwise alike;
4. bad input: each a clear error at ``shard()``, the model and optimizer untouched;
5. a model garbage-collected: its file descriptors (the files) are gone.
"""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path

import pytest
import torch

import zerolite
import zerolite.cli
from tests.support import parity
from tests.support.memory_accounting import tier_bytes_held
from zerolite import checkpoint as ckpt
from zerolite.memory import estimate, footprint, track
from zerolite.plan.offload import OffloadPlan
from zerolite.state.offload import check_offload
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

STEPS = 3
CHUNK_BYTES = 4096  # far below 64 MiB: pieces of the tiny GPT span several chunks
HALF_FRACTION = 0.5
SETTINGS = list(itertools.product(("disk", "host"), (1.0, HALF_FRACTION)))
CASES = list(itertools.product((1, 2, 3), (torch.float32, torch.bfloat16), ("AdamW", "SGD")))


def _settings_of(i: int) -> list[tuple[str, float]]:
    # Two neighbouring settings, shifted every other case: over the 12 cases every setting
    # meets every stage, dtype and optimizer (test_parity_bitwise counts them).
    k = i + i // 2
    return [SETTINGS[k % 4], SETTINGS[(k + 1) % 4]]


def _config(stage, dtype, offload=None, fraction=1.0, where=None, **kw) -> zerolite.ZeroConfig:
    return zerolite.ZeroConfig(
        stage=stage, param_dtype=dtype, bucket_size_mb=0.01, offload=offload,
        offload_dir=where if offload == "disk" else None, offload_fraction=fraction, **kw,
    )


def _build(config, name="AdamW"):
    model = parity.make_model()
    opt = zerolite.shard(model, parity.make_optimizer(name, model), config)
    tier = state_of(model).offload
    if tier is not None:
        tier.chunk_bytes = CHUNK_BYTES
    return model, opt


def _train(model, opt, data):
    return parity.train(
        model, opt, data, sliced=True, before_step=lambda: opt.clip_grad_norm_(1.0)
    )


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in zerolite.full_state_dict(model, rank0_only=False).items()}


def _estimate(config, name, rank):
    """`estimate` of the same model and optimizer, not sharded."""
    model = parity.make_model()
    return estimate(model, world_size=2, config=config,
                    optimizer=parity.make_optimizer(name, model), rank=rank)


def _resident(b) -> int:
    return b.master + b.optimizer_state


def _offload_fds(where: str) -> list[str]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(where):
            fds.append(target)
    return fds


def _parity_and_accounting(where: str) -> list[dict]:
    data = parity.batches(STEPS)
    out = []
    for i, (stage, dtype, name) in enumerate(CASES):
        model, opt = _build(_config(stage, dtype), name)
        losses = _train(model, opt, data)
        full, resident = _full(model), footprint(opt)
        # This rank's trained elements: the optimizer's tensors (its master pieces), counted
        # from the in-memory run's param groups.
        trained = sum(t.numel() for g in opt.param_groups for t in g["params"])
        del model, opt
        for offload, fraction in _settings_of(i):
            config = _config(stage, dtype, offload, fraction, where)
            model, opt = _build(config, name)
            with track(opt) as t:
                off_losses = _train(model, opt, data)
            off_full, off = footprint(opt), _full(model)
            tier = state_of(model).offload
            out.append({
                "case": (stage, str(dtype), name, offload, fraction),
                "losses_equal": off_losses == losses,
                "unequal": [k for k in full if not torch.equal(full[k], off[k])],
                "tier_bytes": tier_bytes_held(model),
                "trained_elements": trained,
                "offloaded_elements": sum(s.numel for s in tier.plan.slots),
                "shard_elements": sum(f.layout.shard_numel for f in opt.flats),
                "split_pieces": any(s.numel * s.bytes_per_element > CHUNK_BYTES
                                    for s in tier.plan.slots),
                "footprint_offloaded": off_full.offloaded,
                "resident_drop": _resident(resident) - _resident(off_full),
                "same_params_grads": (resident.params, resident.grads)
                == (off_full.params, off_full.grads),
                "estimate": _estimate(config, name, opt.group.rank),
                "footprint": off_full,
                "tracked": (t.offloaded, str(t)),
                "staging": ([s.untyped_storage().nbytes() for s in tier.staging],
                            tier.chunk_bytes, [s.is_pinned() for s in tier.staging],
                            tier.arena.nbytes),
            })
            del model, opt
    return out


def _bad_inputs(where: str) -> dict[str, str]:
    """Every rank gets the same bad input, so each raises its own error (not a peer's)."""
    errors = {}
    cases = {
        "missing dir": dict(offload="disk", offload_dir=os.path.join(where, "nope", "deeper")),
        "a file": dict(offload="disk", offload_dir=__file__),
        "unwritable": dict(offload="disk", offload_dir="/sys"),
    }
    for label, kw in cases.items():
        model = parity.make_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        inner = parity.make_optimizer("AdamW", model)
        groups = [list(g["params"]) for g in inner.param_groups]
        try:
            zerolite.shard(model, inner, zerolite.ZeroConfig(stage=2, **kw))
        except ValueError as exc:
            errors[label] = str(exc)
        untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and all(
            a is b for g, saved in zip(inner.param_groups, groups)
            for a, b in zip(g["params"], saved)
        ) and state_of(model) is None
        errors[label + " untouched"] = str(untouched)
    return errors


def _collected(where: str) -> dict:
    gc.collect()  # the parity runs' models, in reference cycles until a collection
    model, opt = _build(_config(2, torch.bfloat16, "disk", 1.0, where))
    _train(model, opt, parity.batches(1))
    alive = _offload_fds(where)
    listed = os.listdir(where)
    del model, opt
    gc.collect()
    return {"alive": alive, "listed": listed, "after": _offload_fds(where)}


def _fp16_with_a_skipped_step(where: str) -> dict:
    """fp16 with loss scaling; step 1's gradients hold an inf, so it is skipped."""
    data = parity.batches(STEPS)
    out = {}
    for offload in (None, "disk"):
        model, opt = _build(_config(2, torch.float16, offload, 0.5, where))
        r, skipped = torch.distributed.get_rank(), []
        for step, (x, y) in enumerate(data):
            loss = model(parity.local_slice(x), parity.local_slice(y))
            opt.scale_loss(loss * (float("inf") if step == 1 else 1.0)).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            skipped.append(opt.step_was_skipped)
        fp = footprint(opt)
        out[offload] = (skipped, _full(model), r, fp.master + fp.optimizer_state,
                        tier_bytes_held(model))
    return out


def _with_scheduler(where: str) -> dict:
    """A LambdaLR built on the user's optimizer before shard(), lr 0 at step 1: offloaded
    (disk, all pieces; host, half) as in memory, and the lr reaches the streamed step."""
    data = parity.batches(STEPS)
    out = {}
    for offload, fraction in ((None, 1.0), ("disk", 1.0), ("host", HALF_FRACTION)):
        model = parity.make_model()
        inner = parity.make_optimizer("AdamW", model)
        schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.0 if s == 1 else 1.0)
        opt = zerolite.shard(model, inner, _config(3, torch.bfloat16, offload, fraction, where))
        if offload is not None:
            state_of(model).offload.chunk_bytes = CHUNK_BYTES
        changed, lrs = [], []
        for x, y in data:
            before = _full(model)
            model(parity.local_slice(x), parity.local_slice(y)).backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            schedule.step()
            after = _full(model)
            changed.append(any(not torch.equal(before[k], after[k]) for k in after))
        out[offload] = {"changed": changed, "lrs": lrs, "full": _full(model),
                        "tier": tier_bytes_held(model)}
    return out


def _save_rank(where: str, root: str) -> dict:
    results = {
        "scheduler": _with_scheduler(where),
        "fp16": _fp16_with_a_skipped_step(where),
        "parity": _parity_and_accounting(where),
        "bad": _bad_inputs(where),
        "gc": _collected(where),
    }
    data = parity.batches(2)
    for label, offload in (("mem", None), ("off", "disk")):
        model, opt = _build(_config(2, torch.bfloat16, offload, 0.5, where))
        _train(model, opt, data)
        ckpt.save(Path(root) / label, model, opt)
    return results


def _load_rank(where: str, root: str) -> dict:
    data = parity.batches(4)[2:]
    out = {}
    for source, (offload, fraction) in itertools.product(
        ("mem", "off"), ((None, 1.0), ("disk", 1.0), ("host", 0.5))
    ):
        model, opt = _build(_config(3, torch.bfloat16, offload, fraction, where))
        ckpt.load(Path(root) / source, model, opt)
        losses = _train(model, opt, data)
        out[source, offload, fraction] = (losses, _full(model))
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    where = str(tmp_path_factory.mktemp("offload"))
    root = str(tmp_path_factory.mktemp("ckpt"))
    saved = run_ranks(_save_rank, 2, where, root, timeout=300)
    loaded = run_ranks(_load_rank, 3, where, root, timeout=300)
    return saved, loaded, where


def test_parity_bitwise(launched):
    saved, _, _ = launched
    seen = set()
    for rank in saved:
        for r in rank["parity"]:
            assert r["losses_equal"] and not r["unequal"], r["case"]
            stage, dtype, name, offload, fraction = r["case"]
            seen |= {(stage, offload, fraction), (dtype, offload, fraction),
                     (name, offload, fraction)}
            if fraction == 1.0:
                assert r["offloaded_elements"] == r["shard_elements"], r["case"]
            else:  # rounded up to whole pieces, but not everything
                assert r["shard_elements"] / 2 <= r["offloaded_elements"] < r["shard_elements"]
    assert len(seen) == (3 + 2 + 2) * 4
    assert any(r["split_pieces"] for r in saved[0]["parity"])


def test_fp16_skipped_step_as_in_memory(launched):
    """Bitwise the in-memory run, with the tier observed: it holds bytes on disk (measured
    through the file's descriptor), and the resident bytes are lower by exactly as many."""
    for rank in launched[0]:
        (skipped, full, _, resident, _), (off_skipped, off, _, off_resident, held) = (
            rank["fp16"][None], rank["fp16"]["disk"])
        assert skipped == off_skipped and skipped[1] and not skipped[0]
        assert all(torch.equal(full[k], off[k]) for k in full)
        assert held > 0 and resident - off_resident == held, (resident, off_resident, held)


# Per trained element, what the tier takes: the optimizer's per-element state (AdamW's two
# fp32 moments, SGD's fp32 momentum), and with 16-bit parameters the fp32 master.
STATE_BYTES = {"AdamW": 8, "SGD": 4}


def test_resident_bytes_drop_by_the_offloaded_bytes(launched):
    """What the tier holds, measured where it lives (the kernel's size of the disk file
    through its descriptor, the host arena's storage), equals the drop in resident master +
    optimizer-state bytes against the in-memory run (both from real storages), and what
    `footprint`, `track` and `estimate` report as offloaded; with every piece offloaded
    (fraction 1) it is the trained elements times the bytes per element."""
    saved, _, _ = launched
    for rank in saved:
        for r in rank["parity"]:
            stage, dtype, name, offload, fraction = r["case"]
            held = r["tier_bytes"]
            assert held > 0, r["case"]
            assert r["resident_drop"] == held, (r["case"], r["resident_drop"], held)
            assert r["footprint_offloaded"] == held, (r["case"], r["footprint_offloaded"], held)
            if fraction == 1.0:
                per_element = STATE_BYTES[name] + (4 if dtype != "torch.float32" else 0)
                assert held == r["trained_elements"] * per_element, (r["case"], held)
            assert r["same_params_grads"]
            est, fp = r["estimate"], r["footprint"]
            assert est.offloaded == held, (r["case"], est.offloaded, held)
            assert (est.params, est.grads, est.master, est.optimizer_state) == (
                fp.params, fp.grads, fp.master, fp.optimizer_state
            ), r["case"]
            label = "optimizer state on disk" if offload == "disk" else "in host memory"
            assert label in str(fp)
            tracked, text = r["tracked"]
            assert tracked == held and label in text, (r["case"], tracked, held)
            # What is allocated, exactly: the arena (never pinned) and the three staging
            # buffers (pinned only for a CUDA model), each on its own line.
            sizes, chunk, pinned, arena = r["staging"]
            assert arena == held and len(sizes) == 3 and min(sizes) >= chunk
            assert fp.offload_staging == sum(sizes) and not any(pinned), r["case"]
            assert "offload staging buffers (host): " in str(fp)
            if dtype == "torch.float32":
                assert fp.master == 0  # the master is the parameter shard: it stays


def test_lr_scheduler_reaches_the_offloaded_step(launched):
    """A scheduler built before shard() drives the streamed step: lr 0 at step 1 leaves the
    parameters unchanged there (and only there), bitwise as in memory, with the tier holding
    bytes (stage 3, bf16: masters and moments offloaded)."""
    for rank in launched[0]:
        runs = rank["scheduler"]
        memory = runs[None]
        assert memory["changed"] == [True, False, True] and memory["lrs"][1] == 0.0, memory
        for offload in ("disk", "host"):
            got = runs[offload]
            assert got["tier"] > 0, (offload, got["tier"])
            assert got["changed"] == memory["changed"] and got["lrs"] == memory["lrs"], offload
            assert all(torch.equal(got["full"][k], v) for k, v in memory["full"].items()), offload


def test_bad_input_at_shard(launched):
    bad = launched[0][0]["bad"]
    assert "not an existing directory" in bad["missing dir"]
    assert "not an existing directory" in bad["a file"]
    if os.access("/sys", os.W_OK) and "unwritable" not in bad:
        pytest.skip("/sys is writable here")
    assert "not writable" in bad["unwritable"]
    for label in ("missing dir", "a file", "unwritable"):
        assert bad[label + " untouched"] == "True", label


def test_files_gone_when_model_collected(launched):
    saved, _, where = launched
    for rank in saved:
        result = rank["gc"]
        assert len(result["alive"]) == 1  # one file per rank and model
        assert result["after"] == []
    assert os.listdir(where) == []


def test_checkpoint_round_trip_two_to_three_ranks(launched):
    _, loaded, _ = launched
    for rank in loaded:
        (ref_losses, ref), *others = rank.values()
        for key, (losses, full) in rank.items():
            assert losses == ref_losses, key
            assert all(torch.equal(full[k], ref[k]) for k in ref), key


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(offload_fraction=0.0), "offload_fraction"),
        (dict(offload_fraction=1.5), "offload_fraction"),
        (dict(offload_fraction=float("nan")), "offload_fraction"),
        (dict(offload="nvme"), "ZeroConfig.offload:"),
        (dict(offload="disk"), "offload_dir"),
    ],
)
def test_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        zerolite.ZeroConfig(**kw)


def test_config_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROLITE_OFFLOAD", "disk")
    monkeypatch.setenv("ZEROLITE_OFFLOAD_DIR", str(tmp_path))
    monkeypatch.setenv("ZEROLITE_OFFLOAD_FRACTION", "0.25")
    config = zerolite.ZeroConfig()
    assert (config.offload, config.offload_dir, config.offload_fraction) == (
        "disk", str(tmp_path), 0.25
    )


def test_free_space_checked_against_the_exact_byte_count(tmp_path):
    config = zerolite.ZeroConfig(offload="disk", offload_dir=str(tmp_path))
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    too_big = OffloadPlan("disk", (), (), free + 2**30, 0)
    with pytest.raises(ValueError, match=f"needs {free + 2**30} bytes"):
        check_offload(too_big, config, torch.device("cpu"))
    check_offload(OffloadPlan("disk", (), (), 2**20, 0), config, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can pin memory")
def test_host_tier_for_cuda_needs_pinned_memory():
    offload = OffloadPlan("host", (), (), 2**20, 0)
    with pytest.raises(ValueError, match="pinned host memory"):
        check_offload(offload, zerolite.ZeroConfig(offload="host"), torch.device("cuda"))


def test_formula_offload_line():
    b = zerolite.memory.formula(10**9, world_size=4, stage=3, param_dtype=torch.bfloat16,
                                offload="disk", offload_fraction=0.5)
    assert (b.master, b.optimizer_state, b.offloaded) == (5 * 10**8, 10**9, 15 * 10**8)
    assert "optimizer state on disk" in str(b)


def test_cli_estimate_offload(capsys):
    assert zerolite.cli.main(
        ["estimate", "--params", "1e9", "--world-size", "4", "--offload", "disk"]
    ) == 0
    out = capsys.readouterr().out
    assert "optimizer state on disk" in out
    stage3 = next(line for line in out.splitlines() if line.startswith("3 "))
    # bf16 stage 3 at N = 4: 0.5 GB params + 0.5 GB grads resident, 3 GB on disk.
    assert stage3.split()[-3:] == ["1", "-", "3"]
