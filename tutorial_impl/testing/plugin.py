"""The pytest plugin of the harness: every option, marker, hook and fixture it adds, here.

**How pytest finds it.** The package declares this module under the ``pytest11`` entry point
(``pyproject.toml``), the group pytest scans at start-up: once ``tutorial-impl`` is installed,
every pytest run in that environment loads it, with no ``conftest.py`` line. The entry point's
name is the module's own name, ``tutorial_impl.testing.plugin``; pytest registers plugins by
name, so a ``pytest_plugins = ["tutorial_impl.testing.plugin"]`` line (this repository's root
conftest keeps one, for runs with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``) finds it registered
and does not load it twice. ``-p no:tutorial_impl.testing.plugin`` turns it off.

**Cheap to load.** A plugin loads in every pytest run of the environment, so this module
imports no torch (two seconds) until a test needs it: the machinery it drives (``supervisor``,
``ranks``, ``rendezvous``) imports torch on first use.

What pytest calls, in the order it calls it:

``pytest_addoption``
    the command-line options (``--rank-timeout``, ``--init-method``, ``--require-gpu``,
    ``--check-collectives``, ``--rank-pdb``, ``--launcher``) and
    ini values (``rank_timeout``, ``rank_preload``), shown under "torch.distributed
    multi-rank harness" in ``pytest --help``.
``pytest_cmdline_main``
    under torchrun, gives each rank a ``--basetemp`` of its own.
``pytest_configure``
    registers the markers (so ``--strict-markers`` accepts them and ``pytest --markers``
    lists them) and sets up what ranks preload (in an xdist worker: which forkserver they
    come from); under torchrun (``--launcher``), joins the
    job and registers ``launched_session.LaunchedSession``, whose hooks keep the ranks in
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
    fails a misconfigured test, or one ``--require-gpu`` refused to skip, before its
    fixtures run; leases a GPU test's GPUs for its run (``backends.lease``).
fixtures ``run_ranks`` and ``world_size``
    run a rank function on N processes; the size of this test's world.

Markers: ``world_size(n)`` or ``world_size(n1, n2, ...)``, ``dist_backend(name)``,
``dist_gpu(n=1)``, ``rank_timeout(seconds)``, ``check_collectives``; ``backend`` and ``gpu``
are deprecated aliases, honoured only on tests that use the harness. ``config`` reads and
checks them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tutorial_impl.testing import backends, launched, matrix, report, warm
from tutorial_impl.testing import config as _config
from tutorial_impl.testing import ranks as _ranks
from tutorial_impl.testing.errors import RankError, RankResults, RankSkipped, RankXFailed
from tutorial_impl.testing.rendezvous import INIT_METHODS
from tutorial_impl.testing.supervisor import run_ranks
from tutorial_impl.testing.torchenv import CHECK_COLLECTIVES

MARKERS = {
    "world_size(n, ...)": "run the test's ranks with world size n (default 2); several sizes "
    "make one test per size, with ids [world_sizeN] and markers world_size(n=N)",
    "dist_backend(name)": "process-group backend for the ranks: gloo (default), nccl, mpi, "
    "a per-device form such as 'cpu:gloo,cuda:nccl', or None",
    "dist_gpu(n=1)": "needs CUDA and n GPUs, leased for the test (no other test of this host "
    "uses them meanwhile); skipped at collection time otherwise (a failure under "
    "--require-gpu)",
    "rank_timeout(seconds)": "harness deadline for this test's ranks (stack dump, then kill)",
    "backend(name)": "deprecated: dist_backend(name); honoured on tests using run_ranks only",
    "gpu(n=1)": "deprecated: dist_gpu(n); honoured on tests using run_ranks only",
    "warm_world(enabled=True)": "run this module's or class's rank functions in warm worlds: "
    "ranks and process group kept between tests, checked before each reuse, replaced by a "
    "fresh world after anything wrong (see tutorial_impl.testing.warm); warm_world(False) "
    "opts one test out",
    "check_collectives": "check before every collective that all ranks call the same one "
    "(TORCH_DISTRIBUTED_DEBUG=DETAIL in the ranks): a mismatch fails in seconds, not at the "
    "deadline",
}
# Imported once by the rank forkserver under pytest: a rank that runs a function of a test
# file imports that file, and the file imports pytest (~0.3 s a rank otherwise).
PYTEST_PRELOAD = ["pytest", __name__]
_refused_skip = pytest.StashKey[str]()  # reason a --require-gpu test would have been skipped
_bad_config = pytest.StashKey[str]()  # a marker the harness cannot honour: fails the test
_settings = pytest.StashKey[_config.Settings]()  # what the test's ranks run with
_deadline_cap = pytest.StashKey[float]()  # no run_ranks call may wait longer (pytest-timeout)
_default_deadline = pytest.StashKey[float]()  # --rank-timeout, else rank_timeout ini, else 60
_leases = pytest.StashKey[contextlib.ExitStack]()
_world = pytest.StashKey[Any]()  # launched.World: this pytest is one rank of a torchrun job
LAUNCHERS = ("auto", "fork", "torchrun")


class HarnessDeprecationWarning(DeprecationWarning):
    """A harness feature that still works and will go: the message says what replaces it."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Options and ini values. pytest calls this once per plugin, before parsing argv."""
    group = parser.getgroup("dist-harness", "torch.distributed multi-rank harness")
    group.addoption(
        "--rank-timeout",
        type=float,
        default=None,
        help="harness deadline in seconds for every multi-rank test without its own "
        "rank_timeout marker (default: the rank_timeout ini value, else 60). At the deadline "
        "every live rank's Python stacks go into the report, then the ranks are killed",
    )
    group.addoption(
        "--init-method",
        choices=INIT_METHODS,
        default=None,
        help="how ranks rendezvous: env (default), tcp or file; all are race-free",
    )
    group.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail, instead of skipping, every test marked dist_gpu or using the nccl backend "
        "that this machine cannot run (no CUDA, too few GPUs, no NCCL), with the reason: "
        "for GPU CI jobs, which must not pass by skipping every GPU test",
    )
    group.addoption(
        "--check-collectives",
        action="store_true",
        default=False,
        help="check before every collective of every multi-rank test that all ranks call the "
        "same one with the same shapes (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL): ranks in "
        "different collectives then fail in seconds, naming both, instead of hanging until "
        "the deadline. Costs a few times a small collective; the check_collectives marker "
        "turns it on for one test",
    )
    group.addoption(
        "--rank-pdb",
        type=int,
        default=None,
        metavar="N",
        help="debug rank N of every multi-rank test: its breakpoint() and the post-mortem of "
        "its exception wait on a local port (printed on the terminal and in the rank's log) "
        "for `python -m tutorial_impl.testing.attach PORT`; the other ranks are held and the "
        "harness deadline paused meanwhile (pytest-timeout still counts: add --timeout 0)",
    )
    group.addoption(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="where rank functions run. fork: fresh ranks forked for each test (the default "
        "outside torchrun). torchrun: this pytest is one worker of a torchrun job "
        "(`torchrun --nproc-per-node=N -m pytest`), run_ranks runs the function here as this "
        "rank, the ranks agree on every verdict, and rank 0 reports. auto (default): "
        "torchrun when torchrun's variables (TORCHELASTIC_RUN_ID, RANK, ...) are set",
    )
    parser.addini(
        "rank_timeout",
        "default harness deadline in seconds",
        default=str(_config.DEFAULT_DEADLINE),
    )
    parser.addini(
        "rank_preload",
        "modules the rank forkserver imports once, so each rank starts with them loaded",
        type="linelist",
        default=[],
    )


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists (launched ranks quiet it)
def pytest_configure(config: pytest.Config) -> None:
    """Register the markers; check the options; tell the forkserver what to preload; under
    torchrun, join the job and register its session hooks (``launched_session``).

    A bad option or ini value raises ``pytest.UsageError``: pytest prints the message and
    exits with status 4 before collecting anything, as for its own options.
    """
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    try:
        deadline = _config.deadline_option(config.getoption("--rank-timeout"), "--rank-timeout")
        if deadline is None:
            deadline = _config.deadline_option(config.getini("rank_timeout"), "rank_timeout ini")
    except _config.ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_default_deadline] = deadline or _config.DEFAULT_DEADLINE
    launch = _launch(config)
    if launch is not None:
        from tutorial_impl.testing.launched_session import LaunchedSession

        world = launched.World(launch, config.stash[_default_deadline])
        config.stash[_world] = world
        config.pluginmanager.register(
            LaunchedSession(config, world, _deadline_of), "tutorial-impl-launched-session"
        )
        return
    _ranks.add_preload([*PYTEST_PRELOAD, *config.getini("rank_preload")])
    shared = getattr(config, "workerinput", {}).get(_ranks.WORKERINPUT_KEY)
    if shared is not None:  # an xdist worker: its ranks come from the controller's server
        _ranks.use_shared_forkserver(shared)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (-p no:xdist) never called
