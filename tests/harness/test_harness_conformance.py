"""Conformance: one stranger's test file, run three ways, against one table of verdicts.

The harness runs a test's rank function three ways: **forked** (fresh ranks from the
forkserver for each test, the default), **warm** (the same file with ``warm_world`` in its
module ``pytestmark``: ranks and group kept between tests) and under **torchrun** (each pytest
process is one rank of the job; here two agents of one worker each, as on two nodes). A
user must get the same verdict, with the same first line, whichever way the file runs, but
where the table below names a difference and says why.

``STRANGER`` is a stranger's test file (a pytester project: no conftest, only the installed
package). Each run writes junit XML; every test case's verdict (passed, failed, error,
skipped, xfailed, or "not run"), the first line of its message and its time are compared
with ``CASES``, the one table of what each case must give. A ``Differs`` entry in it says
what one strategy gives instead, and why; it is checked like the rest. Each test below runs
the file once and lists every case that deviates (case, strategy, expected, got) in one
assertion message, with the run's own problems: a process that outlived it, a run past its
bound. Every process that runs a rank function signs with its pid and test (``note``), and
every worker of the torchrun job with its pid (``proctable``); from the signatures, the
forked run proves that no rank served two tests, and the warm run that some did (it really
was warm).

Forked and warm run in this process (``pytester.runpytest``: their ranks come from the
forkserver this process already has). Under torchrun each agent is torchrun's own ``main``
(its c10d rendezvous, store, variables, monitoring and teardown) in a harness rank, and its
worker is a fork of it (``--start-method=fork``) that runs pytest as ``python -u -m pytest``
would (``torchrun_worker.torchrun_agent_of_pytest``): four fresh interpreters importing torch
cost about 14 s of CPU, and what the claims are about is what the harness does in a worker of
a job, not the interpreter's start. The job deselects
the two SIGKILL cases and rank 0's ``os._exit`` (``TORCHRUN_DESELECT``): a death ends a job,
and so does the reporter's exit, so the injected kill and c13b each run in a job of their
own (``test_torchrun_a_leaving_worker_ends_the_job``). The file's order serves torchrun:
``os._exit`` on rank 1 comes last (the job cannot go on without it), and the test that
patches ``dist.all_reduce`` comes after every other test that calls it but its witness (a
torchrun rank is one process for the whole session: the patch stays).

``test_the_checker_sees_each_kind_of_deviation`` proves the comparison itself on a junit
file of known content: a conforming run gives no deviation, each planted one is reported.

Every run of the file uses ``RUN_ARGS``: among them ``--tb=native`` (pytest's own traceback
form parses the whole file again for each entry of each failure; the table compares first
lines, which it does not change).
"""

from __future__ import annotations

import functools
import os
import re
import resource
import signal
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy  # noqa: F401 - see below
import pytest
import torch  # noqa: F401 - see below
import torch.distributed._functional_collectives  # noqa: F401 - see below
from torchrun_worker import (
    job_environment,
    pytest_as_a_torchrun_worker,
    torchrun_agent_of_pytest,
)

from tests.torchrun_in_process import ForkedJob
from tutorial_impl.testing import RankError, proctable, run_ranks
from tutorial_impl.testing.forkserver import server as _ranks
from tutorial_impl.testing.rendezvous import agents_store

