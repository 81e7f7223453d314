"""Meta-device builds: unit-by-unit materialisation, uninitialised tensors, peak memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import zerolite
import zerolite.checkpoint
from examples.gpt import GPT
from tests.support import parity
from zerolite.checkpoint import load_pretrained
from zerolite.memory import footprint, track
from zerolite.testing import run_ranks

pytestmark = pytest.mark.numerics  # `make test-kernels` runs it under other CPUs' kernels


class PlainGPT(GPT):
    """The example GPT initialised only by its layers' own ``reset_parameters()``: the
    kind of model whose meta build equals its normal build (see zerolite.params.meta_init)."""

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        pass


def _build(meta: bool, seed: int = 3) -> PlainGPT:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return PlainGPT(parity.TINY)
    return PlainGPT(parity.TINY)


def _train_three_steps(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for x, y in parity.batches(3):
        model(parity.local_slice(x), parity.local_slice(y)).backward()
        opt.step()
        opt.zero_grad()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _meta_equals_normal() -> dict:
    out = {}
    for stage in (1, 2, 3):
        config = zerolite.ZeroConfig(stage=stage, bucket_size_mb=0.02)
        models, rng_after = {}, {}
        for meta in (False, True):
            model = _build(meta)
            opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
            rng_after[meta] = torch.get_rng_state()
            models[meta] = (model, opt)
        (normal, normal_opt), (built, built_opt) = models[False], models[True]
        initial = _equal(
            zerolite.full_state_dict(normal, rank0_only=False),
            zerolite.full_state_dict(built, rank0_only=False),
        )
        _train_three_steps(normal, normal_opt)
        _train_three_steps(built, built_opt)
        trained = _equal(
            zerolite.full_state_dict(normal, rank0_only=False),
            zerolite.full_state_dict(built, rank0_only=False),
        )
        out[stage] = {
            "initial": initial,
            "trained": trained,
            "rng": torch.equal(rng_after[False], rng_after[True]),
        }
    # Any rank's own generator state is irrelevant: every rank draws from rank 0's.
    torch.manual_seed(3 + dist.get_rank())
    with torch.device("meta"):
        model = PlainGPT(parity.TINY)
    zerolite.shard(model, parity.make_optimizer("AdamW", model), zerolite.ZeroConfig(stage=3))
    out["seeded_per_rank"] = zerolite.full_state_dict(model, rank0_only=False)
    out["init_fn"] = _init_fn_build()
    return out


def _init_fn_build() -> dict[str, torch.Tensor]:
    """The example GPT (whose __init__ applies its own init) on meta with init_fn."""
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(parity.TINY)
    config = zerolite.ZeroConfig(stage=3, init_fn=GPT.init_weights)
    opt = zerolite.shard(model, parity.make_optimizer("AdamW", model), config)
    initial = zerolite.full_state_dict(model, rank0_only=False)
    _train_three_steps(model, opt)  # runs: every tensor was initialised
    return initial


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_build_equals_the_normal_build(world_size):
    results = run_ranks(_meta_equals_normal, world_size, timeout=120)
    torch.manual_seed(3)
    reference = PlainGPT(parity.TINY).state_dict()
    single_process = _init_fn_build()
    for rank, r in enumerate(results):
        for stage in (1, 2, 3):
            assert r[stage]["initial"] and r[stage]["trained"], (rank, stage, r[stage])
            # rank 0 advanced as a normal build
            assert r[stage]["rng"] == (rank == 0), (rank, stage)
        assert _equal(r["seeded_per_rank"], reference), rank  # rank 0's seed (3), on every rank
        # init_fn: not a normal build's values, but the same at every world size.
        assert _equal(r["init_fn"], single_process), rank


# -- a transformers-style model: GPT-2's Conv1D has no reset_parameters() ----------------
class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: a linear layer with transposed weight ``[nx, nf]``,
    initialised in ``__init__`` (so nothing initialises it on the meta device)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.nf
        )


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = Conv1D(4 * d, d)
        self.c_out = Conv1D(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2)
            for z in self.c_attn(self.ln_1(x)).split(c, 2)
        )
        x = x + self.c_proj(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        )
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))


class GPT2Style(nn.Module):
    def __init__(
        self, vocab: int = 64, seq: int = 16, d: int = 32, layers: int = 3, heads: int = 2
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Rotary(nn.Module):
    """A module whose non-persistent buffer is computed in ``__init__`` (so left on meta)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.inv_freq.repeat(2)


