"""The pytest plugin of the harness: every option, marker, hook and fixture it adds, here.

**How pytest finds it.** The ``pytest11`` entry point (``pyproject.toml``): once
``tutorial-impl`` is installed, every pytest run in that environment loads it, with no
``conftest.py`` line. Its name is the module's own, so a ``pytest_plugins`` line naming it
(this repository's root conftest keeps one, for ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``) finds
it registered and does not load it twice. ``-p no:tutorial_impl.testing.plugin`` turns it off.

**Cheap to load.** A plugin loads in every pytest run of the environment, so this module
imports no torch (two seconds) until a test needs it: the machinery it drives (``forked``,
``forkserver``, ``rendezvous``) imports torch on first use.

What pytest calls, in the order it calls it:

``pytest_addoption``
    the command-line options (``--rank-timeout``, ``--init-method``, ``--require-gpu``,
    ``--check-collectives``, ``--rank-pdb``, ``--launcher``, ``--warm-worlds``,
    ``--warm-audit``) and ini values (``rank_timeout``, ``warm_worlds``; the ``rank_preload*``
    ones from ``preload``), shown under "torch.distributed multi-rank harness" in ``pytest
    --help``; their help texts are constants, in ``config`` and ``preload``.
``pytest_cmdline_main``
    under torchrun, gives each rank a ``--basetemp`` of its own.
``pytest_configure``
    registers the markers (for ``--strict-markers`` and ``pytest --markers``), sets up what
    ranks preload and when their forkserver starts (``preload``: behind collection; an xdist
    worker's is the controller's) and the warm worlds' summary (``strategies.warm.summary``);
    under torchrun (``--launcher``), joins the job and registers
    ``strategies.torchrun.session.LaunchedSession`` instead, whose hooks keep the ranks in
    lockstep and let rank 0 report for all.
``pytest_configure_node``
    xdist's hook, in the controller: starts one rank forkserver for all its workers.
``pytest_generate_tests``
    the world-size matrix: ``@pytest.mark.world_size(1, 2, 4)`` becomes one item per size
    (see ``matrix``).
``pytest_collection_modifyitems``
    after collection, before any test runs: reads and checks each harness test's markers
    (``config``); skips what this machine cannot run (no CUDA, too few GPUs, no NCCL or MPI)
    with the reason, or marks it to fail under ``--require-gpu``; and keeps pytest-timeout
    from firing before the harness deadline.
``pytest_runtest_setup`` / ``pytest_runtest_teardown``
    fails a misconfigured test (a project's own ``run_ranks`` fixture included:
    ``shadowing``), or one ``--require-gpu`` refused to skip, before its fixtures run;
    leases a GPU test's GPUs for its run (``backends.lease``).
``pytest_runtest_call``
    while the test's body runs, the public ``run_ranks`` is the test's (``fixtures.in_test``).
``pytest_terminal_summary``
    names the test files' imports the rank forkserver left to the ranks, and why.
fixtures ``run_ranks`` and ``world_size`` (``fixtures``)
    run a rank function on N processes; the size of this test's world.

Markers: ``world_size(n)`` or ``world_size(n1, n2, ...)``, ``dist_backend(name)``,
``dist_gpu(n=1)``, ``rank_timeout(seconds)``, ``check_collectives``; ``backend`` and ``gpu``
are deprecated aliases, honoured only on tests that use the harness. ``config`` reads and
checks them all.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from tutorial_impl.testing import backends, fixtures, torchcase, words
from tutorial_impl.testing.fixtures import (
    DEADLINE_CAP,
    SESSION,
    SETTINGS,
    Session,
    _run_ranks,
    _world_size_matrix,
    default_size,
    world_size,
)
from tutorial_impl.testing.forkserver import plan, server
from tutorial_impl.testing.rendezvous import INIT_METHODS
from tutorial_impl.testing.settings import config as _config
from tutorial_impl.testing.settings import matrix
from tutorial_impl.testing.strategies.torchrun import launch as where
from tutorial_impl.testing.strategies.warm.pool import WarmPool
from tutorial_impl.testing.strategies.warm.summary import register as warm_summary
from tutorial_impl.testing.verdict import report

__all__ = ["_run_ranks", "_world_size_matrix", "world_size"]  # the fixtures pytest finds here

# Imported once by the rank forkserver: a test file's rank imports it, and pytest (~0.3 s).
PYTEST_PRELOAD = ["pytest", __name__]
_refused_skip = pytest.StashKey[str]()  # reason a --require-gpu test would have been skipped
_bad_config = pytest.StashKey[str]()  # a marker the harness cannot honour: fails the test
_leases = pytest.StashKey[contextlib.ExitStack]()
LAUNCHERS = ("auto", "fork", "torchrun")


class HarnessDeprecationWarning(DeprecationWarning):
    """A harness feature that still works and will go: the message says what replaces it."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Options and ini values. pytest calls this once per plugin, before parsing argv."""
    group = parser.getgroup("dist-harness", "torch.distributed multi-rank harness")
    group.addoption("--rank-timeout", type=float, default=None, help=_config.HELP_RANK_TIMEOUT)
    group.addoption(
        "--init-method", choices=INIT_METHODS, default=None, help=_config.HELP_INIT_METHOD
    )
    group.addoption(
        "--require-gpu", action="store_true", default=False, help=_config.HELP_REQUIRE_GPU
    )
    group.addoption(
        "--check-collectives",
        action="store_true",
        default=False,
        help=_config.HELP_CHECK_COLLECTIVES,
    )
    group.addoption("--rank-pdb", type=int, default=None, metavar="N", help=_config.HELP_RANK_PDB)
    group.addoption("--launcher", choices=LAUNCHERS, default="auto", help=_config.HELP_LAUNCHER)
    group.addoption(
        "--warm-worlds", action="store_true", default=None, help=_config.HELP_WARM_WORLDS
    )
    group.addoption(
        "--warm-audit", action="store_true", default=False, help=_config.HELP_WARM_AUDIT
    )
    parser.addini(
        "rank_timeout", _config.HELP_INI_RANK_TIMEOUT, default=str(_config.DEFAULT_DEADLINE)
    )
    plan.addini(parser)  # rank_preload, rank_preload_test_imports, rank_preload_exclude
    parser.addini("warm_worlds", _config.HELP_INI_WARM_WORLDS, type="bool", default=False)
    torchcase.addoption(group, parser)  # --torch-harness, torch_harness: torch's classes


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists (launched ranks quiet it)
def pytest_configure(config: pytest.Config) -> None:
    """Register the markers; check the options; tell the forkserver what to preload; under
    torchrun, join the job and register its session hooks (``strategies.torchrun.session``). A bad
    option or ini value raises ``pytest.UsageError``: pytest prints the message and exits
    with status 4 before collecting anything, as for its own options."""
    for name, help_text in _config.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    try:
        deadline = _config.deadline_option(config.getoption("--rank-timeout"), "--rank-timeout")
        if deadline is None:
            deadline = _config.deadline_option(config.getini("rank_timeout"), "rank_timeout ini")
    except _config.ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    warm_worlds = config.getoption("--warm-worlds")
    pool = WarmPool()
    session = Session(
        strategies=fixtures.strategies_for(pool, config.getoption("--warm-audit")),
        default_deadline=_config.DEFAULT_DEADLINE if deadline is None else deadline,
        init_method=config.getoption("--init-method"),
        warm_worlds=bool(config.getini("warm_worlds") if warm_worlds is None else warm_worlds),
        check_collectives=config.getoption("--check-collectives"),
        debug_rank=config.getoption("--rank-pdb"),
    )
    config.stash[SESSION] = session
    config.pluginmanager.register(torchcase, "tutorial-impl-torchcase")  # MultiProcessTestCase
    launch = _launch(config)
    if launch is not None:
        _join_the_job(config, session, launch)
        return
    warm_summary(config, pool.stats, asked=session.warm_worlds)
    plan.configure(config, PYTEST_PRELOAD)  # and what the test files import (``preload``)
    shared = getattr(config, "workerinput", {}).get(server.WORKERINPUT_KEY)
    if shared is not None:  # an xdist worker: its ranks come from the controller's server
        server.SERVER.use_shared(shared)


