"""How the harness ends a run that goes wrong: fast, with the evidence, and never by hanging.

The plain function ``run_ranks`` is used here (not the fixture) so the tests can catch and
inspect the exceptions a failing test would otherwise be reported with. Each rank function
sits above the tests that run it; ranks find it in this file.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import (
    RankCrashed,
    RankFailed,
    RankSkipped,
    RankTimeout,
    proctable,
    run_ranks,
)
from tutorial_impl.testing.call import RankFiles
from tutorial_impl.testing.diagnose import stacks
from tutorial_impl.testing.rank import main as _ranks
from tutorial_impl.testing.strategies import supervise

# A deadline far above what any of these runs needs: if a failure were only noticed at the
# deadline, the elapsed-time assertions below would catch it.
DEADLINE = 30.0
NOTICED_WELL_BEFORE_THE_DEADLINE = 10.0  # generous: this machine has 2 busy cores


def one_rank_sum(rank: int, world_size: int, pid_dir: str | None = None) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.fixture(scope="module", autouse=True)
def warm_forkserver():
    """Start the rank forkserver (it imports torch once, seconds on a busy machine) before
    the tests that time how fast a failure is noticed."""
    assert run_ranks(one_rank_sum, world_size=1) == [1.0]


def fail_on(rank: int, world_size: int, bad_rank: int, pid_dir: str | None = None) -> None:
    """``bad_rank`` raises; every other rank waits in a collective that can never finish."""
    if pid_dir is not None:
        proctable.record_self(pid_dir, f"rank{rank}")
    print(f"rank {rank} is about to {'fail' if rank == bad_rank else 'wait'}")
    dist.barrier()  # every rank has printed its line before anyone fails
    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    dist.barrier()


def test_a_raising_rank_fails_the_run_with_its_traceback(tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier that can never complete. The run must
    end with RankFailed naming rank 1, its full traceback and both ranks' prefixed output,
    long before the deadline: rank 0 is killed, not waited for."""
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(fail_on, 1, str(tmp_path), world_size=2, timeout=DEADLINE)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    assert "Traceback (most recent call last)" in err.traceback
    assert "in fail_on" in err.traceback  # the frame where it happened
    assert "ValueError: boom from rank 1" in err.traceback
    message = str(err)
    assert message.startswith("rank 1 raised ValueError: boom from rank 1\n")  # the cause first
    assert (err.exc_type, err.exc_message) == ("ValueError", "boom from rank 1")
    assert "[rank 0] rank 0 is about to wait" in message  # the *other* rank's output too
    assert "[rank 1] rank 1 is about to fail" in message
    assert err.outputs[0] == "rank 0 is about to wait\n"
    assert elapsed < NOTICED_WELL_BEFORE_THE_DEADLINE
    assert proctable.wait_until_gone(tmp_path) == {}  # rank 0 did not survive its barrier


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_failure_report_shows_where_the_other_ranks_were(tmp_path, world_size):
    """When rank 1 raises, the others are blocked in a barrier. Before they are killed,
    each one's Python stack is taken (faulthandler, SIGUSR1) and shown after rank 1's own
    traceback, which stays first: the report answers "and where were the others?"."""
    with pytest.raises(RankFailed) as info:
        run_ranks(fail_on, 1, str(tmp_path), world_size=world_size, timeout=DEADLINE)
    err = info.value
    others = [r for r in range(world_size) if r != 1]
    assert sorted(err.stacks) == others
    for rank in others:
        assert "in barrier" in err.stacks[rank]  # blocked in the collective...
        assert "in fail_on" in err.stacks[rank]  # ...called from the rank function
        assert err.stacks[rank].rstrip().endswith("in rank_main")  # harness frames cut below
    message = str(err)
    order = [
        "rank 1 raised ValueError: boom from rank 1",
        "Traceback (most recent call last)",
        f"where the other running rank(s) {', '.join(map(str, others))} were when rank 1 failed",
        "----- Python stacks of rank 0 -----",
        "----- output of the ranks",
    ]
    positions = [message.index(text) for text in order]
    assert positions == sorted(positions), message
    assert "_serve_one" not in message  # no forkserver frames
    assert proctable.wait_until_gone(tmp_path) == {}


