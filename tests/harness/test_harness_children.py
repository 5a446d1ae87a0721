"""Ranks start processes as any training program does, and none outlives its test.

``STRANGER`` is a stranger's test file (a pytester project: no conftest, only the installed
package), run three ways: forked and warm in this process, and as the two workers of a
torchrun job. Its tests, each with its own checks inside:

* a data-parallel training step (gradients all-reduced) whose batches come from
  ``DataLoader(num_workers=2)``, equal to the same step taken in one process without
  workers, the batches loaded by two other processes;
* a ``multiprocessing.Pool``, a ``multiprocessing.Process``, a bare ``os.fork`` whose child
  runs its atexit hooks (the rank forkserver's among them: they must leave the ranks alone)
  and a nested ``run_ranks``;
* nothing of those is left running, so nothing is named (``LeftoverProcessWarning`` is an
  error around them);
* a child in a session of its own, left running: killed when its function ends, named (rank,
  pid) in a ``LeftoverProcessWarning``; once caught with ``pytest.warns``, once left to
  pytest's warnings summary;
* the same child, its rank then hanging: killed at the deadline, named;
* a child a thread of the function starts after the function returned: killed with its rank
  (under torchrun, when the worker's session ends).

Every process the file starts records itself (``proctable``): after each run none is alive,
and the warm run really was warm (a rank served several tests).
"""

from __future__ import annotations

import multiprocessing.pool  # noqa: F401 - see below
import re
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch.utils.data  # noqa: F401 - see below
from torchrun_worker import job_environment, pytest_as_a_torchrun_worker

from tutorial_impl.testing import call, proctable
from tutorial_impl.testing.rendezvous import agents_store
from tutorial_impl.testing.strategies.forked import FORKED

