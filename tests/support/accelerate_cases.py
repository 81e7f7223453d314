"""Training loops run under a real `accelerate launch` by tests/integrations/test_accelerate.py.

    accelerate launch ... tests/support/accelerate_cases.py OUT_DIR CASE [CASE ...]

Each case trains the tiny GPT of tests/support/parity.py with an ordinary Accelerate loop and
rank 0 writes ``OUT_DIR/CASE.safetensors`` (full parameters, via
``accelerator.get_state_dict``) and ``OUT_DIR/CASE.json`` (losses, norms, checks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zerolite  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from tests.support import parity  # noqa: E402
from zerolite.accelerate import ZeroAccelerator  # noqa: E402
from zerolite.memory import footprint  # noqa: E402

STEPS = 4


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def make_model(meta: bool) -> torch.nn.Module:
    """The parity model; with ``meta``, built on the meta device (seed 0, as make_model)."""
    if not meta:
        return parity.make_model()
    torch.manual_seed(0)
    with torch.device("meta"):
        return GPT(parity.TINY)


def _loop(
    accelerator,
    stage: int | None,
    *,
    accumulate: int = 1,
    micro_batches: int = STEPS,
    clip: float | None = None,
    save_at: int | None = None,
    out: Path | None = None,
    resume: Path | None = None,
    meta: bool = False,
) -> dict:
    model = make_model(meta)
    opt = parity.make_optimizer("AdamW", model)
    sched = schedule(opt)
    loader = torch.utils.data.DataLoader(_Batches(micro_batches), batch_size=1)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    if resume is not None:
        accelerator.load_state(resume)
    losses, norms, grads_during_accumulation = [], [], []
    for i, (x, y) in enumerate(loader):
        x, y = x[0], y[0]
        if resume is not None and i < save_at:
            continue
        with accelerator.accumulate(model):
            loss = model(parity.local_slice(x), parity.local_slice(y))
            accelerator.backward(loss)
            if not accelerator.sync_gradients and stage is not None:
                fp = footprint(opt.optimizer)
                grads_during_accumulation.append([fp.grads, fp.transient])
            if clip is not None and accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(parity.mean_over_ranks(loss.item()))
        if save_at is not None and resume is None and i + 1 == save_at:
            accelerator.save_state(out)
    full = accelerator.get_state_dict(model)
    info = {
        "losses": losses,
        "norms": norms,
        "grads_during_accumulation": grads_during_accumulation,
        "lr": [g["lr"] for g in opt.param_groups],
    }
    if stage is not None:
        sharded = opt.optimizer
        info["dtypes"] = sorted({str(p.dtype) for f in sharded.flats for p in f.params})
        info["master_dtypes"] = sorted({str(m.data.dtype) for m in sharded.masters})
        info["rank_state"] = {  # this rank's first piece: proves each rank loaded its own shard
            "rank": accelerator.process_index,
            "first_piece": [
                sharded.flats[0].names[sharded.flats[0].spans[0].index],
                sharded.flats[0].spans[0].param_start,
            ],
        }
    return {"state": full, "info": info}


class _Batches(torch.utils.data.Dataset):
    """Global batch ``i // N`` at item ``i``: Accelerate deals item ``k*N + r`` to rank ``r``,
    so every rank receives the same global batch and takes its own slice of it."""

    def __init__(self, n: int) -> None:
        self.world = torch.distributed.get_world_size()
        self.data = parity.batches(n)

    def __len__(self) -> int:
        return len(self.data) * self.world

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i // self.world]


def _refusals(accelerator, out_dir: Path) -> dict:
    """save_state replaces what this run saved (or resumed from), never another run's
    checkpoint; what each attempt did, by name."""
    from zerolite.checkpoint.run_folders import RUN_FILE

    model = make_model(False)
    opt = parity.make_optimizer("AdamW", model)
    model, opt = accelerator.prepare(model, opt)
    outcome: dict = {}

    def attempt(key: str, *args, **kwargs) -> None:
        try:
            accelerator.save_state(*args, **kwargs)
            outcome[key] = "saved"
        except ValueError as exc:
            outcome[key] = str(exc)

    explicit = out_dir / "explicit_state"
    index = explicit / "zerolite_0" / "index.json"
    attempt("first", explicit)
    before = index.stat().st_mtime_ns
    attempt("again", explicit)  # this run's own folder: replaced, as stock Accelerate does
    outcome["replaced"] = index.stat().st_mtime_ns != before
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # as if another run had written it
        (explicit / RUN_FILE).write_text(json.dumps({"run": "another-run"}))
    accelerator.wait_for_everyone()
    before = index.stat().st_mtime_ns
    attempt("foreign", explicit)
    outcome["untouched"] = index.stat().st_mtime_ns == before
    plain = out_dir / "plain_folder"  # files without a marker: not this run's either
    if accelerator.is_main_process:
        plain.mkdir()
        (plain / "notes.txt").write_text("kept")
    accelerator.wait_for_everyone()
    attempt("unmarked", plain)
    accelerator.load_state(explicit)  # this run now continues the other one
    attempt("resumed", explicit)
    attempt("overwrite", plain, overwrite=True)
    project = accelerator.project_configuration
    project.set_directories(str(out_dir / "auto_project"))
    project.automatic_checkpoint_naming, project.total_limit, project.iteration = True, 1, 0
    attempt("auto_first")
    project.iteration = 0  # a fresh run pointed at the same project_dir
    attempt("auto_again")
    outcome["auto_kept"] = sorted(
        p.name for p in (out_dir / "auto_project" / "checkpoints").iterdir()
    )
    return outcome


def run_case(name: str, out_dir: Path) -> None:
    if name == "refusals2":
        accelerator = ZeroAccelerator(zero_config=zerolite.ZeroConfig(stage=2))
        outcome = _refusals(accelerator, out_dir)
        if accelerator.is_main_process:
            (out_dir / f"{name}.json").write_text(json.dumps(outcome))
        accelerator.wait_for_everyone()
        return
    stage = int(name[-1]) if name[-1].isdigit() else None
    kwargs: dict = {}
    acc_kwargs: dict = {}
    if "accum" in name:
        acc_kwargs["gradient_accumulation_steps"] = 2
        kwargs.update(micro_batches=5, clip=0.05)
    if name.startswith("bf16"):
        acc_kwargs["mixed_precision"] = "bf16"
    if name.startswith("resume") or name.startswith("save"):
        kwargs.update(save_at=2, out=out_dir / "accelerate_state")
        if name.startswith("resume"):
            kwargs["resume"] = out_dir / "accelerate_state"
    config = zerolite.ZeroConfig(stage=stage) if stage is not None else None
    if name.startswith("meta"):  # built on the meta device, materialised by shard()
        kwargs["meta"] = True
        config = zerolite.ZeroConfig(stage=stage, init_fn=GPT.init_weights)
    if stage is None:  # stock Accelerate with DDP, for the parity bar
        from accelerate import Accelerator

        accelerator = Accelerator(**acc_kwargs)
    else:
        accelerator = ZeroAccelerator(
            zero_config=None if name.startswith("bf16") else config, **acc_kwargs
        )
    result = _loop(accelerator, stage, **kwargs)
    if accelerator.is_main_process:
        state = {k: v.detach().float().contiguous().clone() for k, v in result["state"].items()}
        save_file(state, str(out_dir / f"{name}.safetensors"))
    infos = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(infos, result["info"])
    if accelerator.is_main_process:
        (out_dir / f"{name}.json").write_text(json.dumps(infos))
    accelerator.wait_for_everyone()


def main() -> None:
    out_dir = Path(sys.argv[1])
    for name in sys.argv[2:]:
        run_case(name, out_dir)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
