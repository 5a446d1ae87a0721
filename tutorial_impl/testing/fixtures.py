"""The fixtures ``run_ranks`` and ``world_size``, and how one call finds its strategy.

``run_ranks(fn, *args, **options)`` is the whole path of a test's call, one way in and one
verdict out: the test's settings (``config``, read once at collection) and the call's own
keyword options become one checked ``call.Call``; the strategy is chosen (``Session.strategy``:
under torchrun the job, a warm world when asked for and possible, else fresh ranks), runs it
and returns the results or raises the run's one error (``verdict``); a skip or an xfail
becomes pytest's own, and what the ranks caught (warnings, exceptions in their threads)
becomes pytest's warnings (``caught``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tutorial_impl.testing import call as _call
from tutorial_impl.testing import words
from tutorial_impl.testing.rank import caught, leftovers
from tutorial_impl.testing.rank.torchenv import CHECK_COLLECTIVES
from tutorial_impl.testing.settings import config as _config
from tutorial_impl.testing.settings import matrix, shadowing
from tutorial_impl.testing.strategies import protocol
from tutorial_impl.testing.strategies.forked import FORKED, IN_TEST, RUNNING
from tutorial_impl.testing.strategies.protocol import Strategy
from tutorial_impl.testing.strategies.warm.audit import Audited
from tutorial_impl.testing.strategies.warm.pool import WarmPool
from tutorial_impl.testing.verdict.errors import RankError, RankResults, RankSkipped, RankXFailed

RunRanks = Callable[..., RankResults]


def strategies_for(pool: WarmPool, warm_audit: bool) -> tuple[Strategy, ...]:
    """The one place the list of strategies is made, in order of preference: a warm world
    (wrapped by ``--warm-audit``), then fresh ranks. Under torchrun the job's replaces it
    (``Session.join``). A new strategy is registered here."""
    warm: Strategy = Audited(pool, FORKED) if warm_audit else pool
    return (warm, FORKED)


@dataclasses.dataclass
class Session:
    """What one pytest session's calls share: its strategies (``strategies_for``; under
    torchrun the job's alone) and the session's options. On ``config.stash``."""

    strategies: tuple[Strategy, ...]
    default_deadline: float
    init_method: str | None  # --init-method, if given
    warm_worlds: bool  # --warm-worlds / the warm_worlds ini value
    check_collectives: bool  # --check-collectives
    debug_rank: int | None  # --rank-pdb

    def join(self, job: Strategy) -> None:
        """This pytest is a worker of a torchrun job: every call is the job's."""
        self.strategies = (job,)

    @property
    def size(self) -> int | None:
        """The world size every test has here, if the strategies fix one (a torchrun job)."""
        return self.strategies[0].size

    @property
    def own_ranks(self) -> bool:
        """Whether this pytest starts the ranks itself (not a worker of a job)."""
        return self.strategies[0].own_ranks

    def why_not_here(self, settings: _config.Settings) -> str | None:
        """Why a test with ``settings`` cannot run on this host (a skip at collection)."""
        return self.strategies[-1].why_not_here(settings)

    def strategy(self, settings: _config.Settings, call: _call.Call) -> Strategy:
        """The strategy for ``call``: the first that can honour it (``protocol.choose``) of the
        session's, the warm one offered only when asked for (marker or --warm-worlds, not
        warm_world(False)) and no GPUs are leased; under torchrun, the job's."""
        wanted = settings.warm if settings.warm is not None else self.warm_worlds
        offered = self.strategies if wanted and not settings.gpus else self.strategies[-1:]
        return protocol.choose(offered, call)

    def test_ended(self, failed: bool) -> None:
        for strategy in self.strategies:
            strategy.test_ended(failed)

    def close(self) -> None:
        for strategy in self.strategies:
            strategy.close()


SESSION = pytest.StashKey[Session]()
SETTINGS = pytest.StashKey[_config.Settings]()  # what the test's ranks run with
DEADLINE_CAP = pytest.StashKey[float]()  # no run_ranks call may wait longer (pytest-timeout)
_CALL_DIRS = pytest.StashKey[tuple[Path, Iterator[int]]]()  # see call_dirs