def _conv1d_case(path: str) -> dict:
    torch.manual_seed(11)
    normal = GPT2Style().eval()
    # a plain pretrained file, as transformers writes it (tied alias dropped)
    if dist.get_rank() == 0:
        save_file({k: v for k, v in normal.state_dict().items() if k != "lm_head.weight"}, path)
    dist.barrier()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for stage in (2, 3):
        with torch.device("meta"):
            model = GPT2Style().eval()
        zerolite.shard(
            model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(stage=stage)
        )
        with pytest.raises(RuntimeError) as refused:
            model(x)
        load_pretrained(model, path)
        with torch.no_grad():
            same_output = torch.equal(model(x), normal(x))
        out[stage] = {
            "refused": str(refused.value),
            "same_output": same_output,
            "same_params": _equal(
                zerolite.full_state_dict(model, rank0_only=False), normal.state_dict()
            ),
        }
    # Resuming from a zerolite checkpoint fills what nothing initialised, as load_pretrained does.
    torch.manual_seed(11)
    saved = GPT2Style()
    saved_opt = zerolite.shard(
        saved, torch.optim.AdamW(saved.parameters()), zerolite.ZeroConfig(stage=2)
    )
    zerolite.checkpoint.save(f"{path}.ckpt", saved, saved_opt)
    with torch.device("meta"):
        model = GPT2Style().eval()
    opt = zerolite.shard(model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(stage=3))
    zerolite.checkpoint.load(f"{path}.ckpt", model, opt)
    with torch.no_grad():
        out["resumed"] = torch.equal(model(x), normal(x))
    # Through a module wrapping the sharded one (load accepts it), the same.
    with torch.device("meta"):
        inner = GPT2Style().eval()
    opt = zerolite.shard(inner, torch.optim.AdamW(inner.parameters()), zerolite.ZeroConfig(stage=3))
    wrapper = nn.Sequential(inner)
    zerolite.checkpoint.load(f"{path}.ckpt", wrapper, opt)
    with torch.no_grad():
        out["resumed_through_a_wrapper"] = torch.equal(wrapper(x), normal(x))
    with torch.device("meta"):
        rotary = nn.Sequential(Rotary(8), Rotary(8))
    zerolite.shard(
        rotary, torch.optim.SGD(rotary.parameters(), lr=0.1), zerolite.ZeroConfig(stage=3)
    )
    with pytest.raises(RuntimeError) as left_on_meta:
        rotary(torch.ones(2, 8))
    for module in rotary:
        module.inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    out["rotary"] = {
        "refused": str(left_on_meta.value),
        "runs": bool(torch.isfinite(rotary(torch.ones(2, 8))).all()),
    }
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_built_conv1d_model_needs_and_takes_pretrained_weights(tmp_path, world_size):
    for r in run_ranks(_conv1d_case, world_size, str(tmp_path / "model.safetensors"), timeout=120):
        for stage in (2, 3):
            assert r[stage]["same_output"] and r[stage]["same_params"], (stage, r[stage])
            message = r[stage]["refused"]
            assert "nothing initialised them" in message and "load_pretrained" in message, message
            assert "'h.0.c_attn.bias', 'h.0.c_attn.weight'" in message, message  # Conv1D's, named
            # reset_parameters() covered those
            assert "ln_1" not in message and "wte" not in message
        assert r["resumed"] and r["resumed_through_a_wrapper"]
        message = r["rotary"]["refused"]
        assert "left on the meta device" in message and "['0.inv_freq', '1.inv_freq']" in message, (
            message
        )
        assert r["rotary"]["runs"]


# -- memory: a 400 MB model at N=4 -------------------------------------------------------
D_BIG, BLOCKS_BIG = 1024, 12  # a block: 8.4 M parameters (33.6 MB fp32); 12 blocks + root = 407 MB


class BigBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class BigModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, D_BIG)
        self.blocks = nn.ModuleList(BigBlock(D_BIG) for _ in range(BLOCKS_BIG))
        self.norm = nn.LayerNorm(D_BIG)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x).square().mean()


