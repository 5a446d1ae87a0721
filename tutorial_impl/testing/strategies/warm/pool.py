"""Warm worlds: one set of ranks and one process group serving many tests, as good as new.

A fresh world costs every test a fork per rank and a process-group rendezvous (tens of ms
here; seconds for an NCCL communicator). Under the ``warm_world`` marker (a module's
``pytestmark`` or a class; ``warm_world(False)`` opts one test out) or ``--warm-worlds`` (every
test of the session), the ranks of a world stay alive between tests: each test's rank
function is sent to them as a *task* (the function by name, its pickled arguments, fresh log
and stack files), runs in the group the world made, and reports its outcome exactly as a
fresh rank does. Waiting (``supervise``) and the verdict (``verdict``) are the fresh runner's
own, so a failing test reads the same in a warm world as in a fresh one.

Reuse is where peers went wrong (a failure skipping the rest of a class; one stalled rank
hanging the run; leaked groups; state carried into the next test), so a world is reused only
when it is as good as new: after every task each rank checks itself (``strategies.warm.loop``) and
answers within ``CHECK_DEADLINE`` seconds (the answers are read when the world is next
wanted, so the check runs while pytest moves on). Anything wrong, and also any test that
failed (in a rank or in the parent), and the world is killed, every rank, as a fresh one
would be; the next test gets a fresh world. Nothing is skipped. Worlds are keyed by
everything that must not differ between the tests they serve (world size, backend, init
method, deadline, the ``env=`` a test asks for, torch's debug level, the visible GPUs,
coverage), at most ``MAX_WORLDS`` per pool, and all are killed when the module that used them
ends and at session end. ``docs/harness.md`` lists exactly what is reset, what is detected,
and what cannot be seen.

Not warm (the call takes the fresh path, which honours them): ``may_exit``, ``debug_rank`` /
``--rank-pdb``, ``stream``, and tests that lease GPUs.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tutorial_impl.testing import call as _call
from tutorial_impl.testing.call import Call
from tutorial_impl.testing.forkserver import server
from tutorial_impl.testing.rank import debugging
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.rendezvous import AgentStore
from tutorial_impl.testing.settings.timing import CHECK_DEADLINE
from tutorial_impl.testing.strategies import supervise
from tutorial_impl.testing.strategies.protocol import OwnRanks
from tutorial_impl.testing.strategies.warm import loop, summary
from tutorial_impl.testing.strategies.warm.summary import FAILED, WarmStats
from tutorial_impl.testing.verdict.decision import Finished

_ALL_RETURNED = pickle.dumps(loop.ALL_RETURNED)
MAX_WORLDS = 4  # warm worlds one pool keeps; the least recently used goes first
MARKER = "warm_world"
# What a warm world cannot serve: the fresh path honours these (``protocol.refusal``).
NOT_WARM: Mapping[str, str] = MappingProxyType(
    {
        "may_exit": "a rank that exits ends its warm world",
        "debug_rank": "a debugged rank holds its world",
        "stream": "warm ranks' output is read after the test",
    }
)


@dataclass(eq=False)
class World:
    """The ranks of one warm world and what they share: the store and the key."""

    key: tuple[Any, ...]
    procs: list[supervise.Proc]
    store: Any
    work: Path  # the world's own directory (file:// rendezvous, start-up logs)
    rank_env: list[dict[str, str]]
    tasks: int = 0  # tests served so far
    last_test: str | None = None  # the pytest id of the last test served, if known
    unchecked: bool = False  # the ranks' answers to the check after the last task are unread
    problem: str | None = field(default=None)  # why it was retired, if it was

    def close(self) -> None:
        supervise.LIVE.kill(self.procs)
        self.store.close()
        shutil.rmtree(self.work, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.procs]


def key_of(call: Call) -> tuple[Any, ...]:
    """What two calls must share to be served by one world."""
    return (
        call.world_size,
        call.backend,
        call.init_method,
        call.deadline,
        tuple(sorted(call.env.items())),
        os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        call.coverage is not None,
        bool(call.faults),  # a world whose group is gloo behind the fault injector
    )


class WarmPool(OwnRanks):
    """The warm worlds of one pytest session (or one benchmark): the ``warm`` strategy."""

    name = "warm"
    cannot = NOT_WARM
    serial = True  # a warm world is one set of ranks

    def __init__(self) -> None:
        self.worlds: OrderedDict[tuple[Any, ...], World] = OrderedDict()
        self.served: list[World] = []  # worlds used by the test now running
        self.stats = WarmStats()  # for the session's summary (``strategies.warm.summary``)
        self.failed_calls: list[tuple[World, bool]] = []  # and whether its ranks skipped

    def gather(self, call: Call) -> Finished:
        """``run_ranks`` in a warm world: the same call, the same evidence. A world whose
        run did not go as planned (a verdict other than a pass) is retired at once."""
        __tracebackhide__ = True
        with _call.work_dir(call) as work:
            since_ns = time.time_ns()  # the ranks' records from here on are this test's
            specs = [_call.rank_spec(call, r, work, {}) for r in range(call.world_size)]
            world = self._world_for(call, specs)
            if world.tasks:  # its ranks have answered the last check: what they record from
                since_ns = time.time_ns()  # now on is this test's (not the check's barrier)
            self.served.append(world)
            world.last_test = _current_test()
            for p, spec in zip(world.procs, specs, strict=True):
                spec.env = {**world.rank_env[p.rank], **spec.env}
                p.files = spec.files
                p.streamed, p.extra, p.quiet = 0, [], False
                if world.tasks:  # a new world was started with its first task already
                    p.conn.send_bytes(pickle.dumps(spec))
            world.tasks += 1
            try:
                deadline = debugging.Deadline(call.deadline, work)
                finished = supervise.supervise(world.procs, deadline, call, since_ns)
            except BaseException:
                self._call_failed(world, skipped=False)
                raise
            if not finished.as_planned:
                self._call_failed(world, skipped=_skipped(finished))
            else:  # the ranks check themselves now, from this word on; read before next task
                for p in world.procs:
                    p.conn.send_bytes(_ALL_RETURNED)
                world.unchecked = True
            return finished

    def _world_for(self, call: Call, specs: list[_call.RankSpec]) -> World:
        """The warm world for ``call``, or a new one started with ``specs`` as its first task."""
        key = key_of(call)
        world = self.worlds.get(key)
        if world is not None and world.unchecked:
            world.unchecked = False
            problem = checked(world)
            if problem:
                self.retire(world, problem)
                world = None
        if world is not None:
            self.worlds.move_to_end(key)
            self.stats.reuses += 1
            return world
        while len(self.worlds) >= MAX_WORLDS:
            _, oldest = self.worlds.popitem(last=False)
            oldest.close()
        world = self.worlds[key] = start_world(call, key, specs)
        self.stats.started += 1
        return world

    def retire(self, world: World, why: str | None) -> None:
        """Kill ``world``'s ranks; the next test that needs such a world gets a fresh one.
        ``why`` None: not counted yet (``_call_failed``)."""
        if self.worlds.get(world.key) is world:
            del self.worlds[world.key]
        if world.problem is None and why is not None:
            world.problem = why
            self.stats.retire(why, world.last_test)
        world.close()

    def _call_failed(self, world: World, skipped: bool) -> None:
        """A call that did not pass: its world is retired now, and counted by its test's
        verdict (``test_ended``): a test may catch a failed call (``pytest.raises``)."""
        self.retire(world, None)
        self.failed_calls.append((world, skipped))

    def test_ended(self, failed: bool) -> None:
        """The plugin's word after each test: a world that served a failed test is retired,
        and each world retired during it is counted by what happened, once per test: a test
        failed (its first world), or a call failed or skipped in a test that did not fail."""
        served, self.served = self.served, []
        calls, self.failed_calls = self.failed_calls, []
        if failed:
            worlds = list(dict.fromkeys([*(w for w, _ in calls), *served]))
            for i, world in enumerate(worlds):
                self.retire(world, FAILED if i == 0 else summary.FAILED_TOO)
            return
        for world, skipped in calls:
            self.retire(world, summary.SKIPPED if skipped else summary.CAUGHT)

    def close(self) -> None:
        """Kill every warm world of this pool (a module that used them ended; session end)."""
        while self.worlds:
            _, world = self.worlds.popitem()
            world.close()
        calls, self.failed_calls = self.failed_calls, []
        for world, _ in calls:  # no test said how it ended: a script's calls
            self.retire(world, summary.CALL_FAILED)
        self.served.clear()

    def pids(self) -> list[int]:
        """The pids of every warm rank alive in this pool's worlds."""
        return [pid for world in self.worlds.values() for pid in world.pids]


