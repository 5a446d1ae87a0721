"""The cause, not its echo: which rank a failed run's first line names, in every arrival order.

When rank 2 raises and its process ends, its peers inside a collective with it raise gloo's
"Connection closed by peer" (or "reset") a moment later, and which report the parent reads
first is a race. ``verdict.decide`` must name rank 2 whatever the order (``echo``); a peer
whose group closed because that peer *returned* is said to have returned; ``--warm-audit``
compares how every rank ended, not which report came first. These are the verdict's own
rules, checked here on every order of arrival, without starting ranks; the conformance
file (``test_c34c``, ``test_c34d``) checks the same first lines on real ranks, forked, warm
and under torchrun. The runs behind the messages below: gloo's own words, as rank 1 raised
them when its peer's process ended (``tests/dist_tuto/test_08_failure.py`` checks them).
"""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tutorial_impl.testing import run_ranks
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.settings import timing
from tutorial_impl.testing.strategies.forked import Running
from tutorial_impl.testing.verdict import echo
from tutorial_impl.testing.verdict.agree import verdict_of
from tutorial_impl.testing.verdict.decision import Finished, decide
from tutorial_impl.testing.verdict.errors import RankCrashed, RankError, RankFailed

CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:21410. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF!"
)
RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:19626: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application. Check the logs of the remote worker before "
    "reporting an error. GLHF!"
)


def raised(exc_type: str, message: str) -> _o.Raised:
    return _o.Raised(exc_type, message, f"Traceback (most recent call last):\n{exc_type}: x\n")


OWN = raised("ValueError", "rank 2's own bug")


def verdict(outcomes: dict[int, _o.Outcome], order: list[int]) -> RankError:
    reports = {r: _o.Report(o, pid=100 + r, at=0.0) for r, o in outcomes.items()}
    run = Finished(len(outcomes), reports, order, {}, deadline=60.0)
    with pytest.raises(RankError) as caught:
        decide(run)
    return caught.value


def test_only_a_lost_peer_connection_is_an_echo():
    assert echo.is_echo(raised("RuntimeError", CLOSED))
    assert echo.is_echo(raised("RuntimeError", RESET))
    assert not echo.is_echo(OWN)
    assert not echo.is_echo(raised("RuntimeError", "Timed out waiting 1500ms for recv"))
    assert not echo.is_echo(_o.Killed(9)) and not echo.is_echo(_o.Returned(None))


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_rank_that_raised_is_named_first_whatever_arrived_first(order):
    outcomes = {0: raised("RuntimeError", CLOSED), 1: raised("RuntimeError", RESET), 2: OWN}
    error = verdict(outcomes, list(order))
    assert isinstance(error, RankFailed) and error.rank == 2
    # The echoes are not named on the first line as failures of their own...
    assert error.headline == "rank 2 raised ValueError: rank 2's own bug"
    assert error.failed_ranks == [2]
    # ... but their tracebacks are still in the report.
    assert "rank 0 failed too" in str(error) and "rank 1 failed too" in str(error)
    assert error.outcomes == outcomes


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0]])
def test_two_ranks_with_errors_of_their_own_are_both_named(order):
    outcomes = {0: raised("RuntimeError", CLOSED), 1: raised("KeyError", "'k'"), 2: OWN}
    error = verdict(outcomes, order)
    first = [r for r in order if r != 0][0]
    assert isinstance(error, RankFailed) and error.rank == first
    assert error.failed_ranks == [1, 2]


def test_a_death_still_comes_before_an_error_of_its_own():
    outcomes = {0: raised("RuntimeError", CLOSED), 1: _o.Killed(9), 2: OWN}
    error = verdict(outcomes, [0, 2, 1])
    assert isinstance(error, RankCrashed) and error.rank == 1
    assert error.headline.endswith("(rank(s) 2 failed too)")  # raised before the news came
    assert "had returned" not in error.headline


def test_every_failure_an_echo_names_the_first_and_the_others():
    # Close() faults: every rank's connections shut, no rank raised anything else.
    outcomes = {0: raised("RuntimeError", RESET), 1: raised("RuntimeError", CLOSED)}
    error = verdict(outcomes, [1, 0])
    assert isinstance(error, RankFailed) and error.rank == 1
    assert error.failed_ranks == [0, 1]