# The stranger's file imports torch, numpy and functional collectives. pytester's in-process
# runs drop the modules they imported, and none can be loaded twice in one process (the
# last registers torch operators): imported here, they stay.
pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODULE = "test_stranger"
STRANGER = '''\
import functools
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch.distributed._functional_collectives as funcol
from tutorial_impl.testing import Close, Delay, Exit, Fault, Hang, InjectedFault, Kill, Raise
from tutorial_impl.testing import RankFailed, fault_point
from tutorial_impl.testing.faults import group as faulty_group
from tutorial_impl.testing import assert_equal_across_ranks, proctable
from tutorial_impl.testing import run_ranks as public_run_ranks

pytestmark = []  # the warm run puts pytest.mark.warm_world here
PIDS = os.environ["CONFORMANCE_PIDS"]  # where every process that runs a rank function signs
CACHE = {}
SEEDED = np.random.RandomState(0).rand(10)  # the first ten draws after np.random.seed(0)


def note():  # this process ran a rank function of this test: the suite checks it is gone
    test = os.environ.get("PYTEST_CURRENT_TEST", "unknown").split()[0].rpartition("::")[2]
    proctable.record_self(PIDS, f"{test}@{os.getpid()}")


def sum_of_ranks(rank, world_size):
    note()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return total.item()


def test_c01_all_reduce_passes(run_ranks):
    assert run_ranks(sum_of_ranks) == [1.0, 1.0]


def raise_on(rank, world_size, bad):
    note()
    if rank == bad:
        raise ValueError("boom on " + ("one" if bad == 1 else "zero"))
    dist.barrier()  # waits for the rank that raised


def test_c02_raise_on_rank_1(run_ranks):
    run_ranks(raise_on, 1)


def test_c03_raise_on_rank_0(run_ranks):
    run_ranks(raise_on, 0)


def hang(rank, world_size):
    note()
    if rank == 0:  # rank 1 skips the collective and returns: rank 0 waits for it
        gathered = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(gathered, torch.ones(1))  # the hang's all_gather


@pytest.mark.rank_timeout(3)
def test_c04_hang(run_ranks):
    run_ranks(hang)


def returns_early(rank, world_size):
    note()
    total = torch.ones(1)
    dist.all_reduce(total)
    if rank == 0:  # rank 1 returns after the first all_reduce: rank 0 waits in the second
        dist.all_reduce(total)  # the stranded all_reduce
    return total.item()


@pytest.mark.rank_timeout(10)
def test_c04b_rank_1_returns_early(run_ranks):
    run_ranks(returns_early)


# torch's collective checker: rank 0 waits in its barrier before the all_reduce, recorded nowhere
@pytest.mark.check_collectives
@pytest.mark.rank_timeout(10)
def test_c04e_rank_1_returns_early_under_the_checker(run_ranks):
    run_ranks(returns_early)


def slow_rank_1(rank, world_size):
    note()
    if rank == 1:
        time.sleep(1.0)  # three looks for a stranded rank at least: rank 1 has not returned
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def test_c04c_a_slow_rank_is_waited_for(run_ranks):
    assert run_ranks(slow_rank_1) == [2.0, 2.0]


def catches_the_fault(rank, world_size):
    note()
    out = torch.zeros(1)
    try:
        dist.reduce_scatter_tensor(out, torch.ones(world_size))  # the caught fault's
    except InjectedFault:
        return "caught"
    return out.item()


@pytest.mark.rank_timeout(10)
def test_c04d_a_caught_fault_strands_rank_0(run_ranks):
    run_ranks(catches_the_fault, faults=Fault(1, Raise("bad shard"), op="reduce_scatter_tensor"))


def kill_rank_1(rank, world_size):
    note()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_c05_kill_rank_1(run_ranks):
    run_ranks(kill_rank_1)


def skip_everywhere(rank, world_size):
    note()
    pytest.skip("no data")


def test_c06_skip_on_every_rank(run_ranks):
    run_ranks(skip_everywhere)


def xfail_everywhere(rank, world_size):
    note()
    pytest.xfail("known")


def test_c07_xfail_on_every_rank(run_ranks):
    run_ranks(xfail_everywhere)


def skip_on_1_assert_on_0(rank, world_size, how, delay):
    note()
    if rank == 1:
        getattr(pytest, how)("rank 1 has nothing to do")
    time.sleep(delay)
    assert rank != 0, "rank 0 disagrees"


def test_c08_skip_on_1_then_assert_on_0(run_ranks):
    run_ranks(skip_on_1_assert_on_0, "skip", 0.3)


def test_c09_xfail_on_1_then_assert_on_0(run_ranks):
    run_ranks(skip_on_1_assert_on_0, "xfail", 0.3)


@pytest.mark.parametrize("attempt", range(4))
def test_c10_skip_and_assert_at_once(run_ranks, attempt):
    run_ranks(skip_on_1_assert_on_0, "skip", 0)


class Skipped(Exception):
    """The application's own exception, named as pytest's is."""


class XFailed(Exception):
    """The application's own exception, named as pytest's is."""


def raise_own(rank, world_size, name):
    note()
    if rank == 1:
        raise {"Skipped": Skipped, "XFailed": XFailed}[name]("data corrupted")
    dist.barrier()


def test_c11_own_class_named_skipped(run_ranks):
    run_ranks(raise_own, "Skipped")


def test_c11_own_class_named_xfailed(run_ranks):
    run_ranks(raise_own, "XFailed")


def fork_on_rank_1(rank, world_size, rank_1_raises):
    note()
    if rank == 1:
        if os.fork() == 0:
            note()
            return "the forked child's value"  # the child returns from the rank function
        if rank_1_raises:
            time.sleep(0.2)
            raise RuntimeError("rank 1 failed after forking")
    return rank


def test_c12_forked_child_returns_and_rank_1_raises(run_ranks):
    run_ranks(fork_on_rank_1, True)


def test_c12_forked_child_returns_and_rank_1_too(run_ranks):
    run_ranks(fork_on_rank_1, False)


def odd_one_out(rank, world_size):
    note()
    assert_equal_across_ranks(torch.tensor([rank]))


def test_c14_not_equal_across_ranks(run_ranks):
    run_ranks(odd_one_out)


def numpy_agrees(rank, world_size):
    note()
    assert_equal_across_ranks(np.array([1, 2]))


def test_c15_numpy_arrays_equal_across_ranks(run_ranks):
    run_ranks(numpy_agrees)


def lock_on_rank_0(rank, world_size):
    note()
    return threading.Lock() if rank == 0 else rank


def test_c16_unpicklable_result(run_ranks):
    run_ranks(lock_on_rank_0)


@pytest.mark.world_size(0)
def test_c17_world_size_0(run_ranks):
    run_ranks(sum_of_ranks)


@pytest.mark.world_size(0, 2)
def test_c17_matrix_with_0(run_ranks):
    run_ranks(sum_of_ranks)


@pytest.mark.world_size(2, 2)
def test_c17_matrix_with_2_twice(run_ranks):
    run_ranks(sum_of_ranks)


@pytest.mark.warm_world("yes")
def test_c17_warm_world_yes(run_ranks):
    run_ranks(sum_of_ranks)


@pytest.mark.world_size(2)
@pytest.mark.world_size(3)
def test_c17_two_world_size_markers(run_ranks):
    run_ranks(sum_of_ranks)


@pytest.mark.rank_timeout(0)
def test_c17_rank_timeout_0(run_ranks):
    run_ranks(sum_of_ranks)


def thread_raises_on_rank_1(rank, world_size):
    note()
    if rank == 1:
        t = threading.Thread(target=lambda: 1 / 0)
        t.start()
        t.join()
    return rank


def test_c18_exception_in_a_thread_of_rank_1(run_ranks):
    assert run_ranks(thread_raises_on_rank_1) == [0, 1]


def fill_cache(rank, world_size):
    note()
    CACHE["k"] = 1
    return CACHE["k"]


def read_cache(rank, world_size):
    note()
    return CACHE["k"]


def test_c19a_fills_a_module_global(run_ranks):
    assert run_ranks(fill_cache) == [1, 1]


def test_c19b_reads_it_in_the_next_test(run_ranks):
    run_ranks(read_cache)


def seeded_draw(rank, world_size):
    note()
    np.random.seed(0)
    return float(np.random.rand())


def unseeded_draw(rank, world_size):
    note()
    draw = np.random.rand()
    assert draw not in SEEDED, "numpy's generator goes on from an earlier test's seed(0)"
    return float(draw)


def test_c19c_seeds_numpy(run_ranks):
    assert run_ranks(seeded_draw) == [SEEDED[0]] * 2


def test_c19d_draws_unseeded(run_ranks):
    run_ranks(unseeded_draw)


def add(a, b):
    return a + b


def rpc_ring(rank, world_size):
    import torch.distributed.rpc as rpc

    note()  # backend=None: no group from the harness; RPC rendezvous on MASTER_ADDR/PORT
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    try:
        return rpc.rpc_sync(f"worker{(rank + 1) % world_size}", add, args=(rank, 10))
    finally:
        rpc.shutdown()


def test_c21_rpc_gets_a_rendezvous_of_its_own(run_ranks, world_size):
    assert run_ranks(rpc_ring, backend=None) == [rank + 10 for rank in range(world_size)]


@pytest.mark.world_size(2, 3)
def test_c22_matrix(run_ranks, world_size):
    assert run_ranks(sum_of_ranks) == [sum(range(world_size))] * world_size


# Plain tests (no run_ranks): forked, one pytest process runs them once; under torchrun every
# rank does, with a rank of its own (RANK).
RANK = int(os.environ.get("RANK", "0"))
LAUNCHED = "TORCHELASTIC_RUN_ID" in os.environ


def test_c23_plain_fails_on_rank_1_only():
    assert RANK != 1, "rank 1 disagrees"


@pytest.fixture
def broken_on_rank_1():
    if RANK == 1:
        raise RuntimeError("fixture broke on rank 1")


def test_c23_setup_fails_on_rank_1(broken_on_rank_1):
    pass


def test_c23_plain_skips_on_rank_1():
    if RANK == 1:
        pytest.skip("rank 1 has no such device")


@pytest.mark.rank_timeout(1)
def test_c23_plain_hang_on_rank_0():
    if LAUNCHED and RANK == 0:
        time.sleep(1000)


def test_c23_after_the_plain_hang():
    pass


def group_timeout(rank, world_size):
    note()
    gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
    return gloo.options._timeout.total_seconds()


@pytest.mark.rank_timeout(7)
def test_c24_the_group_timeout_stays_behind_the_deadline(run_ranks):
    # The harness's deadline fires first, while the ranks are still in their collective
    # (and it takes their stacks there); gloo's own timeout comes 10 s later.
    assert run_ranks(group_timeout) == [17.0, 17.0]


def rank_only(rank):
    note()
    return rank


def offset_sum(offset, rank, world_size, *, scale):
    note()
    total = torch.tensor([float(offset + rank)])
    dist.all_reduce(total)
    return total.item() * scale


def test_c25_call_shapes(run_ranks):
    assert run_ranks(rank_only) == [0, 1]
    assert run_ranks(functools.partial(offset_sum, 10), fn_kwargs={"scale": 2}) == [42.0, 42.0]


class Helper:  # a library's test helper, which calls run_ranks itself
    def all_reduce(self):
        return public_run_ranks(sum_of_ranks)


def test_c26_a_helper_runs_the_tests_ranks():
    assert Helper().all_reduce() == [1.0, 1.0]


# Faults on purpose (docs/faults.md): a SIGKILL inside DDP's third gradient all_reduce,
# a hang before a functional collective, a delay survived, a raise at a named step.
def ddp_steps(rank, world_size):
    note()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        fault_point("step")
        opt.zero_grad()
        model(torch.ones(3, 4) * (rank + 1)).sum().backward()
        opt.step()
    return model.module.weight.sum().item()


def step_sums(rank, world_size):
    note()
    total = torch.zeros(1)
    for _ in range(4):
        fault_point("step")  # c29b's step
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
    return total.item()


def functional_sum(rank, world_size):
    note()
    return funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).sum().item()  # the fault's


def test_c27a_kill_in_ddps_third_all_reduce(run_ranks):
    run_ranks(ddp_steps, faults=Fault(1, Kill(), at=3, op="all_reduce"))


def test_c27e_exit_on_rank_0_in_ddps_second_all_reduce(run_ranks):
    run_ranks(ddp_steps, faults=Fault(0, Exit(3), at=2, op="all_reduce"))


@pytest.mark.rank_timeout(3)
def test_c27b_hang_at_a_functional_collective(run_ranks):
    run_ranks(functional_sum, faults=Fault(1, Hang(), op="all_reduce"))


def test_c27c_a_delay_is_survived(run_ranks):
    start = time.monotonic()
    assert run_ranks(functional_sum, faults=Fault(0, Delay(0.3))) == [4.0, 4.0]
    assert time.monotonic() - start >= 0.3


def test_c27d_raise_at_a_step(run_ranks):
    # Not in DDP: under torchrun rank 1 is left inside its all_reduce (abandoned), and one
    # left inside DDP's backward can take its worker down when the group's timeout ends it.
    run_ranks(step_sums, faults=Fault(0, Raise("bad batch"), step="step", at=3))


# A rank function is a test body: its warnings meet the test's filters (RUN_ARGS' -W, the
# project's ini, the test's marks), its threads' failures and unraisable exceptions are
# reported as pytest reports them, and a thread it leaves running is waited for.
def warn_on_1(rank, world_size, text, category):
    note()
    if rank == 1:
        warnings.warn(text, category)  # the warning's line
    return rank


def test_c28a_warning_under_cmdline_error(run_ranks):
    run_ranks(warn_on_1, "cmdline-decides: old API", DeprecationWarning)


def test_c28b_warning_under_ini_error(run_ranks):
    run_ranks(warn_on_1, "ini-decides: odd value", RuntimeWarning)


@pytest.mark.filterwarnings("error")  # the mark beats -W always:shown-always
def test_c28c_warning_under_mark_error(run_ranks):
    run_ranks(warn_on_1, "shown-always: take note", UserWarning)


def test_c28d_warning_shown_in_the_summary(run_ranks):
    assert run_ranks(warn_on_1, "shown-always: take note", UserWarning) == [0, 1]
    with pytest.warns(UserWarning, match="^rank 1: shown-always: caught here$"):
        run_ranks(warn_on_1, "shown-always: caught here", UserWarning)


def warns_inside(rank, world_size):
    note()
    with pytest.warns(DeprecationWarning, match="cmdline-decides"):  # -W made it an error
        warnings.warn("cmdline-decides: expected", DeprecationWarning)
    return rank


def test_c28e_pytest_warns_in_a_rank(run_ranks):
    assert run_ranks(warns_inside) == [0, 1]


def leave_threads(rank, world_size):
    note()

    def late():
        time.sleep(0.1)
        raise ValueError(f"late on {rank}")

    if rank == 1:  # (a thread still running after the grace: test_harness_caught)
        threading.Thread(target=late, name="late-boom").start()


def test_c28f_thread_fails_after_the_function(run_ranks):
    run_ranks(leave_threads)


class Unclosable:
    def __del__(self):
        raise OSError("close failed")


def drop_unclosable(rank, world_size):
    note()
    if rank == 1:
        Unclosable()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_c28g_unraisable_exception(run_ranks):
    run_ranks(drop_unclosable)


# One test, one context (issue 34): run_ranks from a thread the test started is the test's;
# bad values are refused before any rank starts, naming the field; a rank's own error is the
# headline over the lost connections its exit caused, and a peer that returned is said to.
@pytest.mark.world_size(4)
def test_c34a_run_ranks_from_a_thread_of_the_test(run_ranks):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(public_run_ranks, sum_of_ranks).result() == [6.0] * 4


async def coroutine_ranks(rank, world_size):
    note()


def generator_ranks(rank, world_size):
    note()
    yield rank


async def async_generator_ranks(rank, world_size):
    note()
    yield rank


MISUSES = [
    ({"timeout": float("inf")}, ValueError, "timeout must be a positive number of seconds"),
    ({"timeout": 1e9}, ValueError, "timeout must be .* at most 604800"),
    ({"env": ["A"]}, TypeError, "env must be a mapping of str to str"),
    ({"env": {"A": 1}}, TypeError, "env must be a mapping of str to str"),
    ({"stream": "stdout"}, TypeError, "stream must be a text stream"),
]
NOT_FUNCTIONS = [
    (coroutine_ranks, "an async def function"),
    (generator_ranks, "a generator function"),
    (async_generator_ranks, "an async generator function"),
    (functools.partial(coroutine_ranks), "an async def function"),
]


def test_c34b_bad_values_are_refused_naming_the_field(run_ranks):
    # TypeError/ValueError from the call itself: no rank ran (a rank's error is a RankError).
    for options, error, words in MISUSES:
        with pytest.raises(error, match=words):
            run_ranks(sum_of_ranks, **options)
    for fn, kind in NOT_FUNCTIONS:
        with pytest.raises(TypeError, match=f"^run_ranks: fn .* is {kind}"):
            run_ranks(fn)
        with pytest.raises(TypeError, match=f"^run_ranks: fn .* is {kind}"):
            public_run_ranks(fn)


def own_error_on_rank_2(rank, world_size):
    note()
    dist.init_process_group("gloo")
    try:
        if rank == 2:
            raise ValueError("rank 2's own bug")
        dist.all_reduce(torch.ones(1))  # ranks 0 and 1 lose their connection to rank 2 ...
    finally:
        dist.destroy_process_group()  # ... at once, as rank 2 cleans up before it reports


@pytest.mark.world_size(3)
def test_c34c_rank_2_raises_and_its_peers_lose_the_connection(run_ranks):
    run_ranks(own_error_on_rank_2, backend=None)


def rank_0_returns_early(rank, world_size):
    note()
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        dist.destroy_process_group()  # rank 0 is done: its connections close
        return "done"
    dist.all_reduce(torch.ones(1))  # rank 1 waits for rank 0, which has left


def test_c34d_a_peer_that_returned_is_said_to_have_returned(run_ranks):
    run_ranks(rank_0_returns_early, backend=None)


# Processes a rank starts (issue 50), by any start method or context: each is killed when
# its function ends (or when the harness stops its rank) and named once, by what it is,
# not by a server's command line; multiprocessing's own helpers (its forkserver, its
# resource tracker) are neither; a DataLoader left running passes with the warning in every
# mode; a thread left past the grace is named. Each process signs: none outlives the run.
import multiprocessing as mp
import re

from tutorial_impl.testing import LeftoverProcessWarning

KEPT = []  # what a rank function forgot, alive after it returns (a global, as in a program)


def sign(what, pids):
    for pid in pids:
        proctable.record(PIDS, f"{what}@{pid}", pid)
    return sorted(pids)


def sign_helpers():  # multiprocessing's forkserver and resource tracker, where started
    from multiprocessing import forkserver, resource_tracker

    found = [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
    own = proctable.children(os.getpid())  # (a rank may share its parent's tracker)
    return sign("mp-helper", [pid for pid in found if pid in own])


def still_running(pids, within=2.0):
    deadline = time.monotonic() + within
    while [p for p in pids if proctable.running(p)] and time.monotonic() < deadline:
        time.sleep(0.01)
    return [p for p in pids if proctable.running(p)]


def forget_processes(rank, world_size, then_wait=False):
    note()
    # Python 3.11's start method on Linux: a pool's workers are forks of the rank; 3.14's:
    # children of multiprocessing's forkserver, not of the rank. (A forkserver pool would
    # leave its semaphores to the resource tracker, which complains at exit.)
    pools = [mp.get_context("fork").Pool(2)] if rank == 0 else []
    if rank == (0 if then_wait else 1):
        name = f"left-by-rank-{rank}"
        mp.get_context("forkserver").Process(target=time.sleep, args=(600,), name=name).start()
    KEPT.extend(pools)
    assert [pool.map(abs, [-1, -2]) for pool in pools] == [[1, 2]] * len(pools)
    sign_helpers()
    left = sign("left", [p.pid for p in mp.active_children()])
    if then_wait:  # rank 1 fails while rank 0 waits: the harness stops rank 0
        dist.barrier()
        if rank == 1:
            raise ValueError("rank 1 fails while rank 0 waits")
        dist.barrier()
    return left


def test_c50pa_forgotten_processes_are_killed_and_named_once(run_ranks):
    with pytest.warns(LeftoverProcessWarning) as caught:
        left = run_ranks(forget_processes)
    said = sorted(str(w.message) for w in caught if w.category is LeftoverProcessWarning)
    assert len(said) == 2 and len(left[0]) == 2 and len(left[1]) == 1, (left, said)
    for rank, (pids, text) in enumerate(zip(left, said)):
        assert text.startswith(f"rank {rank} left {len(pids)} process(es) running"), text
        assert sorted(map(int, re.findall(r"(?:: |; )pid (\\d+) \\(", text))) == pids, (pids, text)
        assert "import main" not in text, text  # no server's command line
    assert said[0].count("ForkPoolWorker") == 2 and "'left-by-rank-1'" in said[1], said
    assert still_running(left[0] + left[1]) == []


def test_c50pb_a_stopped_ranks_processes_are_named_once(run_ranks):
    run_ranks(forget_processes, True)


def pool_in_a_with(rank, world_size):
    note()
    with mp.get_context("forkserver").Pool(2) as pool:
        squares = pool.map(abs, [-1, -2])
    sign_helpers()
    return squares, os.getpid()


@pytest.mark.filterwarnings("error::tutorial_impl.testing.LeftoverProcessWarning")
def test_c50pc_multiprocessings_own_helpers_are_no_leftovers(run_ranks):
    first, again = run_ranks(pool_in_a_with), run_ranks(pool_in_a_with)
    assert [squares for squares, _ in first + again] == [[1, 2]] * 4
    if pytestmark or LAUNCHED:  # warm, or a torchrun worker: the same ranks serve both
        assert [pid for _, pid in again] == [pid for _, pid in first], "the world was retired"


def leave_a_loader(rank, world_size):
    note()
    from torch.utils.data import DataLoader

    if rank == 1:  # its workers are alive when the function returns: killed, named
        batches = iter(DataLoader(list(range(8)), batch_size=2, num_workers=2))
        KEPT.append(batches)
        assert next(batches).tolist() == [0, 1]
    return sign("left", [p.pid for p in mp.active_children()])


def test_c50pd_a_loader_left_running_passes_with_a_warning(run_ranks):
    left = run_ranks(leave_a_loader)
    assert len(left[1]) == 2 and still_running(left[1]) == [], left


def leave_a_thread(rank, world_size):
    note()
    if rank == 1:  # the function warns nothing else: the thread alone is named
        threading.Thread(target=time.sleep, args=(3,), name="lingers-past-the-grace").start()
    return rank


def test_c50pe_a_thread_left_past_the_grace_is_named(run_ranks):
    assert run_ranks(leave_a_thread) == [0, 1]


STEP_LINE = next(n for n, line in enumerate(open(__file__), 1) if "# c29b's step" in line)


def test_c29a_an_unfired_fault_fails_naming_it(run_ranks):
    run_ranks(sum_of_ranks, faults=Fault(1, Delay(30), at=5, op="all_reduce"))


def test_c29b_the_results_say_which_faults_fired(run_ranks):
    quiet = Fault(0, Delay(30), at=99, optional=True)  # never reached: optional, no failure
    assert run_ranks(step_sums, faults=quiet).fired == {0: (), 1: ()}
    # The same world (warm) or group (torchrun): its steps are counted from 1 again.
    results = run_ranks(step_sums, faults=[Fault(1, Delay(0.01), step="step", at=2), quiet])
    assert results == [8.0, 8.0] and results.fired[0] == ()
    (fired,) = results.fired[1]
    assert (fired.point, fired.action, fired.step, fired.where) == (
        "fault_point('step') #2", "delay", "step", f"test_stranger.py:{STEP_LINE}"
    )
    assert 0 <= fired.elapsed < 60 and fired.time > 0


def helper_sums(rank, world_size):
    note()
    faulty_group.init_process_group(rank, world_size)  # docs/faults.md's helper: no plan given
    total = torch.zeros(1)
    for _ in range(2):
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
    return total.item()


def test_c29c_the_documented_helper_keeps_the_plan(run_ranks):
    results = run_ranks(helper_sums, backend=None, faults=Fault(1, Delay(0.01), at=2))
    assert results == [4.0, 4.0]
    assert [f.point for f in results.fired[1]] == ["all_reduce #2"]


def gather_into_tensor(rank, world_size):
    note()
    out = torch.zeros(world_size)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    return out.tolist()


def test_c29d_a_fault_on_all_gather_into_tensor_fires(run_ranks):
    plan = Fault(0, Delay(0.01), op="all_gather_into_tensor")
    results = run_ranks(gather_into_tensor, faults=plan)
    assert results == [[0.0, 1.0], [0.0, 1.0]]
    assert [(f.op, f.seq) for f in results.fired[0]] == [("all_gather_into_tensor", 1)]


def closed_and_caught(rank, world_size):
    note()
    dist.all_reduce(torch.ones(1))  # both ranks past the group's set-up: the close meets #2
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_c29e_a_close_the_ranks_survive(run_ranks):
    said = run_ranks(closed_and_caught, faults=Fault(0, Close(), at=2))  # every rank returns
    assert all("peer" in s or "pipe" in s for s in said), said


def test_c29f_a_faulty_test_after_a_fired_close_passes(run_ranks):
    assert run_ranks(step_sums, faults=Fault(1, Delay(0.01), step="step", at=1)) == [8.0, 8.0]


# Issue 50: the harness's own files closed under "-W error"; first lines that name the
# thing (an unprintable exception, a sleeping rank, a deprecation made an error); a failed
# test's rank output in junit; a world size no host starts; an early return before DTensor's
# redistribute, seen at once.
@pytest.mark.filterwarnings("error")
def test_c50a_a_fault_fires_under_warnings_as_errors(run_ranks):
    assert run_ranks(sum_of_ranks, faults=Fault(1, Delay(0.01))) == [1.0, 1.0]


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def raise_unprintable(rank, world_size):
    note()
    if rank == 1:
        raise Unprintable()
    dist.barrier()


def test_c50b_an_unprintable_exception_by_its_type(run_ranks):
    run_ranks(raise_unprintable)


def sleeping(rank, world_size):
    note()
    time.sleep(20)  # the sleeper's line


@pytest.mark.rank_timeout(2)
def test_c50c_a_sleeping_rank_at_its_line(run_ranks):
    run_ranks(sleeping)


def call_deprecated(rank, world_size):
    from typing_extensions import deprecated

    note()
    old = deprecated("old thing, use new")(lambda: rank)
    return old() if rank == 1 else rank  # the deprecated call


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_c50d_a_deprecation_made_an_error_at_the_users_call(run_ranks):
    run_ranks(call_deprecated)


def say_then_fail_on_1(rank, world_size):
    note()
    print(f"said by rank {rank}", flush=True)
    dist.barrier()
    assert rank != 1, "rank 1 disagrees"


def test_c50e_a_failed_tests_rank_output_is_in_junit(run_ranks):
    run_ranks(say_then_fail_on_1)


@pytest.mark.world_size(10**6)
def test_c50f_a_world_size_the_host_cannot_start(run_ranks):
    run_ranks(sum_of_ranks)


def early_before_redistribute(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    note()
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    if rank == 1:
        return "done early"
    return sharded.redistribute(mesh, [Replicate()]).to_local().sum().item()  # the redistribute


@pytest.mark.rank_timeout(10)
def test_c50g_an_early_return_before_a_redistribute(run_ranks):
    run_ranks(early_before_redistribute)


@pytest.mark.check_collectives  # torch's checker: the redistribute's records name no group
@pytest.mark.rank_timeout(10)
def test_c50h_an_early_return_before_a_redistribute_under_the_checker(run_ranks):
    run_ranks(early_before_redistribute)


# c35: a warm world's own machinery meets none of the test's: torch's groups of a DeviceMesh
# go with the test (the next test runs in the same world), and a rank that returned while its
# peer waits in a barrier is stranding it, in a world that served tests before (the world's
# check after a test is no collective that could answer the peer's barrier).
def mesh_sums(rank, world_size):
    note()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))  # tp: groups of 1
    total, one = torch.ones(1), torch.ones(1)
    dist.all_reduce(total, group=mesh["dp"].get_group())
    dist.all_reduce(one, group=mesh["tp"].get_group())
    return total.item() + one.item()


@pytest.mark.rank_timeout(10)
def test_c35a_a_two_dimensional_device_mesh(run_ranks):
    assert run_ranks(mesh_sums) == [3.0, 3.0]


@pytest.mark.rank_timeout(10)
def test_c35b_the_next_test_after_the_mesh(run_ranks):
    assert run_ranks(sum_of_ranks) == [1.0, 1.0]


def skips_the_barrier(rank, world_size):
    note()
    if rank == 1:
        return
    dist.barrier()  # c35c's barrier


@pytest.mark.rank_timeout(10)
def test_c35c_rank_1_skips_a_barrier(run_ranks):
    run_ranks(skips_the_barrier)


def test_c20_init_method_tcp(run_ranks):
    assert run_ranks(sum_of_ranks, init_method="tcp") == [1.0, 1.0]


def patch_all_reduce(rank, world_size):
    note()

    def all_reduce(tensor, *args, **kwargs):
        tensor.fill_(123)

    dist.all_reduce = all_reduce
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return ones.item()


def real_all_reduce(rank, world_size):
    note()
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return ones.item()


def test_c19e_patches_all_reduce(run_ranks):
    assert run_ranks(patch_all_reduce) == [123.0, 123.0]


def test_c19f_all_reduces_for_real(run_ranks):
    assert run_ranks(real_all_reduce) == [2.0, 2.0]


def exit_on_rank_0(rank, world_size):
    note()
    if rank == 0:
        os._exit(3)
    dist.barrier()


@pytest.mark.rank_timeout(10)
def test_c13b_os_exit_on_rank_0(run_ranks):  # torchrun: the reporter leaves; a job of its own
    run_ranks(exit_on_rank_0)


def exit_on_rank_1(rank, world_size):
    note()
    if rank == 1:
        print("rank 1 leaves now", flush=True)
        Path(PIDS, "exit.time").write_text(repr(time.time()))
        os._exit(0)
    dist.barrier()


@pytest.mark.rank_timeout(10)
def test_c13_os_exit_on_rank_1(run_ranks):  # last: a torchrun job cannot go on without a rank
    run_ranks(exit_on_rank_1)
'''
WARM = STRANGER.replace("pytestmark = []", "pytestmark = [pytest.mark.warm_world]", 1)
assert WARM != STRANGER
FUNCTIONAL_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "# the fault's" in line
)
WARN_LINE = next(i for i, line in enumerate(STRANGER.splitlines(), 1) if "warning's line" in line)
AT_WARN = f"(at {MODULE}.py:{WARN_LINE})"  # where an "error" filter raised the warning
HANG_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "hang's all_gather" in line
)
EARLY_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "the stranded all_reduce" in line
)
CAUGHT_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "the caught fault's" in line
)
BARRIER_LINE = next(i for i, line in enumerate(STRANGER.splitlines(), 1) if "c35c's" in line)
# Warm, one world serves these in turn (the mesh's groups go with c35a; c35c strands rank 0).
SAME_WORLD = ["test_c35a_a_two_dimensional_device_mesh", "test_c35b_the_next_test_after_the_mesh"]
SAME_WORLD.append("test_c35c_rank_1_skips_a_barrier")
# A hang that cannot resolve: the verdict comes when seen (``stranded``), not at the deadline.
NEVER = (
    ", which rank 1 never entered: a hang that cannot resolve (ended when seen, not at the "
    "harness deadline of {} s)"
)

