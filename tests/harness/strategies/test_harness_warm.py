"""Warm worlds (``tutorial_impl/testing/strategies/warm/pool.py``): reused only when as good as new.

A warm world keeps its ranks between tests, so the danger is a test that poisons it: fails,
hangs, kills a rank, or leaves a process group, an RPC agent, a thread, a child process or an
``irecv`` nobody sends to behind, or replaces the default group. The promise: the *next* test
in that warm world runs in a fresh world and passes, nothing is skipped, and no rank outlives
the run.

The proof is one pytest run of a stranger's project (only the installed package, no
conftest): every rank records its pid and start time (``proctable``), the poisoning tests
alternate with a plain test, and afterwards we read, from those records and the OS process
table, which tests shared ranks and whether any rank is still alive.
"""

from __future__ import annotations

import pytest
import torch  # noqa: F401 - before any in-process pytester run (see below)

from tutorial_impl.testing import call, proctable
from tutorial_impl.testing.strategies import protocol
from tutorial_impl.testing.strategies.forked import FORKED
from tutorial_impl.testing.strategies.warm import pool as warm

# pytester restores sys.modules after each in-process run: torch must have been imported
# before the first, or the next run imports its C extension a second time and crashes.

pytest_plugins = ["pytester"]

POISONED = """
import os, signal, subprocess, threading, time
import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from tutorial_impl.testing import proctable
from tutorial_impl.testing.rendezvous import rpc_init_method

# One deadline for all: worlds are keyed by it, and the hanging test must end soon.
pytestmark = [pytest.mark.warm_world, pytest.mark.rank_timeout(3)]
PIDS = os.environ["WARM_PIDS"]

def note(rank, name):
    proctable.record(PIDS, f"{name}.{rank}", os.getpid())

def plain(rank, world_size, name):
    note(rank, name)
    dist.barrier()
    return rank

def poison(rank, world_size, how, tmp):
    note(rank, how)
    dist.barrier()  # both ranks are recorded before anything goes wrong
    if how == "fails":
        raise ValueError("boom")
    if how == "hangs" and rank == 1:
        time.sleep(600)
    if how == "kills" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "group":
        dist.new_group([0, 1])
    if how == "rpc":
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method=rpc_init_method()))
    if how == "child":
        proctable.record(PIDS, f"child-process.{rank}", subprocess.Popen(["sleep", "600"]).pid)
    if how == "thread":
        threading.Thread(target=time.sleep, args=(600,)).start()
    if how == "irecv" and rank == 0:
        dist.irecv(torch.zeros(1), src=1)  # never waited, and rank 1 sends nothing
    if how == "async" and rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited, rank 1 never joins it
    if how == "skips" and rank == 1:
        return rank  # rank 0 waits in a barrier rank 1 never enters: no check may answer it
    if how == "skips":
        dist.barrier()
    if how == "mesh":  # torch's groups for a mesh (tp: one each) go with the test
        from torch.distributed.device_mesh import init_device_mesh
        init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["tp"].get_group()
    if how == "default":
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{tmp}/default", rank=rank,
                                world_size=world_size)
    return rank

def test_00_plain(run_ranks):
    assert run_ranks(plain, "00_plain") == [0, 1]

def test_01_plain_again(run_ranks):
    assert run_ranks(plain, "01_plain_again") == [0, 1]

@pytest.mark.warm_world(False)
def test_02_opted_out(run_ranks):
    assert run_ranks(plain, "02_opted_out") == [0, 1]

HOW = ["fails", "hangs", "kills", "group", "rpc", "thread", "irecv", "async", "child", "default",
       "skips", "mesh", "parent"]

@pytest.mark.parametrize("how", HOW)
def test_10_poison_then_next(run_ranks, how, tmp_path):
    run_ranks(plain, f"before_{how}")
    if how == "parent":  # the ranks pass, the test fails in the parent
        run_ranks(plain, "parent")
        assert False, "the parent fails this test"
    run_ranks(poison, how, str(tmp_path))

@pytest.mark.parametrize("how", HOW)
def test_11_after(run_ranks, how):
    assert run_ranks(plain, f"after_{how}") == [0, 1]
"""