# pytester's in-process runs drop the modules they imported, and some cannot be loaded twice
# in one process (they register torch operators): what the stranger's file imports, here.
pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODULE = "test_children"
STRANGER = """\
import atexit
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from tutorial_impl.testing import LeftoverProcessWarning, RankTimeout, proctable
from tutorial_impl.testing import run_ranks as public_run_ranks

pytestmark = []  # the warm run puts pytest.mark.warm_world here
PIDS = os.environ["CHILDREN_PIDS"]
SAMPLES, FEATURES = 16, 4


def note(what):  # this process ran for this test: the suite checks it is gone
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split()[0].rpartition("::")[2]
    proctable.record_self(PIDS, f"{what}-{test}@{os.getpid()}")


class Samples(Dataset):
    def __init__(self, rows):
        self.rows = list(rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:  # a worker, not the test itself
            note("loader")
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(self.rows[i]))
        return x, x.sum(0, keepdim=True) * 0.5 + 1.0, torch.tensor([os.getpid(), os.getppid()])


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def squared_error(net, x, y):
    return ((net(x) - y) ** 2).sum()


def sgd_step(net, lr=0.1):  # torch.optim would import torch._dynamo: seconds, in a rank
    with torch.no_grad():
        for p in net.parameters():
            p -= lr * p.grad


def data_parallel_step(rank, world_size):
    note("rank")
    share = SAMPLES // world_size
    rows = Samples(range(rank * share, (rank + 1) * share))
    loader = DataLoader(rows, batch_size=4, num_workers=2)
    net = model()
    loaders = set()
    for x, y, pids in loader:
        (squared_error(net, x, y) / SAMPLES).backward()
        loaders |= {tuple(pair) for pair in pids.tolist()}
    # DDP's gradient sum by hand (DDP itself would import torch._dynamo in each fresh rank:
    # 800 modules, 8 s here); the sum over ranks is the mean over every sample.
    for p in net.parameters():
        dist.all_reduce(p.grad)
    sgd_step(net)
    return [p.detach().clone() for p in net.parameters()], sorted(loaders), os.getpid()


def test_a_dataloader_training_step(run_ranks):
    net = model()  # the reference: one process, every sample, no workers
    x, y, _ = next(iter(DataLoader(Samples(range(SAMPLES)), batch_size=SAMPLES)))
    (squared_error(net, x, y) / SAMPLES).backward()
    sgd_step(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeftoverProcessWarning)
        results = run_ranks(data_parallel_step)
    for params, loaders, rank_pid in results:
        for got, want in zip(params, net.parameters()):
            # (torch.testing.assert_close would import 500 modules, DTensor's among them)
            assert torch.allclose(got, want.detach(), rtol=1e-5, atol=1e-6), (got, want)
        # Two workers loaded the batches, forked by the rank (not by a forkserver of its own)
        assert len(loaders) == 2 and {parent for _, parent in loaders} == {rank_pid}
    assert params[0].ne(model().weight).any()  # the step changed the weights


def square(x):
    return x * x


def pools_processes_and_ranks(rank, world_size):
    note("rank")
    with mp.Pool(2, initializer=note, initargs=("pool",)) as pool:
        squares = pool.map(square, range(4))
    process = mp.Process(target=note, args=("process",))
    process.start()
    process.join(30)
    return squares, process.exitcode, fork_and_exit(), public_run_ranks(sum_of_ranks)


def fork_and_exit():
    # A bare fork whose child ends as an interpreter does, its atexit hooks run: it inherited
    # the rank forkserver's, which must then do nothing (not kill the forkserver's ranks).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded" (3.12+)
        child = os.fork()
    if child == 0:
        atexit._run_exitfuncs()
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def sum_of_ranks(rank, world_size):
    note("inner")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return total.item()


def test_a_pool_a_process_and_a_nested_run_ranks(run_ranks):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeftoverProcessWarning)
        results = run_ranks(pools_processes_and_ranks)
    assert results == [([0, 1, 4, 9], 0, 0, [1.0, 1.0])] * 2


def leave_a_child(rank, world_size, then_hang=False):
    note("rank")
    # What an earlier test left was reaped through multiprocessing's own book (under
    # torchrun this worker ran it): else it would count that process as alive for ever.
    assert mp.active_children() == []
    # sleep(1), not a Python interpreter: six of these a run, each one 35 ms of CPU less
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    proctable.record(PIDS, f"sleeper-{rank}-{then_hang}@{sleeper.pid}", sleeper.pid)
    while then_hang:
        time.sleep(0.05)
    return sleeper.pid


def sleepers(then_hang):
    found = {}
    for name, (pid, _) in proctable.recorded(PIDS).items():
        if name.startswith("sleeper-") and name.split("@")[0].endswith(f"-{then_hang}"):
            found[int(name.split("-")[1])] = pid
    return found


def leave_a_child_and_a_process(rank, world_size):
    sleeper = leave_a_child(rank, world_size)
    process = mp.Process(target=time.sleep, args=(600,), daemon=True)  # never joined
    process.start()
    return [sleeper, process.pid]


def named(caught, children):
    text = " ".join(str(w.message) for w in caught)
    return all(f"rank {r} left {len(pids)} process" in text
               and all(f"pid {pid} (" in text for pid in pids)
               for r, pids in children.items())


def test_a_child_left_running_is_killed_and_named(run_ranks):
    with pytest.warns(LeftoverProcessWarning) as caught:
        children = dict(enumerate(run_ranks(leave_a_child_and_a_process)))
    assert named(caught, children), [str(w.message) for w in caught]
    # Each warning points at the line above, the test's own, not into the harness.
    here = (__file__, sys._getframe().f_lineno - 3)
    where = [(w.filename, w.lineno) for w in caught if w.category is LeftoverProcessWarning]
    assert where == [here] * len(children), (where, here)
    pids = [pid for both in children.values() for pid in both]
    assert [pid for pid in pids if proctable.running(pid)] == []


def test_a_child_left_running_in_the_warnings_summary(run_ranks):
    run_ranks(leave_a_child)


@pytest.mark.rank_timeout(1)
def test_a_child_of_a_rank_that_hangs(run_ranks):
    with pytest.warns(LeftoverProcessWarning) as caught:
        with pytest.raises(RankTimeout):
            run_ranks(leave_a_child, True)
    children = sleepers(True)
    assert sorted(children) == [0, 1] and named(caught, {r: [p] for r, p in children.items()})
    assert [pid for pid in children.values() if proctable.running(pid)] == []


def start_a_child_after_returning(rank, world_size):
    # Rank 0's daemon thread starts a child in a session of its own once the function has
    # returned; rank 1 holds the run open until it has. A thread of its function still runs,
    # so rank 0 cannot report itself quiet: its parent freezes it and kills the child too
    # (under torchrun the worker, this test's process, kills it when its session ends).
    note("rank")
    # this run's: its ranks' parent, or under torchrun the job (each worker has a parent of
    # its own there, the process torchrun started: strategies/torchrun/watcher.py)
    started = os.path.join(PIDS, f"late-{os.environ.get('TORCHELASTIC_RUN_ID') or os.getppid()}")
    if rank == 0:
        def late():
            time.sleep(0.05)  # the function has returned by now
            sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
            proctable.record(PIDS, f"sleeper-late@{sleeper.pid}", sleeper.pid)
            open(started, "w").close()
            time.sleep(600)
        threading.Thread(target=late, daemon=True).start()
        return True
    deadline = time.monotonic() + 30
    while not os.path.exists(started) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(started)


def test_a_thread_starts_a_child_after_its_function_returned(run_ranks):
    assert run_ranks(start_a_child_after_returning) == [True, True]
"""
WARM = STRANGER.replace("pytestmark = []", "pytestmark = [pytest.mark.warm_world]", 1)
assert WARM != STRANGER
ARGS = ["-p", "no:cacheprovider", "-p", "no:randomly", "-rA", "--rank-timeout=60"]
SUMMARY_CASE = "test_a_child_left_running_in_the_warnings_summary"


