"""The CUDA paths that ``tests/gpu/test_cuda.py`` does not cover (docs/limits.md, "Validated
where"): `make gpu-check` runs them on one GPU; without CUDA they skip.

- 16-bit training on the GPU against the hand-written mixed-precision recipe run on the same
  GPU (`tests.support.mixed_recipe.mixed_reference` with ``device="cuda"``: same kernels, same
  rounding): stages 1-3, bf16 and fp16 (dynamic loss scaling, clipping, an overflow forced at
  step 3), world size 1 on NCCL, judged by `tests.support.recipe_checks.stage_failures`.
- World size 2 with gloo over CUDA tensors, both ranks on the one GPU: which
  ``torch.distributed`` primitives gloo carries for CUDA tensors here (each probed in its own
  launch, its values checked; a primitive gloo lacks is an expected failure naming it), then
  bf16 training at stages 1-3 on each collectives path whose primitives gloo carries,
  against the recipe over 2 slices; a path it cannot carry is an expected failure.
- The meta build at 2 ranks on the GPU: both ranks draw from rank 0's CPU and CUDA
  generators (broadcast as a small collective), rank 0 keeps the advanced states, rank 1 gets
  its own back, and the parameters equal a normal build on the GPU.
- Checkpoints: the CUDA generator of the model's device saved and restored at the same
  world size; an asynchronous save staged device-to-host through pinned memory while
  training goes on, loaded bitwise equal to the state at the call.
- `zerolite.memory.estimate` against the CUDA allocator: per phase (build, forward, backward,
  step) ``memory_allocated`` and ``max_memory_allocated`` beside the estimate (printed: the
  table of docs/limits.md), and the bytes held after a step between the estimate's model
  states and its total.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerolite
from tests.stage3.test_meta_init import PlainGPT
from tests.support import parity
from tests.support.mixed_recipe import POISONED, SMALL_BUCKETS_MB, mixed_reference, single_thread
from tests.support.recipe_checks import stage_failures
from zerolite import ZeroConfig
from zerolite import checkpoint as ckpt
from zerolite.checkpoint.staging import staging_area
from zerolite.memory import estimate, footprint
from zerolite.state.shard_state import state_of
from zerolite.testing import RankFailure, RankTimeout, run_ranks

pytestmark = pytest.mark.cuda

OVERFLOW_STEP = 3  # fp16: the step whose gradient one rank poisons with an inf
MAX_NORM = 1.0
INIT_SCALE = 2.0**16  # LossScaler's first scale
ROUNDING = 512  # bytes: the CUDA caching allocator rounds every block up to a multiple


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


# ------------------------------------------------------- 16-bit training against the recipe


def _one_step(model, opt, x, y, *, fp16: bool, inject: bool, stage: int) -> float:
    target = dict(model.named_parameters())[POISONED]
    # Stages 2-3 drop param.grad during backward: a tensor hook poisons it on the way in.
    handle = target.register_hook(_poison) if inject and stage >= 2 else None
    loss = model(x, y)
    (opt.scale_loss(loss) if fp16 else loss).backward()
    if handle is not None:
        handle.remove()
    if inject and stage == 1:  # param.grad is this rank's local gradient (a view)
        with torch.no_grad():
            target.grad.view(-1)[0] = float("inf")
    if fp16:
        opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _recipe_rank(dtype_name: str, collectives: str, data) -> dict:
    """Stages 1-3 of 16-bit training on this rank's GPU: per stage the full parameters
    (CPU) and this rank's losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    fp16 = dtype == torch.float16
    out = {}
    for stage in (1, 2, 3):
        model = parity.make_model().to(_device())
        config = ZeroConfig(stage=stage, param_dtype=dtype, bucket_size_mb=SMALL_BUCKETS_MB,
                            collectives=collectives, timeout_s=60.0)
        opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
        losses = []
        for step, (x, y) in enumerate(data):
            x, y = parity.local_slice(x.to(_device())), parity.local_slice(y.to(_device()))
            inject = fp16 and step == OVERFLOW_STEP and rank == min(1, world - 1)
            losses.append(_one_step(model, opt, x, y, fp16=fp16, inject=inject, stage=stage))
        full = zerolite.full_state_dict(model, rank0_only=False)
        out[stage] = {"params": {n: full[n].clone() for n, _ in model.named_parameters()},
                      "losses": losses}
    return out


