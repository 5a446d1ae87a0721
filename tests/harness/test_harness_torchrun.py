"""torchrun's refusals: what makes a job run no test, or a pytest refuse to join one.

A test file runs forked, warm and under torchrun with the same verdicts:
``test_harness_conformance.py`` proves that (a stranger's file, two agents of one worker
each, as on two nodes). Here, what must stop a job before any test runs:

* ``test_ranks_that_collect_different_tests_refuse_together``: no test runs, the difference
  is named, every worker exits with a usage error.
* ``test_misuses_are_refused_with_the_reason``: ``--launcher torchrun`` outside torchrun,
  ``-n`` and ``--init-method`` under it, a malformed variable.

And how a job ends: ``test_the_job_exits_with_every_ranks_status``; what an abandoned
function leaves: ``test_an_abandoned_functions_logs_stay_out_of_later_tests``.
"""

from __future__ import annotations

import logging
import sys
import threading
import types

import pytest
from torchrun_worker import job_environment, pytest_as_a_torchrun_worker

from tutorial_impl.testing.rendezvous import agents_store
from tutorial_impl.testing.strategies.torchrun.phases import job_status
from tutorial_impl.testing.strategies.torchrun.worker import AbandonedLogs

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.timeout(300)]

JOB_DEADLINE = 150.0  # seconds for a whole job; generous, the machine is shared


COLLECTS_BY_RANK = """
import os

def test_everyone_has_this():
    pass

if os.environ.get("RANK") == "1":
    def test_only_rank_1_has_this():
        pass
"""


def test_ranks_that_collect_different_tests_refuse_together(
    pytester: pytest.Pytester, run_ranks
) -> None:
    """Two workers started as torchrun starts them, without the agent (it adds nothing to
    this claim and would cost a third interpreter): torchrun's variables, and the job's
    store hosted here, as the agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``). Each is a
    harness rank (``torchrun_worker``): about 3 s of CPU less than two fresh
    ``python -m pytest``, and the same refusal, output and exit status to check."""
    pytester.makepyfile(test_uneven=COLLECTS_BY_RANK)
    store = agents_store(JOB_DEADLINE)
    workers = run_ranks(
        pytest_as_a_torchrun_worker,
        job_environment(store, 2),
        str(pytester.path),
        ["-p", "no:cacheprovider", "test_uneven.py"],
        world_size=2,
        backend=None,
        may_exit={0, 1},
        timeout=JOB_DEADLINE,
    )
    report, quiet = workers.outputs
    assert "the ranks collected different tests, so no test was run" in report, report
    assert "rank 0 has 1, rank 1 has 2" in report
    assert "test_uneven.py::test_only_rank_1_has_this" in report
    assert "passed" not in report.split("no test was run")[-1]
    assert "no test was run" not in quiet and "test session starts" not in quiet, quiet
    assert [w.exitcode for w in workers] == [pytest.ExitCode.USAGE_ERROR] * 2, workers.outputs


@pytest.mark.slow
def test_misuses_are_refused_with_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any test runs (status 4, a message naming the problem), in this process:
    ``--launcher torchrun`` outside torchrun, ``-n`` or ``--init-method`` under torchrun (a
    job has torchrun's own rendezvous: the option is refused, never dropped), a malformed
    variable."""
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest("--launcher", "torchrun")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--launcher torchrun: this pytest was not started by torchrun*"])

    job = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    for name, value in {**job, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    result = pytester.runpytest("-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*-n/--numprocesses cannot be used under torchrun*"])

    result = pytester.runpytest("--init-method", "tcp")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--init-method cannot be honoured under torchrun*"])

    monkeypatch.setenv("RANK", "two")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*torchrun variable RANK='two' is not a number*"])
    # --launcher fork: torchrun's variables are ignored, the test runs forked as usual
    result = pytester.runpytest("--launcher", "fork")
    assert result.ret == pytest.ExitCode.OK


def test_the_job_exits_with_every_ranks_status() -> None:
    # Every worker exits with the status the ranks agreed on, at the end of the session.
    # All passed: 0. One rank failed (here rank 1, with rank 0's tests all passed): the job
    # failed, with that rank's status, not rank 0's 0.
    failed, usage = int(pytest.ExitCode.TESTS_FAILED), int(pytest.ExitCode.USAGE_ERROR)
    assert job_status({0: 0, 1: 0}, 2) == 0
    assert job_status({0: 0, 1: usage}, 2) == usage
    # A rank that sent no status (its worker vanished) failed the job, even if rank 0 passed.
    assert job_status({0: 0}, 2) == failed
    assert job_status({0: 0, 1: 0}, 3) == failed
    # Several failed: the first in rank order, the same answer on every rank.
    assert job_status({0: 0, 1: usage, 2: failed}, 3) == usage


LATER_TEST = """
import logging

def test_later(caplog):
    logging.getLogger("tutorial_impl.demo").warning("this test's own record")
    import conftest_shared
    conftest_shared.release.set()  # the abandoned function logs now, during this test
    conftest_shared.done.wait(5)
    assert [r.getMessage() for r in caplog.records] == ["this test's own record"]
"""


def test_an_abandoned_functions_logs_stay_out_of_later_tests(pytester: pytest.Pytester) -> None:
    # Under torchrun a rank function still running at its test's deadline is abandoned (a
    # thread cannot be killed); when its collective fails later, at the group's timeout, torch
    # logs it. That record must not appear in the captured log of the test running then.
    release, done = threading.Event(), threading.Event()

    def abandoned() -> None:
        release.wait(5)
        logging.getLogger("torch.distributed.distributed_c10d").warning("late, from a dead test")
        done.set()

    thread = threading.Thread(target=abandoned, name="rank 0", daemon=True)
    thread.start()
    job = types.SimpleNamespace(abandoned=[thread])
    sys.modules["conftest_shared"] = types.SimpleNamespace(release=release, done=done)
    try:
        pytester.makepyfile(test_later=LATER_TEST)
        result = pytester.inline_run(plugins=[AbandonedLogs(job)])
    finally:
        del sys.modules["conftest_shared"]
    result.assertoutcome(passed=1)
    assert done.is_set()  # the record was logged, during the later test
