"""Tests for zerolite.testing.run_ranks, on real gloo process groups (no mocks)."""

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import psutil
import pytest
import torch
import torch.distributed as dist

import zerolite.testing
from zerolite.testing import RankFailure, RankTimeout, run_ranks

# --- rank functions (module level so they pickle by reference) ---------------------------------


def _identity_and_sum() -> tuple[int, int, int, float, tuple[str, ...]]:
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    env = tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads(), t.item(), env


def _make_tensor(scale: float) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    return {"t": torch.arange(6, dtype=torch.float64).reshape(2, 3) * scale + rank}


_PENDING: list[object] = []  # keeps an isend alive after its rank's fn has returned


def _early_return_with_pending_send() -> float | None:
    if dist.get_rank() == 1:
        _PENDING.append(dist.isend(torch.tensor([42.0]), dst=0))
        return None  # returns before rank 0 has even posted its recv
    time.sleep(0.5)
    t = torch.zeros(1)
    dist.recv(t, src=1)
    return t.item()


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom")
    dist.barrier()


def _rank1_sigkills_itself() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _rank0_hangs(seconds: float) -> int:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def _rank1_exits(code: int) -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.2)
        os._exit(code)
    time.sleep(60)


def _rank1_raises_rank0_sleeps() -> None:
    dist.barrier()  # rank 0 is past gloo's connection setup before rank 1 disappears
    if dist.get_rank() == 1:
        time.sleep(0.2)
        raise ValueError("boom")
    time.sleep(60)  # in Python, not a collective: cannot notice that rank 1 is gone


def _both_raise() -> None:
    dist.barrier()
    time.sleep(0.2 if dist.get_rank() == 1 else 0.7)  # rank 1 first, rank 0 inside the grace
    raise KeyError(f"bad rank {dist.get_rank()}")


def _say(tag: str) -> None:
    print(f"{tag}: stdout of rank {dist.get_rank()}", flush=True)
    print(f"{tag}: stderr of rank {dist.get_rank()}", file=sys.stderr, flush=True)


def _return_unpicklable() -> threading.Lock:
    return threading.Lock()


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


# --- helpers ------------------------------------------------------------------------------------


def _stray_rank_processes() -> list[psutil.Process]:
    """Live descendants that are not our direct children.

    Direct children are the forkserver and multiprocessing's resource tracker; rank processes
    are forked by the forkserver, so any rank still alive is a grandchild of this process.
    """
    me = os.getpid()
    stray = []
    for proc in psutil.Process(me).children(recursive=True):
        try:
            if proc.ppid() != me and proc.status() != psutil.STATUS_ZOMBIE:
                stray.append(proc)
        except psutil.NoSuchProcess:
            pass
    return stray


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_see_group_and_all_reduce(world_size: int) -> None:
    results = run_ranks(_identity_and_sum, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    ws = str(world_size)
    assert results == [
        (r, world_size, 1, expected_sum, (str(r), ws, str(r), ws)) for r in range(world_size)
    ]


def test_tensor_return_values_round_trip() -> None:
    results = run_ranks(_make_tensor, 2, 0.5)
    for rank, out in enumerate(results):
        expected = torch.arange(6, dtype=torch.float64).reshape(2, 3) * 0.5 + rank
        torch.testing.assert_close(out["t"], expected)
        assert not out["t"].is_shared()


def test_group_outlives_ranks_that_return_early() -> None:
    # A rank must not destroy the group while a peer still uses it.
    assert run_ranks(_early_return_with_pending_send, 2, timeout=30) == [42.0, None]


def test_caller_environment_reaches_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The forkserver's environment is frozen at its start; set a variable only now.
    monkeypatch.setenv("ZEROLITE_TESTING_PROBE", "on")
    assert run_ranks(_read_env, 2, "ZEROLITE_TESTING_PROBE") == ["on", "on"]
    has_lo = os.path.exists("/sys/class/net/lo")
    expected = os.environ.get("GLOO_SOCKET_IFNAME") or ("lo" if has_lo else None)
    assert run_ranks(_read_env, 1, "GLOO_SOCKET_IFNAME") == [expected]


def test_rank_output_reaches_callers_fds(capfd: pytest.CaptureFixture[str]) -> None:
    # The forkserver was started by an earlier test; ranks must still write to our fds 1/2.
    run_ranks(_say, 2, "probe")
    out, err = capfd.readouterr()
    assert "probe: stdout of rank 0" in out and "probe: stdout of rank 1" in out
    assert "probe: stderr of rank 0" in err and "probe: stderr of rank 1" in err


def test_unpicklable_return_value_is_reported() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_return_unpicklable, 2, timeout=30)
    # Both ranks fail the same way; a rank that has not reported within the grace period
    # after the first failure (a loaded machine) is stopped, so require the first reporter.
    assert info.value.failures
    for message in info.value.failures.values():
        assert "cannot pickle '_thread.lock'" in message or "killed after rank" in message, message
    assert any("cannot pickle '_thread.lock'" in m for m in info.value.failures.values())


