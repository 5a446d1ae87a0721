"""``run_ranks(..., may_exit={rank})``: a rank whose death is part of the test.

The harness fails a run as soon as any rank dies, because its peers are then probably stuck
waiting for it. Some lessons are *about* a death, though: "a dead parameter server fails
training with a clear error". For those, the test names the ranks that may die; the harness
then records how each one ended (a ``RankExited`` in its place in the results) and lets the
others run to their own end, within the same deadline.

Read in order: a rank that ``os._exit``s while its peer runs on; one killed by a signal;
the limits (a death outside the set, or an exception inside it, still fails the run; a rank
the world does not have is refused); and, through the OS process table, that nothing is
left behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tutorial_impl.testing import RankCrashed, RankExited, RankFailed, proctable

# --- Rank functions: one rank dies, the other watches it go --------------------------------


def die_while_rank0_watches(rank: int, world_size: int, pid_dir: str, how: str) -> str:
    """Rank 1 dies (``how``: "exit" or "kill"); rank 0 waits until it is gone, then reports."""
    proctable.record_self(pid_dir, f"rank{rank}")
    if rank == 1:
        if how == "exit":
            os._exit(3)  # no result, no cleanup: like a process that crashed
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while "rank1" not in proctable.recorded(pid_dir) or "rank1" in proctable.alive(pid_dir):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 1 never died")
        time.sleep(0.01)
    return f"rank {rank} outlived rank 1"


def die_or_sleep(rank: int, world_size: int, dying: int) -> None:
    """Rank ``dying`` exits at once; every other rank sleeps far past any test's patience."""
    if rank == dying:
        os._exit(5)
    time.sleep(120)


def raise_instead(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank 1 raised, which is not dying")
    return rank


# --- The tests ------------------------------------------------------------------------------


def test_a_rank_that_exits_is_reported_and_the_others_run_on(run_ranks, tmp_path):
    results = run_ranks(die_while_rank0_watches, str(tmp_path), "exit", backend=None, may_exit={1})
    # Rank 0 saw rank 1 gone and still returned its value: the run went on after the death.
    assert results[0] == "rank 0 outlived rank 1"
    exited = results[1]
    assert isinstance(exited, RankExited) and (exited.rank, exited.exitcode) == (1, 3)
    assert "exited with code 3" in exited.how
    # Nothing is left: not the rank that died, not the one the harness killed at the end.
    assert proctable.wait_until_gone(tmp_path) == {}


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal(run_ranks, tmp_path):
    results = run_ranks(die_while_rank0_watches, str(tmp_path), "kill", backend=None, may_exit=[1])
    assert results[0] == "rank 0 outlived rank 1"
    exited = results[1]
    assert isinstance(exited, RankExited) and (exited.rank, exited.exitcode) == (1, -9)
    assert "killed by signal SIGKILL" in exited.how
    assert proctable.wait_until_gone(tmp_path) == {}


def test_a_death_outside_the_set_still_fails_the_run_at_once(run_ranks):
    # Rank 0 dies, but only rank 1 was allowed to: the run fails in moments, even though
    # rank 1 would sleep for two minutes.
    start = time.monotonic()
    with pytest.raises(RankCrashed, match="rank 0 exited with code 5") as failure:
        run_ranks(die_or_sleep, 0, backend=None, may_exit={1}, timeout=60)
    assert failure.value.rank == 0
    assert time.monotonic() - start < 30


def test_an_exception_in_a_rank_of_the_set_still_fails_the_run(run_ranks):
    # may_exit excuses a silent death, not an error.
    with pytest.raises(RankFailed, match="rank 1 raised, which is not dying"):
        run_ranks(raise_instead, backend=None, may_exit={1})


@pytest.mark.parametrize(
    ("may_exit", "message"),
    [
        ({2}, r"may_exit names \[2\], not ranks of a world of 2"),
        ({-1, 0}, r"may_exit names \[-1\], not ranks of a world of 2"),
        ("1", "may_exit must be a collection of ranks, got '1'"),
        (1, "may_exit must be a collection of ranks, got 1"),
    ],
)
def test_ranks_the_world_does_not_have_are_refused(run_ranks, may_exit, message):
    with pytest.raises(ValueError, match=message):
        run_ranks(raise_instead, backend=None, may_exit=may_exit)