def start_world(call: Call, key: tuple[Any, ...], specs: list[_call.RankSpec]) -> World:
    """Start the ranks of a new world, each with its first task (``specs``)."""
    store = AgentStore(timeout=call.deadline)
    home = Path(tempfile.mkdtemp(prefix="warm-world-"))
    ctx = server.context()
    started: list[supervise.Proc] = []
    rank_env = [store.rank_env(rank, call.world_size) for rank in range(call.world_size)]
    try:
        for spec in specs:
            first = _call.rank_spec(
                call, spec.rank, home, rank_env[spec.rank], harness_env=store.harness_env()
            )
            first.files, first.payload = spec.files, b""
            first.forkserver = server.SERVER.address()  # for a nested run_ranks
            parent_end, rank_end = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=loop.warm_rank_main, args=(first, spec, rank_end), daemon=True
            )
            process.start()
            rank_end.close()  # only the rank holds its end: EOF then means it is gone
            supervise.LIVE.add(process.pid)
            started.append(supervise.Proc(spec.rank, process, parent_end, spec.files))
    except BaseException:
        supervise.LIVE.kill(started)
        store.close()
        shutil.rmtree(home, ignore_errors=True)
        raise
    return World(key, started, store, home, rank_env)


def _skipped(finished: Finished) -> bool:
    """Whether a call that did not pass was skipped or xfailed in its ranks (no failure)."""
    ended = (_o.Returned, _o.Skipped, _o.XFailed)
    return not any(finished.unfired.values()) and all(
        isinstance(o, ended) for o in finished.outcomes.values()
    )


