"""Error-feedback residuals load under another setup without losing what they owe
(`zerolite.checkpoint.residual_fold`; docs/hybrid-and-quantized.md, "Residuals across
setups"). One 4-rank launch; setups at 2 ranks run on a process group of ranks 0-1.

- What the residuals owe the mean gradient per element (`tests.support.checkpoint_contents.
  residual_mass`) is the saved one after a load at another world size -- 4 to 2 (folded),
  2 to 4 (repeated), hybrid 4 (k=2) to flat 2 (cross-node residuals moved into the shard
  group's) -- read from a save taken right after the load, up to fp32 rounding.
- A quantized SGD run (coarse blocks: the residuals carry real mass) saved at 4 ranks after
  3 steps and resumed at 2 for 5 more keeps closer to the uninterrupted 4-rank run's
  losses than the same resume with its residuals zeroed after the load.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

import zerolite
from tests.checkpoint.test_resume_matrix import _train
from tests.support import parity
from tests.support.checkpoint_contents import residual_mass
from tests.support.rank_reports import guarded
from zerolite import checkpoint as ckpt
from zerolite.testing import run_ranks

BEFORE, AFTER = 3, 5
BLOCK = 1024  # coarse: most elements round to zero in a block and wait in the residual


def _build(group, k: int | None = None):
    model = parity.make_model()
    config = zerolite.ZeroConfig(stage=2, quantize_reduce=True, quant_block=BLOCK,
                                 bucket_size_mb=0.01, shard_group_size=k, process_group=group)
    return model, zerolite.shard(model, parity.make_optimizer("SGD", model), config)


def _resume(root: Path, name: str, group, *, drop: bool = False, train: bool = True) -> list:
    """Load ``name`` under ``group``, save it again as ``name@N`` (or, with ``drop``, zero
    the residuals); then, with ``train``, the losses of `AFTER` steps."""
    model, opt = _build(group)
    ckpt.load(root / name, model, opt)
    if drop:
        for flat in opt.flats:
            flat.exchange.residual.zero_()
    else:
        ckpt.save(root / f"{name}@{dist.get_world_size(group)}", model, opt)
    if not train:
        return []
    return _train(model, opt, parity.batches(BEFORE + AFTER)[BEFORE:], group)


def _rank(root: str) -> dict:
    root_ = Path(root)
    pair = dist.new_group([0, 1])
    data = parity.batches(BEFORE + AFTER)
    model, opt = _build(None)
    _train(model, opt, data[:BEFORE], None)
    ckpt.save(root_ / "flat4", model, opt)
    straight = _train(model, opt, data[BEFORE:], None)
    model, opt = _build(None, k=2)
    _train(model, opt, data[:2], None)
    ckpt.save(root_ / "hybrid4", model, opt)
    out = {"straight": straight}
    if dist.get_rank() < 2:
        model, opt = _build(pair)
        _train(model, opt, data[:2], pair)
        ckpt.save(root_ / "flat2", model, opt)
        out["folded"] = _resume(root_, "flat4", pair)
        out["dropped"] = _resume(root_, "flat4", pair, drop=True)
        _resume(root_, "hybrid4", pair, train=False)
    dist.barrier()
    _resume(root_, "flat2", None, train=False)
    return out


def test_residuals_keep_what_they_owe_across_world_sizes(tmp_path):
    report = run_ranks(guarded, 4, _rank, str(tmp_path), timeout=300)[0]
    assert "error" not in report, report["error"]
    for saved, loaded in (("flat4", "flat4@2"), ("flat2", "flat2@4"), ("hybrid4", "hybrid4@2")):
        owed, kept = residual_mass(tmp_path / saved), residual_mass(tmp_path / loaded)
        assert owed.keys() == kept.keys(), (saved, owed.keys() ^ kept.keys())
        scale = max(v.abs().max().item() for v in owed.values())
        worst = max((owed[k] - kept[k]).abs().max().item() for k in owed)
        assert scale > 0 and worst <= 1e-6 * scale, (saved, loaded, worst, scale)
    straight = report["straight"]
    folded = sum(parity.loss_deviations(report["folded"], straight))
    dropped = sum(parity.loss_deviations(report["dropped"], straight))
    print(f"sum of relative loss deviations from the uninterrupted run over {AFTER} steps: "
          f"residuals folded {folded:.3e}, dropped {dropped:.3e}")
    assert folded < dropped, f"resumed with residuals {folded:.3e}, dropped {dropped:.3e}"