SLEEP_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "the sleeper's line" in line
)
DEPRECATED_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "the deprecated call" in line
)
REDISTRIBUTE_LINE = next(
    i for i, line in enumerate(STRANGER.splitlines(), 1) if "# the redistribute" in line
)

# --- the expected table ------------------------------------------------------------------

NOT_RUN = "not run"  # the strategy's run does not include the case


@dataclass(frozen=True)
class Expect:
    """What a case must give: its verdict; the first line of its junit message (a string:
    exactly that; a pattern: ``re.search`` finds it; None: not checked); at most how many
    seconds it may take (junit's time, setup to teardown); patterns its entry in pytest's
    warnings summary must match; patterns its junit ``system-out`` must match."""

    verdict: str
    first_line: str | re.Pattern[str] | None = None
    within: float | None = None
    warnings: tuple[str, ...] = ()
    out: tuple[str, ...] = ()


@dataclass(frozen=True)
class Differs(Expect):
    """What one strategy gives instead of the case's ``Expect``, and ``why`` (keyword)."""

    why: str = ""

    def __post_init__(self) -> None:
        assert self.why, "a difference says why"


@dataclass(frozen=True)
class Case:
    expect: Expect
    forked: Differs | None = None
    warm: Differs | None = None
    torchrun: Differs | None = None

    def under(self, strategy: str) -> Expect:
        return getattr(self, strategy) or self.expect