def verdicts(junit: Path) -> dict[str, str]:
    """Each test case's verdict in a junit XML file."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[case.get("name", "")] = " + ".join(kinds) or "passed"
    return found


def problems_of(how: str, project: Path, output: str) -> list[str]:
    """Every way a run of the file went wrong: a test that did not pass, the leftover of
    ``SUMMARY_CASE`` not named in the warnings summary, a process alive after the run."""
    problems = []
    junit = project / f"{how}.xml"
    got = verdicts(junit) if junit.exists() else {}
    tests = re.findall(r"^def (test_\w+)\(", STRANGER, re.M)
    if got != dict.fromkeys(tests, "passed"):
        problems.append(f"[{how}] verdicts {got}, expected every test passed")
    summary = output.partition("warnings summary")[2]
    for rank in (0, 1):
        pattern = rf"{SUMMARY_CASE}\n.*LeftoverProcessWarning: rank {rank} left 1 process.*pid \d+"
        if not re.search(pattern, summary):
            problems.append(f"[{how}] no LeftoverProcessWarning of rank {rank} in the summary")
    left = proctable.wait_until_gone(project / "pids")
    if left:
        problems.append(f"[{how}] processes outlived the run: {left}")
    kinds = {name.partition("-")[0] for name in proctable.recorded(project / "pids")}
    if not {"rank", "loader", "pool", "process", "inner", "sleeper"} <= kinds:
        problems.append(f"[{how}] not every kind of process recorded itself: {sorted(kinds)}")
    return problems


def _in_process(pytester: pytest.Pytester, monkeypatch, how: str, source: str) -> list[str]:
    (pytester.path / "pids").mkdir()
    monkeypatch.setenv("CHILDREN_PIDS", str(pytester.path / "pids"))
    (pytester.path / f"{MODULE}.py").write_text(source)
    result = pytester.runpytest(*ARGS, f"--junitxml={how}.xml", f"{MODULE}.py")
    output = result.stdout.str() + result.stderr.str()
    problems = problems_of(how, pytester.path, output)
    return [*problems, output] if problems else []


def leave_a_daemon_thread(rank: int, world_size: int) -> None:
    if rank == 1:  # rank 0's function leaves nothing running
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def test_a_rank_is_quiet_only_when_nothing_of_its_test_runs() -> None:
    """A rank whose function left no thread and no process says so in its report: its
    parent then kills it outright, unfrozen (``Report.quiet``); a thread still running, even
    a daemon, could start a process any time, so that rank is frozen and searched first."""
    finished = FORKED.gather(call.build(leave_a_daemon_thread, backend=None))
    assert [finished.reports[r].quiet for r in (0, 1)] == [True, False]


def test_forked(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _in_process(pytester, monkeypatch, "forked", STRANGER) == []


def test_warm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    problems = _in_process(pytester, monkeypatch, "warm", WARM)
    ranks: dict[int, set[str]] = {}
    for name, (pid, _) in proctable.recorded(pytester.path / "pids").items():
        if name.startswith("rank-"):
            ranks.setdefault(pid, set()).add(name.partition("@")[0])
    if not any(len(tests) > 1 for tests in ranks.values()):
        problems.append(f"[warm] no rank served two tests: not warm ({ranks})")
    assert problems == []


def test_torchrun(pytester: pytest.Pytester, run_ranks) -> None:
    """The file's session on each worker of a two-worker job (``torchrun_worker``: the
    workers are harness ranks, the job's store hosted here as its agent hosts it)."""
    (pytester.path / "pids").mkdir()
    (pytester.path / f"{MODULE}.py").write_text(STRANGER)
    store = agents_store(120)
    job = {**job_environment(store, 2), "CHILDREN_PIDS": str(pytester.path / "pids")}
    args = [*ARGS, "--junitxml=torchrun.xml", f"{MODULE}.py"]
    workers = run_ranks(
        pytest_as_a_torchrun_worker, job, str(pytester.path), args,
        world_size=2, backend=None, may_exit={0, 1}, timeout=120,
    )  # fmt: skip
    problems = problems_of("torchrun", pytester.path, workers.outputs[0])
    if [w.exitcode for w in workers] != [0, 0]:
        problems.append(f"[torchrun] workers exited {[w.exitcode for w in workers]}")
    assert problems == [], workers.outputs[0][-4000:]


