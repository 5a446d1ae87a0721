"""One test file, forked on a laptop or under torchrun across nodes.

``torchrun --nnodes=2 --nproc-per-node=2 -m pytest`` starts four pytest processes, one per
rank, on two "nodes" (here two agents on this machine). The plugin notices torchrun's
variables and runs in *launched* mode (``tutorial_impl.testing.launched``): every rank
collects the same tests, ``run_ranks(fn)`` runs ``fn`` right here as this rank, the ranks
agree on every verdict through the job's store, and rank 0 alone prints the report.

A stranger's project proves it: two test files and no conftest. The first file is run both
ways and must give the same verdicts, test by test; the second holds plain tests (no
``run_ranks``) that only make sense with a rank of one's own: ``RANK`` in the environment.
What each job proves:

* ``test_one_file_forked_or_under_torchrun``: a passing test is reported once; a test that
  fails on rank 3 only fails on every rank with rank 3's traceback in rank 0's report; a hang
  on one rank ends at its deadline with the stacks of all four ranks, and the next test runs
  on a fresh process group; an RPC test (``backend=None``) gets a rendezvous of its own; the
  world-size matrix runs its size-4 entry and skips size 2
  (documented: no subgroups); a cross-rank assertion names the odd rank out; plain tests
  failing, erroring in setup or skipping on one rank have one verdict everywhere; a plain
  test hanging on rank 0 is stopped by the watchdog; junit XML comes from rank 0 only; every
  worker exits non-zero, within the deadlines plus a few seconds, and nothing is left. Then
  the same file forked gives the same verdicts, test by test.
* ``test_ranks_that_collect_different_tests_refuse_together``: no test runs, the difference
  is named, every worker exits with a usage error.
* ``test_misuses_are_refused_with_the_reason``: ``--launcher torchrun`` outside torchrun,
  ``-n`` under it, a malformed variable; ``may_exit`` in a launched job fails its test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tutorial_impl.testing import proctable

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1"]
JOB_DEADLINE = 150.0  # seconds for a whole job; generous, the machine is shared
MARK = "TUTORIAL_HARNESS_TORCHRUN_JOB"  # in the agents' environment, so in every worker's

USER_TESTS = """
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from tutorial_impl.testing import assert_equal_across_ranks

pytestmark = pytest.mark.world_size(4)


def sum_of_ranks(rank, world_size):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"rank {rank} holds {total.item():g}")
    return total.item()


def test_all_reduce_sums_the_ranks(run_ranks, world_size):
    results = run_ranks(sum_of_ranks)
    assert results == [sum(range(world_size))] * world_size
    assert "rank 3 holds 6" in results.outputs[3]


def raise_on_rank_3(rank, world_size):
    if rank == 3:
        raise ValueError("boom from rank 3")
    dist.barrier()  # the others wait for rank 3, which never comes


def test_fails_on_rank_3_only(run_ranks):
    run_ranks(raise_on_rank_3)


def sleep_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(1000)
    dist.barrier()


@pytest.mark.rank_timeout(2)
def test_hangs_on_rank_1(run_ranks):
    run_ranks(sleep_on_rank_1)


def test_the_next_test_runs_on_a_fresh_group(run_ranks, world_size):
    assert run_ranks(sum_of_ranks) == [sum(range(world_size))] * world_size


@pytest.mark.world_size(2, 4)
def test_matrix(run_ranks, world_size):
    assert run_ranks(sum_of_ranks) == [sum(range(world_size))] * world_size


def add(a, b):
    return a + b


def rpc_ring(rank, world_size):
    # backend=None: no group from the harness; RPC rendezvous on MASTER_ADDR/MASTER_PORT
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    try:
        return rpc.rpc_sync(f"worker{(rank + 1) % world_size}", add, args=(rank, 10))
    finally:
        rpc.shutdown()


def test_rpc_gets_a_rendezvous_of_its_own(run_ranks, world_size):
    assert run_ranks(rpc_ring, backend=None) == [rank + 10 for rank in range(world_size)]


def two_says_seven(rank, world_size):
    assert_equal_across_ranks(7 if rank == 2 else 1, name="answer")


def test_cross_rank_assertion(run_ranks):
    run_ranks(two_says_seven)
"""

PLAIN_TESTS = """
import os
import time

import pytest

RANK = int(os.environ["RANK"])


def test_plain_fails_on_rank_3_only():
    assert RANK != 3, "rank 3 disagrees"


def test_plain_passes():
    print(f"plain hello from rank {RANK}")


@pytest.fixture
def broken_on_rank_2():
    if RANK == 2:
        raise RuntimeError("fixture broke on rank 2")


def test_setup_fails_on_rank_2(broken_on_rank_2):
    pass


def test_skips_on_rank_1():
    if RANK == 1:
        pytest.skip("rank 1 has no such device")


