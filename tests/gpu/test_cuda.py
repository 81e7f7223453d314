"""What only a GPU can show: `make gpu-check` runs these; without CUDA they skip.

The single-GPU list (world size 1, NCCL where a group is needed): agreement flags built on
the CPU exchanged over NCCL; waits that do not block the host; host syncs per step that do
not grow with the number of buckets, units or offload chunks (``set_sync_debug_mode``);
``step`` on the CPU after a load; async-save staging; exact-size pinned memory; offload
parity on CUDA; stage-3 storage freed per unit; the meta build on CUDA; ``track()`` against
the allocator's own peak; fp16 through `ZeroAccelerator` with a forced overflow; the
conversion guard. Tests that need two GPUs (NCCL training at 2 ranks, a model on a device
that is not the current one) skip with one. Measurements are printed (``-s``): they are the
GPU table in docs/limits.md.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zerolite
from tests.stage3.test_meta_init import PlainGPT
from tests.support import parity
from tests.support.rank_reports import check_reports, guarded, new_report, record_parity
from zerolite import ZeroConfig
from zerolite import checkpoint as ckpt
from zerolite.checkpoint.staging import StagingArea
from zerolite.comm.collectives import Group, wait_for
from zerolite.comm.small_collectives import run_small
from zerolite.memory import footprint, track
from zerolite.state.pinned import host_buffer
from zerolite.state.shard_state import state_of
from zerolite.testing import run_ranks

pytestmark = pytest.mark.cuda
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def _model(device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    return parity.make_model(seed).to(device)


def _data(steps: int, device: str = "cuda") -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.to(device), y.to(device)) for x, y in parity.batches(steps)]


def _train(model, opt, data, *, clip: bool = True, fp16: bool = False) -> None:
    for x, y in data:
        loss = model(parity.local_slice(x), parity.local_slice(y))
        (opt.scale_loss(loss) if fp16 else loss).backward()
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _sleep_cycles(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the current stream busy about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds * 1000 / start.elapsed_time(end))


# ------------------------------------------------------------------- NCCL groups of one


def _nccl_group_of_one() -> dict:
    model = _model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), ZeroConfig(stage=2))
    group = opt.group
    flags = torch.tensor([1, 5, -3])  # born on the CPU, as the step's agreement flags
    exchanged = run_small(flags.to(group.device), group, "max", what="gpu-check flags")
    _train(model, opt, _data(2))
    try:
        other = _model()
        zerolite.shard(other, torch.optim.AdamW(other.parameters()),
                       ZeroConfig(collectives="point_to_point"))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    zerolite.shard(meta, torch.optim.AdamW(meta.parameters()))
    return {
        "backend": (str(dist.get_backend()), dist.get_backend_config()),
        "device": str(group.device),
        "current": torch.cuda.current_device(),
        "bound": str(dist.group.WORLD.bound_device_id),
        "waits": (group.bounded_waits, group.point_to_point),
        "exchanged": (exchanged.tolist(), str(exchanged.device)),
        "refused": refused,
        "meta": str(next(meta.parameters()).device),
    }


@pytest.mark.parametrize("backend", ["nccl", None])
def test_nccl_group_of_one_places_small_collectives_on_the_buffers_device(backend):
    out = run_ranks(_nccl_group_of_one, 1, backend=backend, timeout=300)[0]
    print(f"\n[gpu-check] backend={backend!r}: {out}")
    assert "nccl" in out["backend"][1], out
    assert (out["device"], out["current"], out["bound"]) == ("cuda:0", 0, "cuda:0"), out
    assert out["waits"] == (False, False), out  # NCCL: no timeout in waits, native kernels
    assert out["exchanged"] == ([1, 5, -3], "cpu"), out
    assert "refused over NCCL" in out["refused"], out
    assert out["meta"] == "cuda:0", out  # a backend-less group on a GPU machine too


def _wait_timing() -> dict:
    group = Group(device=torch.device("cuda", torch.cuda.current_device()))
    cycles = _sleep_cycles(0.5)
    t = torch.ones(1, device="cuda")
    out = {}
    for name, wait in (
        ("zerolite", lambda work: wait_for(work, group, "gpu-check wait")),
        ("wait(timeout)", lambda work: work.wait(timedelta(seconds=60))),
    ):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # the stream is busy for ~0.5 s
        work = dist.all_reduce(t, async_op=True)
        start = time.perf_counter()
        wait(work)
        out[name] = time.perf_counter() - start
        torch.cuda.synchronize()
    return out


def test_nccl_waits_do_not_block_the_host():
    out = run_ranks(_wait_timing, 1, backend="nccl", timeout=300)[0]
    print(f"\n[gpu-check] host time in a wait behind 0.5 s of GPU work: {out}")
    assert out["zerolite"] < 0.1, out


# --------------------------------------------------------------- host syncs per step


def _count_syncs(work: Callable[[], object]) -> int:
    """Host syncs ``work`` makes on this thread (the offload writer waits on its events)."""
    main = threading.get_ident()
    syncs = []

    def record(message, *args, **kwargs) -> None:
        if "synchroniz" in str(message) and threading.get_ident() == main:
            syncs.append(str(message))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return len(syncs)


def _syncs_in_one_step(config: ZeroConfig, chunk_bytes: int | None = None) -> int:
    model = _model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    if chunk_bytes is not None:
        state_of(model).offload.chunk_bytes = chunk_bytes
    fp16 = config.param_dtype == torch.float16
    data = _data(2)
    _train(model, opt, data[:1], fp16=fp16)  # warm-up: state, staging buffers, caches
    return _count_syncs(lambda: _train(model, opt, data[1:], fp16=fp16))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["fp32", "fp16", "offload"])
def test_host_syncs_per_step_do_not_grow_with_buckets(stage, kind, tmp_path):
    extra: dict = {"param_dtype": torch.float16} if kind == "fp16" else {}
    chunks: tuple[int | None, int | None] = (None, None)
    if kind == "offload":
        extra = {"offload": "host"}
        chunks = (2**26, 4096)  # one chunk, many chunks
    few = _syncs_in_one_step(ZeroConfig(stage=stage, bucket_size_mb=25.0, **extra), chunks[0])
    many = _syncs_in_one_step(ZeroConfig(stage=stage, bucket_size_mb=0.01, **extra), chunks[1])
    print(f"\n[gpu-check] stage {stage} {kind}: host syncs in one step with clip: "
          f"1 bucket {few}, many buckets {many}")
    assert few == many, (few, many)


# ------------------------------------------------------------------ state and memory


def _step_after_load(root: str) -> dict:
    out = {}
    for fused in (False, True):
        model = _model()
        opt = zerolite.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused))
        _train(model, opt, _data(2))
        ckpt.save(f"{root}/fused{fused}", model, opt)
        fresh = _model(seed=1)
        fresh_opt = zerolite.shard(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3,
                                                              fused=fused))
        ckpt.load(f"{root}/fused{fused}", fresh, fresh_opt)
        out[fused] = sorted({str(p.state["step"].device) for p in state_of(fresh).pieces()})
        _train(fresh, fresh_opt, _data(1))  # and it steps
    return out


def test_step_stays_on_the_cpu_after_a_load(tmp_path):
    out = run_ranks(_step_after_load, 1, str(tmp_path), backend="nccl", timeout=300)[0]
    print(f"\n[gpu-check] device of `step` after a load (fused False / True): {out}")
    assert out == {False: ["cpu"], True: ["cuda:0"]}, out


def _staging_check(device: torch.device) -> bool:
    x = torch.randn(2**22, device=device)
    expected = x.cpu()
    with torch.cuda.device(device):
        torch.cuda._sleep(_sleep_cycles(0.2))  # the copies queue behind 0.2 s of work
    area = StagingArea()
    area.copy_in({"x": x})
    x.add_(1.0)  # an edit right after the call must not reach the staged bytes
    slot = area.slots[0]
    staged = area.buffer[slot.start : slot.end].view(torch.float32)
    return bool(area.buffer.is_pinned()) and torch.equal(staged, expected)


def test_async_save_staging_equals_the_values_at_the_call():
    assert _staging_check(torch.device("cuda", torch.cuda.current_device()))


@two_gpus
def test_async_save_staging_from_a_device_that_is_not_the_current_one():
    with torch.cuda.device(0):
        assert _staging_check(torch.device("cuda", 1))


def _host_allocator_bytes() -> int:
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def test_pinned_buffers_are_exactly_their_size():
    nbytes = 10 * 2**20 + 12345  # the caching host allocator would reserve 16 MiB
    before = _host_allocator_bytes()
    rounded = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    by_torch = _host_allocator_bytes() - before
    del rounded
    before = _host_allocator_bytes()
    buffer = host_buffer(nbytes, pinned=True)
    print(f"\n[gpu-check] pinning {nbytes} B: pin_memory=True reserves {by_torch} B, "
          f"zerolite.state.pinned {buffer.untyped_storage().nbytes()} B")
    assert buffer.is_pinned() and buffer.untyped_storage().nbytes() == nbytes
    assert _host_allocator_bytes() == before  # the caching host allocator is not involved
    ptr = buffer.data_ptr()
    del buffer
    gc.collect()
    assert int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0  # already unregistered
    model = _model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model),
                         ZeroConfig(stage=2, offload="host"))
    _train(model, opt, _data(1))
    tier = state_of(model).offload
    measured = footprint(opt)
    print(f"\n[gpu-check] offload host arena {measured.offloaded} B (pinned: "
          f"{tier.arena.data.is_pinned()}), staging {measured.offload_staging} B for chunks of "
          f"{tier.chunk_bytes} B (pinned: {[t.is_pinned() for t in tier.staging]})")
    assert not tier.arena.data.is_pinned() and all(t.is_pinned() for t in tier.staging)
    assert measured.offloaded == tier.plan.nbytes
    assert measured.offload_staging == sum(t.numel() for t in tier.staging)


@pytest.mark.parametrize("offload", ["host", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_is_bitwise_the_in_memory_step_on_cuda(offload, dtype, tmp_path):
    results = []
    for config in (
        ZeroConfig(stage=2, param_dtype=dtype),
        ZeroConfig(stage=2, param_dtype=dtype, offload=offload, offload_dir=str(tmp_path)),
    ):
        model = _model()
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
        if config.offload is not None:
            state_of(model).offload.chunk_bytes = 4096  # pieces span several chunks
        _train(model, opt, _data(3))
        results.append(zerolite.full_state_dict(model, rank0_only=False))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_stage3_frees_each_unit_after_use():
    model = _model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model),
                         ZeroConfig(stage=3, reshard_after_forward=True))
    _train(model, opt, _data(2))
    state = state_of(model)
    units = state.scheduler.flats  # per unit, the root last
    freed = [all(f.data.untyped_storage().nbytes() == 0 for f in unit) for unit in units]
    assert all(freed[:-1]), freed  # after a step only the root may stay gathered
    grown = []
    for i in range(len(units) - 1):
        before = torch.cuda.memory_allocated()
        with state.gather(i) as flats:
            full = sum(f.layout.padded_numel * f.data.element_size() for f in flats)
            grown.append((torch.cuda.memory_allocated() - before, full))
        assert torch.cuda.memory_allocated() == before, i  # its storage went back
    print(f"\n[gpu-check] stage 3: allocated while a unit is gathered vs its full size: {grown}")
    assert all(delta >= full for delta, full in grown), grown


def test_meta_build_on_cuda_equals_the_normal_build():
    config = ZeroConfig(stage=3, device="cuda", bucket_size_mb=0.02)
    built, generators = [], []
    for meta in (False, True):
        torch.manual_seed(3)
        with torch.device("meta" if meta else "cuda"):
            model = PlainGPT(parity.TINY)
        zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
        built.append(zerolite.full_state_dict(model, rank0_only=False))
        generators.append((torch.get_rng_state(), torch.cuda.get_rng_state()))
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])
    assert all(torch.equal(a, b) for a, b in zip(*generators))


class _Stacked(torch.nn.Module):
    """Three stage-3 units (the blocks) of ``depth`` Linear layers each, and a head."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(depth)))
            for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 2)


