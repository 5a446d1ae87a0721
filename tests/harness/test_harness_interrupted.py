"""Nothing survives a pytest run that is interrupted (Ctrl-C) or killed (SIGKILL).

Checked in the OS process table (``proctable``), as ``test_harness_leaks`` does for every
way a run can end by itself. Each link of the death chain is shown alone: Ctrl-C lets the
harness's ``finally`` kill the ranks while their forkserver and the process that asked for
them live on; a worker SIGKILLed under xdist takes its ranks with it while the controller
and the server live on (the ranks watch their owner); and the controller SIGKILLed, while
the worker that asked for the ranks is stopped, leaves the forkserver alone to kill them.
The two SIGKILLs share one ``pytest -n 2`` run (``killed_run``), each claim its own test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tutorial_impl.testing import proctable

pytest_plugins = ["pytester"]

GONE_WITHIN = 5.0  # seconds; the kill is immediate, this is slack for a loaded machine


def _wait_until_gone(pid_dir: Path, names: set[str], timeout: float) -> dict[str, int]:
    """Like ``proctable.wait_until_gone``, for the records ``names`` only."""
    deadline = time.monotonic() + timeout
    while True:
        left = {name: pid for name, pid in proctable.alive(pid_dir).items() if name in names}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


# A stranger's test, run in this process (pytester, in-process) and interrupted there as
# Ctrl-C interrupts pytest: a SIGINT, turned into KeyboardInterrupt in the main thread while
# the test waits for its ranks. Each rank records itself, its parent (the forkserver) and a
# child of its own (in the rank's process group), then hangs.
HANGING_TEST = """
import os, subprocess, time
from tutorial_impl.testing import proctable

def family_then_hang(rank, world_size, pid_dir):
    child = subprocess.Popen(["sleep", "600"])
    proctable.record(pid_dir, f"grandchild{{rank}}", child.pid)
    proctable.record(pid_dir, "forkserver", os.getppid())
    proctable.record_self(pid_dir, f"rank{{rank}}")  # last: then every record is written
    while True:
        time.sleep(60)

def test_hangs(run_ranks):
    run_ranks(family_then_hang, {pid_dir!r}, world_size=2, timeout=120)
"""


class _CtrlC:
    """Ctrl-C for the in-process run only: a thread waits until every rank has recorded
    itself (all of them alive: the check after can fail), then sends this process a SIGINT;
    the handler turns it into KeyboardInterrupt while the stranger's run is under way and
    never after (a late signal must not interrupt this test)."""

    def __init__(self, pid_dir: Path, expected: set[str]) -> None:
        self.pid_dir, self.expected = pid_dir, expected
        self.inside = threading.Event()
        self.alive_then: set[str] = set()
        self.sent = False
        self._thread = threading.Thread(target=self._wait_then_interrupt, daemon=True)

    def _handler(self, signum: int, frame: object) -> None:
        if self.inside.is_set():
            self.inside.clear()
            raise KeyboardInterrupt

    def _wait_then_interrupt(self) -> None:
        deadline = time.monotonic() + 60
        while set(proctable.recorded(self.pid_dir)) < self.expected:
            if time.monotonic() > deadline or not self.inside.is_set():
                return  # the ranks never started: the test below says so
            time.sleep(0.05)
        self.alive_then = set(proctable.alive(self.pid_dir))
        self.sent = True
        os.kill(os.getpid(), signal.SIGINT)

    def run(self, pytester: pytest.Pytester) -> pytest.RunResult:
        previous = signal.signal(signal.SIGINT, self._handler)
        self.inside.set()
        self._thread.start()
        try:
            return pytester.runpytest_inprocess(
                "-p", "no:cacheprovider", "-p", "no:randomly", no_reraise_ctrlc=True
            )
        finally:
            self.inside.clear()
            self._thread.join(timeout=70)
            signal.signal(signal.SIGINT, previous)


def test_nothing_survives_an_interrupted_pytest_run(pytester, tmp_path):
    """Ctrl-C (SIGINT) lets the harness's ``finally`` kill the ranks and their children at
    once: the forkserver they came from and the process that asked for them both live on,
    so no other link of the death chain (``test_nothing_survives_a_killed_pytest_run``)
    can have done it. pytest reports the interrupt and ends the run."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    pytester.makepyfile(test_hangs=HANGING_TEST.format(pid_dir=str(pid_dir)))
    ranks = {"rank0", "rank1", "grandchild0", "grandchild1"}
    ctrl_c = _CtrlC(pid_dir, ranks | {"forkserver"})
    result = ctrl_c.run(pytester)
    output = result.stdout.str()
    assert ctrl_c.sent, f"the ranks never started:\n{output}"
    assert ctrl_c.alive_then == ranks | {"forkserver"}  # all running: the check can fail
    left = _wait_until_gone(pid_dir, ranks, GONE_WITHIN)
    assert left == {}, f"still alive: {left}; output of the pytest run:\n{output}"
    server = proctable.recorded(pid_dir)["forkserver"][0]
    assert proctable.running(server)  # so the finally did it, not the server's death
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert "KeyboardInterrupt" in output  # pytest saw the Ctrl-C and reported it
    # Prove the check above had something to find: the pids were real, distinct processes.
    assert len({pid for pid, _ in proctable.recorded(pid_dir).values()}) == 5


