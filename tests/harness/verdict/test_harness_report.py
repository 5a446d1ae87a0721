"""What a user of the harness sees: pytest run on a throwaway test file, report inspected.

``pytester`` writes a small test suite into a temporary directory and runs pytest on it
in this process; we then read the terminal report as a user would. The plugin comes from
the installed package's entry point (no conftest), and each throwaway test file defines its
own rank functions, as a user's would.
"""

from __future__ import annotations

import pytest

from tutorial_impl.testing import proctable

pytest_plugins = ["pytester"]

USER_TESTS = """
import os, time
import pytest
import torch
import torch.distributed as dist

def rank_sum(rank, world_size, pid_dir=None):
    if pid_dir:
        from tutorial_impl.testing import proctable
        proctable.record_self(pid_dir, f"rank{rank}")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()

def test_passes(run_ranks):
    assert run_ranks(rank_sum) == [3.0, 3.0]

def fail_on(rank, world_size, bad):
    print(f"rank {rank} is about to {'fail' if rank == bad else 'wait'}")
    dist.barrier()
    if rank == bad:
        raise ValueError(f"boom from rank {rank}")
    dist.barrier()

def test_one_rank_raises(run_ranks):
    run_ranks(fail_on, 1)

def hang_on(rank, world_size):
    t = torch.ones(1)
    if rank == 0:
        dist.all_reduce(t)
    elif rank == 1:
        dist.broadcast(t, src=0)
    else:
        while True:
            time.sleep(0.05)

@pytest.mark.rank_timeout(2)
@pytest.mark.world_size(3)
def test_hangs(run_ranks):
    run_ranks(hang_on)

def exit_on(rank, world_size, bad, code):
    if rank == bad:
        os._exit(code)
    dist.barrier()

def test_crashes(run_ranks):
    run_ranks(exit_on, 0, 5)

def skip_on(rank, world_size, skipping):
    if rank >= skipping:  # every rank that skips skips before any collective
        pytest.skip("this rank has no work here")

def test_rank_skips(run_ranks):
    run_ranks(skip_on, 1)

def compare(rank, world_size):
    got = [1, 2, 3]
    assert got == [1, 2, 3 + rank]

def test_plain_assert_in_a_rank(run_ranks):
    run_ranks(compare)

def xfail_on(rank, world_size):
    if rank == 1:
        pytest.xfail("known bug on rank 1")

def test_rank_xfails(run_ranks):
    run_ranks(xfail_on)

def unpicklable(rank, world_size):
    return (lambda: rank) if rank == 1 else rank

def test_unpicklable_result(run_ranks):
    run_ranks(unpicklable)
"""