def _reported(pid: int) -> bool:
    """Whether rank ``pid`` has sent its report: it then waits in ``signal.pause``
    (``rank.main.rank_main``). A process on a CPU reads "0" as its wait channel (a busy rank 2
    still writing its report: once taken for "reported", rank 1 died first in 3 of 8 runs at
    load); where the kernel hides wait channels (a sleeping process reads "0" too), assumed."""
    try:
        where = Path(f"/proc/{pid}/wchan").read_text()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return "pause" in where or (where in ("", "0") and state not in ("R", "D"))


def fail_two_ways(rank: int, world_size: int, second: str, mark: str) -> None:
    """Rank 2 raises first; rank 1 fails after it (raising a moment later, or dying at
    once); rank 0 is busy (in plain Python: a collective would fail too when a peer dies,
    a moment later or not). Rank 1 waits for rank 2's mark, written as it raises: under
    load rank 2 may start later than rank 1, and 50 ms of sleep did not order them."""
    if rank == 2:
        Path(mark).write_text(str(os.getpid()))
        raise KeyError("first")
    if rank == 1:
        stop = time.monotonic() + 20
        while time.monotonic() < stop and not (os.path.exists(mark) and os.path.getsize(mark)):
            time.sleep(0.005)
        if second == "dies":
            # Once rank 2 has sent its report it pauses until the parent kills it: dying
            # only then, rank 1 does not race that report (under load it once came later than
            # the grace after this death, and rank 2 went unnamed).
            while not _reported(int(Path(mark).read_text())) and time.monotonic() < stop:
                time.sleep(0.005)
            os._exit(3)  # the cause whatever the order: a death makes its peers fail
        time.sleep(0.1)  # inside the grace in which simultaneous failures are gathered
        raise ValueError("second")
    time.sleep(30)


@pytest.mark.parametrize(("second", "cause", "headline"), [
    ("raises", 2, "rank 2 raised KeyError: 'first' (rank(s) 1 failed too)"),
    ("dies", 1, "rank 1 exited with code 3 (os._exit or a crash) before returning a result "
     "(rank(s) 2 failed too)"),
])  # fmt: skip
def test_every_failing_rank_is_named_and_the_cause_comes_first(
    second, cause, headline, tmp_path, monkeypatch
):
    """Two ranks fail differently: the first to fail is the cause, unless the other died
    (a death is what makes its peers fail), and the other is named on the same first line.
    Rank 0, still busy, is where-were-the-others, not a failure. Both failures must reach the
    parent within the grace that gathers simultaneous failures: under load (15-25 on two
    cores) rank 2's report took longer than the 0.2 s grace after rank 1's death, so the
    grace is widened here; what is proved is the naming, not the grace."""
    monkeypatch.setattr(supervise, "CRASH_GRACE", 3.0)
    mark = str(tmp_path / "rank2-raised")
    with pytest.raises((RankFailed, RankCrashed)) as info:
        run_ranks(fail_two_ways, second, mark, world_size=3, timeout=DEADLINE)
    err = info.value
    assert err.headline == headline
    assert err.rank == cause and err.failed_ranks == [1, 2]
    assert sorted(err.stacks) == [0] and "in fail_two_ways" in err.stacks[0]
    other = 3 - cause
    assert f"----- rank {other} failed too: " in str(err)