def pytest_configure_node(node: Any) -> None:
    """In the xdist controller, for each worker it is about to start: share one forkserver.

    xdist calls this once per worker, before the worker process runs any of pytest; what
    goes into ``node.workerinput`` (a dict of plain values) arrives in that worker as
    ``config.workerinput``, where ``pytest_configure`` reads it. The first call starts the
    server (``ranks.start_shared_forkserver``: it returns without waiting for the server's
    torch import, which then overlaps the workers' own start-up); later calls, and workers
    xdist restarts, reuse it. Only for workers on this machine with this interpreter (a
    ``--tx ssh=...`` or ``popen//python=...`` worker keeps a server of its own); under
    torchrun there are no workers (``-n`` is refused), so this is never called there.
    """
    spec = node.gateway.spec
    if not spec.popen or spec.python or _world in node.config.stash:
        return
    node.workerinput[_ranks.WORKERINPUT_KEY] = _ranks.start_shared_forkserver()


def _launch(config: pytest.Config) -> launched.Launch | None:
    """This run's place in a torchrun job (``--launcher``), or None for forked ranks."""
    choice = config.getoption("--launcher")
    if choice == "fork":
        return None
    try:
        launch = launched.detect()
    except ValueError as exc:
        raise pytest.UsageError(f"--launcher {choice}: {exc}") from None
    if launch is None:
        if choice == "torchrun":
            raise pytest.UsageError(
                "--launcher torchrun: this pytest was not started by torchrun (it needs all "
                f"of {', '.join(launched.LAUNCH_ENV)} in its environment); run `torchrun "
                "--nproc-per-node=N -m pytest ...`"
            )
        return None
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            "-n/--numprocesses cannot be used under torchrun: every torchrun worker is one "
            "rank and runs the whole session; drop -n (or use --launcher fork)"
        )
    return launch


