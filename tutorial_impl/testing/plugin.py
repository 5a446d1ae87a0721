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
    the command-line options (``--rank-timeout``, ``--init-method``, ``--require-gpu``) and
    ini values (``rank_timeout``, ``rank_preload``), shown under "torch.distributed
    multi-rank harness" in ``pytest --help``.
``pytest_configure``
    registers the markers (so ``--strict-markers`` accepts them and ``pytest --markers``
    lists them) and sets up what ranks preload.
``pytest_generate_tests``
    the world-size matrix: ``@pytest.mark.world_size(1, 2, 4)`` becomes one item per size
    (see ``matrix``).
``pytest_collection_modifyitems``
    after collection, before any test runs: skips what this machine cannot run (no CUDA, too
    few GPUs, no NCCL or MPI) with the reason, or marks it to fail under ``--require-gpu``;
    and keeps pytest-timeout's backstop above each test's harness deadline.
``pytest_runtest_setup``
    fails the tests ``--require-gpu`` refused to skip, before their fixtures run.
fixtures ``run_ranks`` and ``world_size``
    run a rank function on N processes; the size of this test's world.

Markers: ``world_size(n)`` or ``world_size(n1, n2, ...)``, ``backend(name)``, ``gpu(n=1)``,
``rank_timeout(seconds)``, ``slow``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tutorial_impl.testing import matrix
from tutorial_impl.testing import ranks as _ranks
from tutorial_impl.testing.errors import RankResults, RankSkipped
from tutorial_impl.testing.rendezvous import INIT_METHODS, avoid_reverse_dns_stalls
from tutorial_impl.testing.supervisor import DEFAULT_TIMEOUT, run_ranks