def _current_test() -> str | None:
    """The id of the pytest test now running (pytest sets it for every phase), if any."""
    running = os.environ.get("PYTEST_CURRENT_TEST")
    return running.rsplit(" (", 1)[0] if running else None


def checked(world: World) -> str | None:
    """Each rank's answer to "are you as good as new?": None when all say yes in time."""
    pending = {p.conn: p for p in world.procs}
    for p in world.procs:  # answers ``supervise`` read already, after the reports
        if p.extra:
            problem = _answer(p, p.extra.pop(0))
            if problem:
                return problem
            del pending[p.conn]
    sentinels = {p.process.sentinel: p for p in world.procs}
    end = time.monotonic() + CHECK_DEADLINE + 1.0  # the ranks' own barrier deadline, and some
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            return f"ranks {sorted(p.rank for p in pending.values())} did not answer the check"
        for handle in wait([*pending, *sentinels], timeout=left):
            if handle in sentinels:
                return f"rank {sentinels[handle].rank} died after its test"
            try:
                message = pickle.loads(handle.recv_bytes())
            except (EOFError, OSError):
                return f"rank {pending[handle].rank} closed its pipe after its test"
            problem = _answer(pending[handle], message)
            if problem:
                return problem
            del pending[handle]
    return None


def _answer(p: supervise.Proc, message: Any) -> str | None:
    if message is None:
        return None
    if isinstance(message, str):
        return f"rank {p.rank}: {message}"
    return f"rank {p.rank} sent {type(message).__name__} after its report (a forked child?)"
