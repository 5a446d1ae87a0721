"""The harness keeps to itself: what it sets up applies to its own processes only.

Installing the package loads the plugin into every pytest session of the environment, so
the plugin must not change another project's process: ``os.environ`` included. The DNS
workaround (``RES_OPTIONS=use-vc``, see ``rendezvous.avoid_reverse_dns_stalls``) goes to the
ranks, and into the C environment of the process that runs them once it starts a store.
"""

from __future__ import annotations

# Imported here, in the outer pytest: pytester's in-process runs drop every module they
# imported afterwards, and torch cannot be imported twice in one process.
import os

import fresh_server
import pytest
import torch.distributed  # noqa: F401

from tutorial_impl.testing import proctable
from tutorial_impl.testing.forkserver import server as forkserver

pytest_plugins = ["pytester"]

# A stranger's project: only the installed package, no conftest.
DNS_TESTS = """
import ctypes
import os

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p


def resolver_options(rank, world_size):
    return os.environ.get("RES_OPTIONS")


def test_installing_the_plugin_changes_nothing():
    assert "RES_OPTIONS" not in os.environ


def test_ranks_get_the_workaround_and_os_environ_stays_as_it_was(run_ranks):
    assert run_ranks(resolver_options) == ["use-vc", "use-vc"]
    assert "RES_OPTIONS" not in os.environ
    # ... but glibc's resolver in this process, which hosts the store, reads it.
    assert libc.getenv(b"RES_OPTIONS") == b"use-vc"


def test_a_users_own_setting_wins(run_ranks, monkeypatch):
    monkeypatch.setenv("RES_OPTIONS", "attempts:1")
    assert run_ranks(resolver_options) == ["attempts:1", "attempts:1"]
"""


def test_the_dns_workaround_reaches_the_ranks_and_nothing_else(pytester, monkeypatch):
    monkeypatch.delenv("RES_OPTIONS", raising=False)  # our root conftest sets it for us
    pytester.makepyfile(DNS_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=3)


# Variables torch reads at import (torchenv.py), and the collective checking they enable.
COLLECTIVE_TESTS = """
import os

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import RankFailed


def mismatched(rank, world_size):
    t = torch.ones(1)
    if rank == 0:
        dist.all_reduce(t)  # rank 1 never joins this one...
    else:
        dist.broadcast(t, src=0)  # ...nor rank 0 this one: without checking, a hang


def debug_level(rank, world_size):
    return dist.get_debug_level().name


@pytest.mark.check_collectives
def test_marked(run_ranks):
    run_ranks(mismatched)


def test_set_in_the_parent_after_the_forkserver_imported_torch(run_ranks, monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    run_ranks(mismatched)


def test_unmarked(run_ranks):
    run_ranks(mismatched)


@pytest.mark.check_collectives(False)  # no "off" switch: leaving the marker out is off
def test_marker_with_an_argument(run_ranks):
    run_ranks(mismatched)


def test_each_run_gets_the_level_it_asks_for(run_ranks):
    assert run_ranks(debug_level, env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}) == ["INFO"] * 2
    assert run_ranks(debug_level) == ["OFF"] * 2


def cpp_log_level(rank, world_size):
    return os.environ.get("TORCH_CPP_LOG_LEVEL")


def test_a_variable_read_only_at_import_is_refused(run_ranks, monkeypatch):
    with pytest.raises(RankFailed, match="TORCH_CPP_LOG_LEVEL='INFO' cannot take effect"):
        run_ranks(debug_level, env={"TORCH_CPP_LOG_LEVEL": "INFO"})
    # Set in the parent since torch was imported, it is not what the rank's torch uses.
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    assert run_ranks(cpp_log_level) == [None, None]
"""


def test_mismatched_collectives_fail_in_seconds_naming_both(pytester, monkeypatch):
    """A 10 s deadline: a mismatch that were not caught would be reported as a timeout."""
    for name in ("TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(COLLECTIVE_TESTS)
    plain = ("-p", "no:cacheprovider", "-p", "no:randomly", "--rank-timeout", "10")
    result = pytester.runpytest(*plain, "-k", "not unmarked")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.check_collectives(False): takes no arguments; accepted:*"]
    )
    result.stdout.fnmatch_lines(["FAILED *::test_marked*", "FAILED *::test_set_in_the_parent*"])
    text = result.stdout.str()
    assert text.count("Detected mismatch between collectives") >= 2
    assert "ALLREDUCE" in text and "BROADCAST" in text
    assert "deadline" not in text.lower() and "timed out" not in text.lower()
    # The option does for every test what the marker does for one.
    checked = pytester.runpytest(*plain, "--check-collectives", "-k", "unmarked")
    checked.assert_outcomes(failed=1)
    assert "Detected mismatch between collectives" in checked.stdout.str()