def starts(prefix: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(prefix))


def misconfigured(marker: str) -> Case:
    return Case(Expect("error", re.compile(rf"^harness configuration: .*\b{marker}\b")))


ASSERT_ON_0 = "rank 0 raised AssertionError: rank 0 disagrees"
PLAIN = (
    "a plain test (no run_ranks) runs once, in the one pytest process, forked or warm; under "
    "torchrun every rank runs it, and a failure on any rank fails it"
)
ONE_PROCESS = (
    "under torchrun each rank is one pytest process for the whole session, so state a test "
    "leaves in a module carries over to the next test, as in any pytest process"
)
UNFIRED = (
    "tutorial_impl.testing.faults.FaultNotFired: planned fault(s) did not fire (Fault(..., "
    "optional=True) if that may be so): delay on rank(s) 1 at all_reduce #5 did not fire on rank "
    "1: it made 1 all_reduce(s) that matched; its collectives: all_reduce 1; its steps: none"
)
# Plain and under torch's collective checker (c04b/c04e, c50g/c50h): the same first line.
RETURNED_EARLY = Case(
    Expect(
        "failed",
        "rank 1 returned after all_reduce #1; rank 0 waits in all_reduce #2 at "
        f"{MODULE}.py:{EARLY_LINE}" + NEVER.format(10),
        within=2,
    )
)
BEFORE_REDISTRIBUTE = Case(
    Expect(
        "failed",
        f"rank 1 returned after scatter #1; rank 0 waits in all_gather #2 at {MODULE}.py:"
        f"{REDISTRIBUTE_LINE}" + NEVER.format(10),
        within=5,
    )
)