def _references(dtype: torch.dtype, data, world: int) -> tuple[dict, dict]:
    """The recipe on this GPU: over ``world`` slices, and on the whole batch."""
    fp16 = dtype == torch.float16
    extra = ({"loss_scale": INIT_SCALE, "overflow_step": OVERFLOW_STEP, "max_norm": MAX_NORM}
             if fp16 else {})
    with single_thread():
        runs = [mixed_reference(dtype, data, slices=s, device="cuda", **extra)
                for s in (world, 1)]
    return runs[0], runs[1]


def _check_recipe(dtype: torch.dtype, ranks: list[dict], data) -> None:
    world = len(ranks)
    sliced, whole = _references(dtype, data, world)
    fp32_losses = None
    if dtype == torch.bfloat16:
        with single_thread():
            fp32_losses = parity.reference_run("AdamW", data)[1]
    failures = []
    for stage in (1, 2, 3):
        runs = [r[stage] for r in ranks]
        mean = [sum(v) / world for v in zip(*(r["losses"] for r in runs))]
        runs = [{**r, "losses": mean} for r in runs]
        failures += stage_failures(f"{world} rank(s) stage {stage} {dtype}", runs, sliced, whole,
                                   fp32_losses)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_training_on_one_gpu_matches_the_recipe(dtype):
    data = parity.batches()
    ranks = run_ranks(_recipe_rank, 1, dtype, "auto", data, backend="nccl", timeout=300)
    _check_recipe(getattr(torch, dtype), ranks, data)


# ---------------------------------------------------------- gloo over CUDA tensors, 2 ranks

# What each collectives path sends a flat buffer's chunks with (small collectives run on the
# CPU under gloo, `zerolite.comm.devices`).
NEEDS = {"point_to_point": ("isend_irecv",),
         "native": ("reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")}
PRIMITIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
              "isend_irecv")