# multiprocessing's own forkserver started first, by the test, in a session whose rank
# forkserver is not started yet (a fresh ``forkserver.SERVER``, as a new pytest process has).
POOL_FIRST_TESTS = """
import gc
import multiprocessing as mp
import os
import sys
from multiprocessing import forkserver

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing.forkserver import server as rank_server
from tutorial_impl.testing import proctable

import scanned_probe  # imported by this file: the forkserver preloads it, nobody naming it


def facts(rank, world_size, pid_dir):
    import preloaded_probe, second_probe  # rank_preload, given twice with -o

    proctable.record(pid_dir, f"forkserver{rank}", os.getppid())
    proctable.record_self(pid_dir, f"rank{rank}")
    return {
        "server": os.getppid(),
        "preloaded_in": {
            module.IMPORTED_IN for module in (preloaded_probe, second_probe, scanned_probe)
        },
        "death_chain": "tutorial_impl.testing.forkserver.boot" in sys.modules,
        "frozen": gc.get_freeze_count() > 0,
    }


# The first test waits for the whole server start (torch, then torch._dynamo for the DDP
# tests below, probed and imported: some 7 s of CPU), which at a load of 25 on 2 cores took
# more than the suite's 120 s.
@pytest.mark.timeout(600)
def test_a_pool_starts_the_global_forkserver_before_any_rank(run_ranks, tmp_path):
    assert rank_server.forkserver_pid() is None  # the rank forkserver is not started yet
    with mp.get_context("forkserver").Pool(1) as pool:
        assert pool.map(abs, [-3]) == [3]
    global_server = forkserver._forkserver._forkserver_pid
    assert global_server is not None  # multiprocessing's own server is up now
    for got in run_ranks(facts, os.environ["PID_DIR"]):
        assert got["server"] == rank_server.forkserver_pid() != global_server  # ours...
        assert got["preloaded_in"] == {got["server"]}  # ...which did the preloads,
        assert got["death_chain"] and got["frozen"]  # the death chain and gc.freeze


def mismatched(rank, world_size):
    t = torch.ones(1)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def test_unmarked(run_ranks):
    run_ranks(mismatched)


def train_step(rank, world_size):
    # Whether torch's lazy import of dynamo (by DDP's and AdamW's constructors) was done once,
    # by the forkserver, before this rank: nothing named it, this file only uses DDP.
    preloaded = "torch._dynamo" in sys.modules
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    optimizer.step()
    return preloaded, model.module.weight.detach().tolist()


# Not under the session's --check-collectives: DDP's constructor dies of SIGSEGV in torch's
# ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL), preloaded or not (torch 2.13, CPU).
UNCHECKED = {"TORCH_DISTRIBUTED_DEBUG": "OFF"}


def test_a_training_step_finds_what_torch_imports_for_it_preloaded(run_ranks):
    (first, weights), *others = run_ranks(train_step, env=UNCHECKED)
    assert first and others == [(True, weights)]


@pytest.mark.warm_world
def test_the_step_in_a_warm_world_keeps_it(run_ranks):
    for _ in range(2):  # and the world is reused, not retired (the summary's line)
        (first, weights), *others = run_ranks(train_step, env=UNCHECKED)
        assert first and others == [(True, weights)]
"""


@pytest.fixture
def fresh_rank_server(monkeypatch):
    """A rank forkserver not yet started, as in a new pytest process (``fresh_server``)."""
    with fresh_server.swapped(monkeypatch) as server:
        yield server


@pytest.mark.slow
def test_a_global_forkserver_started_first_leaves_the_harness_its_guarantees(
    pytester, tmp_path, monkeypatch, fresh_rank_server
):
    """A pytest session (in-process, with a rank forkserver of its own to start) whose first
    test starts multiprocessing's forkserver with a Pool; it also runs with
    --check-collectives, for the option's sake, and shows the session's forkserver importing
    what its test file imports, both ``-o rank_preload`` values, and what torch imports once
    a rank builds DDP and an optimizer (``importscan.LAZY``), fresh and warm, unnamed."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv("PID_DIR", str(pid_dir))
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    pytester.makepyfile(test_pool_first=POOL_FIRST_TESTS)
    probe = "import os\n\nIMPORTED_IN = os.getpid()\n"
    pytester.makepyfile(preloaded_probe=probe, second_probe=probe, scanned_probe=probe)
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "--rank-timeout", "10",
        "--check-collectives", "-o", "rank_preload=preloaded_probe",
        "-o", "rank_preload=second_probe",
        # The claim needs the Pool first: no rank forkserver started behind collection.
        "-o", "rank_forkserver_early=false",
    )  # fmt: skip
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["FAILED *::test_unmarked*"])
    result.stdout.fnmatch_lines(["*warm worlds: 1 started, 1 reuses, 0 retired*"])
    assert "Detected mismatch between collectives" in result.stdout.str()
    # Once the server is stopped (as when pytest exits), its ranks and itself are gone.
    assert set(proctable.recorded(pid_dir)) == {"rank0", "rank1", "forkserver0", "forkserver1"}
    fresh_rank_server.server._stop()
    assert proctable.wait_until_gone(pid_dir, 10.0) == {}


def test_a_worker_that_cannot_reach_the_shared_forkserver_starts_its_own(monkeypatch, tmp_path):
    """Under xdist a worker's ranks come from the controller's forkserver (``forkserver.py``).
    Should that server be unreachable (its socket gone), the worker must not fail or hang:
    it starts a server of its own and says so, once, as a warning. The real server is not
    started here (it would cost a torch import): a stand-in records that it was asked for
    the rank instead."""
    asked = []

    class OwnServer:
        def connect_to_new_process(self, fds):
            asked.append(fds)
            return "sentinel", "pipe"

    server = forkserver.RankServer()  # this process's own stays untouched
    monkeypatch.setattr(forkserver, "SERVER", server)
    monkeypatch.setattr(server, "_own_server", OwnServer)
    shared = {"address": str(tmp_path / "no-such-socket"), "pid": 0, "authkey": None}
    unreachable = forkserver._SharedForkServer(shared)
    try:
        with pytest.warns(forkserver.ForkServerFallbackWarning, match="could not be reached"):
            assert unreachable.connect_to_new_process([]) == ("sentinel", "pipe")
    finally:
        os.close(unreachable._forkserver_alive_fd)
    assert asked == [[]]  # the rank was asked of the worker's own server...
    assert isinstance(server.server, OwnServer)  # ...which serves every rank from now on