def _join_the_job(config: pytest.Config, session: Session, launch: where.Launch) -> None:
    """This pytest is one worker of a torchrun job: join it, register its session hooks."""
    from tutorial_impl.testing.strategies.torchrun.job import Job
    from tutorial_impl.testing.strategies.torchrun.session import LaunchedSession
    from tutorial_impl.testing.strategies.torchrun.worker import AbandonedLogs, Launched

    if session.init_method is not None:
        raise pytest.UsageError(words.init_method_under_torchrun())
    the_job = Job(launch, session.default_deadline)
    session.join(Launched(the_job))
    config.pluginmanager.register(
        LaunchedSession(config, the_job, _deadline_of), "tutorial-impl-launched-session"
    )
    config.pluginmanager.register(AbandonedLogs(the_job), "tutorial-impl-abandoned-logs")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (-p no:xdist) never called
def pytest_configure_node(node: Any) -> None:
    """In the xdist controller, for each worker it is about to start: share one server.

    xdist calls this once per worker, before the worker process runs any of pytest; what
    goes into ``node.workerinput`` arrives in that worker as ``config.workerinput``, where
    ``pytest_configure`` reads it. The first call starts the server (``forkserver``), later
    calls reuse it. Only for workers on this machine with this interpreter; under torchrun
    there are no workers (``-n`` is refused), so this is never called there.
    """
    spec = node.gateway.spec
    session = node.config.stash.get(SESSION, None)
    if not spec.popen or spec.python or (session is not None and not session.own_ranks):
        return
    node.workerinput[server.WORKERINPUT_KEY] = server.SERVER.start_shared()