def test_what_a_user_sees_in_the_report(pytester):
    """One pytest run over USER_TESTS; the report must let a user diagnose each test
    without re-running anything, and its first line for each failure is the cause."""
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rfsx", "--junitxml=junit.xml")
    text = result.stdout.str()

    # A pass passes, a raise/hang/crash fails, a rank's pytest.skip is a skip and its
    # pytest.xfail an expected failure.
    result.assert_outcomes(passed=1, failed=5, skipped=1, xfailed=1)

    # The short summary (-ra, CI logs) leads with the cause, not the exception's class path.
    result.stdout.fnmatch_lines(
        [
            # (pytester's terminal is 80 columns wide: pytest cuts each line there)
            "FAILED test_user.py::test_one_rank_raises - rank 1 raised ValueError: boom*",
            "FAILED test_user.py::test_hangs - rank(s) 0, 1, 2 still running after*",
            "FAILED test_user.py::test_crashes - rank 0 exited with code 5*",
            "FAILED test_user.py::test_plain_assert_in_a_rank - rank 1 raised Assertion*",
            "FAILED test_user.py::test_unpicklable_result - rank 1 raised *",
            "XFAIL test_user.py::test_rank_xfails - rank 1: known bug on rank 1",
        ]
    )

    # The failure shows the rank's traceback; where the other rank was (in the barrier,
    # called from fail_on) and what every rank printed are sections of their own.
    assert "RankFailed: rank 1 raised ValueError: boom from rank 1" in text
    assert "in fail_on" in text
    assert "Python stacks of rank 0" in text
    assert "output of rank 0" in text and "[rank 0] rank 0 is about to wait" in text
    assert "[rank 1] rank 1 is about to fail" in text

    # A plain assert in a rank function of the test file keeps pytest's explanation.
    assert "assert [1, 2, 3] == [1, 2, 4]" in text

    # The hang's first line says, from the ranks' flight-recorder records, that the ranks
    # are in different collectives, which and where; and where the rank outside any
    # collective was (its stack). No rerun with --check-collectives is needed for that.
    hang = next(line for line in text.splitlines() if "RankTimeout: rank(s)" in line)
    assert "rank 0 waits in all_reduce #1 at test_user.py:" in hang
    assert "rank 1 waits in broadcast #1 at test_user.py:" in hang
    assert "the ranks are in different collectives" in hang
    assert "rank 2 at test_user.py:" in hang and "in hang_on" in hang
    assert "--check-collectives" not in hang
    assert "@pytest.mark.rank_timeout(SECONDS)" in text
    assert "Python stacks of rank 2" in text and "in hang_on" in text

    # A result the parent cannot receive names the rank.
    assert "RankFailed: rank 1 raised " in text
    assert ": returned a value that cannot be pickled: " in text

    # The skip shows which rank skipped and why.
    assert "SKIPPED [1] test_user.py" in text
    assert "rank 1: this rank has no work here" in text

    # junit XML, what CI systems render: the cause as the failure's message.
    junit = (pytester.path / "junit.xml").read_text()
    assert 'message="rank 1 raised ValueError: boom from rank 1"' in junit

    # --tb=no: one line per failure, and it is still the cause.
    quiet = pytester.runpytest("-p", "no:cacheprovider", "--tb=no", "-k", "one_rank_raises")
    quiet.stdout.fnmatch_lines(["FAILED *test_one_rank_raises - rank 1 raised ValueError: boom*"])


CANNOT_RUN_HERE = """
import pytest
from tutorial_impl.testing import proctable

PIDS = {pid_dir!r}

def record(rank, world_size):
    proctable.record_self(PIDS, f"rank{{rank}}")

@pytest.mark.dist_gpu
def test_gpu(run_ranks):
    run_ranks(record)

@pytest.mark.dist_gpu(8)
def test_eight_gpus(run_ranks):
    run_ranks(record)

@pytest.mark.dist_backend("nccl")
def test_nccl(run_ranks):
    run_ranks(record)

@pytest.mark.dist_backend("mpi")
@pytest.mark.world_size(1)  # forked MPI ranks above 1 are refused: see test_harness_config
def test_mpi(run_ranks):
    run_ranks(record)

def test_gloo_runs(run_ranks):
    run_ranks(record, world_size=1)
"""


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the skips of a CPU-only machine"
)
def test_tests_that_cannot_run_here_are_skipped_before_any_rank_starts(pytester, tmp_path):
    """gpu / gpu(8) / nccl / mpi tests are skipped at collection time with a reason; their
    rank function (which would record its pid) never runs. The gloo test proves that the
    recording itself works."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    pytester.makepyfile(CANNOT_RUN_HERE.format(pid_dir=str(pid_dir)))
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=4)
    text = result.stdout.str()
    if __import__("torch").distributed.is_nccl_available():
        # A CUDA build of torch without a GPU: NCCL is there, so the nccl test asks for CUDA.
        assert text.count("CUDA is not available") == 3  # gpu, gpu(8) and nccl
    else:
        assert text.count("CUDA is not available") == 2  # gpu and gpu(8)
        assert "NCCL is not available in this build of torch" in text
    assert "MPI backend not available" in text
    assert set(proctable.recorded(pid_dir)) == {"rank0"}  # only the gloo test ran a rank


BACKSTOP = """
import pytest