# The poisoning tests that fail as such; the others pass and leave their world dirty.
FAILING = {"fails", "hangs", "kills", "skips", "parent"}
CLEAN = {"mesh"}  # passes, and leaves nothing a fresh world would not have: the world is kept
HOW = [
    "fails",
    "hangs",
    "kills",
    "group",
    "rpc",
    "thread",
    "irecv",
    "async",
    "child",
    "default",
    "skips",
    "mesh",
    "parent",
]


def forked(rank, world_size):
    return rank


@pytest.mark.slow
def test_a_poisoned_warm_world_is_replaced_and_nothing_is_skipped_or_left(
    pytester, tmp_path, run_ranks
):
    # This session's rank forkserver starts now, with this session's plan: started by the run
    # below, it would keep that run's plan (and numpy state) for this session's later tests.
    assert run_ranks(forked, world_size=1, backend=None) == [0]
    pids = tmp_path / "pids"
    pids.mkdir()
    pytester.makepyfile(test_poison=POISONED)
    # Order: test_10[x] then test_11[x] for each x (so each 'after' follows its poison).
    order = []
    for how in HOW:
        order += [f"test_poison.py::test_10_poison_then_next[{how}]"]
        order += [f"test_poison.py::test_11_after[{how}]"]
    args = ["test_poison.py::test_00_plain", "test_poison.py::test_01_plain_again"]
    args += ["test_poison.py::test_02_opted_out", *order]
    # In this process: its ranks come from the forkserver this session has (a subprocess
    # would import torch and start a server of its own, seconds of CPU).
    result = pytester.runpytest_inprocess(
        "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:xdist", *args
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    # Nothing skipped: each poisoning test that fails is reported as failed, the rest pass.
    assert outcomes.get("skipped", 0) == 0, result.stdout.str()
    assert outcomes.get("failed") == len(FAILING), result.stdout.str()
    assert outcomes.get("passed") == 3 + 2 * len(HOW) - len(FAILING), result.stdout.str()
    out = result.stdout.str()
    # ... each with the report a fresh world gives: the cause first.
    assert "rank 0 raised ValueError: boom" in out or "raised ValueError: boom" in out
    assert "RankTimeout" in out or "deadline" in out
    assert "SIGKILL" in out
    assert "rank 1 returned after barrier #1; rank 0 waits in barrier #2" in out  # skips

    record = {name: pid for name, (pid, _) in proctable.recorded(pids).items()}

    def world(name: str) -> tuple[int, int]:
        return record[f"{name}.0"], record[f"{name}.1"]

    # Warm really is warm: the second plain test ran in the first one's ranks ...
    assert world("00_plain") == world("01_plain_again")
    # ... and warm_world(False) gave its test fresh ranks.
    assert not set(world("02_opted_out")) & set(world("00_plain"))
    for how in HOW[:-1]:  # all but "parent"
        # The poison ran in the world that served the test before it (it was warm) ...
        assert world(how) == world(f"before_{how}"), how
        # ... and the next test got fresh ranks (the same, where it was clean), and passed.
        assert (world(f"after_{how}") == world(how)) == (how in CLEAN), how
        assert how in CLEAN or not set(world(f"after_{how}")) & set(world(how)), how
    assert world("parent") == world("before_parent")
    assert not set(world("after_parent")) & set(world("parent"))
    # No rank outlives the run.
    assert proctable.wait_until_gone(pids) == {}


@pytest.fixture(autouse=True)
def _pid_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_PIDS", str(tmp_path / "pids"))


def test_only_calls_a_warm_world_can_serve_run_warm():
    # may_exit, debug_rank and stream change how ranks are run or watched: fresh worlds,
    # and the refusal names the field.
    pool = warm.WarmPool()
    assert protocol.refusal(pool, call.build(len, world_size=2, env={}, timeout=5.0)) is None
    for field, value in (
        ("may_exit", {1}),
        ("debug_rank", 0),
        ("stream", __import__("io").StringIO()),
    ):
        built = call.build(len, **{field: value})
        refusal = protocol.refusal(pool, built)
        assert refusal is not None and refusal.startswith(field), refusal
        assert protocol.choose([pool, FORKED], built) is FORKED  # the fresh path honours it


def test_worlds_are_keyed_by_what_must_not_differ(monkeypatch):
    def key(**options):
        fields = dict(world_size=2, backend="gloo", init_method="env", timeout=60.0, env=None)
        fields.update(options)
        return warm.key_of(call.build(len, **fields))

    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    plain = key()
    assert key() == plain
    for different in (
        {"world_size": 3},
        {"env": {"A": "1"}},
        {"timeout": 5.0},
        {"init_method": "file"},  # a warm test asking for file:// must not run on env://
        {"backend": None},
    ):
        assert key(**different) != plain, different
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # torch reads it at group init
    assert key() != plain


MISUSED = """
import pytest

def one(rank, world_size):
    return rank

@pytest.mark.warm_world("yes")
def test_misused(run_ranks):
    run_ranks(one)
"""


def test_a_misused_marker_fails_its_test_naming_it(pytester):
    pytester.makepyfile(test_misused=MISUSED)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)  # in setup, before any rank starts
    result.stdout.fnmatch_lines(["*warm_world('yes'): takes one True or False*"])