def _big_memory_case(path: str) -> dict:
    with torch.device("meta"):
        model = BigModel()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    with track() as build:
        opt = zerolite.shard(
            model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(stage=3)
        )
    held = footprint(opt).total
    sizes = [f.layout.padded_numel * f.data.element_size() for f in opt.flats]
    with track(opt) as load:
        load_pretrained(model, path)
    loss = model(torch.arange(8).view(1, 8))
    return {
        "model_bytes": model_bytes,
        "units": len(opt.flats),
        "held": held,
        "largest_unit": max(sizes),
        "build": build.peaks["build"].process,
        "load": load.peaks["load"].process,
        "finite": bool(torch.isfinite(loss)),
    }


def test_meta_build_and_load_pretrained_peak_memory_at_n4(tmp_path):
    path = str(tmp_path / "big.safetensors")
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in BigModel().state_dict().items()}
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            k: torch.randn(shape, generator=g).to(dtype) * 0.02
            for k, (shape, dtype) in shapes.items()
        },
        path,
    )
    for rank, r in enumerate(run_ranks(_big_memory_case, 4, path, timeout=240)):
        print(
            f"rank {rank}: build peak {r['build'] / 1e6:.1f} MB, load peak {r['load'] / 1e6:.1f} "
            f"MB, held {r['held'] / 1e6:.1f} MB, largest unit {r['largest_unit'] / 1e6:.1f} MB"
        )
        assert r["model_bytes"] >= 400e6 and r["units"] >= 8, r
        # This rank's quarter of the parameters and of the gradient shards, nothing else.
        assert math.isclose(r["held"], 2 * r["model_bytes"] / 4, rel_tol=0.02), r
        bound = r["held"] + 2 * r["largest_unit"] + 50e6
        assert r["build"] <= bound, (rank, r["build"] / 1e6, bound / 1e6)
        assert r["load"] <= bound, (rank, r["load"] / 1e6, bound / 1e6)
        assert r["build"] > 0.25 * r["held"], r  # the measurement sees the shards being made
        assert r["finite"], r


# -- bad input: a clear error, nothing changed -------------------------------------------
class Overreaching(nn.Module):
    """Its reset_parameters() writes a parameter of another stage-3 unit."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.blocks[0].weight)


def test_meta_build_bad_input_is_refused_clearly():
    def meta_model() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    model = meta_model()
    with pytest.raises(ValueError, match="ZeroConfig.device is 'meta'"):
        zerolite.shard(
            model, torch.optim.AdamW(model.parameters()), zerolite.ZeroConfig(device="meta")
        )
    opt = torch.optim.AdamW(model.parameters())
    opt.state[model[0].weight]["step"] = torch.tensor(1.0)
    with pytest.raises(ValueError, match="optimizer has state for parameters on the meta device"):
        zerolite.shard(model, opt)
    assert all(p.is_meta for p in model.parameters())  # nothing materialised
    view = model[1].weight.view(-1)
    with pytest.raises(ValueError, match="meta parameter '1.weight' is referenced elsewhere"):
        zerolite.shard(model, torch.optim.AdamW(model.parameters()))
    del view
    with pytest.raises(ValueError, match="init_fn"):
        zerolite.ZeroConfig(init_fn=3)

    real = nn.Linear(4, 4)
    real.register_buffer("scale", torch.empty(4, device="meta"))
    with pytest.raises(
        ValueError,
        match="buffer 'scale' is on the meta device while the trained parameters are on cpu",
    ):
        zerolite.shard(real, torch.optim.AdamW(real.parameters()))

    with torch.device("meta"):
        overreaching = Overreaching()
    with pytest.raises(
        RuntimeError,
        match=r"reset_parameters\(\) of module '<root>' \(Overreaching\).*only write its own",
    ):
        zerolite.shard(
            overreaching, torch.optim.AdamW(overreaching.parameters()), zerolite.ZeroConfig(stage=3)
        )

    model = meta_model()
    with pytest.raises(
        RuntimeError, match=r"ZeroConfig.init_fn of module '0' \(Linear\) failed.*boom"
    ):
        zerolite.shard(
            model,
            torch.optim.AdamW(model.parameters()),
            zerolite.ZeroConfig(init_fn=lambda m: (_ for _ in ()).throw(ValueError("boom"))),
        )
