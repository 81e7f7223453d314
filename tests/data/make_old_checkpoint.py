"""Writes ``tests/data/old_checkpoint/``: a checkpoint saved by zerolite 0.1.0 as it stood
before the package was reorganised into folders (commit 201468d), and what loading it must
give. ``tests/checkpoint/test_old_checkpoint.py`` loads it with the current code.

Run it with that version of the package (it reads each rank's pieces through that
version's internals, ``zerolite.shard_state``), from the root of a checkout of it::

    git worktree add ../zerolite-201468d 201468d
    mkdir -p ../zerolite-201468d/tests/data
    cp tests/data/make_old_checkpoint.py ../zerolite-201468d/tests/data/
    cd ../zerolite-201468d && python -m tests.data.make_old_checkpoint OUT_DIR

then copy ``OUT_DIR`` over ``tests/data/old_checkpoint``. The files are kept as written:
regenerating them with newer code would defeat their purpose.

What is saved: `OldModel` (an embedding tied to the head, two blocks, a frozen layer, a
persistent buffer) trained for `STEPS` steps with AdamW in two param groups at stage 2 on
2 ranks, in flat buffers of about 128 elements (so parameters span buffers and ranks),
with a MultiStepLR scheduler and a typed ``extra``. ``expected.safetensors`` holds, per
parameter, the full fp32 master and optimizer state of the save (``master/NAME``,
``state/KEY/NAME``), the full state dict (``model/NAME``), and the state dict after one
more step on 2 ranks (``after/NAME``); ``expected.json`` the scheduler, the param groups'
hyperparameters and ``extra``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WORLD_SIZE = 2
STAGE = 2
STEPS = 3
BUCKET_SIZE_MB = 512 / 2**20  # 128 fp32 elements per flat buffer
VOCAB, WIDTH, BATCH, SEQ = 16, 8, 4, 6
EXTRA = {"data_position": STEPS, "note": (1, 2)}
CHECKPOINT = "step3"


class OldModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(2)
        )
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        x = self.wte(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x + self.frozen(x))


def build(stage: int = STAGE):
    """The model, its AdamW (decay / no-decay groups), sharded, and its scheduler."""
    import zerolite

    torch.manual_seed(0)
    model = OldModel()
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    config = zerolite.ZeroConfig(stage=stage, bucket_size_mb=BUCKET_SIZE_MB)
    opt = zerolite.shard(model, opt, config)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    return model, opt, sched


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per = BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_step(model, opt, sched, step: int) -> None:
    import torch.distributed as dist

    x, y = batch(step, dist.get_rank(), dist.get_world_size())
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def save_rank(root: str) -> dict:
    """One rank of the save: train, save, record what was saved, then one step more."""
    import zerolite
    from zerolite.shard_state import state_of  # 201468d's internals

    model, opt, sched = build()
    for step in range(STEPS):
        train_step(model, opt, sched, step)
    zerolite.checkpoint.save(Path(root) / CHECKPOINT, model, opt, schedulers=[sched], extra=EXTRA)
    pieces = {}
    for piece in state_of(model).pieces():
        state = {k: v.clone() for k, v in piece.read_state().items()}
        pieces[(piece.name, piece.param_start, piece.param_end)] = {
            "master": piece.read_master().reshape(-1).clone(), **state
        }
    saved = {k: v.clone() for k, v in zerolite.full_state_dict(model, rank0_only=False).items()}
    hyper = [
        {k: v for k, v in g.items() if k not in ("params", "betas")} for g in opt.param_groups
    ]
    scheduler = {"last_epoch": sched.last_epoch, "last_lr": sched.get_last_lr()}
    train_step(model, opt, sched, STEPS)
    after = zerolite.full_state_dict(model, rank0_only=False)
    return {"pieces": pieces, "saved": saved, "after": after, "hyper": hyper,
            "scheduler": scheduler}


def assemble(rank_pieces: list[dict]) -> dict[str, torch.Tensor]:
    """``master/NAME`` and ``state/KEY/NAME``: every rank's pieces of a parameter, joined."""
    by_name: dict[str, list] = {}
    for pieces in rank_pieces:
        for (name, start, end), entry in pieces.items():
            by_name.setdefault(name, []).append((start, end, entry))
    out = {}
    for name, items in by_name.items():
        items.sort(key=lambda item: item[0])
        for key in items[0][2]:
            values = [entry[key] for _, _, entry in items]
            field = "master" if key == "master" else f"state/{key}"
            # A scalar (Adam's step) is the same on every piece.
            out[f"{field}/{name}"] = values[0] if values[0].dim() == 0 else torch.cat(values)
    return out


def main(out: str) -> None:
    from safetensors.torch import save_file

    from tests.data import make_old_checkpoint as me  # by module name: ranks import it
    from zerolite.testing import run_ranks

    target = Path(out)
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(me.save_rank, WORLD_SIZE, root)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(root) / CHECKPOINT, target / CHECKPOINT, dirs_exist_ok=True)
    first = results[0]
    tensors = assemble([r["pieces"] for r in results])
    tensors.update({f"model/{k}": v.contiguous() for k, v in first["saved"].items()})
    tensors.update({f"after/{k}": v.contiguous() for k, v in first["after"].items()})
    # safetensors refuses shared storage: the tied head gets its own copy.
    save_file({k: v.clone() for k, v in tensors.items()}, str(target / "expected.safetensors"))
    expected = {
        "world_size": WORLD_SIZE, "stage": STAGE, "steps": STEPS,
        "hyper": first["hyper"], "scheduler": first["scheduler"],
        "extra": {"data_position": EXTRA["data_position"], "note": list(EXTRA["note"])},
    }
    (target / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