# A stranger's project (no conftest) run with two xdist workers. Each worker's test records
# the worker's pid, and its ranks record themselves and their parent, the forkserver; gw1's
# ranks also start a child each (in the rank's process group). Then every rank hangs: gw1's
# test keeps the controller, and so the shared forkserver, alive while gw0 is killed.
TWO_WORKERS = """
import os, subprocess, time
from tutorial_impl.testing import proctable

PIDS = os.environ["PID_DIR"]


def record_then_hang(rank, world_size, worker):
    proctable.record(PIDS, f"{worker}-server{rank}", os.getppid())
    if worker == "gw1":
        proctable.record(PIDS, f"gw1-grandchild{rank}", subprocess.Popen(["sleep", "600"]).pid)
    proctable.record_self(PIDS, f"{worker}-rank{rank}")  # last: then every record is written
    while True:
        time.sleep(60)


def test_on_each_worker(run_ranks):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    proctable.record_self(PIDS, worker)
    run_ranks(record_then_hang, worker, timeout=120)
"""
GW0_RANKS = {"gw0-rank0", "gw0-rank1"}
# gw1's ranks, their children and their forkserver (recorded once by each rank)
GW1_FAMILY = {"gw1-rank0", "gw1-rank1", "gw1-grandchild0", "gw1-grandchild1", "gw1-server0"}


@dataclass
class KilledRun:
    """What the two-worker run showed: first gw0 is SIGKILLed, then the controller."""

    records: dict[str, int]  # every record, by name: its pid
    server_parent: int  # the forkserver's parent, read from /proc while it ran
    controller: int
    gw0_ranks_alive: set[str]  # of GW0_RANKS, just before gw0's SIGKILL
    gw0_left: dict[str, int]  # ... still alive GONE_WITHIN s after it
    session_alive: bool  # the controller and the forkserver, once gw0's ranks were gone
    gw1_family_alive: set[str]  # of GW1_FAMILY, just before the controller's SIGKILL
    gw1_left: dict[str, int]  # ... still alive GONE_WITHIN s after it
    gw1_outlived: bool  # gw1 itself (stopped) was still there then
    returncode: int | None
    output: str  # the controller's, up to its SIGKILL


def _wait_for_records(pid_dir: Path, names: set[str], run: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not names <= set(proctable.recorded(pid_dir)):
        assert run.poll() is None, "the run ended before its ranks started"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)