def never_answers_sigusr1() -> subprocess.Popen:
    code = (
        "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"1\n"  # the handler is in place
    return child


def test_asking_for_stacks_is_bounded_even_when_a_rank_cannot_answer(tmp_path):
    """A rank that cannot answer (still starting, or dying) costs the report at most the
    budget, and shows up with an explanation instead of a stack."""
    child = never_answers_sigusr1()
    try:

        class Silent:
            rank = 3
            pid = child.pid
            stack_path = tmp_path / "rank3.stacks"

        start = time.monotonic()
        dumped = stacks.dump_stacks([Silent()], budget=0.3)
        elapsed = time.monotonic() - start
    finally:
        child.kill()
        child.wait()
    assert dumped == {3: ""}
    assert 0.3 <= elapsed < 1.0
    assert stacks.DUMP_BUDGET <= 1.0  # what a failing test may pay for its forensics
    assert "(no answer: the rank was still starting" in _errors_stacks_section(dumped)


def _errors_stacks_section(stacks):
    from tutorial_impl.testing.verdict.errors import stacks_section

    return stacks_section(stacks)


def skip_on(rank: int, world_size: int, skip_rank: int) -> None:
    if rank == skip_rank:
        pytest.skip("this rank has no work here")


def test_a_skipping_rank_skips_the_run():
    """pytest.skip in one rank, the others ending well, becomes RankSkipped (the fixture
    turns it into a skip)."""
    with pytest.raises(RankSkipped) as info:
        run_ranks(skip_on, 0, world_size=2, timeout=DEADLINE)
    assert (info.value.rank, info.value.reason) == (0, "this rank has no work here")


def sleep_forever() -> None:
    while True:
        time.sleep(0.05)


def hang_on(rank: int, world_size: int, hang_rank: int, pid_dir: str | None = None) -> None:
    """``hang_rank`` sleeps (a stand-in for a missing send); the others block in a barrier."""
    if pid_dir is not None:
        proctable.record_self(pid_dir, f"rank{rank}")
    if rank == hang_rank:
        sleep_forever()
    dist.barrier()


def test_a_hang_ends_at_the_deadline_with_every_live_rank_s_stack(tmp_path):
    """Rank 1 sleeps forever, rank 0 blocks in a barrier (in C++). At the 2 s deadline both
    must be dumped by faulthandler, so the report shows *where* each one was stuck."""
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(hang_on, 1, str(tmp_path), world_size=2, timeout=2.0)
    elapsed = time.monotonic() - start
    err = info.value
    assert sorted(err.stacks) == [0, 1]
    assert "in hang_on" in err.stacks[0] and "in hang_on" in err.stacks[1]
    assert "in sleep_forever" in err.stacks[1]  # the rank that never reached the barrier
    assert "in barrier" in err.stacks[0]  # ... and the one waiting for it
    assert "still running after the harness deadline of 2 s" in str(err)
    assert "----- Python stacks of rank 1 -----" in str(err)
    assert 2.0 <= elapsed < NOTICED_WELL_BEFORE_THE_DEADLINE
    assert proctable.wait_until_gone(tmp_path) == {}  # and then they were killed


def wait_where_the_report_can_see_it(pid_dir: str) -> None:
    """The survivor's place while its peer dies. Not a collective: gloo would notice the
    death itself and this rank would fail on its own, racing the report for the stacks."""
    with open(os.path.join(pid_dir, "survivor.waiting"), "w"):
        pass
    time.sleep(DEADLINE)


def kill_self_on(rank: int, world_size: int, bad_rank: int, pid_dir: str) -> None:
    """``bad_rank`` dies by SIGKILL, as the OOM killer would do it, once the other waits."""
    proctable.record_self(pid_dir, f"rank{rank}")
    if rank != bad_rank:
        wait_where_the_report_can_see_it(pid_dir)
    deadline = time.monotonic() + DEADLINE
    while not os.path.exists(os.path.join(pid_dir, "survivor.waiting")):
        assert time.monotonic() < deadline, "the survivor never got into place"
        time.sleep(0.01)
    with open(os.path.join(pid_dir, f"rank{rank}.killed_at"), "w") as f:
        f.write(repr(time.time()))  # when it died, to measure how soon the parent noticed
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_by_a_signal_is_noticed_at_once(tmp_path):
    """SIGKILL (the OOM killer's signal) leaves no exception and no result: the parent must
    see the process end itself, within about a second, and name the signal. The report
    also says where the survivor was at that moment."""
    with pytest.raises(RankCrashed) as info:
        run_ranks(kill_self_on, 0, str(tmp_path), world_size=2, timeout=DEADLINE)
    noticed = time.time()
    killed_at = float((tmp_path / "rank0.killed_at").read_text())
    err = info.value
    assert (err.rank, err.exitcode) == (0, -9)
    assert "rank 0 was killed by signal SIGKILL" in str(err)
    # "about a second", with slack for a loaded 2-core machine; a miss would take 30 s.
    assert noticed - killed_at < 2.0
    assert list(err.stacks) == [1] and "in wait_where_the_report_can_see_it" in err.stacks[1]
    assert str(err).index("killed by signal") < str(err).index("Python stacks of rank 1")
    assert proctable.wait_until_gone(tmp_path) == {}


def exit_on(rank: int, world_size: int, bad_rank: int, code: int, pid_dir: str) -> None:
    """``bad_rank`` leaves with ``os._exit(code)``: no exception, no result."""
    proctable.record_self(pid_dir, f"rank{rank}")
    if rank == bad_rank:
        os._exit(code)
    dist.barrier()


def test_a_rank_that_calls_os_exit_is_noticed_with_its_exit_code(tmp_path):
    """os._exit(3) skips every except/finally: again only the process's end tells."""
    start = time.monotonic()
    with pytest.raises(RankCrashed) as info:
        run_ranks(exit_on, 1, 3, str(tmp_path), world_size=2, timeout=DEADLINE)
    assert time.monotonic() - start < NOTICED_WELL_BEFORE_THE_DEADLINE
    assert (info.value.rank, info.value.exitcode) == (1, 3)
    assert "rank 1 exited with code 3" in str(info.value)
    assert proctable.wait_until_gone(tmp_path) == {}


def unpicklable_result(rank: int, world_size: int):
    return lambda: rank


def test_an_unpicklable_return_value_is_a_clear_failure():
    """A rank's return value travels by pickle; one that cannot is reported, not lost."""
    with pytest.raises(RankFailed, match="returned a value that cannot be pickled"):
        run_ranks(unpicklable_result, world_size=2, backend=None, timeout=DEADLINE)


def _in_main(rank: int, world_size: int) -> None:
    pass


_in_main.__module__ = "__main__"  # as if defined in a script run with `python script.py`


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(rank: int, world_size: int) -> None:
        return fn(rank, world_size)

    return wrapper


@_logged
def _decorated(rank: int, world_size: int) -> None:
    pass


async def _coroutine(rank: int, world_size: int) -> None:
    pass


def _generator(rank: int, world_size: int) -> Iterator[int]:
    yield rank


async def _async_gen(rank: int, world_size: int) -> AsyncIterator[int]:
    yield rank


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive integer, got 0"),
        ({"world_size": "2"}, ValueError, "world_size must be a positive integer"),
        ({"world_size": True}, ValueError, "world_size must be a positive integer"),
        ({"init_method": "udp"}, ValueError, "unknown init method 'udp'"),
        ({"backend": "glooo"}, ValueError, "unknown backend 'glooo'"),
        ({"backend": "cpu:glo"}, ValueError, "unknown backend 'cpu:glo'"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds"),
        ({"timeout": "10"}, ValueError, "timeout must be a positive number of seconds"),
        # within what the waits beneath can take (OverflowError from the store, else)
        ({"timeout": float("inf")}, ValueError, r"at most 604800 \(a week\), got inf"),
        ({"timeout": float("nan")}, ValueError, "timeout must be .*, got nan"),
        ({"timeout": 604800.5}, ValueError, "timeout must be .*, got 604800.5"),
        ({"env": ["A"]}, TypeError, r"env must be a mapping of str to str, got \['A'\]"),
        ({"env": {"A": 1}}, TypeError, "env must be a mapping of str to str"),
        ({"env": {1: "A"}}, TypeError, "env must be a mapping of str to str"),
        ({"stream": "stdout"}, TypeError, "stream must be a text stream .* got 'stdout'"),
        ({"stream": types.SimpleNamespace(write=print)}, TypeError, "with write.. and flush"),
        ({"fn": _coroutine}, TypeError, r"fn \(the rank function _coroutine\) is an async def"),
        ({"fn": _generator}, TypeError, r"fn \(the rank function _generator\) is a generator"),
        ({"fn": _async_gen}, TypeError, "is an async generator function"),
        ({"fn": functools.partial(_coroutine, 1)}, TypeError, "_coroutine.* is an async def"),
        ({"backend": "mpi", "world_size": 2}, ValueError, "each forked rank would be a world"),
        ({"fn": lambda rank, world_size: None}, TypeError, "not a module-level function"),
        ({"fn": _in_main}, TypeError, "defined in __main__"),
        ({"fn": functools.partial(lambda r, w, d: 0)}, TypeError, "not a module-level function"),
        # a signature that cannot take the call: named, with inspect's reason
        ({"args": (1, 2)}, TypeError, r"one_rank_sum\(rank, world_size, args\[0\], args\[1\]\)"),
        ({"fn_kwargs": {"x": 1}}, TypeError, "got an unexpected keyword argument 'x'"),
        ({"fn": functools.partial(one_rank_sum, 0, 1, "d")}, TypeError, "too many positional"),
        # the function under the decorator: its module holds the wrapper under that name
        ({"fn": _decorated.__wrapped__}, TypeError, "is not what its module"),
        ({"fn": 42}, TypeError, "must be callable"),
        ({"backend": "nccl", "world_size": 100}, ValueError, "needs one GPU per rank"),
        ({"args": (threading.Lock(),)}, TypeError, "cannot be sent to the ranks"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_is_refused_before_any_rank_starts(tmp_path, kwargs, error, match):
    """Mistakes in the call are reported in the parent with a message that names them,
    and no rank is started (so there is nothing that could hang)."""
    kwargs = dict(kwargs)
    fn = kwargs.pop("fn", one_rank_sum)
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


def test_a_function_of_an_interactive_session_is_refused_in_the_parent(monkeypatch):
    """``python -i`` or a notebook: ``__main__`` has no file; say so."""
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    with pytest.raises(TypeError, match=r"defined in __main__ \(an interactive session\)"):
        run_ranks(_in_main)


def test_a_function_of_a_module_without_a_file_is_refused_in_the_parent():
    """A module made up on the spot exists only in this process: no rank could load it,
    so the call is refused here, before any rank starts, saying why."""
    import types

    module = types.ModuleType("made_up_module_for_this_test")
    exec("def fn(rank, world_size):\n    return rank\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(TypeError, match="has no file"):
            run_ranks(module.fn, world_size=1, backend=None, timeout=DEADLINE)
    finally:
        del sys.modules[module.__name__]


def test_ranks_never_share_a_gpu(monkeypatch):
    """The rank side of the GPU check: with more NCCL ranks than GPUs, a rank refuses to
    start (no silent ``rank % device_count`` sharing), naming both counts."""
    spec = _ranks.RankSpec(
        rank=1,
        world_size=4,
        function=None,  # type: ignore[arg-type]
        payload=b"",
        env={},
        files=RankFiles(Path(), 1),
        backend="nccl",
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set a device"))
    with pytest.raises(RuntimeError, match="world_size 4 but 2 GPU"):
        _ranks.init_process_group(spec)


def test_reports_found_together_are_taken_in_the_order_the_ranks_ended(monkeypatch):
    """A parent behind under load finds several reports ready at once: they are ordered by
    when each rank ended (``Report.at``), not by their handles, so the first failure stays
    the cause."""
    from tutorial_impl.testing.rank import outcome

    ended = {1: 20.0, 2: 10.0, 3: 30.0}  # rank 2 first, then 1, then 3
    procs = [
        supervise.Proc(rank, types.SimpleNamespace(pid=100 + rank), None, None)  # type: ignore
        for rank in (1, 2, 3)
    ]

    def receive(p):
        return outcome.Report(outcome.Raised("ValueError", str(p.rank), ""), p.pid, ended[p.rank])

    monkeypatch.setattr(supervise, "receive", receive)
    watch = supervise._Watch(procs, None, True, frozenset())
    handles = {f"h{p.rank}": p for p in procs}
    watch.take_ready(handles, ["h1", "h3"])  # in handle order: 1, then 3
    watch.take_ready(handles, ["h2"])  # a later batch stays later
    assert watch.order == [1, 3, 2]
    watch = supervise._Watch(procs, None, True, frozenset())
    watch.take_ready(handles, ["h3", "h1", "h2", "h1"])  # one handle twice: taken once
    assert watch.order == [2, 1, 3]
