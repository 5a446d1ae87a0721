"""The pytest side of the harness: markers, options, fixtures and collection-time skips.

The root ``conftest.py`` registers this module with ``pytest_plugins``, which is how a
conftest loads a plugin that lives in a package. Everything pytest-specific is here; the
machinery it drives (``supervisor.run_ranks``) knows nothing about pytest.

Markers (all registered below, so ``--strict-markers`` catches typos):

* ``@pytest.mark.world_size(n)``: how many ranks ``run_ranks`` starts (default 2).
* ``@pytest.mark.backend(name)``: ``gloo`` (default), ``nccl`` or ``mpi``.
* ``@pytest.mark.gpu`` / ``@pytest.mark.gpu(n)``: needs CUDA and at least n GPUs.
* ``@pytest.mark.rank_timeout(seconds)``: the harness deadline of this test.

A test that cannot run on this machine (no CUDA, too few GPUs, NCCL or MPI missing) is
skipped in ``pytest_collection_modifyitems``, in the parent, before any rank exists.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tutorial_impl.testing import ranks as _ranks
from tutorial_impl.testing.errors import RankResults, RankSkipped
from tutorial_impl.testing.rendezvous import INIT_METHODS, avoid_reverse_dns_stalls
from tutorial_impl.testing.supervisor import DEFAULT_TIMEOUT, run_ranks

MARKERS = {
    "world_size(n)": "run the test's ranks with world size n (default 2)",
    "backend(name)": "process-group backend for the ranks: gloo (default), nccl or mpi",
    "gpu(n=1)": "needs CUDA and at least n GPUs; skipped at collection time otherwise",
    "rank_timeout(seconds)": "harness deadline for this test's ranks (stack dump, then kill)",
    "slow": "slower end-to-end tests (torchrun, subprocess pytest runs)",
}
# pytest-timeout stays a backstop: it must never fire before the harness deadline does.
BACKSTOP_MARGIN = 30.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dist-harness", "torch.distributed multi-rank harness")
    group.addoption(
        "--rank-timeout",
        type=float,
        default=None,
        help="harness deadline in seconds for every multi-rank test without its own "
        "rank_timeout marker (default: the rank_timeout ini value, else 60)",
    )
    group.addoption(
        "--init-method",
        choices=INIT_METHODS,
        default=None,
        help="how ranks rendezvous: env (default), tcp or file; all are race-free",
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
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    _ranks.add_preload(config.getini("rank_preload"))
    avoid_reverse_dns_stalls()  # before any store exists: see its docstring


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
        needed = max(needed, int(_marker_arg(item, "world_size", 2)))
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
    timeout_plugin = config.pluginmanager.hasplugin("timeout")
    backstop = float(config.getini("timeout") or 0) if timeout_plugin else 0.0
    for item in items:
        reason = _why_not_here(item)
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


RunRanks = Callable[..., RankResults]


@pytest.fixture(name="run_ranks")
def _run_ranks(request: pytest.FixtureRequest, tmp_path: Path) -> RunRanks:
    """Run a rank function on N processes and return each rank's return value.

    ``run_ranks(fn, *args, **options)`` calls ``fn(rank, world_size, *args)`` in every rank,
    inside a fresh process group, and returns a list of the return values (rank order) with
    the ranks' printed output in ``.outputs``. Defaults come from the test's markers and the
    command line; keyword options (``world_size``, ``backend``, ``init_method``, ``timeout``,
    ``fn_kwargs``, ``env``) override them for one call. ``backend=None`` starts the ranks
    without a process group, for functions that set up their own (RPC, several groups).

    A rank that calls ``pytest.skip`` skips the test; any other failure fails it with that
    rank's traceback and every rank's output. The logs live in the test's ``tmp_path``.
    """
    item = request.node
    config = request.config
    calls = iter(range(1_000_000))

    def run(fn: Callable[..., Any], *args: Any, **options: Any) -> RankResults:
        __tracebackhide__ = True
        options.setdefault("world_size", int(_marker_arg(item, "world_size", 2)))
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
