"""Divergence guard: ranks compare what they are about to build before building it.

A rank that built a different model, config or layout would pair its collectives with
the wrong peers and hang or corrupt silently. So before anything is modified, each
rank reduces a description of its plan (one line per fact) to a digest, the digests
are exchanged, and on any difference -- or any rank's local validation error -- the
full descriptions are exchanged and every rank raises, naming the first difference.
Local errors travel through the same exchange, so a rank that rejects its input never
leaves its peers waiting in a collective. `agreed` is the usual way in: it captures the
error of a block of local work and agrees on it when the block ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator

from zerolite.comm.collectives import Group
from zerolite.comm.small_collectives import all_gather_bytes
from zerolite.errors import RankMismatchError

__all__ = ["RankMismatchError", "agree", "agreed"]


@contextlib.contextmanager
def agreed(
    what: str,
    group: Group,
    lines: list[str] | None = None,
    *,
    peer_error: type[Exception] | None = None,
) -> Iterator[list[str]]:
    """Run a block of local work, then `agree` on its outcome across ``group``.

    An ``Exception`` raised in the block is captured, every rank learns of it, and it is
    raised again on its own rank; the other ranks raise `RankMismatchError` naming it
    (or ``peer_error``). The block must not run collectives: a rank that fails early
    would skip them. All ranks of ``group`` must enter the block. Example::

        with agreed("zerolite.checkpoint.save() (committing)", group):
            if group.rank == 0:
                commit(tmp, path, token)

    Args:
        what: the operation, for messages (e.g. ``"zerolite.shard()"``).
        group: the ranks that agree.
        lines: this rank's description of its plan, compared across ranks; the block
            may extend the list it receives (``as lines``).
        peer_error: the type the other ranks raise a rank's failure as (e.g.
            `zerolite.checkpoint.CheckpointError`, the documented type of a load);
            None keeps `RankMismatchError`.
    Raises:
        The rank's own exception; or `RankMismatchError` (``peer_error``) naming the
        failing rank or the first line on which ranks differ.
    """
    lines = [] if lines is None else lines
    error: Exception | None = None
    try:
        yield lines
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone raises
        error = exc
    try:
        agree(what, lines, error, group)
    except RankMismatchError as exc:
        if peer_error is None:
            raise
        raise peer_error(str(exc)) from exc


def agree(what: str, lines: list[str], error: BaseException | None, group: Group) -> None:
    """Check that every rank of ``group`` holds the same ``lines`` and no ``error``.

    All ranks of the group must call this, with or without an error of their own.

    Args:
        what: the operation, for messages (e.g. ``"shard()"``).
        lines: this rank's description of its plan.
        error: this rank's local validation error, if any; it is re-raised here.
    Raises:
        The rank's own ``error``; or `RankMismatchError` naming the failing rank or
        the first line on which ranks differ.
    """
    payload = json.dumps(
        {"error": None if error is None else f"{type(error).__name__}: {error}", "lines": lines}
    )
    digest = hashlib.sha256(payload.encode()).digest() + (b"\x01" if error is not None else b"\x00")
    if group.size > 1:
        digests = all_gather_bytes(digest, group, what=f"{what} (ranks comparing plans)")
        if all(d == digests[0] for d in digests) and error is None:
            return
        payloads = [
            json.loads(p)
            for p in all_gather_bytes(
                payload.encode(), group, what=f"{what} (ranks comparing plans)"
            )
        ]
    elif error is None:
        return
    else:
        payloads = [json.loads(payload)]
    if error is not None:
        raise error
    failed = [(r, p["error"]) for r, p in enumerate(payloads) if p["error"] is not None]
    if failed:
        rank, message = failed[0]
        raise RankMismatchError(
            f"{group.prefix()} {what} failed on rank {rank}: {message}; every rank stops"
        )
    raise RankMismatchError(f"{group.prefix()} {what}: ranks differ. {_first_difference(payloads)}")


def _first_difference(payloads: list[dict]) -> str:
    reference = payloads[0]["lines"]
    for rank, payload in enumerate(payloads[1:], start=1):
        lines = payload["lines"]
        for i in range(max(len(reference), len(lines))):
            mine = reference[i] if i < len(reference) else "<nothing>"
            theirs = lines[i] if i < len(lines) else "<nothing>"
            if mine != theirs:
                return (
                    f"Rank 0 has {mine!r} where rank {rank} has {theirs!r}. Every rank must build "
                    f"the same model (same parameter names, shapes and order), the same optimizer "
                    f"and the same ZeroConfig."
                )
    return "The descriptions differ only in encoding."