def test_a_bad_call_is_refused_before_any_world_starts():
    pool = warm.WarmPool()
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        protocol.run(pool, call.build(len, world_size=0))
    assert pool.pids() == []


# What a warm world cannot see (state two levels deep in a module), --warm-audit catches: every
# warm call runs fresh too, and a verdict that differs fails the test.
NESTED = """
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.warm_world
STATE = {"inner": {}}  # one level deeper than a warm rank looks


def fill(rank, world_size):
    STATE["inner"]["k"] = rank
    return rank


def read(rank, world_size):
    return STATE["inner"]["k"]


def test_fills(run_ranks):
    assert run_ranks(fill) == [0, 1]


def test_reads(run_ranks):
    assert run_ranks(read) == [0, 1]


def same_error(rank, world_size):
    raise ValueError("the same on every rank")


def test_fails_alike(run_ranks):  # which rank's report comes first is a race, not a verdict
    run_ranks(same_error)


def skips_the_barrier(rank, world_size):
    if rank == 1:
        return
    dist.barrier()


def test_skips_a_barrier(run_ranks):  # stranded warm as fresh: no warm state to blame
    run_ranks(skips_the_barrier)
"""


def test_warm_audit_catches_what_a_warm_world_cannot_see(pytester, run_ranks):
    assert run_ranks(forked, world_size=1, backend=None) == [0]  # as above: this session's
    pytester.makepyfile(test_nested=NESTED)
    args = ["-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:xdist"]
    # Warm alone, the second test passes on the state the first left (a documented blind
    # spot); audited, it fails saying both verdicts.
    pytester.runpytest_inprocess(*args).assert_outcomes(passed=2, failed=2)
    audited = pytester.runpytest_inprocess(*args, "--warm-audit")
    audited.assert_outcomes(passed=1, failed=3)
    audited.stdout.fnmatch_lines(
        [
            "*WarmAuditError: --warm-audit: the warm world's verdict (passed) differs from "
            "fresh ranks' (failed, rank 0 raised KeyError: 'k', rank 1 raised KeyError: 'k')*",
            "FAILED test_nested.py::test_reads - --warm-audit*",
            "FAILED test_nested.py::test_fails_alike - rank ? raised ValueError: the same*",
            "FAILED test_nested.py::test_skips_a_barrier - rank 1 returned before any *",
        ]
    )


def _failed(outcomes: dict) -> BaseException:
    """The error ``decide`` gives a run whose ranks ended as ``outcomes`` (0 reported first)."""
    from tutorial_impl.testing.rank import outcome as _o
    from tutorial_impl.testing.verdict.decision import Finished, decide
    from tutorial_impl.testing.verdict.errors import RankError

    reports = {r: _o.Report(o, pid=100 + r, at=0.0) for r, o in outcomes.items()}
    with pytest.raises(RankError) as caught:
        decide(Finished(len(outcomes), reports, sorted(outcomes), {}, deadline=60.0))
    return caught.value