def default_size(config: pytest.Config) -> int:
    """A test's world size when nothing sets one: 2, or under torchrun the whole job."""
    session = config.stash.get(SESSION, None)
    size = session.size if session is not None else None
    return size if size is not None else _config.DEFAULT_WORLD_SIZE


@pytest.fixture(name=matrix.FIXTURE)
def _world_size_matrix(request: pytest.FixtureRequest) -> int | None:
    """This item's entry of a world-size matrix (``request.param``), or None."""
    return getattr(request, "param", None)


@pytest.fixture
def world_size(request: pytest.FixtureRequest, _world_size_matrix: int | None) -> int:
    """The number of ranks this test runs with: its world-size matrix entry, else its
    ``world_size`` marker, else 2. For computing what every rank should have returned.

    A test may also parametrize it, ``@pytest.mark.parametrize("world_size", [3, 5])``:
    pytest then passes each value in place of this fixture, and ``run_ranks`` (which
    depends on it) runs that many ranks."""
    return _config.world_size_of(request.node, default_size(request.config))


@pytest.fixture(name="run_ranks")
def _run_ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, world_size: int
) -> RunRanks:
    """Run a rank function on N processes and return each rank's return value.

    ``run_ranks(fn, *args, **options)`` calls ``fn(rank, world_size, *args)`` in every rank
    (or ``fn(rank)``, as its signature asks: ``shape``), inside a fresh process group, and
    returns a list of the return values (rank order) with the ranks' printed output in
    ``.outputs``. ``fn`` may be defined in the test file itself, or be a
    ``functools.partial`` of such a function. Defaults come from the test's markers and the
    command line; keyword options
    (``world_size``, ``backend``, ``init_method``, ``timeout``, ``fn_kwargs``, ``env``,
    ``log_dir``, ``stream``, ``may_exit``, ``debug_rank``) override them for one call.
    ``backend=None`` starts the ranks without a process group, for functions that set up
    their own (RPC, several groups). ``may_exit={rank, ...}`` names ranks whose death is part
    of the test: theirs is recorded as a ``RankExited`` result.

    A failure on any rank fails the test with that rank's traceback, where the other ranks
    were, and every rank's output; a skip (or xfail) on a rank skips it only if no rank
    failed. The logs live in ``ranks/<test>-<n>`` under pytest's base temporary directory
    (``call_dirs``). During the test's body, ``tutorial_impl.testing.run_ranks`` runs through
    this same fixture (``in_test``).
    """
    return RunRanksOfTest(request, tmp_path_factory, world_size)


class RunRanksOfTest:
    """One test's ``run_ranks``: the fixture's value, and what the public ``run_ranks``
    calls while the test's body runs (``from_helper``). Both check a call the same way,
    run it on the same strategy and log in the same directories (``call_dirs``)."""

    def __init__(
        self,
        request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory,
        world_size: int,
    ) -> None:
        self.item, self.config = request.node, request.config
        self.session = request.config.stash[SESSION]
        self.settings = _settings_of(self.item, self.session)
        self.next_dir, self.world_size = call_dirs(request, tmp_path_factory), world_size
        self._one_at_a_time = threading.Lock()
        problem = shadowing.size_refusal(self.item, __name__, world_size, self.settings.world_size)
        if problem is not None:
            pytest.fail(words.configuration(problem), pytrace=False)

    def __call__(self, fn: Callable[..., Any], *args: Any, **options: Any) -> RankResults:
        __tracebackhide__ = True
        return self._run(fn, args, options, as_pytest=True)

    def from_helper(self, fn: Callable[..., Any], *args: Any, **options: Any) -> RankResults:
        """The same run, raising what ``run_ranks`` raises outside a test (``RankSkipped``
        included) for a helper to catch; what leaves the test is reported as the fixture's
        (``in_test``)."""
        __tracebackhide__ = True
        return self._run(fn, args, options, as_pytest=False)

    def _run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        options: dict[str, Any],
        as_pytest: bool,
    ) -> RankResults:
        __tracebackhide__ = True
        strategy, call = self.prepare(fn, args, options)
        # Fresh ranks may run side by side for threads of one test; a warm world or the
        # torchrun job is one set of ranks, which the calls of its threads take in turn.
        with self._one_at_a_time if strategy.serial else contextlib.nullcontext():
            return _outcome(strategy, call, self.session, as_pytest=as_pytest)

    def prepare(
        self, fn: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any]
    ) -> tuple[Strategy, _call.Call]:
        """The checked call (the test's settings, the call's own options on top) and the
        strategy that runs it."""
        __tracebackhide__ = True
        unknown = _call.unknown_options(options)
        if unknown:
            raise TypeError(f"run_ranks() got unexpected keyword argument(s) {unknown}")
        call = _build(fn, args, options, self.settings, self.session, self.world_size)
        call = dataclasses.replace(
            call,
            deadline=min(call.deadline, self.item.stash.get(DEADLINE_CAP, float("inf"))),
            home=None if call.log_dir is not None else self.next_dir(),
            announce=_terminal_line(self.config),
            warning_filters=caught.current_filters(),  # pytest's for this test, now
        )
        size = self.session.size
        if size is not None and call.world_size != size:
            # The words of the skip at collection (a marker), for a size asked by the call.
            asked = dataclasses.replace(self.settings, world_size=call.world_size)
            pytest.skip(self.session.why_not_here(asked) or f"world_size {call.world_size}")
        strategy = self.session.strategy(self.settings, call)
        if _streams(strategy) and "stream" not in options and _live(self.config):
            call = dataclasses.replace(call, stream=sys.stdout)  # each line as it comes
        return strategy, call


