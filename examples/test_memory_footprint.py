"""An example memory-footprint regression test for your own model (copy and adapt).

    pytest examples/test_memory_footprint.py

`zerolite_footprint` fails with the category and the exact excess in bytes when what a
rank holds differs from zerolite's byte-exact estimate -- e.g. a tensor leaked into the
optimizer state, or a full-size gradient kept alive in stage 2.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

pytest_plugins = ["zerolite.pytest_plugin"]


def _train_two_steps_and_check(stage: int, assert_footprint) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=2, d_model=64))
    opt = zerolite.shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), zerolite.ZeroConfig(stage=stage)
    )
    for step in range(2):
        x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(step))
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return assert_footprint(opt).model_states  # raises with a per-category report


def test_model_states_are_as_estimated(zerolite_footprint, zerolite_ranks):
    for stage in (1, 2, 3):
        per_rank = zerolite_ranks(_train_two_steps_and_check, 2, stage, zerolite_footprint)
        assert len(per_rank) == 2
