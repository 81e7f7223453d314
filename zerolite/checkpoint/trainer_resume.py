"""Which ``checkpoint-N`` a ZeroTrainer resumes from, and whether its two halves agree.

A Trainer checkpoint is two saves in one folder: Trainer's files (``trainer_state.json``
with the global step and the data position, the scheduler, the RNG states) and zerolite's
``zerolite/`` (weights, fp32 masters, optimizer state). Nothing ties them together on
disk, so:

- `check_steps`: a ``checkpoint-4`` holding ``checkpoint-2``'s ``zerolite/`` (copied by
  hand, or left by an interrupted overwrite) would resume at step 4 with step-2 weights and
  optimizer state. The global step ZeroTrainer records in ``zerolite/`` (``extra``) must
  equal ``trainer_state.json``'s, or the resume is refused naming both, before anything is
  loaded.
- `newest_complete`: ``resume_from_checkpoint=True`` takes the newest ``checkpoint-N``.
  After a crash during an asynchronous save that folder has Trainer's files but no
  ``zerolite/`` (committed last); the newest folder holding both is taken instead, and each
  newer one skipped is logged with its reason.

Plain file reads: every rank reads the same files (one filesystem, as `save` requires) and
decides the same, with no collective.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from zerolite.checkpoint.format import INDEX, INDEX_DIGEST, CheckpointError, read_index
from zerolite.checkpoint.json_codec import decode

__all__ = ["check_steps", "newest_complete"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-N


def _missing(checkpoint: Path, zero_dir: str) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (None: both halves are there)."""
    zero = checkpoint / zero_dir
    if not (zero / INDEX).is_file() or not (zero / INDEX_DIGEST).is_file():
        return (
            f"it has no complete {zero_dir}/ (its save did not finish: a crash during an "
            "asynchronous save, or a save_only_model checkpoint)"
        )
    if not (checkpoint / TRAINER_STATE).is_file():
        return f"it has no {TRAINER_STATE} (Trainer's save did not finish)"
    return None


def newest_complete(output_dir: str | Path, zero_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` holding both ``trainer_state.json``
    and a committed ``zero_dir/``; each newer folder skipped is logged (warning) with why.

    Returns:
        Its path; None when ``output_dir`` has no ``checkpoint-N`` at all (Trainer then
        reports that itself).
    Raises:
        ValueError: ``checkpoint-N`` folders exist but none is complete, naming each and why.
    """
    root = Path(output_dir)
    found = [
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := _CHECKPOINT.match(p.name)) and p.is_dir()
    ]
    skipped = []
    for _, checkpoint in sorted(found, reverse=True):
        reason = _missing(checkpoint, zero_dir)
        if reason is None:
            for name, why in skipped:
                logger.warning(
                    "resume_from_checkpoint=True: skipping %s, %s; resuming from %s, the "
                    "newest complete checkpoint", name, why, checkpoint.name
                )
            return str(checkpoint)
        skipped.append((checkpoint.name, reason))
    if skipped:
        listed = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise ValueError(
            f"resume_from_checkpoint=True: no complete checkpoint in {root} ({listed}). "
            "Start without resuming, or pass the checkpoint to resume from"
        )
    return None


def check_steps(checkpoint: str | Path, zero_dir: str) -> None:
    """Refuse ``checkpoint`` when the global step recorded in its ``zero_dir/`` differs from
    ``trainer_state.json``'s (either missing: nothing to compare).

    Raises:
        ValueError: naming both steps and both files.
        zerolite.checkpoint.CheckpointError: the index is unreadable or not sealed.
    """
    checkpoint = Path(checkpoint)
    state_file = checkpoint / TRAINER_STATE
    if not state_file.is_file() or not (checkpoint / zero_dir / INDEX).is_file():
        return
    try:
        trainer_step = json.loads(state_file.read_text()).get("global_step")
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot resume from {checkpoint}: {state_file} is unreadable "
                         f"({exc})") from None
    try:
        extra = decode(read_index(checkpoint / zero_dir).get("extra"), "extra")
    except ValueError as exc:
        raise CheckpointError(f"{checkpoint / zero_dir}: {exc}") from None
    zero_step = extra.get("global_step") if isinstance(extra, dict) else None
    if trainer_step is None or zero_step is None or trainer_step == zero_step:
        return
    raise ValueError(
        f"cannot resume from {checkpoint}: its {zero_dir}/ was saved at global step "
        f"{zero_step}, and its {TRAINER_STATE} is at global step {trainer_step}. The two "
        "halves come from different saves (a copied or stale folder); resuming would train "
        "from the wrong weights and optimizer state. Resume from a checkpoint whose halves "
        "match"
    )
