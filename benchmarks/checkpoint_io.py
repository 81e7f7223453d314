"""Checkpoint I/O of the benchmark GPT: bytes written, save and load seconds.

Fixed configuration: GPT 6 layers, d_model 384, 6 heads, vocab 8192, seq 128 (tied
head; examples/gpt.py defaults), AdamW(lr 3e-4, weight_decay 0.1), zerolite stage 2,
2 ranks on gloo, 1 thread per rank. One training step first, so that the optimizer
state exists. Each repeat saves a new checkpoint (barrier, `save`, barrier) and loads
it back into a freshly sharded model (barrier, `load`, barrier); the times are those of
rank 0 between the barriers. Files are written to a temporary directory (``--dir``),
so loads usually read from the page cache.

    python benchmarks/checkpoint_io.py [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerolite  # noqa: E402
from examples.gpt import GPT, GPTConfig, param_groups, random_batch  # noqa: E402
from zerolite import checkpoint as ckpt  # noqa: E402
from zerolite.testing import run_ranks  # noqa: E402


def _sharded(cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-4)
    return model, zerolite.shard(model, opt, zerolite.ZeroConfig(stage=2))


def _run(root: str, repeats: int) -> dict:
    cfg = GPTConfig()
    model, opt = _sharded(cfg)
    x, y = random_batch(cfg, 4, seed=dist.get_rank())
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    saves, loads, sizes = [], [], []
    for i in range(repeats):
        path = Path(root) / f"ckpt-{i}"
        dist.barrier()
        start = time.perf_counter()
        ckpt.save(path, model, opt, extra={"repeat": i})
        dist.barrier()
        saves.append(time.perf_counter() - start)
        sizes.append({p.name: p.stat().st_size for p in path.iterdir()})
        fresh, fresh_opt = _sharded(cfg)
        dist.barrier()
        start = time.perf_counter()
        ckpt.load(path, fresh, fresh_opt)
        dist.barrier()
        loads.append(time.perf_counter() - start)
        del fresh, fresh_opt
    params = sum(p.numel() for p in model.parameters())
    return {"saves": saves, "loads": loads, "sizes": sizes[-1], "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        result = run_ranks(_run, 2, root, args.repeats, timeout=600)[0]
    total = sum(result["sizes"].values())
    print(f"GPT {result['params']:,} parameters, 2 ranks, stage 2, AdamW")
    for name, size in sorted(result["sizes"].items()):
        print(f"  {name:36s} {size:>12,d} bytes")
    print(f"  {'total':36s} {total:>12,d} bytes ({total / 2**20:.1f} MiB; "
          f"{total / result['params']:.2f} bytes per parameter)")
    for label, times in (("save", result["saves"]), ("load", result["loads"])):
        print(f"{label}: median {statistics.median(times):.3f} s over {len(times)} "
              f"({', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