@pytest.mark.rank_timeout(1)
def test_plain_hang_on_rank_0():
    if RANK == 0:
        time.sleep(1000)


def test_after_the_plain_hang():
    pass


def nothing(rank, world_size):
    pass


def test_may_exit_is_refused(run_ranks):
    run_ranks(nothing, may_exit={1})  # a worker that exits would end the whole job
"""


def _rendezvous_store() -> dist.TCPStore:
    """A c10d rendezvous store both agents join as clients, on a port the kernel chose
    (see tests/dist_tuto/test_07_torchrun.py for why the test owns it)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=JOB_DEADLINE),
    )


def _agents(nnodes: int, nproc: int, port: int, pytest_args: list[str]) -> list[list[str]]:
    agent = [
        *TORCHRUN,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=harness-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf=is_host=0,join_timeout=120",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *pytest_args,
    ]
    return [agent] * nnodes


def _run_job(commands: list[list[str]], cwd: Path) -> tuple[list[int], list[str], float]:
    """Run the agents to their end; their exit codes, outputs and the wall time. Whatever
    happens, every process of the job (found by a mark in its environment: torchrun puts
    workers in sessions of their own) is killed, and a clean end must leave none."""
    job = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", MARK: job}
    env.pop("PYTEST_XDIST_WORKER", None)  # the workers are not xdist workers of ours
    logs = [cwd / f"agent{i}.log" for i in range(len(commands))]
    procs = []
    start = time.monotonic()
    try:
        for cmd, log in zip(commands, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
        for proc in procs:
            proc.wait(max(1.0, start + JOB_DEADLINE - time.monotonic()))
        wall = time.monotonic() - start
        left = proctable.wait_until_unmarked(MARK, job, timeout=10.0)
        assert not left, f"processes outlived their torchrun job: {left}"
        return (
            [p.returncode for p in procs],
            [log.read_text(errors="replace") for log in logs],
            wall,
        )
    finally:
        proctable.kill_marked(MARK, job)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)


def _worker_statuses(outputs: list[str]) -> dict[int, int]:
    """rank -> its worker's exit status, from the failure summaries the agents print."""
    summary = re.compile(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)")
    return {int(r): int(c) for out in outputs for r, c in summary.findall(out)}