def _default_size(config: pytest.Config) -> int:
    """A test's world size when nothing sets one: 2, or under torchrun the whole job."""
    world = config.stash.get(_world, None)
    return world.launch.world_size if world is not None else _config.DEFAULT_WORLD_SIZE


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Before pytest configures anything: under torchrun, give each rank a ``--basetemp`` of
    its own. The ranks of one host would otherwise share pytest's numbered temporary
    directories and delete each other's (pytest keeps the last three per user)."""
    if config.getoption("--launcher") == "fork" or config.option.basetemp:
        return
    try:
        launch = launched.detect()
    except ValueError:
        return  # pytest_configure reports it
    if launch is not None:
        config.option.basetemp = launched.basetemp(launch)


def _deadline_of(item: pytest.Item) -> float:
    """The harness deadline of ``item``: its rank_timeout, else the session's (under
    torchrun every test has one, ``run_ranks`` or not: see ``launched_session``)."""
    settings = item.stash.get(_settings, None)
    if settings is not None:
        return settings.deadline
    default = item.config.stash[_default_deadline]
    try:
        return _config.read(item, default, _config.DEFAULT_INIT_METHOD).deadline
    except _config.ConfigError:
        return default  # its own setup reports the marker


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.world_size(1, 2, 4)``: one item per size (see ``matrix``)."""
    marker = metafunc.definition.get_closest_marker("world_size")
    try:
        sizes = matrix.sizes(marker)
    except ValueError as exc:
        pytest.fail(f"{metafunc.definition.nodeid}: {exc}", pytrace=False)
    if sizes is None:
        return
    if matrix.FIXTURE not in metafunc.fixturenames:
        pytest.fail(
            f"{metafunc.definition.nodeid}: world_size{tuple(sizes)} makes one test per size "
            "for the run_ranks or world_size fixture, and the test uses neither",
            pytrace=False,
        )
    params = [
        pytest.param(n, id=matrix.item_id(n), marks=pytest.mark.world_size(n=n)) for n in sizes
    ]
    metafunc.parametrize(matrix.FIXTURE, params, indirect=True)


def _pytest_timeout(item: pytest.Item) -> float | None:
    """The test's pytest-timeout, from any of its four sources, or None without the plugin.

    pytest-timeout reads, in order: the closest ``timeout`` marker, ``--timeout``, the
    ``PYTEST_TIMEOUT`` variable, the ``timeout`` ini value; its ``_get_item_settings`` does
    exactly that, and is what it calls itself.
    """
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    try:
        import pytest_timeout

        return pytest_timeout._get_item_settings(item).timeout or None
    except Exception:  # another version: its own error will name the problem
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Read and check every harness test's markers once; skip what cannot run here.

    Runs after collection, before any test. A marker the harness cannot honour is recorded
    and fails that one test in ``pytest_runtest_setup`` (raising here would be an
    INTERNALERROR that ends the whole session). A test this machine cannot run (no CUDA, too
    few GPUs, no NCCL or MPI) is skipped with the reason, or refused under --require-gpu.
    The harness, which reports stacks and kills ranks, must fire before pytest-timeout: a
    session-wide pytest-timeout (``--timeout``, ``PYTEST_TIMEOUT``, ini) is raised above the
    test's deadline, and a test's own ``timeout`` marker lowers the harness deadline under it.
    """
    require_gpu = config.getoption("--require-gpu")
    init_method = config.getoption("--init-method") or _config.DEFAULT_INIT_METHOD
    world = config.stash.get(_world, None)
    for item in items:
        if not _config.uses_the_harness(item) and not any(
            item.get_closest_marker(name) for name in ("dist_backend", "dist_gpu")
        ):
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
            settings = _config.read(
                item, config.stash[_default_deadline], init_method, _default_size(config)
            )
            if world is not None:  # one process of the job per rank, on LOCAL_RANK's GPU
                reason = launched.why_not_here(world.launch, settings)
            else:
                reason = backends.why_not_here(settings.backend, settings.world_size, settings.gpus)
        except _config.ConfigError as exc:
            item.stash[_bad_config] = str(exc)
            continue
        if reason and require_gpu and settings.gpus:
            item.stash[_refused_skip] = reason  # failed in pytest_runtest_setup
            continue
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        limit = _pytest_timeout(item)
        if item.get_closest_marker("timeout") is not None:
            # The test's own limit stands: the harness reports first, inside it.
            cap = _config.under_backstop(float("inf"), limit)
            item.stash[_deadline_cap] = cap
            settings = dataclasses.replace(settings, deadline=min(settings.deadline, cap))
        elif limit and _config.uses_the_harness(item):
            # A session-wide limit is a backstop: keep it above this test's deadline.
            wanted = settings.deadline + _config.BACKSTOP_MARGIN
            if limit < wanted:
                item.add_marker(pytest.mark.timeout(wanted), append=False)
        item.stash[_settings] = settings


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a misconfigured test, or a GPU test --require-gpu kept from being skipped,
    before its fixtures; lease the GPUs of a GPU test for its whole run (see ``backends``)."""
    problem = item.stash.get(_bad_config, None)
    if problem is not None:
        pytest.fail(f"harness configuration: {problem}", pytrace=False)
    reason = item.stash.get(_refused_skip, None)
    if reason is not None:
        pytest.fail(f"--require-gpu: this GPU test cannot run here: {reason}", pytrace=False)
    settings = item.stash.get(_settings, None)
    if settings is not None and settings.gpus and _world not in item.config.stash:
        _lease_gpus(item, settings)


def _lease_gpus(item: pytest.Item, settings: _config.Settings) -> None:
    """Hold ``settings.gpus`` GPUs until teardown; the test and its ranks see only those."""
    stack = contextlib.ExitStack()
    item.stash[_leases] = stack
    devices = backends.visible_gpus()
    leased = stack.enter_context(backends.lease(settings.gpus, devices, settings.deadline))
    if leased is None:
        stack.close()
        reason = (
            f"needs {settings.gpus} GPU(s) of {len(devices)}, and other tests (other xdist "
            f"workers) held them for {settings.deadline:g} s; run fewer workers (-n)"
        )
        if item.config.getoption("--require-gpu"):  # a GPU job must not pass by skipping
            pytest.fail(f"--require-gpu: this GPU test cannot run here: {reason}", pytrace=False)
        pytest.skip(reason)
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(leased)
    stack.callback(_restore_env, "CUDA_VISIBLE_DEVICES", previous)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Give back the GPUs a test leased, after its fixtures are torn down; kill the warm
    worlds when the next test is in another module (or there is none)."""
    stack = item.stash.get(_leases, None)
    if stack is not None:
        stack.close()
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        warm.close_all()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """No warm rank outlives the session."""
    warm.close_all()


