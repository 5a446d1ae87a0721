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

Every test gets a report, as a stranger meets it (``CRASHES``, a project with only the
installed package):
``test_a_session_in_which_a_rank_segfaults_reports_that_test_and_keeps_every_earlier_result``
(torchrun's own agent, two workers: results and output over the store's 8 MiB message limit,
an exception that cannot be printed, one skip text per reason, then a segfault on rank 1 and
the tests after it); ``test_a_crashing_reporter_and_a_sigterm_still_give_a_report`` (rank
0, the reporter, aborts; every worker gets SIGTERM, as from an agent ending the job).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import types
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from torchrun_worker import (
    job_environment,
    pytest_as_a_torchrun_worker,
    torchrun_agent_of_pytest,
)

from tutorial_impl.testing import proctable
from tutorial_impl.testing.rendezvous import agents_store
from tutorial_impl.testing.strategies.torchrun.channel import CHUNK, Channel
from tutorial_impl.testing.strategies.torchrun.launch import Launch
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


# --- every test gets a report ----------------------------------------------------------------

CRASHES = """
import ctypes
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from tutorial_impl.testing import run_ranks as public_run_ranks

BIG = 9 << 20  # over the store's 8 MiB message limit

def big_value(rank, world_size):
    return bytes([rank]) * BIG

def test_a_big_results(run_ranks):
    results = run_ranks(big_value)
    assert [len(r) for r in results] == [BIG, BIG] and results[1][:1] == b"\\x01"

def print_big(rank, world_size):
    if rank == 1:
        print("r" * BIG)

def test_b_big_output(run_ranks):
    print("t" * BIG)  # the test's own captured output, in its report on every rank
    assert [len(out) for out in run_ranks(print_big).outputs] == [0, BIG + 1]

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no words for it")

def raise_unprintable(rank, world_size):
    if rank == 1:
        raise Unprintable()
    dist.barrier()

@pytest.mark.rank_timeout(30)
def test_c_unprintable(run_ranks):
    run_ranks(raise_unprintable)

def nothing(rank, world_size):
    pass

@pytest.mark.world_size(3)
def test_d_size_by_marker(run_ranks):
    run_ranks(nothing)

def test_d_size_by_call(run_ranks):
    run_ranks(nothing, world_size=3)

def test_d_size_by_helper():
    public_run_ranks(nothing, world_size=3)

def segfault_on_1(rank, world_size):
    if rank == 1:
        ctypes.string_at(0)
    dist.all_reduce(torch.ones(1))

def test_e_segfault(run_ranks):
    run_ranks(segfault_on_1)

def test_f_after(run_ranks):
    run_ranks(nothing)

def test_g_plain_after():
    pass

def test_h_reporter_aborts():
    if int(os.environ["RANK"]) == 0:
        os.abort()

def test_i_sigterm_from_the_agent():
    os.kill(os.getppid(), signal.SIGTERM)  # the process torchrun started: the watcher
    time.sleep(60)

def test_j_last():
    pass
"""
UNPRINTABLE = "test_crashes.Unprintable"
BEFORE = "before returning a result"
SIZE_SKIP = (
    "needs world_size 3; this torchrun job has 2 ranks (under torchrun a test runs on the "
    "whole job: launch it with that many workers)"
)