def test_meta_build_syncs_once_per_unit_not_per_module():
    counts = {}
    for depth in (2, 8):
        with torch.device("meta"):
            model = _Stacked(depth)
        opt = torch.optim.AdamW(model.parameters())
        counts[depth] = _count_syncs(
            lambda model=model, opt=opt: zerolite.shard(model, opt, ZeroConfig(stage=3,
                                                                               device="cuda"))
        )
    print(f"\n[gpu-check] host syncs of a stage-3 meta build, 3 units of 2 / 8 modules: {counts}")
    assert counts[2] == counts[8], counts


def test_track_peaks_against_the_allocator_without_resetting_it():
    model = _model()
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), ZeroConfig(stage=2))
    data = _data(2)
    _train(model, opt, data[:1])
    torch.cuda.reset_peak_memory_stats()
    with track(opt) as tracker:
        _train(model, opt, data[1:])
    peak = torch.cuda.max_memory_allocated()
    phases = ("forward", "backward", "step")
    print(f"\n[gpu-check] track() peaks {[tracker.peaks[p].process for p in phases]} B, "
          f"max_memory_allocated {peak} B")
    assert all(tracker.peaks[p].kind == "CUDA peak allocated" for p in phases)
    assert max(tracker.peaks[p].process for p in phases) == peak  # the phase that set it
    big = torch.empty(4 * peak, dtype=torch.uint8, device="cuda")
    del big
    user_peak = torch.cuda.max_memory_allocated()
    with track(opt):
        _train(model, opt, data[1:])
    assert torch.cuda.max_memory_allocated() == user_peak  # the user's counter untouched


