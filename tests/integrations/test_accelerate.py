"""ZeroAccelerator under real `accelerate launch` runs (2 CPU processes), batched.

The loops are in tests/support/accelerate_cases.py; each launch runs several cases and rank 0
writes their full parameters (safetensors) and per-rank info (JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zerolite
from examples.gpt import GPT
from tests.support import accelerate_cases as cases
from tests.support import parity
from tests.support.accelerate_versions import CPU_LAUNCH_NEEDS_USE_CPU
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = Path(sys.executable).parent / "accelerate"
CPU_CONFIG = ROOT / "examples" / "accelerate" / "cpu_2proc.yaml"


def _launch(out: Path, *names: str, extra_args: tuple[str, ...] = (), config: Path = CPU_CONFIG,
            background: bool = False) -> subprocess.Popen | None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(ACCELERATE), "launch", "--config_file", str(config), *extra_args,
           str(ROOT / "tests" / "support" / "accelerate_cases.py"), str(out), *names]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if background:
        return proc
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-5000:]
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("accelerate")
    _launch(out, "stage1", "stage2", "stage3", "ddp", "save2", "ddp_accum", "accum2", "meta3")
    _launch(out, "bf16_2", "refusals2")
    _launch(out, "resume2")  # new processes, loading what save2 wrote
    return out


def _result(out: Path, name: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    return load_file(str(out / f"{name}.safetensors")), json.loads(
        (out / f"{name}.json").read_text()
    )


def _torchrun_loop(stage: int, meta: bool = False) -> dict[str, torch.Tensor]:
    """The same loop with zerolite.shard directly; the scheduler steps once per process per
    optimizer step, as Accelerate's scheduler wrapper does without split_batches."""
    model = cases.make_model(meta)
    opt = parity.make_optimizer("AdamW", model)
    sched = cases.schedule(opt)
    opt = zerolite.shard(
        model, opt, zerolite.ZeroConfig(stage=stage, init_fn=GPT.init_weights if meta else None)
    )
    for x, y in parity.batches(cases.STEPS):
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        opt.step()
        for _ in range(dist.get_world_size()):
            sched.step()
        opt.zero_grad()
    return zerolite.full_state_dict(model, rank0_only=False)


def _single_process(
    accumulate: int, micro_batches: int, clip: float | None
) -> tuple[dict, list[float]]:
    """Whole global batches on one process; with accumulation, the micro-batch losses are
    divided by `accumulate` as Accelerate's backward does (also for a short last group)."""
    model = parity.make_model()
    opt = parity.make_optimizer("AdamW", model)
    sched = cases.schedule(opt)
    data = parity.batches(micro_batches)
    norms = []
    for start in range(0, micro_batches, accumulate):
        for x, y in data[start:start + accumulate]:
            (model(x, y) / accumulate).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        for _ in range(2):
            sched.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, norms


def _errors(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: parity.rel_err(state[k], reference[k]) for k in reference}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_accelerator_is_bitwise_the_torchrun_loop_and_within_ddp_parity(runs, stage):
    state, _ = _result(runs, f"stage{stage}")
    expected = run_ranks(_torchrun_loop, 2, stage, timeout=120)[0]
    for k, v in expected.items():
        assert torch.equal(state[k], v.float()), k
    ddp_state, _ = _result(runs, "ddp")
    reference, _ = _single_process(1, cases.STEPS, None)
    ddp_err, zl_err = _errors(ddp_state, reference), _errors(state, reference)
    bad = {k: (e, ddp_err[k]) for k, e in zl_err.items() if not e <= max(2 * ddp_err[k], 1e-6)}
    assert bad == {}


def test_meta_built_model_through_zero_accelerator_matches_the_torchrun_loop(runs):
    state, _ = _result(runs, "meta3")
    expected = run_ranks(_torchrun_loop, 2, 3, True, timeout=120)[0]
    assert state.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(state[k], v.float()), k