def _warm(item: pytest.Item, settings: _config.Settings, options: dict[str, Any]) -> bool:
    """Whether this call runs in a warm world: the test asks for one (``warm_world``
    marker, not ``warm_world(False)``), leases no GPU, and uses only options warm serves."""
    marker = item.get_closest_marker(warm.MARKER)
    if marker is None:
        return False
    given = [*marker.args, *marker.kwargs.values()]
    if (
        len(given) > 1
        or set(marker.kwargs) - {"enabled"}
        or any(type(v) is not bool for v in given)
    ):
        pytest.fail(
            f"harness configuration: @pytest.mark.warm_world takes one True or False "
            f"(enabled=...), got args {marker.args!r} kwargs {marker.kwargs!r}",
            pytrace=False,
        )
    return (given or [True])[0] and not settings.gpus and warm.suits(options)


RunRanks = Callable[..., RankResults]


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
    return _config.world_size_of(request.node, _default_size(request.config))


@pytest.fixture(name="run_ranks")
def _run_ranks(request: pytest.FixtureRequest, tmp_path: Path, world_size: int) -> RunRanks:
    """Run a rank function on N processes and return each rank's return value.

    ``run_ranks(fn, *args, **options)`` calls ``fn(rank, world_size, *args)`` in every rank,
    inside a fresh process group, and returns a list of the return values (rank order) with
    the ranks' printed output in ``.outputs``. ``fn`` may be defined in the test file itself.
    Defaults come from the test's markers and the command line; keyword options
    (``world_size``, ``backend``, ``init_method``, ``timeout``, ``fn_kwargs``, ``env``)
    override them for one call. ``backend=None`` starts the ranks without a process group,
    for functions that set up their own (RPC, several groups). ``may_exit={rank, ...}`` names
    ranks whose death is part of the test: theirs is recorded as a ``RankExited`` result.

    A rank that calls ``pytest.skip`` skips the test; any other failure fails it with that
    rank's traceback, where the other ranks were, and every rank's output. The logs live
    in the test's ``tmp_path``.
    """
    item = request.node
    settings = item.stash.get(_settings, None)
    if settings is None:  # an item our collection hook did not see: read it now
        try:
            settings = _config.read(
                item,
                request.config.stash[_default_deadline],
                request.config.getoption("--init-method") or _config.DEFAULT_INIT_METHOD,
                _default_size(request.config),
            )
        except _config.ConfigError as exc:
            pytest.fail(f"harness configuration: {exc}", pytrace=False)
    cap = item.stash.get(_deadline_cap, float("inf"))
    calls = iter(range(1_000_000))
    checking_collectives = request.config.getoption("--check-collectives") or (
        settings.check_collectives
    )

    def run(fn: Callable[..., Any], *args: Any, **options: Any) -> RankResults:
        __tracebackhide__ = True
        options.setdefault("world_size", world_size)
        options.setdefault("backend", settings.backend)
        options.setdefault("init_method", settings.init_method)
        options.setdefault("timeout", settings.deadline)
        # Never wait past pytest-timeout: the harness must report (stacks) before it fires.
        if isinstance(options["timeout"], (int, float)) and options["timeout"] > cap:
            options["timeout"] = cap
        options.setdefault("log_dir", tmp_path / f"ranks-{next(calls)}")
        if request.config.getoption("--rank-pdb") is not None:
            options.setdefault("debug_rank", request.config.getoption("--rank-pdb"))
        if checking_collectives:  # the caller's own env= entries win
            options["env"] = {**CHECK_COLLECTIVES, **(options.get("env") or {})}
        world = request.config.stash.get(_world, None)
        try:
            if world is not None:
                if options["world_size"] != world.launch.world_size:
                    pytest.skip(launched.size_mismatch(options["world_size"], world.launch))
                results = launched.run(world, fn, *args, **options)
            elif _warm(item, settings, options):
                results = warm.run(fn, *args, **options)
            else:
                results = run_ranks(fn, *args, **options)
        except RankSkipped as skip:
            pytest.skip(f"rank {skip.rank}: {skip.reason}")
        except RankXFailed as xfail:
            pytest.xfail(f"rank {xfail.rank}: {xfail.reason}")
        except RankError as error:
            error.in_message = False  # stacks and outputs go to report sections instead
            raise
        if world is not None:  # each rank's own capture has it; rank 0 shows them all
            return results
        # Show what the ranks printed in pytest's "Captured stdout" section.
        for rank, text in enumerate(results.outputs):
            if text.strip():
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        return results

    return run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Lead a failed multi-rank test's report with its cause; details in sections (``report``)."""
    rep = yield
    if call.when == "call":
        warm.test_ended(failed=rep.failed)  # a failed test's warm world is not reused
    if call.excinfo is not None:
        report.rewrite(rep, call.excinfo.value)
    return rep