def verdicts(junit: Path) -> dict[str, tuple[str, str, float]]:
    """Each test case of a junit file: (verdict, first line of its message, its time)."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        verdict, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                verdict = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "\n").splitlines()[0]
        found[case.get("name", "")] = (verdict, message, float(case.get("time", 0)))
    return found


def _one_agent(port: int, pytest_args: list[str]) -> list[str]:
    """torchrun's arguments for one node of two workers, forked from the agent, its c10d
    rendezvous on a store the test hosts (no port chosen)."""
    return [
        "--monitor-interval=0.1",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=crash-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf=is_host=0,join_timeout=120",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "--start-method=fork",
        "-m",
        "pytest",
        *pytest_args,
    ]


# -rfEs: no passed test's output in the report (9 MiB of it here)
ARGS = ["-p", "no:cacheprovider", "-p", "no:randomly", "-rfEs", "--tb=native", "-v"]


@pytest.mark.slow
def test_a_session_in_which_a_rank_segfaults_reports_that_test_and_keeps_every_earlier_result(
    pytester: pytest.Pytester, run_ranks
) -> None:
    """Under torchrun's own agent (two workers, forks of it): values and output over the
    store's message limit arrive; an exception whose ``__str__`` raises is named at once by
    its type; a world size the job lacks is skipped with one text whether a marker, the
    call or the helper asks; a segfault on rank 1 fails its test naming the rank and the
    signal, every earlier result is kept (summary and junit XML by rank 0), the tests after
    it are reported as not run with the reason, and the job ends within seconds with the
    agent seeing SIGSEGV, nothing left."""
    pytester.makepyfile(test_crashes=CRASHES)
    workers = pytester.path / "workers"
    workers.mkdir()
    store = agents_store(JOB_DEADLINE)
    args = [
        *ARGS,
        "--junitxml=job.xml",
        "-k",
        "not (test_h or test_i or test_j)",
        "test_crashes.py",
    ]
    start = time.monotonic()
    agent = run_ranks(
        torchrun_agent_of_pytest,
        _one_agent(store.port, args),
        str(pytester.path),
        str(workers),
        world_size=1,
        backend=None,
        env={"PYTHONUNBUFFERED": "1"},
        timeout=JOB_DEADLINE,
    )
    wall = time.monotonic() - start
    output, (end,) = agent.outputs[0], list(agent)
    assert (pytester.path / "job.xml").exists(), output[-5000:]
    got = verdicts(pytester.path / "job.xml")
    lost = "rank 1 was killed by signal SIGSEGV in test_crashes.py::test_e_segfault (call)"
    expected = {
        "test_a_big_results": ("passed", ""),
        "test_b_big_output": ("passed", ""),
        "test_c_unprintable": ("failed", f"rank 1 raised {UNPRINTABLE}: <str() failed>"),
        "test_d_size_by_marker": ("skipped", SIZE_SKIP),
        "test_d_size_by_call": ("skipped", SIZE_SKIP),
        "test_d_size_by_helper": ("skipped", SIZE_SKIP),
        "test_e_segfault": ("failed", f"rank 1 was killed by signal SIGSEGV {BEFORE}"),
        "test_f_after": ("skipped", f"not run: {lost}"),
        "test_g_plain_after": ("skipped", f"not run: {lost}"),
    }
    wrong = {
        name: got.get(name)
        for name, (verdict, first) in expected.items()
        if name not in got or got[name][0] != verdict or not got[name][1].startswith(first)
    }
    assert not wrong and set(got) == set(expected), (wrong, output[-5000:])
    assert got["test_c_unprintable"][2] < 15, "an unprintable exception waited for the deadline"
    # The report is rank 0's, once: its summary names what stopped the session.
    assert output.count("test session starts") == 1, output[-5000:]
    assert re.search(r"2 test\(s\) after it not run", output), output[-5000:]
    assert "generated xml file" in output and "short test summary info" in output
    assert end.failed == {0: 1, 1: -11} or end.failed == {1: -11}, end.failed
    assert not end.left and not proctable.wait_until_gone(workers), end.left
    print(f"the job took {wall:.1f} s")
    assert wall < JOB_DEADLINE / 2, f"the job took {wall:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "first_line", "codes"),
    [
        (
            "test_h_reporter_aborts",
            "rank 0 was killed by signal SIGABRT during the call phase; the session stops here",
            [-6, 1],
        ),
        ("test_i_sigterm_from_the_agent", "rank 0 got SIGTERM: torchrun's agent", [1, 1]),
    ],
    ids=["reporter-aborts", "sigterm"],
)
def test_a_crashing_reporter_and_a_sigterm_still_give_a_report(
    pytester: pytest.Pytester, run_ranks, case: str, first_line: str, codes: list[int]
) -> None:
    """Two workers (harness ranks, the job's store hosted here, no agent: what the workers do
    among themselves). Rank 0, which reports for the job, aborts in a test's body: rank 1
    names it with the signal and reports in its place, the earlier result, the summary and
    the junit XML included. Every worker gets SIGTERM in a test (as torchrun's agent sends
    it when a worker of the job has ended, here to the process torchrun would have started):
    the test fails naming it, at once, not after its sleep, the report is written, the test
    after it is reported as not run, and each worker exits with the session's status."""
    pytester.makepyfile(test_crashes=CRASHES)
    store = agents_store(JOB_DEADLINE)
    # The earlier result is a plain passing test's: test_a's two 9 MiB values (the segfault
    # test's claim) cost each case here about 0.4 s of CPU and prove nothing more.
    args = [*ARGS, "--junitxml=job.xml", "-k", f"test_g_ or {case} or test_j_", "test_crashes.py"]
    start = time.monotonic()
    workers = run_ranks(
        pytest_as_a_torchrun_worker,
        job_environment(store, 2),
        str(pytester.path),
        args,
        world_size=2,
        backend=None,
        may_exit={0, 1},
        timeout=JOB_DEADLINE,
    )
    wall = time.monotonic() - start
    output = "\n".join(workers.outputs)
    assert (pytester.path / "job.xml").exists(), output[-5000:]
    got = verdicts(pytester.path / "job.xml")
    assert got["test_g_plain_after"][0] == "passed", (got, output[-5000:])
    assert got[case][:1] == ("failed",) and got[case][1].startswith(first_line), got
    assert got["test_j_last"][0] == "skipped", got
    assert re.match(r"not run: rank [01] (was killed|got SIGTERM)", got["test_j_last"][1]), got
    assert output.count("short test summary info") == 1, output[-5000:]
    assert [w.exitcode for w in workers] == codes, output[-5000:]
    assert wall < 40, f"the job took {wall:.0f} s"  # the SIGTERMed test sleeps 60 s


def test_values_of_any_size_cross_the_store_in_pieces_that_are_then_deleted() -> None:
    """A value over ``CHUNK`` is stored as pieces behind a head (the store's server drops a
    client sending over 8 MiB at once); the pieces of a publish are deleted by their writer
    once every rank has published in the next gather (it has read them then), not before."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    channel = Channel(Launch(0, 1, 0, "127.0.0.1", store.port, "unit", 0, True), store)
    # 9 MiB, and a few bytes (not bytes themselves: ``publish`` takes those as pickled)
    big, small = {"big": bytes(range(256)) * (9 << 12)}, {"small": 1}
    assert len(pickle.dumps(big)) > 2 * CHUNK
    assert channel.gather("one", big, 5.0) == {0: big}
    pieces = [k for k in store.list_keys() if k.endswith(("#0", "#4194304", "#8388608"))]
    assert len(pieces) == 3, store.list_keys()
    channel.set("loose", big)  # a set is read whenever: never deleted
    assert channel.get("loose") == big
    assert all(store.check([k]) for k in pieces)  # the gather after them has not completed
    assert channel.gather("two", small, 5.0) == {0: small}
    assert not any(store.check([k]) for k in pieces), "the pieces pile up in the store"
    assert channel.get("loose") == big