def test_accumulation_and_clipping_through_accelerate(runs):
    state, infos = _result(runs, "accum2")
    ddp_state, ddp_infos = _result(runs, "ddp_accum")
    reference, ref_norms = _single_process(2, 5, 0.05)  # 5 micro-batches: the last group is forced
    ddp_err, zl_err = _errors(ddp_state, reference), _errors(state, reference)
    bad = {k: (e, ddp_err[k]) for k, e in zl_err.items() if not e <= max(2 * ddp_err[k], 1e-6)}
    assert bad == {}
    norms, ddp_norms = infos[0]["norms"], ddp_infos[0]["norms"]
    assert len(norms) == len(ddp_norms) == len(ref_norms) == 3
    assert all(n > 0.05 for n in norms)  # clipping active on every step
    # Per step within twice DDP's deviation from the reference's norm, or a few fp32
    # roundings of a norm (1e-6 relative): the norms of the same gradient summed in
    # another order (shards vs tensors; slices vs the whole batch).
    for got, ddp_norm, want in zip(norms, ddp_norms, ref_norms):
        assert abs(got - want) <= max(2 * abs(ddp_norm - want), 1e-6 * want), (norms, ddp_norms,
                                                                             ref_norms)
    # Stage 2 during accumulation: the persistent gradient shards only, no full-size gradients.
    psi = sum(p.numel() for p in parity.make_model().parameters())
    for info in infos:
        assert info["grads_during_accumulation"], info
        for grads, transient in info["grads_during_accumulation"]:
            # no full-size gradient alive between micro-steps (flags only)
            assert transient < 1024, info
            assert grads * 2 <= 4 * psi + 64, info  # fp32 shard of Ψ/2 elements (+ padding)


def test_save_state_then_load_state_in_new_processes_resumes_bitwise(runs):
    saved, saved_infos = _result(runs, "save2")
    resumed, resumed_infos = _result(runs, "resume2")
    for k in saved:
        assert torch.equal(saved[k], resumed[k]), k
    assert resumed_infos[0]["losses"] == saved_infos[0]["losses"][2:]
    # Each rank loaded its own shard (a swapped shard would not resume bitwise either).
    assert [i["rank_state"]["rank"] for i in resumed_infos] == [0, 1]
    assert (
        resumed_infos[0]["rank_state"]["first_piece"]
        != resumed_infos[1]["rank_state"]["first_piece"]
    )


def test_save_state_replaces_its_own_checkpoint_never_another_runs(runs):
    outcome = json.loads((runs / "refusals2.json").read_text())
    # This run's folder (saved twice in a row, as run_clm_no_trainer.py does under
    # accumulation) is replaced; so is one this run resumed from with load_state.
    assert outcome["first"] == outcome["again"] == outcome["resumed"] == "saved", outcome
    assert outcome["replaced"]
    for key in ("foreign", "unmarked"):  # another run's marker, or files without one
        assert "holds files that this run did not write" in outcome[key], outcome[key]
        assert "overwrite=True" in outcome[key]
    assert outcome["untouched"]  # refused before anything was written
    assert outcome["overwrite"] == outcome["auto_first"] == "saved"
    assert "checkpoint_0 already exists" in outcome["auto_again"]
    assert outcome["auto_kept"] == ["checkpoint_0"]  # refused before pruning