# torch 2.13 renamed the flat collectives and deprecated the old names (as comm/collectives.py).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _probe(name: str) -> str:
    """One primitive on CUDA tensors of this rank; "ok" when its values are right."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    mine = torch.full((4,), float(rank + 1), device=device)
    if name == "all_reduce":
        dist.all_reduce(mine)
        expected = torch.full((4,), float(sum(range(1, world + 1))), device=device)
    elif name == "broadcast":
        dist.broadcast(mine, src=0)
        expected = torch.full((4,), 1.0, device=device)
    elif name == "all_gather_into_tensor":
        out = torch.empty(4 * world, device=device)
        _all_gather_flat(out, mine)
        mine = out
        expected = torch.arange(1, world + 1, device=device).float().repeat_interleave(4)
    elif name == "reduce_scatter_tensor":
        full = torch.arange(4 * world, device=device).float() * (rank + 1)
        _reduce_scatter_flat(mine, full)
        scale = sum(range(1, world + 1))
        expected = torch.arange(4 * rank, 4 * rank + 4, device=device).float() * scale
    else:
        other = (rank + 1) % world
        received = torch.empty(4, device=device)
        works = [dist.isend(mine, other), dist.irecv(received, (rank - 1) % world)]
        for work in works:
            work.wait()
        mine, expected = received, torch.full((4,), float((rank - 1) % world + 1), device=device)
    torch.cuda.synchronize()
    return "ok" if torch.equal(mine, expected) else f"wrong values: {mine.tolist()}"


_PROBED: dict[str, str] = {}


def _gloo_carries(name: str) -> str:
    """"ok", or why gloo cannot carry ``name`` on CUDA tensors here (probed once)."""
    if name not in _PROBED:
        try:
            answers = run_ranks(_probe, 2, name, backend="gloo", timeout=60)
            _PROBED[name] = next((a for a in answers if a != "ok"), "ok")
        except (RankFailure, RankTimeout) as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            _PROBED[name] = f"unsupported: {lines[-1][:200] if lines else type(exc).__name__}"
    return _PROBED[name]


@pytest.mark.parametrize("name", PRIMITIVES)
def test_which_primitives_gloo_carries_on_cuda_tensors(name):
    verdict = _gloo_carries(name)
    print(f"\n[gpu-check] gloo, 2 ranks on one GPU, {name} on CUDA tensors: {verdict}")
    if verdict.startswith("unsupported"):
        pytest.xfail(f"gloo does not carry {name} on CUDA tensors: {verdict}")
    assert verdict == "ok", verdict


@pytest.mark.parametrize("collectives", ["point_to_point", "native"])
def test_gloo_two_ranks_on_one_gpu_match_the_recipe(collectives):
    missing = {n: v for n in NEEDS[collectives] if (v := _gloo_carries(n)) != "ok"}
    if missing:
        pytest.xfail(f"gloo lacks, for CUDA tensors, what collectives={collectives!r} "
                     f"sends with: {missing}")
    data = parity.batches()
    ranks = run_ranks(_recipe_rank, 2, "bfloat16", collectives, data, backend="gloo",
                      timeout=300)
    _check_recipe(torch.bfloat16, ranks, data)


# -------------------------------------------------------------------- generator states


def _generators() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(_device())


def _meta_build_rank() -> dict:
    """A stage-2 meta build on the GPU at 2 ranks (gloo), against a normal build drawn from
    rank 0's generators."""
    rank = dist.get_rank()
    with torch.random.fork_rng(devices=[_device()]):
        torch.manual_seed(100)  # rank 0's seed
        with torch.device(_device()):
            normal = {n: p.detach().cpu() for n, p in PlainGPT(parity.TINY).named_parameters()}
        advanced = _generators()
    torch.manual_seed(100 + rank)
    own = _generators()
    with torch.device("meta"):
        model = PlainGPT(parity.TINY)
    zerolite.shard(model, parity.make_optimizer("AdamW", model),
                   ZeroConfig(stage=2, device=str(_device())))
    after = _generators()
    wanted = advanced if rank == 0 else own
    return {
        "equal": all(torch.equal(p.detach().cpu(), normal[n]) for n, p in model.named_parameters()),
        "generators": [torch.equal(a, b) for a, b in zip(after, wanted)],
        "device": str(next(model.parameters()).device),
    }


def test_meta_build_at_two_ranks_draws_rank0s_cuda_generator():
    out = run_ranks(_meta_build_rank, 2, backend="gloo", timeout=300)
    print(f"\n[gpu-check] meta build, 2 ranks on one GPU: {out}")
    assert all(r["equal"] for r in out), out
    assert all(r["generators"] == [True, True] for r in out), out  # CPU and CUDA
    assert {r["device"] for r in out} == {"cuda:0"}, out


def _rng_round_trip(root: str) -> bool:
    model = parity.make_model().to(_device())
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), ZeroConfig(stage=2))
    torch.cuda.manual_seed(7)
    ckpt.save(Path(root) / "step", model, opt)
    expected = torch.randn(8, device=_device())
    torch.randn(8, device=_device())  # the generator moves on
    ckpt.load(Path(root) / "step", model, opt)
    return torch.equal(torch.randn(8, device=_device()), expected)


def test_load_restores_the_cuda_generator_of_the_models_device(tmp_path):
    assert run_ranks(_rng_round_trip, 1, str(tmp_path), backend="nccl", timeout=300) == [True]


# ------------------------------------------------------------------- asynchronous save


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"param/{k}": v for k, v in zerolite.full_state_dict(model, rank0_only=False).items()}
    for i, piece in enumerate(state_of(model).pieces()):
        out[f"master/{i}"] = piece.read_master().detach().cpu().clone()
        for key, value in piece.read_state().items():
            if isinstance(value, torch.Tensor):
                out[f"state/{i}/{key}"] = value.detach().cpu().clone()
    return out


