"""Fresh ranks for every call: the default strategy, and the public ``run_ranks``.

``run_ranks(fn, *args, world_size=2)`` forks ``world_size`` ranks from the forkserver, each
joins a process group on a store the parent owns (``rendezvous``), runs ``fn`` through the
one rank-side capture, and reports; ``supervise`` waits for them, ``verdict`` decides
(``protocol.run``), and a ``finally`` kills every rank's process group whatever happened,
Ctrl-C included. During a
pytest test's body, ``run_ranks`` hands the call to that test's own (``IN_TEST``, set by the
plugin: ``fixtures.in_test``; ``RUNNING`` for a thread the test started), so a helper that
calls it runs with the test's settings.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Any, ParamSpec, TextIO

from tutorial_impl.testing import call as _call
from tutorial_impl.testing.call import Call
from tutorial_impl.testing.faults.plan import Fault
from tutorial_impl.testing.forkserver import server
from tutorial_impl.testing.rank import debugging, leftovers, main
from tutorial_impl.testing.rank.outcome import IN_RANK
from tutorial_impl.testing.rendezvous import AgentStore
from tutorial_impl.testing.settings.config import (
    DEFAULT_BACKEND,
    DEFAULT_DEADLINE,
    DEFAULT_INIT_METHOD,
    DEFAULT_WORLD_SIZE,
)
from tutorial_impl.testing.strategies import protocol, supervise
from tutorial_impl.testing.verdict.decision import Finished
from tutorial_impl.testing.verdict.errors import RankError, RankResults

P = ParamSpec("P")


class Forked(protocol.OwnRanks):
    """Fresh ranks per call: honours every field of a call, keeps nothing between calls."""

    name = "forked"
    cannot: Mapping[str, str] = MappingProxyType({})
    serial = False  # fresh ranks may run side by side for the threads of one test

    def gather(self, call: Call) -> Finished:
        __tracebackhide__ = True
        with _call.work_dir(call) as work:
            return self._gather_in(call, work)

    def test_ended(self, failed: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def _gather_in(self, call: Call, work: Path) -> Finished:
        __tracebackhide__ = True
        debugging.forget(work)  # an earlier run's debugger files would pause this deadline
        store = AgentStore(timeout=call.deadline)
        started: list[supervise.Proc] = []
        try:
            for r in range(call.world_size):
                rank_env = store.rank_env(r, call.world_size)
                spec = _call.rank_spec(call, r, work, rank_env, harness_env=store.harness_env())
                spec.env.update(call.debug_env)
                started.append(start(spec))
            announce = (call.announce or _to_stderr) if call.debug_rank is not None else None
            deadline = debugging.Deadline(call.deadline, work, announce)
            return supervise.supervise(started, deadline, call)
        finally:
            supervise.LIVE.kill(started)
            store.close()


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start(spec: _call.RankSpec) -> supervise.Proc:
    """Fork one fresh rank for ``spec`` from the server."""
    if threading.current_thread() in supervise.ABANDONED:
        raise RuntimeError(
            "run_ranks was called by a rank function its torchrun worker abandoned (its test "
            "has ended): its ranks would outlive that test"
        )
    ctx = server.context()
    spec.forkserver = server.SERVER.address()  # for a nested run_ranks in the rank
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=main.rank_main, args=(spec, writer), daemon=True)
    process.start()
    writer.close()  # only the rank holds the write end: EOF then means it is gone
    supervise.LIVE.add(process.pid)
    return supervise.Proc(spec.rank, process, reader, spec.files)


FORKED = Forked()

# The run_ranks of the test whose body is running in this context, set by the pytest plugin
# around each test's call (``fixtures.in_test``); None outside a test's body.
IN_TEST: ContextVar[Callable[..., RankResults] | None] = ContextVar("in_test", default=None)


class Running:
    """The run_ranks of every test whose body runs in this process now, for a thread the
    test started (a ``ThreadPoolExecutor``'s): a new thread does not inherit ``IN_TEST``.
    Tests entered from one thread are nested (a pytester run inside a test's body: the outer
    waits for the inner), so the innermost is the one running; tests running side by side
    in several threads cannot be told apart: a call from another thread is then refused,
    never given a default world in silence."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tests: list[tuple[str, int, Callable[..., RankResults]]] = []

    @contextlib.contextmanager
    def during(self, name: str, helper: Callable[..., RankResults]) -> Iterator[None]:
        entry = (name, threading.get_ident(), helper)
        with self._lock:
            self._tests.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._tests.remove(entry)

    def current(self) -> Callable[..., RankResults] | None:
        """The running test's run_ranks (the innermost); None if no test's body runs."""
        with self._lock:
            tests = list(self._tests)
        if len({thread for _, thread, _ in tests}) > 1:
            names = ", ".join(name for name, _, _ in tests)
            raise RuntimeError(
                f"run_ranks was called from a thread of its own while {len(tests)} tests run "
                f"side by side in this process ({names}), so which test's markers, deadline "
                "and report apply cannot be told; call it from the test's thread, or run the "
                "thread's function in the test's context (contextvars.copy_context().run)"
            )
        return tests[-1][2] if tests else None


RUNNING = Running()


def _in_a_test_its_own(outside: Callable[P, RankResults]) -> Callable[P, RankResults]:
    """``outside`` (the standalone ``run_ranks``), except during a test's body, where the
    test's own ``run_ranks`` takes the call: the options it was given, the rest the test's."""

    @functools.wraps(outside)
    def run_ranks(*args: P.args, **options: P.kwargs) -> RankResults:
        __tracebackhide__ = True
        if IN_RANK.get():  # nested, in a rank function: ranks of its own, as outside a test
            return outside(*args, **options)
        in_test = IN_TEST.get() or RUNNING.current()  # a thread the test started: RUNNING
        return (in_test or outside)(*args, **options)

    return run_ranks


@_in_a_test_its_own
def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = DEFAULT_WORLD_SIZE,
    backend: str | None = DEFAULT_BACKEND,
    init_method: str = DEFAULT_INIT_METHOD,
    timeout: float = DEFAULT_DEADLINE,
    fn_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    stream: TextIO | None = None,
    stream_prefix: bool = True,
    may_exit: Collection[int] = (),
    debug_rank: int | None = None,
    faults: Fault | Collection[Fault] = (),
) -> RankResults:
    """Run ``fn(rank, world_size, *args, **fn_kwargs)`` on ``world_size`` fresh ranks.

    ``fn`` may also take ``(rank)`` only, keyword-only arguments from ``fn_kwargs``, or be a
    ``functools.partial`` of a module-level function (``shape``); a call it cannot take is
    refused before any rank starts. During a pytest test's body this runs through the test's
    ``run_ranks`` fixture instead: the options given here, the rest from the test's markers
    and the session's options, logs in its ``tmp_path``, the strategy it would use (warm,
    torchrun); it raises the same exceptions, and one that leaves the test is reported as
    the fixture's.

    With ``backend`` set (the default, ``"gloo"``) each rank has joined a process group with
    that backend through ``init_method`` (``env``, ``tcp`` or ``file``) before ``fn`` runs.
    With ``backend=None`` the ranks start with only the rendezvous environment (MASTER_ADDR,
    RANK, ...) and ``fn`` sets up what it needs: several groups, RPC, roles. ``timeout`` is
    the deadline for the whole run, in seconds.

    Returns the return values in rank order; raises ``RankFailed``, ``RankCrashed``,
    ``RankTimeout``, ``RankSkipped`` or ``RankXFailed`` (``verdict`` says which wins).
    ``stream`` relays the ranks' output while they run.

    ``fn`` may start processes (``DataLoader`` workers, a ``multiprocessing`` pool, a
    subprocess, a nested ``run_ranks``); any still running when it ends are killed, and
    named in a ``LeftoverProcessWarning`` (``leftovers``).

    ``may_exit`` names ranks whose death is part of the test (a server that fails on
    purpose): such a rank may end without reporting, by ``os._exit`` or a signal, and the
    run goes on; its entry in the results is then a ``RankExited``. A rank outside
    ``may_exit`` that dies still fails the run at once.

    ``debug_rank=N`` debugs rank N: its ``breakpoint()`` and the post-mortem of its exception
    wait on a local port for ``python -m tutorial_impl.testing.attach PORT`` (``debugging``).

    ``faults`` (a ``Fault`` or several) makes things go wrong on purpose, at a chosen
    collective or a named ``fault_point`` of chosen ranks: a kill, an exit, a raise, a hang,
    a delay, closed connections (docs/faults.md). With ``backend="gloo"`` the ranks' group is
    then made on the ``"faulty"`` backend, gloo with the plan in front of it.
    """
    __tracebackhide__ = True
    options = {name: value for name, value in locals().items() if name in _call.OPTIONS}
    return _run_forked(_call.build(fn, args, **options))


def _run_forked(call: Call) -> RankResults:
    """``call`` on fresh ranks; what the ranks left running is named, whatever the verdict."""
    __tracebackhide__ = True
    try:
        results = protocol.run(FORKED, call)
    except RankError as error:
        leftovers.warn(error.killed)  # what the ranks left running, named (``leftovers``)
        raise
    leftovers.warn(results.killed)
    return results