def test_bf16_mixed_precision_keeps_fp32_params_under_accelerates_autocast(runs):
    """Accelerate's recipe by default: fp32 parameters (their own masters), bf16 compute."""
    _, infos = _result(runs, "bf16_2")
    for info in infos:
        assert info["dtypes"] == ["torch.float32"]
        assert info["master_dtypes"] == ["torch.float32"]
    _, fp32_infos = _result(runs, "stage2")
    # bf16 training follows the fp32 loss curve: a sanity bound, not parity (that is
    # tests/integrations/test_stock_loops.py's, against the stock bf16 loop). bf16 matmuls round to
    # 2^-9 relative; CPUs' kernel families move these losses by ~1e-5, far inside 2e-2.
    vs_fp32 = parity.loss_deviations(infos[0]["losses"], fp32_infos[0]["losses"])
    assert all(d <= 2e-2 for d in vs_fp32), vs_fp32  # NaN fails
    assert max(vs_fp32) > 0  # the autocast reached the model: not the fp32 run


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    """A loopback port bound (not listening) by this process for the whole block, so no other
    process can be given it meanwhile; SO_REUSEADDR lets the launched rendezvous store bind
    and listen on it too (torch's TCPStore sets SO_REUSEADDR; two sockets may share a port
    when both do and at most one listens). No window between choosing the port and using it,
    and no retry."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_two_launches_as_two_nodes_match_one_launch(runs, tmp_path):
    config = ROOT / "examples" / "accelerate" / "multi_node.yaml"
    with _held_port() as port:
        procs = [
            _launch(tmp_path, "stage2", config=config, background=True, extra_args=(
                "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                "--mixed_precision", "no"))
            for rank in (0, 1)
        ]
        for proc in procs:
            output, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, output[-5000:]
    two_nodes, _ = _result(tmp_path, "stage2")
    one_launch, _ = _result(runs, "stage2")
    for k in one_launch:
        assert torch.equal(two_nodes[k], one_launch[k]), k


def test_cpu_launch_without_accelerate_use_cpu_is_refused_or_trains_as_with_it(tmp_path, runs):
    """A CPU launch without ACCELERATE_USE_CPU: where Accelerate then sees one process per
    worker (1.13 on), zerolite refuses it with the fix; where it sees them all (before 1.13),
    there is nothing to refuse and the run is the one with the variable, bit for bit."""
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env["OMP_NUM_THREADS"] = "1"  # as in _launch, whose stage2 run is the reference
    cmd = [str(ACCELERATE), "launch", "--config_file", str(CPU_CONFIG),
           str(ROOT / "tests" / "support" / "accelerate_cases.py"), str(tmp_path), "stage2"]
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if CPU_LAUNCH_NEEDS_USE_CPU:
        assert result.returncode != 0
        assert "ACCELERATE_USE_CPU=1" in result.stdout + result.stderr
        return
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    launched, _ = _result(tmp_path, "stage2")
    reference, _ = _result(runs, "stage2")
    assert launched.keys() == reference.keys()
    for k in reference:
        assert torch.equal(launched[k], reference[k]), k


def test_example_resumes_only_its_own_run_and_says_which_checkpoint(tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"

    def example(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(ACCELERATE), "launch", "--config_file", str(CPU_CONFIG),
               str(ROOT / "examples" / "train_gpt.py"), "--out", str(out), "--save-every", "2",
               *args]
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)

    first = example("--steps", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    fresh = example("--steps", "2")  # a new run pointed at the old --out
    assert fresh.returncode != 0
    assert "holds checkpoints of an earlier run (checkpoint_0): pass --resume" in fresh.stderr
    resumed = example("--steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'checkpoint_0'} at step 2" in resumed.stdout


MAX_NORM = 0.05  # below the tiny GPT's gradient norms: clipping acts on every step


def _setup_rank(root: str) -> dict:
    """`zerolite.accelerate.setup` on a stock Accelerator (no launcher: run_ranks' group, as
    Accelerate finds it with ACCELERATE_USE_CPU=1) against `zerolite.shard` driven directly:
    the same loop through the accelerator's backward / clip_grad_norm_, and save_state /
    load_state."""
    os.environ["ACCELERATE_USE_CPU"] = "1"
    from accelerate import Accelerator

    from tests.checkpoint.test_checkpoint import differences, pieces
    from zerolite.accelerate import setup

    data = parity.batches(cases.STEPS)
    accelerator = Accelerator()
    model = parity.make_model()
    prepared, opt = setup(accelerator, model, parity.make_optimizer("AdamW", model),
                          zerolite.ZeroConfig(stage=2))
    norms = []
    for x, y in data[:3]:
        accelerator.backward(prepared(parity.local_slice(x), parity.local_slice(y)))
        norms.append(float(accelerator.clip_grad_norm_(prepared.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in accelerator.get_state_dict(prepared).items()}
    folder = str(Path(root) / "setup")
    accelerator.save_state(folder)
    at_save = pieces(opt.optimizer)
    x, y = data[3]
    accelerator.backward(prepared(parity.local_slice(x), parity.local_slice(y)))
    opt.step()
    opt.zero_grad()
    moved = bool(differences(pieces(opt.optimizer), at_save))
    accelerator.load_state(folder)
    # zerolite.shard driven directly, torch-style loop with zerolite's global-norm clipping.
    direct = parity.make_model()
    direct_opt = zerolite.shard(direct, parity.make_optimizer("AdamW", direct),
                                zerolite.ZeroConfig(stage=2))
    direct_norms = []
    for x, y in data[:3]:
        direct(parity.local_slice(x), parity.local_slice(y)).backward()
        direct_norms.append(float(direct_opt.clip_grad_norm_(MAX_NORM)))
        direct_opt.step()
        direct_opt.zero_grad()
    expected = zerolite.full_state_dict(direct, rank0_only=False)
    return {
        "unwrapped": prepared is model and not isinstance(
            prepared, torch.nn.parallel.DistributedDataParallel),
        "norms": (norms, direct_norms),
        "state_equal": dist.get_rank() != 0 or (
            state.keys() == expected.keys()
            and all(torch.equal(state[k], v) for k, v in expected.items())),
        "moved": moved,
        "restored": differences(pieces(opt.optimizer), at_save),
    }


def test_setup_patches_a_stock_accelerator(tmp_path):
    """setup(): the model sharded in place, never DDP-wrapped; accelerator.backward and
    clip_grad_norm_ (the global norm, clipping on every step) train bitwise as zerolite.shard
    driven directly; get_state_dict gives the full parameters; save_state / load_state
    restore this rank's shard after a later step."""
    for rank, out in enumerate(run_ranks(_setup_rank, 2, str(tmp_path), timeout=120)):
        assert out["unwrapped"], rank
        norms, direct = out["norms"]
        assert norms == direct and all(n > MAX_NORM for n in norms), (rank, norms, direct)
        assert out["state_equal"], rank
        assert out["moved"] and not out["restored"], (rank, out["restored"][:8])