CASES: dict[str, Case] = {
    "test_c01_all_reduce_passes": Case(Expect("passed")),
    "test_c02_raise_on_rank_1": Case(Expect("failed", "rank 1 raised ValueError: boom on one")),
    "test_c03_raise_on_rank_0": Case(Expect("failed", "rank 0 raised ValueError: boom on zero")),
    # Rank 1 returned; rank 0 waits in a collective rank 1 never entered: the verdict comes
    # at once (the bar: under 2 s), whatever the deadline.
    "test_c04_hang": Case(
        Expect(
            "failed",
            "rank 1 returned before any collective; rank 0 waits in all_gather #1 at "
            f"{MODULE}.py:{HANG_LINE}" + NEVER.format(3),
            within=2,
        )
    ),
    "test_c04b_rank_1_returns_early": RETURNED_EARLY,
    "test_c04e_rank_1_returns_early_under_the_checker": RETURNED_EARLY,
    "test_c04c_a_slow_rank_is_waited_for": Case(Expect("passed")),
    # gloo records a reduce_scatter_tensor as an all_reduce: the line names the user's call,
    # and the fault rank 1 caught, which explains why it returned.
    "test_c04d_a_caught_fault_strands_rank_0": Case(
        Expect(
            "failed",
            "rank 1 returned before any collective; rank 0 waits in reduce_scatter_tensor #1 at "
            f"{MODULE}.py:{CAUGHT_LINE}" + NEVER.format(10) + " (rank 1: injected raise at "
            "reduce_scatter_tensor #1)",
            within=2,
        )
    ),
    "test_c05_kill_rank_1": Case(
        Expect("failed", "rank 1 was killed by signal SIGKILL before returning a result"),
        torchrun=Differs(
            NOT_RUN,
            why="a worker killed by a signal ends a torchrun job (its agent tears every worker "
            "down), so no later test would run: the torchrun run deselects it (-k)",
        ),
    ),
    "test_c06_skip_on_every_rank": Case(Expect("skipped", "rank 0: no data")),
    "test_c07_xfail_on_every_rank": Case(Expect("xfailed", re.compile(r"\bknown\b"))),
    # A failure on any rank beats a skip or an xfail anywhere, however late it comes.
    "test_c08_skip_on_1_then_assert_on_0": Case(Expect("failed", ASSERT_ON_0)),
    "test_c09_xfail_on_1_then_assert_on_0": Case(Expect("failed", ASSERT_ON_0)),
    **{
        f"test_c10_skip_and_assert_at_once[{i}]": Case(Expect("failed", ASSERT_ON_0))
        for i in range(4)
    },
    # Skips are pytest's own exception types, never a class that has their name.
    "test_c11_own_class_named_skipped": Case(
        Expect("failed", re.compile(r"^rank 1 raised [\w.]+\.Skipped: data corrupted$"))
    ),
    "test_c11_own_class_named_xfailed": Case(
        Expect("failed", re.compile(r"^rank 1 raised [\w.]+\.XFailed: data corrupted$"))
    ),
    "test_c12_forked_child_returns_and_rank_1_raises": Case(Expect("failed", starts("rank 1 "))),
    "test_c12_forked_child_returns_and_rank_1_too": Case(
        Expect("failed", re.compile(r"^rank 1\b.*fork"))
    ),
    "test_c14_not_equal_across_ranks": Case(
        Expect(
            "failed",
            re.compile(r"^(?=.*not equal across ranks)(?=.*\brank(?:\(s\))? (?:\d+, )*1\b)"),
        )
    ),
    "test_c15_numpy_arrays_equal_across_ranks": Case(Expect("passed")),
    "test_c16_unpicklable_result": Case(
        Expect("failed", re.compile(r"^rank 0 raised .*cannot be pickled"))
    ),
    # Each fails its own test in setup, and the session goes on.
    "test_c17_world_size_0": misconfigured("world_size"),
    "test_c17_matrix_with_0": misconfigured("world_size"),
    "test_c17_matrix_with_2_twice": misconfigured("world_size"),
    "test_c17_warm_world_yes": misconfigured("warm_world"),
    "test_c17_two_world_size_markers": misconfigured("world_size"),
    "test_c17_rank_timeout_0": misconfigured("rank_timeout"),
    "test_c18_exception_in_a_thread_of_rank_1": Case(
        Expect("passed", warnings=(r"ZeroDivisionError", r"\brank 1\b"))
    ),
    # pytest's conventions inside ranks: the test's filters decide in the rank (an "error"
    # raises at the warning, so the rank fails with it, at its line); what is shown reaches
    # pytest's summary labelled with the rank, at the warning's own file and line.
    "test_c28a_warning_under_cmdline_error": Case(
        Expect("failed", f"rank 1 raised DeprecationWarning: cmdline-decides: old API {AT_WARN}")
    ),
    "test_c28b_warning_under_ini_error": Case(
        Expect("failed", f"rank 1 raised RuntimeWarning: ini-decides: odd value {AT_WARN}")
    ),
    "test_c28c_warning_under_mark_error": Case(
        Expect("failed", f"rank 1 raised UserWarning: shown-always: take note {AT_WARN}")
    ),
    "test_c28d_warning_shown_in_the_summary": Case(
        Expect(
            "passed",
            warnings=(rf"{MODULE}\.py:{WARN_LINE}: UserWarning: rank 1: shown-always: take note",),
        )
    ),
    "test_c28e_pytest_warns_in_a_rank": Case(Expect("passed")),
    "test_c28f_thread_fails_after_the_function": Case(
        Expect(
            "failed",
            "rank 1 raised ValueError: late on 1 (in thread 'late-boom', after the rank function "
            "had returned)",
            within=5,
        ),
    ),
    # Under its mark's "error", as pytest fails a test whose object's __del__ raised.
    "test_c28g_unraisable_exception": Case(
        Expect(
            "failed",
            starts(
                "pytest.PytestUnraisableExceptionWarning: rank 1: Exception ignored in: "
                "<function Unclosable.__del__"
            ),
        )
    ),
    # Fresh ranks start clean; a warm world that a test changed is replaced.
    "test_c19a_fills_a_module_global": Case(Expect("passed")),
    "test_c19b_reads_it_in_the_next_test": Case(
        # Both ranks raise it: the first is the cause, the other is named on the same line
        # when its KeyError arrives within the crash grace (under load it may come later).
        Expect(
            "failed",
            re.compile(r"^rank [01] raised KeyError: 'k'( \(rank\(s\) [01] failed too\))?$"),
        ),
        torchrun=Differs("passed", why=ONE_PROCESS),
    ),
    "test_c19c_seeds_numpy": Case(Expect("passed")),
    "test_c19d_draws_unseeded": Case(
        Expect("passed"),
        torchrun=Differs(
            "failed", re.compile(r"^rank [01] raised AssertionError"), why=ONE_PROCESS
        ),
    ),
    "test_c20_init_method_tcp": Case(
        Expect("passed"),
        torchrun=Differs(
            "failed",
            re.compile(r"\binit_method\b"),
            why="the job has its own rendezvous: init_method cannot be honoured there, so it is "
            "refused, never silently dropped",
        ),
    ),
    "test_c34a_run_ranks_from_a_thread_of_the_test": Case(
        Expect("passed"),
        torchrun=Differs(
            "skipped",
            re.compile(r"needs world_size 4; this torchrun job has 2 ranks"),
            why="the thread's call is the test's (its world_size(4)), which the job cannot "
            "give: skipped as the test's own call would be, not run on the job's 2 ranks",
        ),
    ),
    "test_c34b_bad_values_are_refused_naming_the_field": Case(Expect("passed")),
    "test_c34c_rank_2_raises_and_its_peers_lose_the_connection": Case(
        Expect("failed", "rank 2 raised ValueError: rank 2's own bug"),
        torchrun=Differs(
            "skipped",
            re.compile(r"needs world_size 3; this torchrun job has 2 ranks"),
            why="under torchrun a test runs on the whole job: another size is skipped",
        ),
    ),
    "test_c34d_a_peer_that_returned_is_said_to_have_returned": Case(
        Expect(
            "failed",
            re.compile(
                r"^rank 1 raised RuntimeError: .*Connection (closed|reset) by peer.*"
                r"\(rank\(s\) 0 had returned and closed the connection, while this rank was "
                r"still in a collective with it: no rank crashed\)$"
            ),
        )
    ),
    # Processes a rank starts (issue 50): rank 0, stopped in its barrier, is named from
    # outside: two forks of the rank and one process of its forkserver, the forkserver and
    # its resource tracker killed without a word.
    "test_c50pa_forgotten_processes_are_killed_and_named_once": Case(Expect("passed")),
    "test_c50pb_a_stopped_ranks_processes_are_named_once": Case(
        Expect(
            "failed",
            "rank 1 raised ValueError: rank 1 fails while rank 0 waits",
            warnings=(r"\A(?![\s\S]*import main;)[\s\S]*rank 0 left 3 process\(es\) running",),
        )
    ),
    "test_c50pc_multiprocessings_own_helpers_are_no_leftovers": Case(Expect("passed")),
    "test_c50pd_a_loader_left_running_passes_with_a_warning": Case(
        Expect("passed", warnings=(r"LeftoverProcessWarning: rank 1 left 2 process\(es\)",))
    ),
    "test_c50pe_a_thread_left_past_the_grace_is_named": Case(
        Expect("passed", warnings=(r"RankThreadWarning: rank 1: thread 'lingers-past-the-grace'",))
    ),
    "test_c19e_patches_all_reduce": Case(Expect("passed")),
    "test_c19f_all_reduces_for_real": Case(
        Expect("passed"),
        torchrun=Differs("failed", re.compile(r"\b123\b"), why=ONE_PROCESS),
    ),
    # Under torchrun the worker tells its peers through the job's store as it exits.
    "test_c13_os_exit_on_rank_1": Case(
        Expect("failed", starts("rank 1 exited with code 0"), within=5)
    ),
    # Under torchrun rank 0 writes the report: its function's os._exit ends the function,
    # the test fails with it, and the session stops after the test (its own job, below).
    "test_c13b_os_exit_on_rank_0": Case(
        Expect("failed", starts("rank 0 exited with code 3"), within=5)
    ),
    "test_c21_rpc_gets_a_rendezvous_of_its_own": Case(Expect("passed")),
    "test_c24_the_group_timeout_stays_behind_the_deadline": Case(Expect("passed")),
    # Rank functions of other shapes (shape.py), and run_ranks called by a helper during the
    # test's body (the test's own run_ranks: its strategy too).
    "test_c25_call_shapes": Case(Expect("passed")),
    "test_c26_a_helper_runs_the_tests_ranks": Case(Expect("passed")),
    "test_c22_matrix[world_size2]": Case(Expect("passed")),
    "test_c22_matrix[world_size3]": Case(
        Expect("passed"),
        torchrun=Differs(
            "skipped",
            re.compile(r"needs world_size 3; this torchrun job has 2 ranks"),
            why="under torchrun a test runs on the whole job: another size is skipped, never "
            "run on a subgroup (a collective on the default group must mean the world asked for)",
        ),
    ),
    "test_c23_plain_fails_on_rank_1_only": Case(
        Expect("passed"),
        torchrun=Differs("failed", re.compile(r"\brank 1 disagrees\b"), why=PLAIN),
    ),
    "test_c23_setup_fails_on_rank_1": Case(
        Expect("passed"),
        torchrun=Differs("error", re.compile(r"\bfixture broke on rank 1\b"), why=PLAIN),
    ),
    "test_c23_plain_skips_on_rank_1": Case(
        Expect("passed"),
        torchrun=Differs("skipped", starts("rank 1: rank 1 has no such device"), why=PLAIN),
    ),
    "test_c23_plain_hang_on_rank_0": Case(
        Expect("passed"),
        torchrun=Differs(
            "failed",
            starts("rank 0 ran past the harness deadline"),
            within=1 + 5,
            why=PLAIN + "; the watchdog stops a plain test past its deadline",
        ),
    ),
    "test_c23_after_the_plain_hang": Case(Expect("passed")),
    # DDP's start makes five collectives, so its third gradient all_reduce is the group's #8.
    "test_c27a_kill_in_ddps_third_all_reduce": Case(
        Expect(
            "failed",
            "rank 1 was killed by signal SIGKILL before returning a result (rank 1: injected "
            "kill at all_reduce #8, the 3rd all_reduce)",
            within=10,  # a DDP start and three steps: under load, more than a bare kill's 5 s
        ),
    ),
    # Forked and warm, the parent saw an exit; under torchrun rank 0 said so itself (it
    # writes the report: its exit ends its function, and the session stops after the test).
    "test_c27e_exit_on_rank_0_in_ddps_second_all_reduce": Case(
        Expect(
            "failed",
            re.compile(
                r"^rank 0 exited with code 3 \(os\._exit( or a crash)?\) before returning a "
                r"result \(rank 0: injected exit at all_reduce #\d+, the 2nd all_reduce\)$"
            ),
            within=10,
        ),
    ),
    "test_c27b_hang_at_a_functional_collective": Case(
        Expect(
            "failed",
            re.compile(
                r"^rank\(s\) 0, 1 still running after the harness deadline of 3 s: rank 0 waits "
                rf"in all_reduce #1 at {MODULE}\.py:{FUNCTIONAL_LINE}; rank 1 never reached #1 "
                r"\(rank 1: injected hang at all_reduce #1\)$"
            ),
            within=3 + 4,
        )
    ),
    "test_c27c_a_delay_is_survived": Case(Expect("passed")),
    "test_c29a_an_unfired_fault_fails_naming_it": Case(Expect("failed", UNFIRED)),
    "test_c29b_the_results_say_which_faults_fired": Case(Expect("passed")),
    "test_c29c_the_documented_helper_keeps_the_plan": Case(Expect("passed")),
    "test_c29d_a_fault_on_all_gather_into_tensor_fires": Case(Expect("passed")),
    "test_c29e_a_close_the_ranks_survive": Case(Expect("passed")),
    "test_c29f_a_faulty_test_after_a_fired_close_passes": Case(Expect("passed")),
    # Issue 50's cases, each the same in every mode.
    "test_c50a_a_fault_fires_under_warnings_as_errors": Case(Expect("passed")),
    "test_c50b_an_unprintable_exception_by_its_type": Case(
        Expect("failed", f"rank 1 raised {MODULE}.Unprintable: <str() failed>", within=5)
    ),
    "test_c50c_a_sleeping_rank_at_its_line": Case(
        Expect(
            "failed",
            "rank(s) 0, 1 still running after the harness deadline of 2 s: "
            + ", ".join(f"rank {r} at {MODULE}.py:{SLEEP_LINE} in sleeping" for r in (0, 1)),
        )
    ),
    "test_c50d_a_deprecation_made_an_error_at_the_users_call": Case(
        Expect(
            "failed",
            f"rank 1 raised DeprecationWarning: old thing, use new (at {MODULE}.py:"
            f"{DEPRECATED_LINE})",
        )
    ),
    "test_c50e_a_failed_tests_rank_output_is_in_junit": Case(
        Expect(
            "failed",
            "rank 1 raised AssertionError: rank 1 disagrees",
            out=(r"said by rank 0\b", r"said by rank 1\b"),
        )
    ),
    "test_c50f_a_world_size_the_host_cannot_start": Case(
        Expect(
            "error",
            re.compile(
                r"^harness configuration: @pytest\.mark\.world_size\(1000000\): world size "
                r"1000000 is more ranks than this host can start: at most \d+ \("
            ),
        )
    ),
    "test_c50g_an_early_return_before_a_redistribute": BEFORE_REDISTRIBUTE,
    "test_c50h_an_early_return_before_a_redistribute_under_the_checker": BEFORE_REDISTRIBUTE,
    "test_c35a_a_two_dimensional_device_mesh": Case(Expect("passed")),
    "test_c35b_the_next_test_after_the_mesh": Case(Expect("passed")),
    "test_c35c_rank_1_skips_a_barrier": Case(
        Expect(
            "failed",
            f"rank 1 returned before any collective; rank 0 waits in barrier #1 at {MODULE}.py:"
            f"{BARRIER_LINE}" + NEVER.format(10),
            within=2,
        )
    ),
    "test_c27d_raise_at_a_step": Case(
        Expect(
            "failed",
            re.compile(
                r"^rank 0 raised tutorial_impl\.testing\.faults\.InjectedFault: injected fault "
                r"on rank 0 at fault_point\('step'\) #3: bad batch$"
            ),
        )
    ),
}
# Under torchrun a worker's death ends the job, and so does rank 0's os._exit: c27a's kill
# and c13b each run in a job of their own (``test_torchrun_a_leaving_worker_ends_the_job``);
# c05's SIGKILL, from the test's own code, gives the worker no time to tell its peers
# (``TORCHRUN_DESELECT``'s reason in the table).
KILL_JOB = "test_c27a_kill_in_ddps_third_all_reduce"
EXIT_0_JOB = "test_c13b_os_exit_on_rank_0"
FAULT_EXIT_0_JOB = "test_c27e_exit_on_rank_0_in_ddps_second_all_reduce"
OWN_JOBS = (KILL_JOB, EXIT_0_JOB, FAULT_EXIT_0_JOB)
LAST = "test_c13_os_exit_on_rank_1"  # the file's last test: nothing can follow it
TORCHRUN_DESELECT = "not test_c05_kill_rank_1" + "".join(f" and not {n}" for n in OWN_JOBS)