def _async_save_rank(root: str) -> dict:
    data = [(x.to(_device()), y.to(_device())) for x, y in parity.batches(4)]
    config = ZeroConfig(stage=2, param_dtype=torch.bfloat16)
    model = parity.make_model().to(_device())
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    parity.train(model, opt, data[:2], sliced=False)
    at_call = _state(model, opt)
    pending = ckpt.save(Path(root) / "async", model, opt, blocking=False)
    parity.train(model, opt, data[2:], sliced=False)  # changes every tensor during the write
    pending.wait()
    pinned = bool(staging_area(opt).buffer.is_pinned())
    fresh = parity.make_model(seed=1).to(_device())
    fresh_opt = zerolite.shard(fresh, parity.make_optimizer("AdamW", fresh), config)
    ckpt.load(Path(root) / "async", fresh, fresh_opt)
    loaded = _state(fresh, fresh_opt)
    return {"pinned": pinned, "keys": loaded.keys() == at_call.keys(),
            "differ": [k for k in at_call if not torch.equal(at_call[k], loaded[k])]}


def test_async_save_stages_device_to_host_and_loads_the_state_at_the_call(tmp_path):
    out = run_ranks(_async_save_rank, 1, str(tmp_path), backend="nccl", timeout=300)[0]
    print(f"\n[gpu-check] async save on the GPU: {out}")
    assert out == {"pinned": True, "keys": True, "differ": []}, out


# ------------------------------------------------------- estimate against the allocator


def _phase_row(label: str, base: int) -> tuple[str, int, int]:
    torch.cuda.synchronize()
    return (label, torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base)


def _allocator_rank(stage: int, dtype_name: str) -> dict:
    """Bytes the allocator holds and its peak, per phase, against `estimate`."""
    config = ZeroConfig(stage=stage, param_dtype=getattr(torch, dtype_name),
                        bucket_size_mb=SMALL_BUCKETS_MB)
    model = parity.make_model()
    opt = parity.make_optimizer("AdamW", model)
    expected = estimate(model, world_size=1, config=config, optimizer=opt)
    x, y = (t.to(_device()) for t in parity.batches(1)[0])
    warm = parity.make_model().to(_device(), getattr(torch, dtype_name))
    warm(x, y).backward()  # cuBLAS's workspaces come from the allocator and stay: before `base`
    del warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # the batch only
    model.to(_device())
    sharded = zerolite.shard(model, opt, config)
    rows = [_phase_row("build", base)]
    for step in range(2):  # the second step holds the optimizer state the estimate counts
        torch.cuda.reset_peak_memory_stats()
        loss = model(x, y)
        rows.append(_phase_row(f"forward {step}", base))
        loss.backward()
        del loss
        rows.append(_phase_row(f"backward {step}", base))
        sharded.step()
        sharded.zero_grad(set_to_none=True)
        rows.append(_phase_row(f"step {step}", base))
    measured = footprint(sharded)
    return {"rows": rows, "model_states": expected.model_states, "total": expected.total,
            "footprint_equal": measured.model_states == expected.model_states,
            # Blocks held after a step: per parameter its master and two AdamW states at
            # most, per flat buffer its parameters and gradients, and a few flags.
            "blocks": 3 * len(list(model.parameters())) + 2 * len(sharded.flats) + 16}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimate_against_the_cuda_allocator_per_phase(stage, dtype):
    out = run_ranks(_allocator_rank, 1, stage, dtype, backend="nccl", timeout=300)[0]
    states, total = out["model_states"], out["total"]
    print(f"\n[gpu-check] stage {stage} {dtype}: estimate model states {states} B, total "
          f"{total} B; per phase (allocated, peak) B above the batch:")
    for label, held, peak in out["rows"]:
        print(f"[gpu-check]   {label:11s} {held:>10d} {peak:>10d}")
    assert out["footprint_equal"], out
    held_after_step = out["rows"][-1][1]
    # Held after a step: every model state, at most the transient bound besides (stage 3
    # keeps the root unit gathered), and the allocator's rounding of each block.
    bound = total + ROUNDING * out["blocks"]
    assert states <= held_after_step <= bound, (held_after_step, bound, out)
