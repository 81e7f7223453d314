"""`zerolite.state.shard_state`: one `ShardState` per sharded model, found by identity, freed
with it."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import torch
from torch import nn

import zerolite
from zerolite.state import shard_state
from zerolite.state.shard_state import register, state_of
from zerolite.testing import run_ranks


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _EqualModule(nn.Module):
    """Every instance compares equal and none is hashable: registry keys are identities."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


def test_registry_keys_by_identity_and_forgets_dead_models():
    first, second = _EqualModule(), _EqualModule()
    state = SimpleNamespace()  # the registry reads nothing of it
    register(first, state, None)  # type: ignore[arg-type]
    assert state_of(first) is state
    assert state_of(second) is None and state_of(object()) is None
    key, alive = id(first), weakref.ref(first)
    assert key in shard_state._REGISTRY
    del first
    gc.collect()
    # The registry held nothing that kept the model alive, and dropped its entry with it.
    assert alive() is None, "the registry keeps a dead model alive"
    assert key not in shard_state._REGISTRY, "the registry did not forget a dead model"
    assert all(ref() is not None for ref, *_ in shard_state._REGISTRY.values())


def _owned_state(stage: int) -> dict:
    torch.manual_seed(0)
    model = _Net()
    model.blocks[0].a.weight.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = zerolite.ZeroConfig(stage=stage, bucket_size_mb=0.0002, unit_modules=(_Block,))
    opt = zerolite.shard(model, opt, config)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    state = state_of(model)
    assert state is opt.shard_state and state.model is model
    assert (state.scheduler is None) == (stage < 3)
    leftovers = [k for k in vars(model) if k.startswith("_zerolite")]
    # The same records as walking flats and masters side by side, with the step's state.
    expected = [
        (flat.names[pc.index], pc.param_start, pc.param_end, id(t))
        for flat, master in zip(opt.flats, opt.masters)
        for pc, t in zip(flat.spans, master.views)
    ]
    pieces = list(state.pieces())
    got = [(p.name, p.param_start, p.param_end, id(p.master)) for p in pieces]
    state_ok = all(p.state is opt.state[p.master] and "exp_avg" in p.state for p in pieces)
    frozen = [(f.name, f.shard.data_ptr() - f.flat.shard.data_ptr()) for f in
              state.frozen_pieces()]
    refs = [weakref.ref(model), weakref.ref(opt)]
    del model, opt, state, pieces
    gc.collect()
    return {
        "leftovers": leftovers,
        "pieces_match": got == expected and bool(got),
        "state_ok": state_ok,
        "frozen": frozen,
        "freed": [ref() is None for ref in refs],
        "registry_empty": not shard_state._REGISTRY,
    }


def test_state_owns_the_shard_and_goes_with_the_model():
    for stage in (1, 3):
        for rank, res in enumerate(run_ranks(_owned_state, 2, stage, timeout=120)):
            assert res["leftovers"] == [], (stage, rank)
            assert res["pieces_match"] and res["state_ok"], (stage, rank)
            # Stage 3 shards the frozen weight (no master): its pieces view the shard.
            names = [name for name, _ in res["frozen"]]
            assert names == (["blocks.0.a.weight"] if stage == 3 else []), (stage, rank, names)
            assert all(offset >= 0 for _, offset in res["frozen"])
            assert res["freed"] == [True, True], (stage, rank)
            assert res["registry_empty"], (stage, rank)