# --- reading a run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Got:
    verdict: str
    first_line: str | None = ""  # None: unknown (no junit XML; verdicts from progress lines)
    time: float | None = 0.0
    out: str | None = ""  # its junit system-out (None: unknown)


@dataclass
class Run:
    strategy: str
    cases: dict[str, Got]  # junit name -> what it gave
    output: str  # the terminal output (rank 0's under torchrun)
    wall: float
    cpu: float
    problems: list[str] = field(default_factory=list)  # run-level deviations


def read_junit(path: Path) -> dict[str, Got]:
    """junit name -> verdict, first line of its message, time."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        verdicts, lines, out = [], [], ""
        for child in case:
            message = child.get("message", "")
            if child.tag == "system-out":
                out += child.text or ""
            if child.tag == "failure":
                verdicts.append("failed")
            elif child.tag == "error":
                wrapped = re.fullmatch(r'failed on (setup|teardown) with "(.*)"', message, re.S)
                phase, message = wrapped.groups() if wrapped else ("setup", message)
                verdicts.append("error" if phase == "setup" else f"error in {phase}")
            elif child.tag == "skipped":
                verdicts.append("xfailed" if child.get("type") == "pytest.xfail" else "skipped")
            else:
                continue
            lines.append((message.splitlines() or [""])[0])
        name = case.get("name", "")
        got = Got(
            " + ".join(verdicts) or "passed",
            lines[0] if lines else "",
            float(case.get("time", 0)),
            out,
        )
        earlier = found.get(name)
        if earlier is not None:  # a test's phases in two testcases (a failed call, then an
            # error in teardown, the way torchrun's rank 0 reports them): one verdict
            got = Got(
                f"{earlier.verdict} + {got.verdict}",
                earlier.first_line or got.first_line,
                (earlier.time or 0) + (got.time or 0),
                (earlier.out or "") + (got.out or ""),
            )
        found[name] = got
    return found


PROGRESS = {
    "PASSED": "passed",
    "FAILED": "failed",
    "ERROR": "error",
    "SKIPPED": "skipped",
    "XFAIL": "xfailed",
    "XPASS": "passed",
}


def read_progress(output: str) -> dict[str, Got]:
    """junit name -> verdict, from pytest's ``-v`` progress lines: for a run that ended
    before writing its junit XML (first lines and times unknown)."""
    found: dict[str, Got] = {}
    line = re.compile(rf"^{MODULE}\.py::(\S+) ({'|'.join(PROGRESS)})\b", re.M)
    for name, word in line.findall(output):
        verdict = PROGRESS[word]
        if name in found:  # a failed call, then an error in teardown
            verdict = f"{found[name].verdict} + error in teardown"
        found[name] = Got(verdict, None, None, None)
    return found


def warnings_entries(output: str, name: str) -> str:
    """The entries of pytest's warnings summary that name test ``name``."""
    own = re.compile(rf"::{re.escape(name)}$", re.M)
    return "\n\n".join(e for e in _summary_entries(output) if own.search(e))


@functools.lru_cache(maxsize=4)
def _summary_entries(output: str) -> tuple[str, ...]:
    """The entries of pytest's warnings summary in ``output``, found once per run: the search
    walks the whole output (megabytes with ``-rA``), about 10 ms of CPU each time."""
    summary = re.search(r"^=+ warnings summary =+\n(.*?)(?=^=+ |\Z)", output, re.S | re.M)
    return tuple(summary.group(1).split("\n\n")) if summary else ()


def _matches(expected: str | re.Pattern[str] | None, line: str) -> bool:
    if expected is None:
        return True
    if isinstance(expected, str):
        return line == expected
    return expected.search(line) is not None


def _show(expected: str | re.Pattern[str] | None) -> str:
    return f"/{expected.pattern}/" if isinstance(expected, re.Pattern) else repr(expected)


def deviations(run: Run, cases: dict[str, Case] = CASES) -> list[str]:
    """Every way ``run`` differs from ``cases``: (case, strategy, expected, got), one a line."""
    out = list(run.problems)
    seen = set()
    for name, case in cases.items():
        want = case.under(run.strategy)
        got = {n: g for n, g in run.cases.items() if n == name or n.startswith(name + "[")}
        if "[" in name:
            got = {name: run.cases[name]} if name in run.cases else {}
        seen |= set(got)
        if not got:
            got = {name: Got(NOT_RUN)}
        for n, g in got.items():
            tag = f"{n} [{run.strategy}]"
            if g.verdict != want.verdict:
                out.append(
                    f"{tag}: expected {want.verdict} {_show(want.first_line)}, got {g.verdict} "
                    f"{g.first_line!r}"
                )
                continue
            if g.first_line is not None and not _matches(want.first_line, g.first_line):
                out.append(
                    f"{tag}: expected first line {_show(want.first_line)}, got {g.first_line!r}"
                )
            if want.within is not None and g.time is not None and g.time > want.within:
                out.append(f"{tag}: took {g.time:.1f} s, expected at most {want.within:g} s")
            for pattern in want.out if g.out is not None else ():
                if not re.search(pattern, g.out):
                    out.append(f"{tag}: junit system-out has no /{pattern}/: {g.out[-300:]!r}")
            text = warnings_entries(run.output, n) if want.warnings else ""
            for pattern in want.warnings:
                if not re.search(pattern, text):
                    out.append(
                        f"{tag}: warnings summary has no /{pattern}/ for it; its entry: {text!r}"
                    )
    for n in sorted(set(run.cases) - seen):
        out.append(
            f"{n} [{run.strategy}]: not in the table, got {run.cases[n].verdict} "
            f"{run.cases[n].first_line!r}"
        )
    return out


