"""`GradReducer`: when buckets are reduce-scattered, and in what order.

Two rules keep ranks in lockstep without any extra communication:

- Buckets launch in index order. A bucket whose gradients are complete early waits
  until every lower-index bucket has launched (a rank where some parameter got no
  gradient would otherwise launch in a different order, and point-to-point messages
  or NCCL kernels would pair up wrongly).
- Every bucket is launched exactly once per reduction round, whether or not this rank
  produced gradients for it: another rank may have.

At most ``max_in_flight`` buckets are in flight; launching one more first waits for the
oldest, which bounds the full-size gradient memory alive during backward.

Which parameters got a gradient is tracked per rank (``local_used``) and combined over
ranks at the step boundary (`global_used`): a parameter no rank produced a gradient
for is skipped by the optimizer, as torch skips parameters whose ``grad`` is None.

A gradient that arrives after its bucket was launched in the same backward (a
parameter autograd reaches again, e.g. one used inside and outside a reentrant
checkpoint) is kept as an unreduced local gradient: the step boundary's agreement sees it
on some rank, and every rank reduce-scatters every bucket once more. Correct, at the cost
of one more round of communication for that step.

[Note: repeated step] torch's ``step()`` twice without a backward applies the same gradients
again. Stages 2-3 free the gradient shards at the step (`after_step`), so a second step
would find no gradients and skip every parameter: silently a no-op. It is refused instead,
on every rank (the flag rides on the step's agreement), before anything changes. A new
gradient (from backward, or assigned by hand) or ``zero_grad()`` clears it: after
``zero_grad()`` a step without gradients is a no-op, as in torch. (A backward that reaches
no parameter does not: torch would apply the old gradients again.)

Gradient arrival is recorded here and nowhere else: the hooks (`zerolite.grads.hooks`) own
``param.grad`` and hand each gradient over with one call (`add_grad` in backward;
`add_unhooked_grad` or `set_full_grads` at the step boundary); only this class and the
buckets themselves change a bucket's counters or the used-flags.

The entry points hooks and autograd callbacks call (`add_grad`, `end_backward`, `flush`,
`reduce`, `zero`) are `not_compiled`: they also run inside a compiled function that runs
``backward()``, and dynamo must not trace their collectives (see `zerolite.ground.compile_guard`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator

import torch
from torch import nn

from zerolite.comm.collectives import Group
from zerolite.comm.small_collectives import small_collective
from zerolite.errors import RankMismatchError
from zerolite.grads.bucket import GradBucket
from zerolite.ground.compile_guard import not_compiled

__all__ = ["GradReducer", "install_no_sync"]

logger = logging.getLogger(__name__)


class GradReducer:
    """Launch policy and bookkeeping over all of a model's `GradBucket`s.

    Args:
        buckets: one per flat buffer, in launch order.
        group: the data-parallel group.
        max_in_flight: reduce-scatters allowed in flight at once (>= 1).
    """

    def __init__(
        self, buckets: list[GradBucket], group: Group, *, stage: int = 1, max_in_flight: int = 1
    ) -> None:
        self.buckets = buckets
        self.stage = stage
        self.group = group
        self.max_in_flight = max_in_flight
        self._next_launch = 0
        self._in_flight: deque[GradBucket] = deque()
        # Per bucket, per param: this rank produced a gradient since the last zero().
        self.local_used = [torch.zeros(len(b.flat.params), dtype=torch.bool) for b in buckets]
        # Reduced shards are up to date for the coming step.
        self.reduced = False
        self.global_used: list[torch.Tensor] = []
        # True inside model.no_sync(): gradients stay local, nothing launches.
        self.sync_disabled = False
        # Stages 2-3: a step used (and freed) the gradient shards, and no new gradient
        # arrived since ([Note: repeated step]).
        self.stepped = False

    @not_compiled
    def add_grad(self, b: int, i: int, grad: torch.Tensor) -> bool:
        """Stage 2-3: param ``i`` of bucket ``b`` produced ``grad`` in backward.

        Adds it into the bucket, records that this rank used the parameter and, unless
        inside ``no_sync()``, launches every bucket that is now complete, in order.
        Returns True when this gradient completed bucket ``b`` (its unit may be freed).
        """
        bucket = self.buckets[b]
        self.stepped = False
        if bucket.in_flight:
            # A late gradient (see the module docstring): its bucket is already on its way.
            logger.debug("%s %r got a gradient after its bucket was launched; it is reduced again "
                         "at the step", self.group.prefix(), bucket.flat.names[i])
            bucket.wait()
        with torch.no_grad():
            bucket.add_grad(i, grad)
        self.local_used[b][i] = True
        if self.sync_disabled:
            return False
        was_complete = bucket.complete
        complete = bucket.mark_arrived(i)
        self.launch_ready()
        return complete and not was_complete

    def add_unhooked_grad(self, b: int, i: int, grad: torch.Tensor) -> None:
        """Stage 2-3, step boundary: a gradient the hooks never saw (assigned to
        ``param.grad`` by hand) joins bucket ``b`` as param ``i``'s local gradient.

        Nothing launches: the bucket is left unreduced, so `reduce`'s agreement sees it
        and every rank reduce-scatters every bucket once more. Call under ``torch.no_grad()``.
        """
        self.buckets[b].add_grad(i, grad)
        self.local_used[b][i] = True
        self.stepped = False

    def set_full_grads(self, b: int, used: list[bool]) -> None:
        """Stage 1, step boundary: bucket ``b``'s ``full`` buffer holds this rank's gradients.

        Autograd accumulated them through the ``param.grad`` views, without `add_grad`.
        ``used[i]``: param ``i`` had a gradient. The bucket awaits reduction (`reduce`).
        """
        self.local_used[b].copy_(torch.tensor(used, dtype=torch.bool))
        self.buckets[b].mark_unreduced()

    def launch_ready(self) -> None:
        """Launch, in order, every bucket from the next one on whose gradients are complete."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not bucket.complete:
                return
            self._launch(bucket)

    @not_compiled
    def end_backward(self) -> None:
        """Stage 2-3, the end of a backward: launch what is left and wait (`flush`).

        Inside ``no_sync()`` nothing launches: the gradients stay local until the next
        synced backward. Every rank calls it at the end of every backward.
        """
        if not self.sync_disabled:
            self.flush()

    @not_compiled
    def flush(self) -> None:
        """Launch every bucket not launched yet this round, in order, then wait for all.

        Called at the end of a backward (stage 2) and at the step boundary for buckets
        holding unreduced gradients; all ranks must call it the same number of times.
        """
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        self._wait_in_flight()

    def _launch(self, bucket: GradBucket) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().wait()
        bucket.launch()
        self._in_flight.append(bucket)
        self._next_launch += 1

    @not_compiled
    def reduce(self) -> list[torch.Tensor]:
        """Make every bucket's ``shard`` hold the averaged gradients; idempotent per step.

        Returns, per bucket, a bool tensor over its params: some rank produced a gradient.
        Every rank must call this at the same step boundary.
        """
        if not self.reduced:
            self._wait_in_flight()  # a shard is read only once its reduce-scatter has landed
            # Ranks may disagree on whether local gradients await reduction (no_sync
            # leftovers, late or hand-assigned gradients), so decide together: one small
            # all-reduce carries the used-flags and an "unreduced" flag.
            # It also carries each rank's exchange count and step, as a max and a negated
            # max: ranks out of step all see it, and all raise (see collectives' lockstep).
            unreduced = any(b.unreduced for b in self.buckets)
            counters = [self.group.sequence, self.group.step, self.group.forwards]
            local = torch.cat([
                *self.local_used,
                torch.tensor([self.stepped, unreduced]),
                torch.tensor([v for c in counters for v in (c, -c)]),
            ]).to(torch.int64)
            # Over every rank (hybrid: all replica groups too), since all of them reduce.
            flags = small_collective(
                local, self.group.world, "max", what="step()'s gradient agreement"
            )
            _check_lockstep(self.group, flags[-6:].tolist())
            if flags[-8]:
                raise _repeated_step(self.group, self.stage)
            if flags[-7]:
                self.flush()
            self.global_used = list(flags[:-8].bool().split([len(u) for u in self.local_used]))
            self.reduced = True
        return self.global_used

    def after_step(self) -> None:
        """The step consumed the reduced gradients.

        Stage 1 keeps its full gradients (``param.grad`` views them, as in torch, until
        ``zero_grad``). Stages 2-3 forget the shards: users cannot see them, and a loop that
        zeroes with ``model.zero_grad()`` or ``param.grad = None`` never reaches them, so
        gradients are never carried across an optimizer step (as in DeepSpeed). A step
        with no new gradient since is then refused ([Note: repeated step]).
        """
        if all(bucket.keep_full for bucket in self.buckets):
            for bucket in self.buckets:
                bucket.consume()
            self.reduced = False
        else:
            self.zero()
            self.stepped = True

    @not_compiled
    def zero(self) -> None:
        """Forget all gradients (``zero_grad``)."""
        self._wait_in_flight()
        for bucket in self.buckets:
            bucket.zero()
        for used in self.local_used:
            used.zero_()
        self.reduced = False
        self.stepped = False

    def _wait_in_flight(self) -> None:
        while self._in_flight:
            self._in_flight.popleft().wait()
        self._next_launch = 0