def _verdicts(junit: Path) -> dict[str, tuple[str, str]]:
    """test name -> (passed/failed/error/skipped, the message) from a junit XML file."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag: child.get("message", "") for child in case}
        kind = next((k for k in ("failure", "error", "skipped") if k in tags), "passed")
        found[case.get("name")] = ({"failure": "failed"}.get(kind, kind), tags.get(kind, ""))
    return found


def test_one_file_forked_or_under_torchrun(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS, test_plain=PLAIN_TESTS)
    store = _rendezvous_store()
    args = ["-v", "-rA", "--rank-timeout=30", "--junitxml=job.xml", "test_user.py"]
    codes, outputs, wall = _run_job(
        _agents(2, 2, store.port, [*args, "test_plain.py"]), pytester.path
    )
    report = next((out for out in outputs if "test session starts" in out), "")
    quiet = next((out for out in outputs if out is not report), "")

    # One report, from rank 0; the other agent's two workers printed no test results.
    assert report, outputs
    assert "test session starts" not in quiet and "PASSED" not in quiet, quiet
    assert "torchrun: 4 ranks" in report
    assert re.search(r"torchrun: 4 ranks on 1 host\(s\): \S+: ranks 0, 1, 2, 3", report), report
    assert report.count("test_user.py::test_all_reduce_sums_the_ranks PASSED") == 1, report

    # Rank 3's failure fails the test, with rank 3's traceback, and where the others waited.
    assert "rank 3 raised ValueError: boom from rank 3" in report
    assert 'raise ValueError("boom from rank 3")' in report
    section = re.search(r"_ test_fails_on_rank_3_only _.*?(?=\n_{5,} )", report, re.S)
    assert section and "Python stacks of rank 0" in section.group(0), report
    assert "in barrier" in section.group(0) or "line" in section.group(0)

    # The hang: at its 2 s deadline, with the stacks of all four ranks (rank 1 in its sleep,
    # the others in the barrier), and the next test passes on a fresh process group.
    hang = re.search(r"_ test_hangs_on_rank_1 _.*?(?=\n_{5,} )", report, re.S)
    assert hang, report
    for rank in range(4):
        assert f"Python stacks of rank {rank}" in hang.group(0), hang.group(0)
    assert "rank 1 at test_user.py" in hang.group(0) and "in sleep_on_rank_1" in hang.group(0)
    assert "test_the_next_test_runs_on_a_fresh_group PASSED" in report
    assert "test_rpc_gets_a_rendezvous_of_its_own PASSED" in report

    # Plain tests: one verdict everywhere, the failing rank named (junit has whole lines).
    launched = _verdicts(pytester.path / "job.xml")
    assert launched["test_plain_fails_on_rank_3_only"] == (
        "failed",
        "rank 3: AssertionError: rank 3 disagrees\nassert 3 != 3",
    )
    assert launched["test_setup_fails_on_rank_2"][0] == "error"
    assert (
        "rank 2: RuntimeError: fixture broke on rank 2" in launched["test_setup_fails_on_rank_2"][1]
    )
    assert launched["test_skips_on_rank_1"] == (
        "skipped",
        "rank 1: Skipped: rank 1 has no such device",
    )
    assert launched["test_plain_passes"][0] == "passed"
    assert "plain hello from rank 3" in report  # the other ranks' output, in rank 0's report
    assert "rank 0 ran past the harness deadline (2 s)" in launched["test_plain_hang_on_rank_0"][1]
    assert launched["test_after_the_plain_hang"][0] == "passed"
    assert "may_exit cannot be honoured under torchrun" in launched["test_may_exit_is_refused"][1]

    # junit from rank 0 only; every worker exits with the agreed (failing) status, in time.
    assert not (pytester.path / "job.xml.1").exists()
    assert "generated xml file" in report and "generated xml file" not in quiet
    # torchrun exits 1 when a worker failed; each worker's own status is in its summary.
    assert codes == [1, 1], (codes, outputs)
    assert _worker_statuses(outputs) == dict.fromkeys(range(4), 1), outputs
    assert wall < 60, f"the job took {wall:.0f} s: its deadlines are 2 s and 1 s"
    took = {
        c.get("name"): float(c.get("time"))
        for c in ET.parse(pytester.path / "job.xml").iter("testcase")
    }
    # The hangs end at their deadlines (2 s; 1 s plus the watchdog's 1 s), plus a few seconds.
    assert took["test_hangs_on_rank_1"] < 2 + 8, took
    assert took["test_plain_hang_on_rank_0"] < 2 + 8, took

    # The same file forked: the same verdicts, test by test, but for the documented
    # difference: under torchrun a world size other than the job's is skipped. (In this
    # process: xdist would only add two more interpreters, and it decides no verdict.)
    forked_run = pytester.runpytest(
        "-p", "no:cacheprovider", "--junitxml=forked.xml", "test_user.py"
    )
    assert forked_run.ret == pytest.ExitCode.TESTS_FAILED
    forked = _verdicts(pytester.path / "forked.xml")
    user = {name: v for name, v in launched.items() if name in forked}
    assert set(user) == set(forked), (launched, forked)
    assert user.pop("test_matrix[world_size2]")[0] == "skipped"
    assert forked.pop("test_matrix[world_size2]")[0] == "passed"
    assert {n: v[0] for n, v in user.items()} == {n: v[0] for n, v in forked.items()}
    assert user["test_fails_on_rank_3_only"] == forked["test_fails_on_rank_3_only"]


COLLECTS_BY_RANK = """
import os

def test_everyone_has_this():
    pass

if os.environ.get("RANK") == "1":
    def test_only_rank_1_has_this():
        pass
"""


def test_ranks_that_collect_different_tests_refuse_together(pytester: pytest.Pytester) -> None:
    """Two workers started as torchrun starts them, without the agent (it adds nothing to
    this claim and would cost a third interpreter): torchrun's variables, and the job's
    store hosted here, as the agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``)."""
    pytester.makepyfile(test_uneven=COLLECTS_BY_RANK)
    store = _rendezvous_store()
    job = {
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    workers = []
    for rank in range(2):
        env = {**os.environ, **job, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.pop("PYTEST_XDIST_WORKER", None)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_uneven.py"]
        workers.append(
            subprocess.Popen(
                command,
                cwd=pytester.path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        outputs = [w.communicate(timeout=JOB_DEADLINE)[0].decode() for w in workers]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    report, quiet = outputs
    assert "the ranks collected different tests, so no test was run" in report, report
    assert "rank 0 has 1, rank 1 has 2" in report
    assert "test_uneven.py::test_only_rank_1_has_this" in report
    assert "passed" not in report.split("no test was run")[-1]
    assert "no test was run" not in quiet and "test session starts" not in quiet, quiet
    assert [w.returncode for w in workers] == [pytest.ExitCode.USAGE_ERROR] * 2, outputs


def test_misuses_are_refused_with_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any test runs (status 4, a message naming the problem), in this process:
    ``--launcher torchrun`` outside torchrun, ``-n`` under torchrun, a malformed variable."""
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

    monkeypatch.setenv("RANK", "two")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*torchrun variable RANK='two' is not a number*"])
    # --launcher fork: torchrun's variables are ignored, the test runs forked as usual
    result = pytester.runpytest("--launcher", "fork")
    assert result.ret == pytest.ExitCode.OK