def _streams(strategy: Strategy) -> bool:
    """Whether ``strategy`` relays its ranks' output as it comes (``stream=``)."""
    return strategy.own_ranks and "stream" not in strategy.cannot


def _live(config: pytest.Config) -> bool:
    """``-s`` (capture off) in a pytest that owns its terminal (not an xdist worker): fresh
    ranks' output is copied to it as it comes (``stream=``), not after the ranks end."""
    return config.getoption("capture", None) == "no" and not hasattr(config, "workerinput")


# --- the public run_ranks inside a test ----------------------------------------------------


@contextlib.contextmanager
def in_test(item: pytest.Item) -> Iterator[None]:
    """While ``item``'s body runs (the plugin's ``pytest_runtest_call``): the public
    ``run_ranks`` is this test's (``forked.IN_TEST``, in this thread's context; in the
    threads it starts, ``forked.RUNNING``: the innermost test running), and a
    ``RankError`` that leaves the body is reported as the fixture reports one."""
    helper = functools.partial(_from_helper, item) if isinstance(item, pytest.Function) else None
    token = IN_TEST.set(helper)
    try:
        with RUNNING.during(item.nodeid, helper) if helper else contextlib.nullcontext():
            yield
    except RankError as error:
        reported(error)
    finally:
        IN_TEST.reset(token)


def _from_helper(item: pytest.Function, fn: Callable[..., Any], *args: Any, **options: Any) -> Any:
    """``tutorial_impl.testing.run_ranks`` called during ``item``'s body: the test's own
    ``run_ranks`` fixture runs it, requested now if the test did not ask for it."""
    __tracebackhide__ = True
    problem = shadowing.run_ranks_refusal(item, __name__)
    if problem is not None:
        pytest.fail(words.configuration(problem), pytrace=False)
    # The item's own request (pytest's, private but long-lived): the fixture as the test
    # would have received it, set up once per test and torn down with it; once, whatever
    # threads of the test ask at the same time.
    with _FIXTURE_LOCK:
        runs: RunRanksOfTest = item._request.getfixturevalue("run_ranks")
    return runs.from_helper(fn, *args, **options)


_FIXTURE_LOCK = threading.Lock()


def refuse_shadowed(item: pytest.Item) -> None:
    """At collection: a ``ConfigError`` for a test that uses ``run_ranks`` when a project's
    own fixture has taken that name, or ``world_size`` whatever its value (``shadowing``)."""
    if "run_ranks" in getattr(item, "fixturenames", ()):
        problem = shadowing.run_ranks_refusal(item, __name__)
        problem = problem or shadowing.size_refusal(item, __name__)
        if problem is not None:
            raise _config.ConfigError(problem)


