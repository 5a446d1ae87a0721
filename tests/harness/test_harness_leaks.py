"""No process outlives its test: checked in the OS process table, not by asking the harness.

Each rank writes its pid and kernel start time (``proctable``) while it runs; afterwards the
test asks the kernel whether any of those processes still exists. That covers every way a
run can end and a rank's own child process; the pytest run itself interrupted (Ctrl-C) or
killed (SIGKILL), where no ``finally`` of ours can run, is ``test_harness_interrupted``'s.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import (
    LeftoverProcessWarning,
    RankCrashed,
    RankFailed,
    RankTimeout,
    assert_equal_across_ranks,
    proctable,
    run_ranks,
)
from tutorial_impl.testing.rank import leftovers
from tutorial_impl.testing.strategies import waiting

GONE_WITHIN = 5.0  # seconds; the kill is immediate, this is slack for a loaded machine


def end_by(rank: int, world_size: int, ending: str, pid_dir: str) -> float:
    """Every rank records itself, then rank 0 ends the run the way ``ending`` says while
    the others wait for it in a collective (or, for "pass", all finish normally)."""
    proctable.record_self(pid_dir, f"rank{rank}")
    dist.barrier()  # every rank has recorded itself before any of them ends
    if ending == "grandchild":  # every rank starts a child of its own, then hangs
        proctable.record(pid_dir, f"grandchild{rank}", start_a_child(rank))
        sleep_forever()
    if ending == "disagree":  # every rank fails the same cross-rank assertion
        assert_equal_across_ranks(rank)
    if rank == 0:
        if ending == "raise":
            raise ValueError("rank 0 ends the run")
        if ending == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if ending == "os_exit":
            os._exit(7)
        if ending == "hang":
            sleep_forever()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


SLEEPER = ["sleep", "600"]
# A shell in a session of its own starts a sleeper there, says its pid and exits at once.
ORPHANING = ["sh", "-c", "sleep 600 </dev/null >/dev/null 2>&1 & echo $!"]


def start_a_child(rank: int) -> int:
    """Rank 0's child stays in the rank's process group; rank 1's has a session of its own;
    rank 2's too, and its parent exits at once (it is handed to the rank, a subreaper)."""
    if rank == 2:
        shell = subprocess.run(
            ORPHANING, capture_output=True, text=True, timeout=30, start_new_session=True
        )
        return int(shell.stdout)
    return subprocess.Popen(SLEEPER, start_new_session=rank == 1).pid


def sleep_forever() -> None:
    while True:
        time.sleep(0.05)