def test_a_peer_that_returned_is_said_to_have_returned_not_to_have_crashed():
    outcomes = {0: _o.Returned("done"), 1: raised("RuntimeError", CLOSED), 2: _o.Returned(2)}
    error = verdict(outcomes, [0, 2, 1])
    assert error.headline == (
        "rank 1 raised RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "pair.cc:553] Connection closed by peer [127.0.0.1]:21410. (rank(s) 0, 2 had returned "
        "and closed the connection, while this rank was still in a collective with it: no rank "
        "crashed)"
    )
    # A death among them: gloo's words may be right, and nothing is rewritten.
    outcomes = {0: _o.Exited(3), 1: raised("RuntimeError", CLOSED), 2: _o.Returned(2)}
    assert "had returned" not in verdict(outcomes, [1, 0, 2]).headline


def test_the_audit_compares_how_every_rank_ended_not_which_came_first():
    same = {0: raised("RuntimeError", CLOSED), 1: raised("RuntimeError", RESET), 2: OWN}
    warm = verdict(same, [0, 1, 2])
    fresh = verdict({**same, 0: _o.Stopped(None)}, [2, 1, 0])
    assert verdict_of(warm) == verdict_of(fresh)  # closed, reset or stopped: the same echo
    both_own = {r: raised("KeyError", "'k'") for r in range(2)}
    first_0, first_1 = verdict(both_own, [0, 1]), verdict(both_own, [1, 0])
    assert (first_0.rank, first_1.rank) == (0, 1)  # type: ignore[attr-defined]
    assert verdict_of(first_0) == verdict_of(first_1)
    other = verdict({**same, 2: raised("ValueError", "another bug")}, [2, 1, 0])
    assert verdict_of(other) != verdict_of(fresh)
    returned = verdict({**same, 1: _o.Returned(1)}, [2, 1, 0])
    assert verdict_of(returned) != verdict_of(fresh)
    # An error no verdict made (no outcomes): its rank and type, as before.
    bare = RankFailed(1, "tb", "rank 1 raised ValueError: x", {}, exc_type="ValueError")
    assert verdict_of(bare) == ("failed", "rank 1 raised ValueError")
    # An object's address differs from run to run; the rest of the message does not.
    at = [raised("TypeError", f"cannot pickle <Lock at {a}>") for a in ("0x7f01", "0x7fab")]
    assert verdict_of(verdict({0: at[0]}, [0])) == verdict_of(verdict({0: at[1]}, [0]))


def test_a_thread_gets_the_innermost_test_and_tests_side_by_side_are_refused():
    running = Running()
    outer, inner = object(), object()
    assert running.current() is None
    with running.during("outer", outer):  # type: ignore[arg-type]
        with running.during("inner", inner):  # type: ignore[arg-type]
            assert running.current() is inner  # a pytester run inside a test: nested
        assert running.current() is outer
        entered, leave = threading.Event(), threading.Event()

        def beside() -> None:
            with running.during("beside", inner):  # type: ignore[arg-type]
                entered.set()
                leave.wait(10)

        thread = threading.Thread(target=beside)
        thread.start()
        entered.wait(10)
        with pytest.raises(RuntimeError, match=r"2 tests run side by side .*\(outer, beside\)"):
            running.current()
        leave.set()
        thread.join(10)
        assert running.current() is outer
    assert running.current() is None


def test_a_deadline_is_usable_from_above_0_to_a_week():
    for seconds in (0.001, 0.5, 1, 60, timing.MAX_DEADLINE):
        assert timing.usable_seconds(seconds), seconds
    for seconds in (0, -1, timing.MAX_DEADLINE + 0.5, 1e9, math.inf, math.nan, True, "60", None):
        assert not timing.usable_seconds(seconds), seconds


def rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


@pytest.mark.world_size(3)
def test_run_ranks_from_a_thread_of_the_test_is_the_tests():
    """The public ``run_ranks`` from an executor's thread, which has no test context of its
    own: the test's world_size(3), not the default 2 (the conformance file's c34a proves it
    forked, warm and under torchrun)."""
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(run_ranks, rank_and_size).result(timeout=60)
    assert got == [(0, 3), (1, 3), (2, 3)]