def _fp16_accelerate() -> dict:
    from zerolite.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(mixed_precision="fp16", zero_config=ZeroConfig(stage=2))
    model = parity.make_model()
    model, opt = accelerator.prepare(model, parity.make_optimizer("AdamW", model))
    skipped, scales = [], []
    for i, (x, y) in enumerate(_data(3, str(accelerator.device))):
        loss = model(x, y)
        accelerator.backward(loss * float("inf") if i == 1 else loss)  # step 1 overflows
        accelerator.unscale_gradients()
        accelerator.clip_grad_value_(model.parameters(), 1.0)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        skipped.append(opt.step_was_skipped)
        scales.append(opt.optimizer.loss_scaler.scale)
        opt.zero_grad()
    return {"skipped": skipped, "scales": scales, "scaler": accelerator.scaler}


def test_fp16_through_zero_accelerator_with_a_forced_overflow():
    out = run_ranks(guarded, 1, _fp16_accelerate, backend="nccl", timeout=300)[0]
    assert "error" not in out, out.get("error")
    assert out["skipped"] == [False, True, False] and out["scaler"] is None, out
    assert out["scales"][1] == out["scales"][0] / 2, out


def test_conversion_guard_after_shard():
    model = _model()
    zerolite.shard(model, parity.make_optimizer("AdamW", model), ZeroConfig(stage=2))
    model.to("cuda")  # the same device: a no-op
    model.cuda()
    for convert in (lambda: model.to("cpu"), model.half, lambda: model.to(torch.bfloat16)):
        with pytest.raises(RuntimeError):
            convert()