def test_exception_in_one_rank_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 raises while rank 0 waits in a barrier: rank 0's barrier fails as soon as rank
    1's process is gone, and the launch ends on both reports. Event-based: the deadline and
    the grace period are set to 10 minutes, so a launch that waited for either would end in a
    RankTimeout or with rank 0 killed, not with rank 0's own error."""
    monkeypatch.setattr(zerolite.testing, "_GRACE_S", 600.0)
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_raises, 2, timeout=600)
    message = str(info.value)
    assert "[rank 1/2]" in message
    assert "ValueError: boom" in message
    assert "ValueError: boom" in info.value.failures[1]
    assert set(info.value.failures) == {0, 1}
    assert "Traceback" in info.value.failures[0], info.value.failures[0]  # its own error
    assert not isinstance(info.value, RankTimeout)
    assert _stray_rank_processes() == []


def test_unresponsive_rank_killed_after_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 sleeps 60 s in Python (it cannot notice rank 1's failure) and would then return
    normally; the launch's deadline is 120 s. Killed, it was killed by the grace period:
    after at least that long (a lower bound, which load cannot break)."""
    monkeypatch.setattr(zerolite.testing, "_GRACE_S", 1.5)  # parent-side constant; saves time
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_raises_rank0_sleeps, 2, timeout=120)
    assert time.monotonic() - start >= 1.5  # the grace period was given
    assert not isinstance(info.value, RankTimeout)
    assert info.value.failures[0] == "killed after rank 1 failed"
    assert "[rank 0/2] killed after rank 1 failed" in str(info.value)
    assert "ValueError: boom" in info.value.failures[1]
    assert _stray_rank_processes() == []


def test_errors_of_all_ranks_are_collected() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_both_raise, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 failed first" in message
    assert "[rank 0/2]" in message and "KeyError: 'bad rank 0'" in message
    assert "[rank 1/2]" in message and "KeyError: 'bad rank 1'" in message


def test_killed_rank_is_reported_promptly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 SIGKILLs itself: its death is seen through its process sentinel and named as
    such. Event-based: with a 10-minute grace period a launch that missed the death would
    end at the 60 s deadline with rank 1 "killed after rank 0 failed", not SIGKILLed."""
    monkeypatch.setattr(zerolite.testing, "_GRACE_S", 600.0)
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_sigkills_itself, 2, timeout=60)
    assert not isinstance(info.value, RankTimeout)
    assert "SIGKILL" in info.value.failures[1]
    assert "[rank 1/2]" in str(info.value)
    assert "SIGKILL" in str(info.value)
    assert _stray_rank_processes() == []


def test_silent_exit_kills_the_rest_immediately(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 exits silently; rank 0 sleeps 60 s in Python and would then return normally.
    No grace period for a silent death: rank 0 is killed at once. Event-based: the grace
    period is 10 minutes and the deadline 120 s, so a launch that gave one would have let
    rank 0 return after its sleep."""
    monkeypatch.setattr(zerolite.testing, "_GRACE_S", 600.0)
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_exits, 2, 3, timeout=120)
    assert "exit code 3" in info.value.failures[1]
    assert info.value.failures[0] == "killed after rank 1 failed"
    assert _stray_rank_processes() == []


def test_hang_times_out_and_names_hung_rank() -> None:
    """Rank 0 sleeps far past the deadline: a RankTimeout naming it (were the deadline not
    kept, rank 0 would return after its sleep), no earlier than the deadline. Rank 1 must
    start, join the group and report within the deadline, so the deadline is no wall-clock
    constant: it is four times what a 2-rank launch takes on this machine now (at least
    5 s), measured just before, so a loaded machine stretches both alike."""
    start = time.monotonic()
    run_ranks(_identity_and_sum, 2)
    deadline = max(5.0, 4 * (time.monotonic() - start))
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank0_hangs, 2, deadline + 60, timeout=deadline)
    assert time.monotonic() - start >= deadline
    assert set(info.value.failures) == {0}
    assert "hung" in str(info.value) and "[rank 0/2]" in str(info.value)
    assert "[rank 1/2]" not in str(info.value)
    assert _stray_rank_processes() == []


def _local_function_factory() -> Callable[[], None]:
    def local() -> None:
        pass

    return local


@pytest.mark.parametrize("fn", [lambda: None, _local_function_factory()], ids=["lambda", "local"])
def test_unpicklable_function_rejected_before_launch(
    fn: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any process starts: starting one would raise AssertionError here."""
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("run_ranks started a launch")

    monkeypatch.setattr(zerolite.testing.mp, "get_context", no_launch)
    with pytest.raises(TypeError, match="module level"):
        run_ranks(fn, 2)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2", True])
def test_invalid_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match=repr(world_size).replace(".", r"\.")):
        run_ranks(_identity_and_sum, world_size)  # type: ignore[arg-type]