def test_an_abandoned_rank_functions_nested_ranks_do_not_outlive_its_test() -> None:
    """Under torchrun a rank function still running when its call ends (another rank failed,
    the deadline) is abandoned: a thread, it cannot be killed. Its nested ``run_ranks`` could
    then run into the next tests, whose ``mp.active_children()`` listed those ranks: made
    to happen by having rank 1 of ``test_torchrun``'s job fail its nested-run test at once,
    rank 0's nested ranks failed the next three tests with the assertion two loaded
    ``-n auto`` runs showed (``assert [<RankProcess ... started daemon>] == []``). Now the
    ranks it had started are killed with the call, named, and off multiprocessing's book (a
    ``sleep`` stands in for one); a nested ``run_ranks`` it makes afterwards is refused
    before any rank starts."""
    from tutorial_impl.testing.strategies import supervise
    from tutorial_impl.testing.strategies.torchrun import here

    before = set(supervise.LIVE.pids)
    nested = subprocess.Popen(["sleep", "600"], start_new_session=True)  # leads its group
    supervise.LIVE.add(nested.pid)
    try:
        killed = here._kill_nested_ranks(threading.current_thread(), before)
        assert [k.pid for k in killed] == [nested.pid]
        assert "a rank of a nested run_ranks" in killed[0].command
        assert nested.wait(5) == -9 and nested.pid not in supervise.LIVE.pids
        with pytest.raises(RuntimeError, match="abandoned"):  # this thread starts no more
            FORKED.gather(call.build(leave_a_daemon_thread, backend=None))
    finally:
        supervise.ABANDONED.discard(threading.current_thread())
        supervise.LIVE.pids.discard(nested.pid)
        if nested.poll() is None:
            nested.kill()
    assert supervise.LIVE.pids == before
