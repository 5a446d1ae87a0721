"""How the harness ends a run that goes wrong: fast, with the evidence, and never by hanging.

The plain function ``run_ranks`` is used here (not the fixture) so the tests can catch and
inspect the exceptions a failing test would otherwise be reported with.
"""

from __future__ import annotations

import threading
import time

import pytest

from tutorial_impl.testing import (
    RankCrashed,
    RankFailed,
    RankSkipped,
    RankTimeout,
    proctable,
    run_ranks,
)
from tutorial_impl.testing import ranks as _ranks
from tutorial_impl.testing import selftest_ranks as sr

# A deadline far above what any of these runs needs: if a failure were only noticed at the
# deadline, the elapsed-time assertions below would catch it.
DEADLINE = 30.0
NOTICED_WELL_BEFORE_THE_DEADLINE = 10.0  # generous: this machine has 2 busy cores


@pytest.fixture(scope="module", autouse=True)
def warm_forkserver():
    """Start the rank forkserver (it imports torch once, seconds on a busy machine) before
    the tests that time how fast a failure is noticed."""
    assert run_ranks(sr.all_reduce_rank, world_size=1) == [1.0]


def test_a_raising_rank_fails_the_run_with_its_traceback(tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier that can never complete. The run must
    end with RankFailed naming rank 1, its full traceback and both ranks' prefixed output,
    long before the deadline: rank 0 is killed, not waited for."""
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(sr.fail_on, 1, str(tmp_path), world_size=2, timeout=DEADLINE)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    assert "Traceback (most recent call last)" in err.traceback
    assert "in fail_on" in err.traceback  # the frame where it happened
    assert "ValueError: boom from rank 1" in err.traceback
    message = str(err)
    assert message.startswith("rank 1 raised:")
    assert "[rank 0] rank 0 is about to wait" in message  # the *other* rank's output too
    assert "[rank 1] rank 1 is about to fail" in message
    assert err.outputs[0] == "rank 0 is about to wait\n"
    assert elapsed < NOTICED_WELL_BEFORE_THE_DEADLINE
    assert proctable.wait_until_gone(tmp_path) == {}  # rank 0 did not survive its barrier


def test_a_skipping_rank_skips_the_run():
    """pytest.skip in one rank becomes RankSkipped (the fixture turns it into a skip)."""
    with pytest.raises(RankSkipped) as info:
        run_ranks(sr.skip_on, 0, world_size=2, timeout=DEADLINE)
    assert (info.value.rank, info.value.reason) == (0, "this rank has no work here")


def test_a_hang_ends_at_the_deadline_with_every_live_rank_s_stack(tmp_path):
    """Rank 1 sleeps forever, rank 0 blocks in a barrier (in C++). At the 2 s deadline both
    must be dumped by faulthandler, so the report shows *where* each one was stuck."""
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(sr.hang_on, 1, str(tmp_path), world_size=2, timeout=2.0)
    elapsed = time.monotonic() - start
    err = info.value
    assert sorted(err.stacks) == [0, 1]
    assert "in hang_on" in err.stacks[0] and "in hang_on" in err.stacks[1]
    assert "in _sleep_forever" in err.stacks[1]  # the rank that never reached the barrier
    assert "in barrier" in err.stacks[0]  # ... and the one waiting for it
    assert "still running after the harness deadline of 2 s" in str(err)
    assert "----- Python stacks of rank 1 -----" in str(err)
    assert 2.0 <= elapsed < NOTICED_WELL_BEFORE_THE_DEADLINE
    assert proctable.wait_until_gone(tmp_path) == {}  # and then they were killed


def test_a_rank_killed_by_a_signal_is_noticed_at_once(tmp_path):
    """SIGKILL (the OOM killer's signal) leaves no exception and no result: the parent must
    see the process end itself, within about a second, and name the signal."""
    with pytest.raises(RankCrashed) as info:
        run_ranks(sr.kill_self_on, 0, str(tmp_path), world_size=2, timeout=DEADLINE)
    noticed = time.time()
    killed_at = float((tmp_path / "rank0.killed_at").read_text())
    err = info.value
    assert (err.rank, err.exitcode) == (0, -9)
    assert "rank 0 was killed by signal SIGKILL" in str(err)
    # "about a second", with slack for a loaded 2-core machine; a miss would take 30 s.
    assert noticed - killed_at < 2.0
    assert proctable.wait_until_gone(tmp_path) == {}


def test_a_rank_that_calls_os_exit_is_noticed_with_its_exit_code(tmp_path):
    """os._exit(3) skips every except/finally: again only the process's end tells."""
    start = time.monotonic()
    with pytest.raises(RankCrashed) as info:
        run_ranks(sr.exit_on, 1, 3, str(tmp_path), world_size=2, timeout=DEADLINE)
    assert time.monotonic() - start < NOTICED_WELL_BEFORE_THE_DEADLINE
    assert (info.value.rank, info.value.exitcode) == (1, 3)
    assert "rank 1 exited with code 3" in str(info.value)
    assert proctable.wait_until_gone(tmp_path) == {}


def test_an_unpicklable_return_value_is_a_clear_failure():
    """A rank's return value travels by pickle; one that cannot is reported, not lost."""
    with pytest.raises(RankFailed, match="returned a value that cannot be pickled"):
        run_ranks(sr.unpicklable_result, world_size=2, backend=None, timeout=DEADLINE)


def _nested_function(rank: int, world_size: int) -> None:
    pass


def _in_main(rank: int, world_size: int) -> None:
    pass


_in_main.__module__ = "__main__"  # as if defined in a script run with `python script.py`


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive integer, got 0"),
        ({"world_size": "2"}, ValueError, "world_size must be a positive integer"),
        ({"world_size": True}, ValueError, "world_size must be a positive integer"),
        ({"init_method": "udp"}, ValueError, "unknown init method 'udp'"),
        ({"backend": "glooo"}, ValueError, "unknown backend 'glooo'"),
        ({"backend": "cpu:glo"}, ValueError, "unknown backend 'cpu:glo'"),
        ({"timeout": 0}, ValueError, "timeout must be positive"),
        ({"fn": lambda rank, world_size: None}, TypeError, "not a module-level function"),
        ({"fn": _in_main}, TypeError, "defined in __main__"),
        ({"fn": 42}, TypeError, "must be callable"),
        ({"args": (threading.Lock(),)}, TypeError, "cannot be sent to the ranks"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_is_refused_before_any_rank_starts(tmp_path, kwargs, error, match):
    """Mistakes in the call are reported in the parent with a message that names them,
    and no rank is started (so there is nothing that could hang)."""
    kwargs = dict(kwargs)
    fn = kwargs.pop("fn", sr.all_reduce_rank)
    args = kwargs.pop("args", (str(tmp_path),))
    start = time.monotonic()
    with pytest.raises(error, match=match):
        run_ranks(fn, *args, log_dir=tmp_path / "logs", **kwargs)
    assert time.monotonic() - start < 1.0
    assert not (tmp_path / "logs").exists()  # no rank got as far as its log file
    assert proctable.recorded(tmp_path) == {}


@pytest.mark.parametrize(
    ("backend", "nccl"),
    [
        ("nccl", True),
        ("cpu:gloo,cuda:nccl", True),
        ("cpu:gloo, cuda:NCCL", True),
        ("gloo", False),
        ("cpu:gloo", False),
        (None, False),
    ],
)
def test_every_backend_string_that_names_nccl_counts_as_nccl(backend, nccl):
    """Ranks pick their GPU before init, and tests without enough GPUs are skipped, for the
    per-device forms ``run_ranks`` accepts too, not only for a plain ``"nccl"``."""
    assert _ranks.uses_nccl(backend) is nccl


def test_a_nested_function_is_refused():
    def inner(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="not a module-level function"):
        run_ranks(inner)


def test_a_rank_function_whose_module_the_rank_cannot_import():
    """A function whose module exists only in the parent (here: a module object made up
    on the spot) fails in the rank with a message that says where functions must live."""
    import types

    module = types.ModuleType("made_up_module_for_this_test")
    exec("def fn(rank, world_size):\n    return rank\n", module.__dict__)
    with pytest.raises(RankFailed, match="rank cannot import the module of its function"):
        run_ranks(module.fn, world_size=1, backend=None, timeout=DEADLINE)