def _repeated_step(group: Group, stage: int) -> RuntimeError:
    """The error for a stage-2/3 step with no new gradient since the previous step."""
    return RuntimeError(
        f"{group.prefix()} zerolite: step() (or clipping) at step {group.step} found no "
        f"backward since the previous step() on some rank. At stage {stage} zerolite frees "
        "the reduced gradient shards once a step has used them, so it cannot apply the same "
        "gradients again as torch would. Run a backward before each step(), call "
        "zero_grad() first if a step without gradients is meant, or use stage=1, which "
        "keeps gradients until zero_grad(). Nothing was changed."
    )


def _check_lockstep(group: Group, extremes: list[int]) -> None:
    """Raise on every rank if the ranks' lockstep counters differ.

    ``extremes``: (max, -min) over ranks of the exchange count, the step count and the
    forward count, as all-reduced with MAX.
    """
    (seq_hi, seq_lo), (step_hi, step_lo), (fwd_hi, fwd_lo) = (
        (extremes[k], -extremes[k + 1]) for k in (0, 2, 4)
    )
    if seq_hi == seq_lo and step_hi == step_lo and fwd_hi == fwd_lo:
        return
    raise RankMismatchError(
        f"{group.prefix()} zerolite: ranks are out of step at step(): across ranks, steps "
        f"completed range from {step_lo} to {step_hi}, forwards with gradients from {fwd_lo} "
        f"to {fwd_hi}, and zerolite exchanges from {seq_lo} to {seq_hi}. A rank skipped or "
        "added step(), an iteration or another zerolite operation (e.g. caught an exception "
        "and moved on alone); every rank must run the same loop. An extra forward on some "
        "ranks only must run under torch.no_grad()."
    )


def install_no_sync(model: nn.Module, reducer: GradReducer) -> None:
    """Give ``model`` a ``no_sync()`` context manager (as DDP's) driving ``reducer``.

    Inside it, backward only accumulates gradients locally; the first backward after
    it reduces the sum. In stage 1 gradients are only reduced at ``step()`` anyway, so
    it changes nothing there.
    """

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        previous = reducer.sync_disabled
        reducer.sync_disabled = True
        try:
            yield
        finally:
            reducer.sync_disabled = previous

    model.no_sync = no_sync  # type: ignore[assignment]