def report(run: Run, cases: dict[str, Case] = CASES) -> str:
    return (
        f"{run.strategy}: {run.wall:.1f} s wall, {run.cpu:.1f} s CPU; "
        f"{len(run.cases)} cases; deviations:\n  " + "\n  ".join(deviations(run, cases))
    )


# --- the checker itself, on a junit file of known content ---------------------------------

KNOWN_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="m" name="test_a" time="0.1"/>
<testcase classname="m" name="test_b" time="0.2">
  <failure message="rank 1 raised ValueError: boom&#10;second line">tb</failure>
  <system-out>[rank 1] said this</system-out></testcase>
<testcase classname="m" name="test_c" time="0.0">
  <error message="failed on setup with &quot;harness configuration: world_size(0)&quot;">e</error>
</testcase>
<testcase classname="m" name="test_d" time="0.0">
  <skipped type="pytest.skip" message="rank 0: no data">m.py:3: rank 0: no data</skipped></testcase>
<testcase classname="m" name="test_e" time="0.0">
  <skipped type="pytest.xfail" message="rank 0: known"/></testcase>
<testcase classname="m" name="test_f[1]" time="9.0"><failure message="x"/></testcase>
<testcase classname="m" name="test_f[1]" time="1.0">
  <error message="failed on teardown with &quot;y&quot;"/></testcase>
</testsuite></testsuites>
"""
KNOWN_OUTPUT = """
============================== warnings summary ===============================
m.py::test_a
  PytestUnhandledThreadExceptionWarning: rank 1: Exception in thread Thread-1
  ZeroDivisionError: division by zero

-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
=========================== short test summary info ===========================
"""
KNOWN_TABLE = {
    "test_a": Case(Expect("passed", warnings=("ZeroDivisionError", r"\brank 1\b"))),
    "test_b": Case(Expect("failed", "rank 1 raised ValueError: boom")),
    "test_c": Case(Expect("error", re.compile(r"^harness configuration: .*\bworld_size\b"))),
    "test_d": Case(Expect("skipped", "rank 0: no data")),
    "test_e": Case(Expect("xfailed", "rank 0: known"), torchrun=Differs(NOT_RUN, why="ends it")),
    "test_f": Case(Expect("failed + error in teardown", "x", within=10.5)),
}


def test_the_checker_sees_each_kind_of_deviation(tmp_path: Path) -> None:
    """The table is only as good as its comparison: a run that conforms gives no deviation,
    and each way of deviating (verdict, first line, time, warnings, a difference not taken,
    a case missing or unknown) gives exactly one."""
    (tmp_path / "known.xml").write_text(KNOWN_JUNIT)
    cases = read_junit(tmp_path / "known.xml")
    assert cases["test_f[1]"] == Got("failed + error in teardown", "x", 10.0)
    assert cases["test_c"] == Got("error", "harness configuration: world_size(0)", 0.0)
    assert cases["test_e"].verdict == "xfailed"
    forked = Run("forked", cases, KNOWN_OUTPUT, 0.0, 0.0)
    assert deviations(forked, KNOWN_TABLE) == []
    without_e = {name: got for name, got in cases.items() if name != "test_e"}
    assert deviations(Run("torchrun", without_e, KNOWN_OUTPUT, 0.0, 0.0), KNOWN_TABLE) == []
    assert len(deviations(Run("torchrun", cases, KNOWN_OUTPUT, 0.0, 0.0), KNOWN_TABLE)) == 1
    planted = {
        "test_a": Case(Expect("failed")),
        "test_b": Case(Expect("failed", "rank 1 raised ValueError: boom on two")),
        "test_c": Case(Expect("error", re.compile(r"\bwarm_world\b"))),
        "test_d": Case(Expect("skipped", "rank 1: no data")),
        "test_e": Case(Expect("xfailed"), forked=Differs("passed", why="planted")),
        "test_f": Case(Expect("failed + error in teardown", within=9.5)),
    }
    for name, case in planted.items():
        found = deviations(forked, {**KNOWN_TABLE, name: case})
        assert len(found) == 1 and found[0].startswith(name), (name, found)
    said = {**KNOWN_TABLE, "test_b": Case(Expect("failed", out=(r"\[rank 1\] said",)))}
    assert deviations(forked, said) == []
    found = deviations(forked, {**said, "test_b": Case(Expect("failed", out=("rank 0 said",)))})
    assert len(found) == 1 and "system-out" in found[0], found
    quiet = Run("forked", cases, KNOWN_OUTPUT.replace("rank 1: ", ""), 0.0, 0.0)
    assert len(deviations(quiet, KNOWN_TABLE)) == 1
    assert len(deviations(forked, {**KNOWN_TABLE, "test_g": Case(Expect("passed"))})) == 1
    assert len(deviations(forked, {n: c for n, c in KNOWN_TABLE.items() if n != "test_a"})) == 1


def test_the_table_names_every_test_of_the_file_and_no_other() -> None:
    defined = re.findall(r"^def (test_\w+)\(", STRANGER, re.M)
    assert sorted({name.partition("[")[0] for name in CASES}) == sorted(defined)
    assert defined[-1] == LAST  # under torchrun nothing can follow it
    assert sum(n.startswith("test_c10_") for n in CASES) == 4


# --- running the file forked or warm, in this process ------------------------------------

RUN_ARGS = [
    "-p",
    "no:cacheprovider",
    "-p",
    "no:randomly",
    "-rA",
    # Tracebacks as Python prints them: pytest's own form parses the whole 1,000-line file
    # again for each entry of each failure (about half a second of CPU per pass, in every
    # worker of a torchrun job), and no claim here reads a traceback, only first lines.
    "--tb=native",
    "--rank-timeout=20",
    # Warning filters for the c28 cases, by message: the file's other cases keep pytest's.
    "-W",
    "error:cmdline-decides:DeprecationWarning",
    "-W",
    "always:shown-always",
]
# The project's: c28b's filter; junit's system-out for c50e.
INI = "[pytest]\njunit_logging = all\nfilterwarnings =\n    error:ini-decides\n"
IN_PROCESS_LIMIT = 60.0  # seconds a forked or warm run of the file may take (deadlines: 3 s)


def _cpu_of(pid: int | None) -> float:
    """CPU seconds of process ``pid`` and of its children it has reaped (the forkserver's
    ranks); 0 if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime


def processes_serving_several_tests(pids: Path) -> dict[int, list[str]]:
    """Every process that ran the rank functions of more than one test (from ``note``)."""
    tests: dict[tuple[int, str], list[str]] = {}
    for name, process in proctable.recorded(pids).items():
        tests.setdefault(process, []).append(name.rpartition("@")[0])
    return {pid: sorted(names) for (pid, _), names in tests.items() if len(names) > 1}


def _rank(rank: int) -> int:
    return rank


@pytest.fixture(scope="module", autouse=True)
def _this_sessions_forkserver() -> None:
    """The stranger's runs take their ranks from this session's forkserver (in-process runs,
    and the torchrun agents), started with this suite's preloads, as under ``-n auto``
    (xdist's controller starts it before any test). Left to the stranger's session to start,
    it would preload without ``torch._dynamo``, and every rank that builds an optimizer or a
    functional collective would import it: about 35 s more CPU for this module alone."""
    run_ranks(_rank, world_size=1, backend=None)


def run_in_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, strategy: str, source: str
) -> Run:
    pids = pytester.path / "pids"
    pids.mkdir()
    monkeypatch.setenv("CONFORMANCE_PIDS", str(pids))
    (pytester.path / f"{MODULE}.py").write_text(source)
    (pytester.path / "pytest.ini").write_text(INI)
    server = _ranks.forkserver_pid()
    cpu = _own_cpu() - _cpu_of(server)
    start = time.monotonic()
    result = pytester.runpytest(*RUN_ARGS, f"--junitxml={strategy}.xml", f"{MODULE}.py")
    wall = time.monotonic() - start
    # The forkserver's ranks (under xdist the server is shared: other workers' ranks too).
    cpu = _own_cpu() + _cpu_of(server or _ranks.forkserver_pid()) - cpu
    output = result.stdout.str() + result.stderr.str()
    problems = []
    left = proctable.wait_until_gone(pids)
    if left:
        problems.append(f"[{strategy}] processes outlived the run: {left}")
    shared = processes_serving_several_tests(pids)
    if strategy == "forked" and shared:
        problems.append(f"[forked] ranks served more than one test: {shared}")
    if strategy == "warm" and not shared and proctable.recorded(pids):
        problems.append("[warm] no rank served two tests: the warm run was not warm")
    if strategy == "warm" and not any(set(SAME_WORLD) <= set(t) for t in shared.values()):
        problems.append(f"[warm] no world served {SAME_WORLD} in turn: {shared}")
    if wall > IN_PROCESS_LIMIT:
        problems.append(f"[{strategy}] the run took {wall:.0f} s, limit {IN_PROCESS_LIMIT:g} s")
    if not (pytester.path / f"{strategy}.xml").exists():
        problems.append(f"[{strategy}] no junit XML; the run said:\n{output}")
        return Run(strategy, {}, output, wall, cpu, problems)
    run = Run(strategy, read_junit(pytester.path / f"{strategy}.xml"), output, wall, cpu, problems)
    if result.ret != pytest.ExitCode.TESTS_FAILED:
        run.problems.append(
            f"[{strategy}] pytest exited {result.ret!r}, expected TESTS_FAILED: "
            + "; ".join(re.findall(r"^(?:ERROR|INTERNALERROR|E ) .*", output, re.M)[:5])
        )
    return run


