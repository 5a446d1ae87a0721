"""No process outlives its test: checked in the OS process table, not by asking the harness.

Each rank writes its pid and kernel start time (``proctable``) while it runs; afterwards the
test asks the kernel whether any of those processes still exists. That covers every way a
run can end, a rank's own child process, and the pytest run itself being interrupted
(Ctrl-C) or killed outright (SIGKILL), where no ``finally`` of ours can run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tutorial_impl.testing import (
    RankCrashed,
    RankFailed,
    RankSkipped,
    RankTimeout,
    proctable,
    run_ranks,
)
from tutorial_impl.testing import selftest_ranks as sr

GONE_WITHIN = 5.0  # seconds; the kill is immediate, this is slack for a loaded machine

# (rank function, its extra args before pid_dir, what run_ranks must raise, deadline)
ENDINGS = {
    "pass": (sr.all_reduce_rank, (), None, 30.0),
    "raise": (sr.fail_on, (0,), RankFailed, 30.0),
    "sigkill": (sr.kill_self_on, (1,), RankCrashed, 30.0),
    "os_exit": (sr.exit_on, (0, 7), RankCrashed, 30.0),
    "hang": (sr.hang_on, (0,), RankTimeout, 1.5),
    "grandchild": (sr.spawn_child_and_hang, (), RankTimeout, 1.5),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_no_rank_survives_its_run(tmp_path, ending):
    """However the run ends, every process it recorded is gone from the process table
    shortly after ``run_ranks`` returns or raises, including a rank's own child."""
    fn, args, error, deadline = ENDINGS[ending]
    world_size = 3
    if error is None:
        assert run_ranks(fn, *args, str(tmp_path), world_size=world_size) == [6.0] * 3
    else:
        with pytest.raises(error):
            run_ranks(fn, *args, str(tmp_path), world_size=world_size, timeout=deadline)
    records = proctable.recorded(tmp_path)
    # The recording is real: every rank wrote its pid (the ones killed early may not have).
    assert {f"rank{r}" for r in range(world_size)} <= set(records) or error is not None
    assert records, "no rank recorded itself: the check below would prove nothing"
    if ending == "grandchild":
        assert {f"grandchild{r}" for r in range(world_size)} <= set(records)
    assert proctable.wait_until_gone(tmp_path, GONE_WITHIN) == {}


def test_a_skip_leaves_nothing_behind(tmp_path):
    """A skip ends the run early too: the rank that did not skip must not be left waiting."""
    with pytest.raises(RankSkipped):
        run_ranks(sr.skip_on, 1, world_size=2, log_dir=tmp_path / "logs")
    # skip_on records nothing itself; the harness's log files tell which ranks existed,
    # and the forkserver's children are checked through /proc.
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == ["rank0.log", "rank1.log"]
    assert _forkserver_children_alive() == []


def _forkserver_children_alive() -> list[int]:
    """Children of this process's rank forkserver that are still alive (not zombies)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    assert server is not None
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if int(ppid) == server and state not in ("Z", "X"):
                alive.append(int(entry.name))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# A throwaway test run in a separate pytest process that we then interrupt or kill.
HANGING_TEST = """
from tutorial_impl.testing import selftest_ranks as sr

def test_hangs(run_ranks):
    run_ranks(sr.family_then_hang, {pid_dir!r}, world_size=2, timeout=120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_nothing_survives_an_interrupted_or_killed_pytest_run(tmp_path, how):
    """Ctrl-C (SIGINT) lets the harness's ``finally`` kill the ranks. SIGKILL gives pytest
    no chance at all: then the forkserver sees its owner go, kills the ranks' process
    groups (ranks, grandchildren) on its way out, and any rank left dies with it through
    PR_SET_PDEATHSIG. Either way every recorded process, forkserver included, is gone."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tutorial_impl.testing.plugin"]\n')
    (tmp_path / "test_hangs.py").write_text(HANGING_TEST.format(pid_dir=str(pid_dir)))
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # a session of its own, so our signal reaches only that run (as Ctrl-C would)
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        expected = {"rank0", "rank1", "grandchild0", "grandchild1", "forkserver"}
        deadline = time.monotonic() + 60
        while set(proctable.recorded(pid_dir)) < expected:  # ranks record themselves last
            assert run.poll() is None, run.stdout.read().decode()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        assert set(proctable.alive(pid_dir)) == expected  # all running: the check can fail
        run.send_signal(getattr(signal, how))
        # The forkserver leaves only once pytest has exited, which after Ctrl-C includes
        # pytest writing its report: allow for that on a loaded machine.
        assert proctable.wait_until_gone(pid_dir, 2 * GONE_WITHIN) == {}
        output = run.communicate(timeout=30)[0].decode()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    if how == "SIGINT":
        assert "KeyboardInterrupt" in output  # pytest saw the Ctrl-C and reported it
    else:
        assert run.returncode == -signal.SIGKILL
    # Prove the check above had something to find: the pids were real, distinct processes.
    assert len({pid for pid, _ in proctable.recorded(pid_dir).values()}) == 5