# ------------------------------------------------------------------------- two GPUs


def _nccl_parity() -> dict:
    report = new_report()
    torch.cuda.set_device(0)  # as a script that never calls set_device: exchanges must
    device = f"cuda:{dist.get_rank()}"  # follow the model's device, not the current one
    data = _data(3, device)
    ref = _model(device)
    ref_losses = parity.train(ref, parity.make_optimizer("AdamW", ref), data, sliced=False)
    ref = ref.cpu()  # compared with full state dicts, which are on the CPU
    ddp_model = _model(device)
    parity.train(DistributedDataParallel(ddp_model), parity.make_optimizer("AdamW", ddp_model),
                 data, sliced=True)
    ddp_errors = parity.tensor_errors(ddp_model, ref)
    for stage in (1, 2, 3):
        model = _model(device)
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), ZeroConfig(stage=stage))
        losses = parity.train(model, opt, data, sliced=True)
        record_parity(f"stage{stage}", model, losses, ref, ref_losses, ddp_errors, report)
        report[f"device{stage}"] = str(opt.group.device)
    return report


@two_gpus
def test_nccl_training_at_two_ranks_matches_ddp():
    reports = run_ranks(guarded, 2, _nccl_parity, backend="nccl", timeout=600)
    check_reports(reports)
    for rank, report in enumerate(reports):
        assert {report[f"device{s}"] for s in (1, 2, 3)} == {f"cuda:{rank}"}, report
    print(f"\n[gpu-check] NCCL 2 ranks, worst rel error vs reference: {reports[0]['worst']}")


def test_run_ranks_puts_each_rank_on_its_own_gpu():
    assert run_ranks(torch.cuda.current_device, torch.cuda.device_count(), backend="nccl",
                     timeout=300) == list(range(torch.cuda.device_count()))