def _launch(config: pytest.Config) -> where.Launch | None:
    """This run's place in a torchrun job (``--launcher``), or None for forked ranks."""
    numprocesses = getattr(config.option, "numprocesses", None)
    try:
        return where.chosen(config.getoption("--launcher"), numprocesses)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Under torchrun, before pytest configures anything, give each rank a ``--basetemp`` of
    its own (the ranks of one host would delete each other's numbered directories)."""
    if config.getoption("--launcher") == "fork" or config.option.basetemp:
        return
    try:
        launch = where.detect()
    except ValueError:
        return  # pytest_configure reports it
    if launch is not None:
        config.option.basetemp = where.basetemp(launch)


def _deadline_of(item: pytest.Item) -> float:
    """The harness deadline of ``item``: its rank_timeout, else the session's (under
    torchrun every test has one, ``run_ranks`` or not: see ``strategies.torchrun.session``)."""
    settings = item.stash.get(SETTINGS, None)
    if settings is not None:
        return settings.deadline
    default = item.config.stash[SESSION].default_deadline
    try:
        return _config.read(item, default, _config.DEFAULT_INIT_METHOD).deadline
    except _config.ConfigError:
        return default  # its own setup reports the marker


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.world_size(1, 2, 4)``: one item per size (see ``matrix``). A bad
    matrix is not parametrized: that test fails in its own setup (``config``), and the
    session goes on."""
    marker = metafunc.definition.get_closest_marker("world_size")
    try:
        sizes = matrix.sizes(marker)
    except ValueError:
        return
    if sizes is None or matrix.FIXTURE not in metafunc.fixturenames:
        return
    params = [
        pytest.param(n, id=matrix.item_id(n), marks=pytest.mark.world_size(n=n)) for n in sizes
    ]
    metafunc.parametrize(matrix.FIXTURE, params, indirect=True)


def _ours(item: pytest.Item) -> bool:
    """Whether the harness reads this test's markers: it uses the harness, or carries one of
    its markers that another project's could not mean otherwise."""
    names = ("dist_backend", "dist_gpu", "warm_world", "rank_timeout")
    if _config.uses_the_harness(item) or any(item.get_closest_marker(n) for n in names):
        return True
    marker = item.get_closest_marker("world_size")
    return marker is not None and len(marker.args) > 1  # a matrix for no fixture


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Read and check every harness test's markers once; skip what cannot run here.

    Runs after collection, before any test. A marker the harness cannot honour is recorded
    and fails that one test in ``pytest_runtest_setup`` (raising here would be an
    INTERNALERROR that ends the whole session). A test this machine cannot run (no CUDA, too
    few GPUs, no NCCL or MPI) is skipped with the reason, or refused under --require-gpu.
    The harness, which reports stacks and kills ranks, must fire before pytest-timeout
    (``timing``): a session-wide pytest-timeout is raised above the test's deadline, and a
    test's own ``timeout`` marker lowers the harness deadline under it.
    """
    session = config.stash[SESSION]
    for item in items:
        if not _ours(item):
            continue  # not ours: a foreign gpu or backend marker keeps its own meaning
        for old in _config.deprecated_markers_on(item):
            new = _config.DEPRECATED_MARKERS[old]
            item.warn(
                HarnessDeprecationWarning(
                    f"@pytest.mark.{old} is deprecated: use @pytest.mark.{new}, the same "
                    "marker under a name no other project's markers can collide with"
                )
            )
        try:
            fixtures.refuse_shadowed(item)
            settings = _config.read(
                item,
                session.default_deadline,
                session.init_method or _config.DEFAULT_INIT_METHOD,
                default_size(config),
            )
            reason = session.why_not_here(settings)
        except _config.ConfigError as exc:
            item.stash[_bad_config] = str(exc)
            continue
        if reason and config.getoption("--require-gpu") and settings.gpus:
            item.stash[_refused_skip] = reason  # failed in pytest_runtest_setup
            continue
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        item.stash[SETTINGS], cap = _config.within_pytest_timeout(item, settings)
        if cap is not None:
            item.stash[DEADLINE_CAP] = cap


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with fixtures.in_test(item):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a misconfigured test, or a GPU test --require-gpu kept from being skipped,
    before its fixtures; lease the GPUs of a GPU test for its whole run (see ``backends``)."""
    problem = item.stash.get(_bad_config, None)
    if problem is not None:
        pytest.fail(words.configuration(problem), pytrace=False)
    reason = item.stash.get(_refused_skip, None)
    if reason is not None:
        pytest.fail(f"--require-gpu: this GPU test cannot run here: {reason}", pytrace=False)
    settings = item.stash.get(SETTINGS, None)
    if settings is not None and settings.gpus and item.config.stash[SESSION].own_ranks:
        _lease_gpus(item, settings)


def _lease_gpus(item: pytest.Item, settings: _config.Settings) -> None:
    """Hold ``settings.gpus`` GPUs until teardown; the test and its ranks see only those."""
    stack = contextlib.ExitStack()
    item.stash[_leases] = stack
    reason = backends.hold(stack, settings.gpus, settings.deadline)
    if reason is None:
        return
    stack.close()
    if item.config.getoption("--require-gpu"):  # a GPU job must not pass by skipping
        pytest.fail(f"--require-gpu: this GPU test cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Give back the GPUs a test leased, after its fixtures are torn down; kill the warm
    worlds when the next test is in another module (or there is none)."""
    stack = item.stash.get(_leases, None)
    if stack is not None:
        stack.close()
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        item.config.stash[SESSION].close()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Name the test files' imports the rank forkserver would not preload, and why."""
    plan.write_summary(terminalreporter, config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """No warm rank outlives the session."""
    found = session.config.stash.get(SESSION, None)
    if found is not None:
        found.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Lead a failed multi-rank test's report with its cause; details in sections (``report``)."""
    rep = yield
    if call.when == "call":  # a failed test's warm world is not reused
        item.config.stash[SESSION].test_ended(failed=rep.failed)
    problem = item.stash.get(_bad_config, None)
    crash = getattr(rep.longrepr, "reprcrash", None)
    if call.when == "setup" and problem is not None and crash is not None:
        crash.message = words.configuration(problem)  # not pytest.fail's "Failed: "
    if call.excinfo is not None:
        report.rewrite(rep, call.excinfo.value, item)
    return rep