def test_forked(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_in_process(pytester, monkeypatch, "forked", STRANGER)
    print(report(run))
    if deviations(run):
        pytest.fail(report(run), pytrace=False)


def test_warm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_in_process(pytester, monkeypatch, "warm", WARM)
    print(report(run))
    if deviations(run):
        pytest.fail(report(run), pytrace=False)


# --- running the file under torchrun: two agents of one worker each -----------------------

JOB_BOUND = 60.0  # seconds the job may take (deadlines: 3 s, 10 s)
JOB_LIMIT = JOB_BOUND + 15  # then it is stopped (its junit XML is then missing)
AFTER_EXIT = 30.0  # seconds the job may go on after rank 1's os._exit, the last test


def _agent(port: int, rdzv_id: str, pytest_args: list[str]) -> list[str]:
    """One agent's ``torchrun`` arguments (after ``python -m torch.distributed.run``): one
    node of two, one worker, a c10d rendezvous on the store the test hosts; the worker a fork
    of the agent (``torchrun_worker.torchrun_agent_of_pytest``)."""
    return [
        "--monitor-interval=0.1",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=is_host=0,join_timeout=120",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "--start-method=fork",
        "-m",
        "pytest",
        *pytest_args,
    ]


def _one_report(outputs: list[str], reporter: int | None) -> list[str]:
    """Rank 0 reports for the job, once, with every rank's stacks where it matters; the other
    worker writes no test results (and no junit XML: only one file is there to read)."""
    if reporter is None:
        return ["[torchrun] no agent's log holds a test session: nothing reported"]
    report, quiet = outputs[reporter], outputs[1 - reporter]
    problems = []
    if "test session starts" in quiet or "PASSED" in quiet or "generated xml file" in quiet:
        problems.append("[torchrun] rank 1's worker reported too:\n" + quiet[-2000:])
    if report.count(f"{MODULE}.py::test_c01_all_reduce_passes PASSED") != 1:
        problems.append("[torchrun] a passing test is not reported exactly once")
    if not re.search(r"torchrun: 2 ranks on 1 host\(s\): \S+: ranks 0, 1", report):
        problems.append("[torchrun] no summary line naming the job's hosts and ranks")
    hang = re.search(r"_ test_c04_hang _.*?(?=\n_{5,} )", report, re.S)
    if not hang or "Python stacks of rank 0" not in hang.group(0):  # rank 1 had returned
        problems.append("[torchrun] the hang's report lacks the stacks of the rank that hung")
    return problems


@dataclass
class Job:
    """How the torchrun job went: each agent's output (its worker's included), what each
    agent saw of its worker (None: the agents' run failed), the run's own problems."""

    outputs: list[str]
    agents: list[ForkedJob] | None
    wall: float
    cpu: float
    ended: float  # time.time() when the agents were done
    problems: list[str]


def run_the_job(pytester: pytest.Pytester, run_ranks, pids: Path) -> Job:
    """The stranger's file under two torchrun agents, each a harness rank running torchrun's
    ``main``, each worker a fork of its agent; nothing of the job may outlive it."""
    workers = pytester.path / "workers"
    workers.mkdir()
    store = agents_store(JOB_LIMIT)
    args = [*RUN_ARGS, "-v", "--junitxml=torchrun.xml", "-k", TORCHRUN_DESELECT, f"{MODULE}.py"]
    command = _agent(store.port, f"conformance-{uuid.uuid4().hex[:8]}", args)
    env = {"PYTHONUNBUFFERED": "1", "CONFORMANCE_PIDS": str(pids)}
    server = _ranks.forkserver_pid()
    cpu = _own_cpu() - _cpu_of(server)
    start = time.monotonic()
    problems = []
    try:
        agents = run_ranks(
            torchrun_agent_of_pytest,
            command,
            str(pytester.path),
            str(workers),
            world_size=2,
            backend=None,
            env=env,
            timeout=JOB_LIMIT,
        )
        outputs, ends = list(agents.outputs), list(agents)
    except RankError as error:  # past JOB_LIMIT, or an agent raised: its report says which
        problems.append(f"[torchrun] the agents' run failed: {error.headline}")
        outputs, ends = [error.outputs.get(rank, "") for rank in range(2)], None
    wall, ended = time.monotonic() - start, time.time()
    cpu = _own_cpu() + _cpu_of(server or _ranks.forkserver_pid()) - cpu
    for end in ends or ():
        if end.left:
            problems.append(f"[torchrun] workers outlived their agent: {end.left}")
    problems += _forks_of_the_agents(workers, ends)
    for left in (proctable.wait_until_gone(workers), proctable.wait_until_gone(pids)):
        if left:
            problems.append(f"[torchrun] processes outlived the job: {left}")
    return Job(outputs, ends, wall, cpu, ended, problems)


def _forks_of_the_agents(workers: Path, ends: list[ForkedJob] | None) -> list[str]:
    """Each worker ran once (no restart), a fork of one agent (its memory, its parent, its
    process group: ``torchrun_in_process``), one worker per agent."""
    names = sorted(proctable.recorded(workers))
    if names != ["attempt0_rank0", "attempt0_rank1"]:
        return [f"[torchrun] the workers that ran: {names}, expected one per rank, once"]
    agents = sorted(f"{end.agent} {end.agent} {end.agent}" for end in ends or ())
    seen = sorted((workers / f"{name}.agent").read_text() for name in names)
    if ends is not None and seen != agents:
        return [f"[torchrun] workers are not forks of one agent each: {seen}, agents {agents}"]
    return []


def test_torchrun(pytester: pytest.Pytester, run_ranks) -> None:
    pids = pytester.path / "pids"
    pids.mkdir()
    (pytester.path / f"{MODULE}.py").write_text(STRANGER)
    (pytester.path / "pytest.ini").write_text(INI)
    job = run_the_job(pytester, run_ranks, pids)
    problems, outputs = job.problems, job.outputs
    reporter = next((i for i, out in enumerate(outputs) if "test session starts" in out), None)
    output = outputs[reporter] if reporter is not None else "\n".join(outputs)
    if job.wall > JOB_BOUND:
        problems.append(f"[torchrun] the job took {job.wall:.0f} s, bound {JOB_BOUND:g} s")
    exit_time = pids / "exit.time"
    if exit_time.exists() and job.ended - float(exit_time.read_text()) > AFTER_EXIT:
        problems.append(
            f"[torchrun] the job ended {job.ended - float(exit_time.read_text()):.0f} s after "
            f"rank 1's os._exit (the last test), bound {AFTER_EXIT:g} s"
        )
    # Every agent: on the node of a worker that exited 0, the job must fail too (and such an
    # agent waits in torchelastic's exit barrier, 300 s, for agents that never come).
    codes = [end.failed for end in job.agents or ()]
    if job.agents is not None and not all(f and all(f.values()) for f in codes):
        problems.append(f"[torchrun] every agent must fail; their workers failed: {codes}")
    junit = pytester.path / "torchrun.xml"
    if junit.exists():
        cases = read_junit(junit)
    else:
        cases = read_progress(output)
        problems.append(
            "[torchrun] no junit XML: verdicts below are read from the progress lines (first "
            "lines and times unknown); rank 0's output ends:\n"
            + "\n".join(output.splitlines()[-15:])
        )
    problems += _one_report(outputs, reporter)
    run = Run("torchrun", cases, output, job.wall, job.cpu, problems)
    table = {name: case for name, case in CASES.items() if name not in OWN_JOBS}
    print(report(run, table), f"workers failed: {codes}", sep="\n")
    if deviations(run, table):
        pytest.fail(report(run, table), pytrace=False)


def _rank_1_killed(codes: list[int | None]) -> bool:
    return codes[1] == -signal.SIGKILL and bool(codes[0])


def _both_failed(codes: list[int | None]) -> bool:
    return all(code is not None and code > 0 for code in codes)


@pytest.mark.parametrize(
    ("case", "codes_ok", "codes_say"),
    [
        (KILL_JOB, _rank_1_killed, "rank 1 killed, rank 0 failed"),
        (EXIT_0_JOB, _both_failed, "each failed (the session's status), neither killed"),
        (FAULT_EXIT_0_JOB, _both_failed, "each failed (the session's status), neither killed"),
    ],
    ids=["kill-on-rank-1", "os-exit-on-rank-0", "exit-fault-on-rank-0"],
)
def test_torchrun_a_leaving_worker_ends_the_job(
    pytester: pytest.Pytester, run_ranks, case: str, codes_ok, codes_say: str
) -> None:
    """c27a and c13b under torchrun, each in a job of its own, with the verdict and first
    line they have forked; the file's last test is selected too, and must be reported as not
    run (skipped, the reason named).

    c27a: the worker a fault kills first tells its peers through the job's store how it
    leaves and which fault fired, shuts its group's sockets, and waits for rank 0's report
    (``torchrun.Launched``); then it dies by SIGKILL, and the session stops after the test.
    c13b: rank 0 writes the report, so its function's ``os._exit`` ends only the function
    (``Job._exit_mid_session``): the test fails on every rank with the exit's first line,
    and the session stops after it. The workers are harness ranks (``torchrun_worker``), the
    job's store hosted here as an agent hosts it: what the workers do among themselves,
    without the agents (the main job, ``test_torchrun``, has them)."""
    pids = pytester.path / "pids"
    pids.mkdir()
    (pytester.path / f"{MODULE}.py").write_text(STRANGER)
    (pytester.path / "pytest.ini").write_text(INI)
    store = agents_store(JOB_LIMIT)
    job = {**job_environment(store, 2), "CONFORMANCE_PIDS": str(pids)}
    args = [*RUN_ARGS, "-v", "--junitxml=job.xml", "-k", f"{case} or {LAST}", f"{MODULE}.py"]
    start = time.monotonic()
    workers = run_ranks(
        pytest_as_a_torchrun_worker,
        job,
        str(pytester.path),
        args,
        world_size=2,
        backend=None,
        may_exit={0, 1},
        timeout=JOB_LIMIT,
    )
    wall = time.monotonic() - start
    problems = (
        [f"[torchrun] processes outlived the job: {left}"]
        if (left := proctable.wait_until_gone(pids))
        else []
    )
    codes = [w.exitcode for w in workers]
    if not codes_ok(codes):
        problems.append(f"[torchrun] workers exited {codes}: expected {codes_say}")
    junit = pytester.path / "job.xml"
    cases = read_junit(junit) if junit.exists() else {}
    run = Run("torchrun", cases, workers.outputs[0], wall, 0.0, problems)
    table = {case: CASES[case], LAST: Case(Expect("skipped", starts("not run: ")))}
    if deviations(run, table):
        pytest.fail(report(run, table) + "\n" + workers.outputs[0][-3000:], pytrace=False)