MARKERS = {
    "world_size(n, ...)": "run the test's ranks with world size n (default 2); several sizes "
    "make one test per size, with ids [world_sizeN] and markers world_size(n=N)",
    "backend(name)": "process-group backend for the ranks: gloo (default), nccl or mpi",
    "gpu(n=1)": "needs CUDA and at least n GPUs; skipped at collection time otherwise "
    "(a failure under --require-gpu)",
    "rank_timeout(seconds)": "harness deadline for this test's ranks (stack dump, then kill)",
    "slow": "slower end-to-end tests (torchrun, subprocess pytest runs)",
}
# pytest-timeout stays a backstop: it must never fire before the harness deadline does.
BACKSTOP_MARGIN = 30.0
# Imported once by the rank forkserver under pytest: a rank that runs a function of a test
# file imports that file, and the file imports pytest (~0.3 s a rank otherwise).
PYTEST_PRELOAD = ["pytest", __name__]
_refused_skip = pytest.StashKey[str]()  # reason a --require-gpu test would have been skipped


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
        help="fail, instead of skipping, every test marked gpu or using the nccl backend "
        "that this machine cannot run (no CUDA, too few GPUs, no NCCL), with the reason: "
        "for GPU CI jobs, which must not pass by skipping every GPU test",
    )
    parser.addini(
        "rank_timeout", "default harness deadline in seconds", default=str(DEFAULT_TIMEOUT)
    )
    parser.addini(
        "rank_preload",
        "modules the rank forkserver imports once, so each rank starts with them loaded",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers; tell the (not yet started) forkserver what to preload."""
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    _ranks.add_preload([*PYTEST_PRELOAD, *config.getini("rank_preload")])
    avoid_reverse_dns_stalls()  # before any store exists: see its docstring


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


def _marker_arg(item: pytest.Item, name: str, default: Any) -> Any:
    marker = item.get_closest_marker(name)
    if marker is None:
        return default
    if marker.args:
        return marker.args[0]
    return marker.kwargs.get("n", marker.kwargs.get("seconds", default))


def _deadline(config: pytest.Config, item: pytest.Item) -> float:
    per_run = config.getoption("--rank-timeout")
    default = per_run if per_run is not None else float(config.getini("rank_timeout"))
    return float(_marker_arg(item, "rank_timeout", default))


def _wants_gpu(item: pytest.Item) -> bool:
    return item.get_closest_marker("gpu") is not None or _ranks.uses_nccl(
        _marker_arg(item, "backend", "gloo")
    )


def _why_not_here(item: pytest.Item) -> str | None:
    """The reason this test cannot run on this machine, or None. Called before any rank."""
    gpu = item.get_closest_marker("gpu")
    backend = _marker_arg(item, "backend", "gloo")
    if gpu is None and backend == "gloo":
        return None
    import torch
    import torch.distributed as dist

    needed = int(_marker_arg(item, "gpu", 1)) if gpu is not None else 0
    if _ranks.uses_nccl(backend):  # "nccl", or a per-device form such as "cpu:gloo,cuda:nccl"
        needed = max(needed, matrix.world_size_of(item))  # one GPU per rank
        if not dist.is_nccl_available():
            return "NCCL is not available in this build of torch"
    elif backend == "mpi":
        if not dist.is_mpi_available():
            return "MPI backend not available (torch was built without MPI)"
    elif backend != "gloo":
        return None  # an unknown backend is a test error, reported when the ranks start
    if needed:
        if not torch.cuda.is_available():
            return f"needs CUDA and {needed} GPU(s); CUDA is not available"
        if torch.cuda.device_count() < needed:
            return f"needs {needed} GPUs, found {torch.cuda.device_count()}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip (or, under --require-gpu, refuse) what cannot run here; keep the backstop up."""
    require_gpu = config.getoption("--require-gpu")
    timeout_plugin = config.pluginmanager.hasplugin("timeout")
    backstop = float(config.getini("timeout") or 0) if timeout_plugin else 0.0
    for item in items:
        reason = _why_not_here(item)
        if reason and require_gpu and _wants_gpu(item):
            item.stash[_refused_skip] = reason  # failed in pytest_runtest_setup
            continue
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        # Keep pytest-timeout above the harness deadline, so the harness (which reports
        # stacks and kills ranks) always fires first.
        if timeout_plugin and "run_ranks" in getattr(item, "fixturenames", ()):
            wanted = _deadline(config, item) + BACKSTOP_MARGIN
            marker = item.get_closest_marker("timeout")
            current = float(marker.args[0]) if marker and marker.args else backstop
            if current and current < wanted:
                item.add_marker(pytest.mark.timeout(wanted))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a GPU test that --require-gpu kept from being skipped, before its fixtures."""
    reason = item.stash.get(_refused_skip, None)
    if reason is not None:
        pytest.fail(f"--require-gpu: this GPU test cannot run here: {reason}", pytrace=False)


RunRanks = Callable[..., RankResults]


@pytest.fixture(name=matrix.FIXTURE)
def _world_size_matrix(request: pytest.FixtureRequest) -> int | None:
    """This item's entry of a world-size matrix (``request.param``), or None."""
    return getattr(request, "param", None)


@pytest.fixture
def world_size(request: pytest.FixtureRequest, _world_size_matrix: int | None) -> int:
    """The number of ranks this test runs with: its world-size matrix entry, else its
    ``world_size`` marker, else 2. For computing what every rank should have returned."""
    return matrix.world_size_of(request.node)


@pytest.fixture(name="run_ranks")
def _run_ranks(
    request: pytest.FixtureRequest, tmp_path: Path, _world_size_matrix: int | None
) -> RunRanks:
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
    config = request.config
    calls = iter(range(1_000_000))

    def run(fn: Callable[..., Any], *args: Any, **options: Any) -> RankResults:
        __tracebackhide__ = True
        options.setdefault("world_size", matrix.world_size_of(item))
        options.setdefault("backend", _marker_arg(item, "backend", "gloo"))
        options.setdefault("init_method", config.getoption("--init-method") or "env")
        options.setdefault("timeout", _deadline(config, item))
        options.setdefault("log_dir", tmp_path / f"ranks-{next(calls)}")
        try:
            results = run_ranks(fn, *args, **options)
        except RankSkipped as skip:
            pytest.skip(f"rank {skip.rank}: {skip.reason}")
        # Show what the ranks printed in pytest's "Captured stdout" section.
        for rank, text in enumerate(results.outputs):
            if text.strip():
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        return results

    return run