def _settings_of(item: pytest.Item, session: Session) -> _config.Settings:
    """The test's settings, read at collection; for an item our collection hook did not see
    (or one that calls run_ranks from a helper only), read now."""
    settings = item.stash.get(SETTINGS, None)
    if settings is not None:
        return settings
    try:
        return _config.read(
            item,
            session.default_deadline,
            session.init_method or _config.DEFAULT_INIT_METHOD,
            default_size(item.config),
        )
    except _config.ConfigError as exc:
        pytest.fail(words.configuration(exc), pytrace=False)


def call_dirs(
    request: pytest.FixtureRequest, factory: pytest.TempPathFactory
) -> Callable[[], Path]:
    """Where each call of this test keeps its ranks' logs, stacks and ``file://`` store:
    ``ranks/<test>-<n>`` under pytest's base temporary directory (kept as pytest keeps it),
    made when the call starts. Not the test's ``tmp_path``: pytest numbers those by listing
    every directory the session has made so far, and links the newest, on every test."""
    if _CALL_DIRS not in request.config.stash:
        request.config.stash[_CALL_DIRS] = factory.getbasetemp() / "ranks", itertools.count()
    base, numbers = request.config.stash[_CALL_DIRS]
    name = re.sub(r"\W", "_", request.node.name)[:40]
    return lambda: base / f"{name}-{next(numbers)}"


def _terminal_line(config: pytest.Config) -> Callable[[str], None]:
    """A line on pytest's terminal now, whatever is being captured (a debugged rank's port)."""

    def line(text: str) -> None:
        capture = config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            config.get_terminal_writer().line(f"\n{text}")

    return line


def _build(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
    settings: _config.Settings,
    session: Session,
    world_size: int,
) -> _call.Call:
    """The checked call: the test's settings, then the call's own options on top."""
    fields: dict[str, Any] = {
        "world_size": world_size,
        "backend": settings.backend,
        "init_method": settings.init_method,
        "timeout": settings.deadline,
        **options,
    }
    if session.debug_rank is not None and "debug_rank" not in options:
        fields["debug_rank"] = session.debug_rank
    try:
        if session.check_collectives or settings.check_collectives:  # the caller's env= wins
            fields["env"] = {**CHECK_COLLECTIVES, **_call.check_env(options.get("env"))}
        return _call.build(fn, args, **fields)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"run_ranks: {exc}") from None


def _outcome(
    strategy: Strategy, call: _call.Call, session: Session, as_pytest: bool = True
) -> RankResults:
    """Run ``call``: its results, or its verdict as pytest's (a failure, skip or xfail:
    ``reported``), or with ``as_pytest=False`` the ``RankError`` itself."""
    __tracebackhide__ = True
    try:
        results = protocol.run(strategy, call)
    except RankError as error:
        leftovers.warn(error.killed)  # here, not in ``reported``: a caught error names them too
        if as_pytest:
            reported(error)
        raise
    caught.emit(results.thread_errors, results.caught)
    leftovers.warn(results.killed)
    # Under torchrun each rank's own capture has the output; with stream= it was relayed live.
    if session.own_ranks and call.stream is None:
        for rank, text in enumerate(results.outputs):
            if text.strip():
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    return results


def reported(error: RankError) -> NoReturn:
    """Raise ``error`` as the test's outcome: pytest's skip or xfail, else the error with its
    stacks and outputs left to the report's sections (``report``); what the ranks caught
    becomes pytest's warnings (``caught.emit``), but one an "error" filter turns into an
    exception does not replace the ranks' own verdict. An error reported once already is
    raised as it is."""
    __tracebackhide__ = True
    if not error.in_message:
        raise error
    error.in_message = False  # stacks and outputs go to report sections instead
    with contextlib.suppress(Warning):
        caught.emit(error.thread_errors, error.caught)
    if isinstance(error, RankSkipped):  # reported at the test's location, not the harness's
        raise pytest.skip.Exception(f"rank {error.rank}: {error.reason}", _use_item_location=True)
    if isinstance(error, RankXFailed):
        pytest.xfail(f"rank {error.rank}: {error.reason}")
    raise error