def _wait_for_text(output: list[bytes], text: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in b"".join(output) and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_two_workers_run(project: Path, pid_dir: Path) -> KilledRun:
    env = {**os.environ, "PID_DIR": str(pid_dir), "PYTHONUNBUFFERED": "1"}  # lines at once
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "each", "--max-worker-restart",
         "0", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.extend(iter(run.stdout.readline, b"")))
    reader.start()
    try:
        _wait_for_records(pid_dir, {"gw0", "gw1", *GW0_RANKS, *GW1_FAMILY}, run)
        records = {name: pid for name, (pid, _) in proctable.recorded(pid_dir).items()}
        server = records["gw1-server0"]
        server_parent = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
        gw0_ranks_alive = GW0_RANKS & set(proctable.alive(pid_dir))
        os.kill(records["gw0"], signal.SIGKILL)
        gw0_left = _wait_until_gone(pid_dir, GW0_RANKS, GONE_WITHIN)
        session_alive = run.poll() is None and proctable.running(server)
        _wait_for_text(output, b"worker gw0 crashed", 60)  # the controller saw it
        gw1_family_alive = GW1_FAMILY & set(proctable.alive(pid_dir))
        # gw1 stopped: its run_ranks cannot kill its ranks, nor its death (which the ranks
        # watch) set them off; only the forkserver's link of the chain is left.
        os.kill(records["gw1"], signal.SIGSTOP)
        os.kill(run.pid, signal.SIGKILL)
        gw1_left = _wait_until_gone(pid_dir, GW1_FAMILY, GONE_WITHIN)
        gw1_outlived = proctable.running(records["gw1"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # what is left of the session (gw1)
        run.wait()
        reader.join(timeout=10)
        for pid in proctable.alive(pid_dir).values():  # should a check above fail
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = b"".join(output).decode(errors="replace")
    return KilledRun(
        records, server_parent, run.pid, gw0_ranks_alive, gw0_left, session_alive,
        gw1_family_alive, gw1_left, gw1_outlived, run.returncode, text,
    )  # fmt: skip


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> KilledRun:
    """One ``pytest -n 2`` run of TWO_WORKERS, both of whose workers' ranks hang: gw0 is
    SIGKILLed while the controller lives on, then the controller itself."""
    project = tmp_path_factory.mktemp("two-workers")
    (project / "test_two_workers.py").write_text(TWO_WORKERS)
    pid_dir = project / "pids"
    pid_dir.mkdir()
    return _kill_two_workers_run(project, pid_dir)


@pytest.mark.slow
@pytest.mark.xdist_group("leaks-killed-run")
def test_xdist_workers_share_one_forkserver_and_ranks_die_with_their_worker(killed_run):
    """Under ``-n 2`` both workers' ranks come from one forkserver, the controller's child;
    SIGKILL of one worker, while its ranks hang and the controller (so the server) lives
    on, leaves none of that worker's ranks alive: each rank watches the worker that asked
    for it (``ranks._die_with_owner``)."""
    run = killed_run
    servers = {pid for name, pid in run.records.items() if "-server" in name}
    assert len(servers) == 1, run.records  # one forkserver for both workers...
    assert run.server_parent == run.controller  # ...the controller's
    assert run.controller not in (run.records["gw0"], run.records["gw1"])
    assert run.gw0_ranks_alive == GW0_RANKS  # hanging: the check can fail
    assert run.gw0_left == {}, f"gw0's ranks outlived it: {run.gw0_left}\n{run.output}"
    assert run.session_alive  # they died with their worker, not with the session
    assert "worker gw0 crashed" in run.output, run.output


@pytest.mark.slow
@pytest.mark.xdist_group("leaks-killed-run")
def test_nothing_survives_a_killed_pytest_run(killed_run):
    """SIGKILL gives pytest no chance at all: the forkserver sees its owner (the controller)
    go, kills the ranks' process groups (ranks, their children) on its way out, and any rank
    left dies with it through PR_SET_PDEATHSIG. gw1, which asked for those ranks, is stopped
    (SIGSTOP) and outlives the controller, so no other link of the death chain (its
    ``finally``, the ranks' watch of it) can have done it."""
    run = killed_run
    assert run.gw1_family_alive == GW1_FAMILY  # all running: the check can fail
    assert run.gw1_left == {}, f"still alive: {run.gw1_left}; output:\n{run.output}"
    assert run.returncode == -signal.SIGKILL
    assert run.gw1_outlived  # stopped, not gone: its ranks had no other way out
    # Prove the check above had something to find: the pids were real, distinct processes.
    assert len({run.records[name] for name in GW1_FAMILY}) == 5