# what run_ranks must raise, and the deadline, for each way a run can end
ENDINGS = {
    "pass": (None, 30.0),
    "raise": (RankFailed, 30.0),  # the others' stacks are taken first (forensics)
    "disagree": (RankFailed, 30.0),
    "sigkill": (RankCrashed, 30.0),
    "os_exit": (RankCrashed, 30.0),
    "hang": (RankTimeout, 1.5),
    "grandchild": (RankTimeout, 1.5),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_no_rank_survives_its_run(tmp_path, ending):
    """However the run ends, every process it recorded is gone from the process table
    shortly after ``run_ranks`` returns or raises, including a rank's own child."""
    error, deadline = ENDINGS[ending]
    world_size = 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if error is None:
            assert run_ranks(end_by, ending, str(tmp_path), world_size=world_size) == [6.0] * 3
        else:
            with pytest.raises(error):
                run_ranks(end_by, ending, str(tmp_path), world_size=world_size, timeout=deadline)
    records = proctable.recorded(tmp_path)
    # The recording is real: every rank wrote its pid before any rank ended the run.
    assert {f"rank{r}" for r in range(world_size)} <= set(records)
    named = [str(w.message) for w in caught if w.category is LeftoverProcessWarning]
    if ending == "grandchild":
        # Killed before the verdict, whatever session each was in, and named with its rank.
        children = {r: records[f"grandchild{r}"][0] for r in range(world_size)}
        assert [pid for pid in children.values() if proctable.running(pid)] == []
        for r, pid in children.items():
            assert any(f"rank {r} " in text and f"pid {pid} " in text for text in named), (
                named,
                children,
            )
    else:
        assert named == []
    assert proctable.wait_until_gone(tmp_path, GONE_WITHIN) == {}


def death_chain_flags(rank: int, world_size: int) -> tuple[int, int]:
    """What the kernel says of this process: the signal it gets when its parent dies
    (``PR_GET_PDEATHSIG``), and whether orphans below it come to it (``PR_GET_CHILD_SUBREAPER``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    signum, subreaper = ctypes.c_int(-1), ctypes.c_int(-1)
    assert libc.prctl(2, ctypes.byref(signum), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
    assert libc.prctl(37, ctypes.byref(subreaper), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return signum.value, subreaper.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_every_rank_dies_with_its_parent_and_is_a_subreaper():
    """The two settings ``enter_rank`` asks the kernel for (through libc's ``prctl``, looked
    up once in the forkserver), read back from the kernel in each rank: SIGKILL when the
    forkserver dies, and orphans handed to the rank (``leftovers``)."""
    assert run_ranks(death_chain_flags, world_size=2, backend=None) == [(signal.SIGKILL, 1)] * 2


FAILS_IN_RANKS = """
import os
import time
from tutorial_impl.testing import proctable

if "RANK" in os.environ:  # in a rank, not in the parent that imported it first
    proctable.record_self({pid_dir!r}, "rank" + os.environ["RANK"])
    # The first failure stops the others: each waits (a while at most) until every rank has
    # recorded itself, or on a loaded machine the last may be stopped before its import.
    end = time.monotonic() + 10
    while len(proctable.recorded({pid_dir!r})) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    raise RuntimeError("this module cannot be imported in a rank")


def fn(rank, world_size):
    return rank
"""


def test_a_module_that_fails_to_import_in_the_ranks_leaves_nothing(tmp_path, monkeypatch):
    """The ranks import the function's module themselves (its name leads to the same file
    there); when that import raises, every rank fails with the module's traceback, and
    none of them outlives the run."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    name = f"fails_in_ranks_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(FAILS_IN_RANKS.format(pid_dir=str(pid_dir)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    module = __import__(name)
    try:
        with pytest.raises(RankFailed, match="this module cannot be imported in a rank"):
            run_ranks(module.fn, world_size=3, timeout=30)
    finally:
        sys.modules.pop(name, None)
    assert set(proctable.recorded(pid_dir)) == {"rank0", "rank1", "rank2"}
    assert proctable.wait_until_gone(pid_dir, GONE_WITHIN) == {}


def skip_on_1(rank: int, world_size: int, pid_dir: str) -> None:
    proctable.record_self(pid_dir, f"rank{rank}")
    dist.barrier()  # both have recorded themselves before rank 1 ends the run
    if rank == 1:
        pytest.skip("rank 1 has no work here")
    dist.barrier()


def test_a_skip_leaves_nothing_behind(tmp_path, monkeypatch):
    """A skip the other rank outlives ends the run too (a failure: the other rank might still
    have failed, see ``verdict``), after ``SKIP_GRACE``: the rank left waiting in its
    barrier must not be left behind."""
    monkeypatch.setattr(waiting, "SKIP_GRACE", 0.5)
    with pytest.raises(
        RankTimeout, match=r"rank 1 skipped \(rank 1 has no work here\) but rank\(s\) 0"
    ):
        run_ranks(skip_on_1, str(tmp_path), world_size=2)
    # Asked of the kernel by pid, not "children of the forkserver": under xdist the server
    # is shared by every worker, and the other workers' ranks are its children too.
    assert set(proctable.recorded(tmp_path)) == {"rank0", "rank1"}
    assert proctable.wait_until_gone(tmp_path, GONE_WITHIN) == {}


KEPT: list[object] = []  # what a rank function forgot, kept alive as a program's global would


def leave_one_of_each(rank: int, world_size: int, pid_dir: str, stop: bool) -> None:
    """Leave a process of each kind running: a forgotten fork ``Pool(2)`` (its maintenance
    thread respawns a killed worker), a ``DataLoader``'s two workers (its SIGCHLD handler
    raises when one is killed), a process of multiprocessing's forkserver (that server's
    child, not the rank's), a bare fork, a subprocess in a session of its own.
    ``stop``: rank 1 then fails while rank 0 waits, so the harness stops rank 0 and kills
    its processes from outside (``kill_tree``); else both return (``kill_leftovers``)."""
    import multiprocessing as mp

    pool = mp.get_context("fork").Pool(2)
    KEPT.append(pool)
    assert pool.map(abs, [-1, -2]) == [1, 2]
    batches = iter(torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2))
    KEPT.append(batches)
    assert next(batches).tolist() == [0, 1]
    served = mp.get_context("forkserver").Process(target=time.sleep, args=(600,), name="served")
    served.start()
    fork = os.fork()
    if fork == 0:
        time.sleep(600)
        os._exit(0)
    sleeper = subprocess.Popen(SLEEPER, start_new_session=True)
    for what, pid in [("served", served.pid), ("fork", fork), ("sleep", sleeper.pid)]:
        proctable.record(pid_dir, f"{what}-{rank}", pid)
    for i, worker in enumerate(mp.active_children()):
        if worker is not served:
            proctable.record(pid_dir, f"worker{i}-{rank}", worker.pid)
    from multiprocessing import forkserver

    proctable.record(pid_dir, f"helper-{rank}", forkserver._forkserver._forkserver_pid)
    proctable.record_self(pid_dir, f"rank-{rank}")
    dist.barrier()
    if stop:
        if rank == 1:
            raise ValueError("rank 1 fails while rank 0 waits")
        dist.barrier()


# What each leftover is named, in the rank's own words (it returned) and from outside (the
# harness stopped it): (pattern, how many); multiprocessing's helpers are never named.
NAMED_INSIDE = [
    (r"pid \d+ \(multiprocessing ForkProcess 'ForkPoolWorker-[\d:]+'\)", 2),
    (r"pid \d+ \(multiprocessing Process 'Process-[\d:]+'\)", 2),  # the DataLoader's
    (r"pid \d+ \(multiprocessing ForkServerProcess 'served'\)", 1),
    (r"pid \d+ \(a fork of pid {rank} \(os\.fork: no command line of its own\)\)", 1),
    (r"pid \d+ \(sleep 600\)", 1),
]
NAMED_OUTSIDE = [
    (r"pid \d+ \(a fork of the rank \(os\.fork, or a process multiprocessing forked\)\)", 5),
    (r"pid \d+ \(a process multiprocessing's forkserver \(pid \d+\) started for the rank\)", 1),
    (r"pid \d+ \(sleep 600\)", 1),
]


@pytest.mark.parametrize("stop", [False, True], ids=["returned", "stopped"])
def test_each_leftover_is_killed_and_named_once_by_what_it_is(tmp_path, stop):
    """However a rank ends, each process it left is killed and named once: a forgotten
    pool's two workers (not the replacements its thread would start as they die), a
    DataLoader's (the rank reports: its test passes), a forkserver-context process, a fork,
    a subprocess; not multiprocessing's own forkserver and resource tracker, nor anything by
    the harness server's command line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if stop:
            with pytest.raises(RankFailed, match="rank 1 fails while rank 0 waits"):
                run_ranks(leave_one_of_each, str(tmp_path), stop, world_size=2)
        else:
            run_ranks(leave_one_of_each, str(tmp_path), stop, world_size=2)
    said = sorted(str(w.message) for w in caught if w.category is LeftoverProcessWarning)
    records = proctable.recorded(tmp_path)
    assert len(said) == 2, said
    for rank, text in enumerate(said):
        table = NAMED_OUTSIDE if stop and rank == 0 else NAMED_INSIDE
        rank_pid = records[f"rank-{rank}"][0]
        assert text.startswith(f"rank {rank} left 7 process(es) running"), text
        for pattern, count in table:
            found = re.findall(pattern.format(rank=rank_pid), text)
            assert len(found) == count, (pattern, text)
        left = {pid for name, (pid, _) in records.items() if name.endswith(f"-{rank}")}
        left -= {rank_pid, records[f"helper-{rank}"][0]}
        assert sorted(map(int, re.findall(r"(?:: |; )pid (\d+) \(", text))) == sorted(left), text
        assert "import main" not in text, text
    assert proctable.wait_until_gone(tmp_path, GONE_WITHIN) == {}


def kill_under_a_sigchld_handler(rank: int, world_size: int) -> tuple[int, bool, int]:
    """A SIGCHLD handler that raises, as a DataLoader's does when a worker dies by a signal:
    the harness's kill must not reach it, and must give it back; from another thread (a
    torchrun worker's may), where Python lets no one change it, the kill still kills."""
    import concurrent.futures

    def on_child(signum: int, frame: object) -> None:
        raise RuntimeError("the harness's kill reached the test's SIGCHLD handler")

    signal.signal(signal.SIGCHLD, on_child)
    subprocess.Popen(SLEEPER)
    killed = leftovers.kill_leftovers()
    kept = signal.getsignal(signal.SIGCHLD) is on_child
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    subprocess.Popen(SLEEPER)
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        elsewhere = thread.submit(leftovers.kill_leftovers).result()
    return len(killed), kept, len(elsewhere)


def test_the_kill_sets_a_sigchld_handler_aside_and_gives_it_back():
    said = run_ranks(kill_under_a_sigchld_handler, world_size=1, backend=None)
    assert said == [(1, True, 1)]


def test_an_environment_mark_finds_a_process_that_left_its_session():
    """What the torchrun tests rely on: a grandchild in a session of its own (as torchrun
    starts its workers) is found by the mark it inherited, and only it; then it is killed."""
    mark = f"h{os.getpid()}-{time.monotonic_ns()}"
    starter = (
        "import subprocess, sys;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
        " print(p.pid)"
    )
    env = {**os.environ, "LEAK_MARK": mark}
    out = subprocess.run(
        [sys.executable, "-c", starter], env=env, capture_output=True, text=True, timeout=30
    )
    grandchild = int(out.stdout)
    try:
        assert [pid for pid, _ in proctable.marked("LEAK_MARK", mark)] == [grandchild]
        assert proctable.marked("LEAK_MARK", mark + "-other") == []
        proctable.kill_marked("LEAK_MARK", mark)
        assert proctable.wait_until_unmarked("LEAK_MARK", mark, GONE_WITHIN) == []
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _only_in_proc(pid: str, listdir, path):
    return [pid] if path == "/proc" else listdir(path)


def test_an_environment_mark_finds_a_process_still_in_its_execve(monkeypatch):
    """The cause of the test above's one miss (at load ~15): ``Popen`` returns once the
    child's close-on-exec pipe is closed, in the middle of its ``execve``, before the kernel
    has published the new environment, which reads empty until then. Here the scan reads the
    child first, right after ``Popen`` returned (an empty read 3 times in 4 on an idle
    machine); ``marked`` waits out the execve and finds it every time."""
    listdir = os.listdir
    for attempt in range(5):
        mark = f"x{os.getpid()}-{attempt}-{time.monotonic_ns()}"
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env={"LEAK_MARK": mark}
        )
        try:
            only_child = functools.partial(_only_in_proc, str(child.pid), listdir)
            monkeypatch.setattr(os, "listdir", only_child)  # no time for its exec to end
            found = proctable.marked("LEAK_MARK", mark)
            monkeypatch.setattr(os, "listdir", listdir)
            assert [pid for pid, _ in found] == [child.pid], attempt
        finally:
            child.kill()
            child.wait()


def test_an_empty_environment_or_a_zombie_is_not_waited_for():
    """What reads empty without an execve under way (an environment emptied on purpose, a
    zombie's) is answered at once, not after ``EXEC_GRACE``; how a leftover is named."""
    empty = subprocess.Popen(["sleep", "60"], env={})
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + GONE_WITHIN
        while proctable.running(zombie.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # exited, not reaped: a zombie
        time.sleep(0.05)  # sleep's exec has ended
        start = time.monotonic()
        assert proctable._environ(empty.pid) == b""
        assert time.monotonic() - start < proctable.EXEC_GRACE / 2
        # (a zombie's environment cannot be read at all here: ESRCH, which ``marked`` skips)
        assert not proctable._exec_in_progress(zombie.pid)
        assert not proctable._exec_in_progress(empty.pid)
        # How a leftover is named: its command line, cut at the limit.
        assert proctable.command(empty.pid) == "sleep 60"
        assert proctable.command(zombie.pid) == "[true]"  # a zombie has no command line
        cut = proctable.command(os.getpid(), limit=20)
        assert len(cut) == 20 and cut.endswith("...")
    finally:
        empty.kill()
        empty.wait()
        zombie.wait()