def test_default_deadline(run_ranks):
    pass

@pytest.mark.rank_timeout(500)
def test_long_deadline(run_ranks):
    pass

@pytest.mark.rank_timeout(500)
def test_no_ranks():
    pass
"""


def test_pytest_timeout_stays_above_the_harness_deadline(pytester):
    """pytest-timeout is only a backstop: a test whose harness deadline (500 s) is above
    the configured timeout (100 s) gets a timeout marker 30 s above its deadline, so the
    harness (stacks, clean kill) always fires first. Tests already below are left alone."""
    pytester.makeini("[pytest]\ntimeout = 100\nrank_timeout = 60\n")
    pytester.makepyfile(BACKSTOP)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    timeouts = {
        item.name: (m.args[0] if (m := item.get_closest_marker("timeout")) else None)
        for item in items
    }
    assert timeouts == {
        "test_default_deadline": None,  # 60 + 30 <= 100: the ini timeout already suffices
        "test_long_deadline": 530.0,
        "test_no_ranks": None,  # no run_ranks fixture, nothing to protect
    }


# A user's test file whose run_ranks records the deadline the fixture chose, starting no rank.
SPY = """
import pytest
from tutorial_impl.testing import RankResults
from tutorial_impl.testing.strategies import protocol

def echo(rank, world_size):
    pass

def spy(strategy, call):
    # Record the deadline the fixture chose instead of starting ranks.
    results = RankResults([call.deadline])
    results.outputs = []
    return results

@pytest.fixture(autouse=True)
def _spy(monkeypatch):
    monkeypatch.setattr(protocol, "run", spy)
"""

DEADLINES = (
    SPY
    + """

def test_default(run_ranks):
    assert run_ranks(echo) == [{default}]

@pytest.mark.rank_timeout(7)
def test_marker(run_ranks):
    assert run_ranks(echo) == [7.0]

def test_call(run_ranks):
    assert run_ranks(echo, timeout=3) == [3]
"""
)


@pytest.mark.parametrize(("option", "default"), [(None, 42.0), ("5", 5.0)])
def test_the_deadline_comes_from_call_marker_option_or_ini(pytester, option, default):
    """Which harness deadline a test gets, most specific first: the call's ``timeout=``,
    then ``@pytest.mark.rank_timeout``, then ``--rank-timeout`` for the whole run, then the
    ``rank_timeout`` ini value (42 here). The hang tests above show a deadline at work."""
    pytester.makeini("[pytest]\nrank_timeout = 42\n")
    pytester.makepyfile(DEADLINES.format(default=default))
    args = ["-p", "no:cacheprovider"] + ([f"--rank-timeout={option}"] if option else [])
    pytester.runpytest(*args).assert_outcomes(passed=3)


TIMEOUTS = (
    SPY
    + """
@pytest.mark.timeout(8)
@pytest.mark.rank_timeout(20)
def test_own_limit_below_the_deadline(run_ranks):
    assert run_ranks(echo) == [6.0]
    assert run_ranks(echo, timeout=100) == [6.0]

def test_session_limit(run_ranks):
    assert run_ranks(echo) == [60.0]
"""
)


def test_the_harness_reports_before_pytest_timeout_whatever_the_user_set(pytester, monkeypatch):
    """A test's own ``timeout(8)`` stands, and its harness deadline (20 s asked, and 100 s
    asked by one call) shrinks under it to 6 s, leaving a quarter of the limit to report the
    ranks' stacks before pytest-timeout would fire. A session-wide limit (``PYTEST_TIMEOUT``
    here; ``--timeout`` and the ini value alike) is a backstop: raised above the deadline."""
    monkeypatch.setenv("PYTEST_TIMEOUT", "10")
    pytester.makepyfile(TIMEOUTS)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    backstop = {item.name: item.get_closest_marker("timeout").args[0] for item in items}
    assert backstop == {"test_own_limit_below_the_deadline": 8, "test_session_limit": 90.0}
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