def test_the_audit_lets_a_late_report_be_a_stop_but_no_other_difference():
    """Two ranks raise the same error; under load one report comes after the others' failure
    and the grace, and that rank is stopped: the same test, not a carried-over state (this
    was a ``WarmAuditError``). Another error, or a return where a rank raised, still differs."""
    from tutorial_impl.testing.rank import outcome as _o
    from tutorial_impl.testing.verdict.agree import Verdict, WarmAuditError, agree

    def raised(message: str) -> _o.Raised:
        return _o.Raised("KeyError", message, f"Traceback (most recent call last):\n{message}\n")

    both = _failed({0: raised("'k'"), 1: raised("'k'")})
    pairs = {  # fresh run's ranks -> whether it agrees with ``both`` (the warm run)
        "rank 1 late": ({0: raised("'k'"), 1: _o.Stopped(None)}, True),
        "rank 0 late": ({0: _o.Stopped(None), 1: raised("'k'")}, True),
        "another error": ({0: _o.Stopped(None), 1: raised("'j'")}, False),
        "one returned": ({0: raised("'k'"), 1: _o.Returned(1)}, False),
        "its own error": ({0: raised("'k'"), 1: raised("'j'")}, False),
    }
    for case, (fresh, agrees) in pairs.items():
        verdict = agree(Verdict(None, both), Verdict(None, _failed(fresh)))
        assert (verdict.error is both) == agrees, case
        assert agrees or isinstance(verdict.error, WarmAuditError), case
    # Two stopped runs with nothing of their own in common are not the same failure; nor a
    # run with a failure of its own and one with none (a stop, a lost connection).
    crossed = _failed({0: raised("'k'"), 1: _o.Stopped(None)})
    other = _failed({0: _o.Stopped(None), 1: raised("'j'")})
    closed = _o.Raised("RuntimeError", "Connection closed by peer [127.0.0.1]:1", "tb")
    echoed = _failed({0: _o.Stopped(None), 1: closed})
    for fresh in (other, echoed):
        assert isinstance(agree(Verdict(None, crossed), Verdict(None, fresh)).error, WarmAuditError)
    # An error without every rank's ending (no verdict made it) is compared as before.
    from tutorial_impl.testing.verdict.errors import RankFailed

    bare = RankFailed(1, "tb", "rank 1 raised KeyError: 'k'", {}, exc_type="KeyError")
    assert isinstance(agree(Verdict(None, crossed), Verdict(None, bare)).error, WarmAuditError)


def test_the_summary_counts_a_failed_test_once_and_a_caught_call_apart(tmp_path):
    """Worlds retired for calls are counted by their test's verdict: a failed test once,
    however many of its calls failed; a call that failed or skipped in a test that did not
    fail, under its own reason (they were all "a test failed")."""
    from types import SimpleNamespace

    from tutorial_impl.testing.strategies.warm import summary

    pool = warm.WarmPool()
    closed = []

    def world(n: int) -> warm.World:
        store = SimpleNamespace(close=lambda: closed.append(n))
        return warm.World((n,), [], store, tmp_path / str(n), [])

    first, second = world(1), world(2)
    pool.worlds[first.key] = first
    pool._call_failed(first, skipped=False)  # a failed call: its world is gone at once ...
    assert pool.worlds == {} and closed == [1] and first.problem is None  # ... counted later
    pool.served += [first, second]  # ... and a world that served the same test
    pool.test_ended(failed=True)
    assert (first.problem, second.problem) == (summary.FAILED, summary.FAILED_TOO)
    pool._call_failed(world(3), skipped=False)  # in pytest.raises: the test passes
    pool.test_ended(failed=False)
    pool._call_failed(world(4), skipped=True)  # every rank skipped
    pool.test_ended(failed=False)
    pool._call_failed(world(5), skipped=False)  # a script: no test ever ends
    pool.close()
    assert pool.stats.retired == {
        summary.FAILED: 1,
        summary.FAILED_TOO: 1,
        summary.CAUGHT: 1,
        summary.SKIPPED: 1,
        summary.CALL_FAILED: 1,
    }
