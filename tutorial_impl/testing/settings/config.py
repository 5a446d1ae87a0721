"""The harness's settings: the defaults in one place, and every marker and option checked once.

A test's settings come from, in order: a ``run_ranks(...)`` keyword (one call), the test's
markers, the command line, the ini file, and the defaults below. This module reads the
markers and options of one test into a frozen ``Settings``, *checking each one where it is
read*: a marker with an argument the harness does not understand is a ``ConfigError`` naming
the marker, the argument and what is accepted. The plugin turns that into a failure of that
one test before any rank starts (never an INTERNALERROR that ends the session, never a
silently ignored argument); a bad command-line option or ini value is a ``pytest.UsageError``.

The markers (``pytest --markers`` lists them):

``world_size(n)`` / ``world_size(n1, n2, ...)``
    the number of ranks; several sizes make one test per size (``matrix``). A test may
    instead parametrize the ``world_size`` fixture, ``@pytest.mark.parametrize("world_size",
    [3])``: ``run_ranks`` then runs that many ranks. Using both on one test is refused.
``dist_backend(name)``
    the process-group backend: ``"gloo"`` (default), ``"nccl"``, ``"mpi"``, a per-device form
    such as ``"cpu:gloo,cuda:nccl"``, or ``None`` for ranks that build their own groups.
``dist_gpu(n=1)``
    the test needs n GPUs (skipped at collection otherwise). NCCL tests need one per rank.
``rank_timeout(seconds)``
    the harness deadline for this test's ranks.

``backend`` and ``gpu`` are the deprecated old names of ``dist_backend`` and ``dist_gpu``:
generic names that another project's own markers may use with another meaning, so the plugin
honours them only on tests that use the harness (``run_ranks`` or ``world_size``), with a
deprecation warning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tutorial_impl.testing import backends
from tutorial_impl.testing.settings import matrix
from tutorial_impl.testing.settings.timing import (
    BACKSTOP_MARGIN,
    DEFAULT_DEADLINE,
    SECONDS,
    usable_seconds,
)

# The defaults, the only place they are written (the CLI and the plugin read them here; the
# deadline and every other clock live in ``timing``).
DEFAULT_WORLD_SIZE = matrix.DEFAULT_WORLD_SIZE
DEFAULT_BACKEND = "gloo"
DEFAULT_INIT_METHOD = "env"
__all__ = ["BACKSTOP_MARGIN", "DEFAULT_DEADLINE"]  # re-exported: the settings' one path

# Old marker names, still honoured on harness tests: new name for each.
DEPRECATED_MARKERS = {"backend": "dist_backend", "gpu": "dist_gpu"}
HARNESS_FIXTURES = ("run_ranks", "world_size")


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
    "ranks and process group kept between tests, reset and checked before each reuse, "
    "replaced by a fresh world after anything wrong (see docs/harness.md); "
    "warm_world(False) opts one test out",
    "check_collectives": "check before every collective that all ranks call the same one "
    "(TORCH_DISTRIBUTED_DEBUG=DETAIL in the ranks): a mismatch fails in seconds, not at the "
    "deadline",
    "torch_harness(enabled=True)": "run this module's or class's torch MultiProcessTestCase "
    "tests under torch's own harness, not on the harness's ranks; torch_harness(False) puts "
    "a class back",
}
# The markers, options and ini values that set no field of a call (``call.Source`` names the
# ones that do): what each decides instead (a deprecated marker is its new name's). A test
# holds the plugin to the two lists.
NOT_A_CALL_FIELD = {
    "dist_gpu": "the GPUs leased for the test (backends.lease); skipped without them",
    "warm_world": "which strategy runs the test's calls (fixtures.Session.strategy)",
    "--warm-worlds": "which strategy runs the test's calls (fixtures.Session.strategy)",
    "warm_worlds": "which strategy runs the test's calls (fixtures.Session.strategy)",
    "--warm-audit": "the warm strategy wrapped by audit.Audited",
    "--launcher": "whether this pytest is a worker of a torchrun job",
    "--require-gpu": "a GPU test that cannot run here fails instead of skipping",
    "rank_preload": "what the forkserver imports (preload)",
    "rank_preload_test_imports": "what the forkserver imports (preload)",
    "rank_preload_exclude": "what the forkserver imports (preload)",
    "rank_forkserver_early": "when the forkserver starts (forkserver.plan: with the session)",
    "torch_harness": "whether torch's MultiProcessTestCase tests run here (torchcase)",
    "--torch-harness": "whether torch's MultiProcessTestCase tests run here (torchcase)",
}
HELP_RANK_TIMEOUT = (
    "harness deadline in seconds for every multi-rank test without its own rank_timeout "
    "marker (default: the rank_timeout ini value, else 60). At the deadline every live rank's "
    "Python stacks go into the report, then the ranks are killed"
)
HELP_INIT_METHOD = "how ranks rendezvous: env (default), tcp or file; all are race-free"
HELP_REQUIRE_GPU = (
    "fail, instead of skipping, every test marked dist_gpu or using the nccl backend that this "
    "machine cannot run (no CUDA, too few GPUs, no NCCL), with the reason: for GPU CI jobs, "
    "which must not pass by skipping every GPU test"
)
HELP_CHECK_COLLECTIVES = (
    "check before every collective of every multi-rank test that all ranks call the same one "
    "with the same shapes (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL): ranks in different "
    "collectives then fail in seconds, naming both, instead of hanging until the deadline. "
    "Costs a few times a small collective; the check_collectives marker turns it on for one test"
)
HELP_RANK_PDB = (
    "debug rank N of every multi-rank test: its breakpoint() and the post-mortem of its "
    "exception wait on a local port (printed on the terminal and in the rank's log) for "
    "`python -m tutorial_impl.testing.attach PORT`; the other ranks are held and the harness "
    "deadline paused meanwhile (pytest-timeout still counts: add --timeout 0)"
)
HELP_LAUNCHER = (
    "where rank functions run. fork: fresh ranks forked for each test (the default outside "
    "torchrun). torchrun: this pytest is one worker of a torchrun job (`torchrun "
    "--nproc-per-node=N -m pytest`), run_ranks runs the function here as this rank, the ranks "
    "agree on every verdict, and rank 0 reports. auto (default): torchrun when torchrun's "
    "variables (TORCHELASTIC_RUN_ID, RANK, ...) are set"
)
HELP_WARM_WORLDS = (
    "run every multi-rank test in warm worlds (ranks and process group kept between tests, "
    "reset and checked before each reuse), as the warm_world marker does for a module; "
    "warm_world(False) opts a test out (default: the warm_worlds ini value, else off)"
)
HELP_WARM_AUDIT = (
    "run every warm call on fresh ranks too and fail the test if the two verdicts differ: "
    "proof, for a CI job, that no test depends on what a warm world carried over"
)
HELP_INI_RANK_TIMEOUT = "default harness deadline in seconds"
HELP_INI_WARM_WORLDS = "run every multi-rank test in warm worlds"


class ConfigError(ValueError):
    """A marker, option or argument the harness cannot honour; the message says which."""


@dataclass(frozen=True)
class Settings:
    """What one test runs with, checked. ``gpus`` counts the GPUs the test leases."""

    world_size: int
    backend: str | None
    deadline: float
    init_method: str
    gpus: int
    uses_harness: bool
    check_collectives: bool = False  # the check_collectives marker (see torchenv)
    warm: bool | None = None  # the warm_world marker: None without one


def _call(marker: Any) -> str:
    """How the marker was written: ``@pytest.mark.backend(name='nccl')``."""
    args = [repr(a) for a in marker.args] + [f"{k}={v!r}" for k, v in marker.kwargs.items()]
    return f"@pytest.mark.{marker.name}({', '.join(args)})"


def _one(marker: Any, keyword: str | None, accepted: str) -> Any:
    """The single argument of a one-argument marker, positional or as ``keyword=``."""
    unknown = sorted(set(marker.kwargs) - ({keyword} if keyword else set()))
    if unknown:
        raise ConfigError(
            f"{_call(marker)}: unknown keyword argument {unknown[0]!r}; accepted: {accepted}"
        )
    given = list(marker.args) + list(marker.kwargs.values())
    if len(given) != 1:
        raise ConfigError(f"{_call(marker)}: expected one argument; accepted: {accepted}")
    return given[0]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _marker(item: Any, name: str, uses_harness: bool) -> Any:
    """The closest ``name`` marker, or its deprecated alias on a harness test."""
    marker = item.get_closest_marker(name)
    for old, new in DEPRECATED_MARKERS.items():
        if new == name and marker is None and uses_harness:
            marker = item.get_closest_marker(old)
    return marker


def deprecated_markers_on(item: Any) -> list[str]:
    """The deprecated marker names this harness test uses (for the warning)."""
    if not uses_the_harness(item):
        return []
    return [old for old in DEPRECATED_MARKERS if item.get_closest_marker(old) is not None]


def uses_the_harness(item: Any) -> bool:
    return any(name in getattr(item, "fixturenames", ()) for name in HARNESS_FIXTURES)


SINGLE = ("world_size", "dist_backend", "dist_gpu", "rank_timeout", "warm_world")


def stacked(item: Any) -> None:
    """Refuse two markers of one name stacked on one function: only one would count."""
    own = getattr(getattr(item, "obj", None), "pytestmark", [])
    for name in SINGLE:
        found = [m for m in own if getattr(m, "name", None) == name]
        if len(found) > 1:
            raise ConfigError(
                f"{item.nodeid}: {len(found)} {name} markers on one test "
                f"({', '.join(_call(m) for m in found)}); only one would count: keep one"
            )


def world_size_of(item: Any, default: int = DEFAULT_WORLD_SIZE) -> int:
    """The world size: a parametrized ``world_size``, a matrix entry, the marker, or
    ``default`` (2; under torchrun, the job's size)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    marker = item.get_closest_marker("world_size")
    if marker is not None and len(marker.args) > 1 and matrix.FIXTURE not in params:
        try:
            matrix.sizes(marker)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        raise ConfigError(
            f"{_call(marker)} makes one test per size for the run_ranks or world_size "
            "fixture, and this test uses neither"
        )
    if "world_size" in params:
        size = params["world_size"]
        if marker is not None or matrix.FIXTURE in params:
            raise ConfigError(
                f"{item.nodeid}: the world size is given twice, by parametrize('world_size', "
                f"...) and by {_call(marker)}; use one of them"
            )
        if not _positive_int(size):
            raise ConfigError(
                f"parametrize('world_size', ...): {size!r} is not a world size; "
                "accepted: positive integers"
            )
        return _within_the_host(size, "parametrize('world_size', ...): world size")
    if matrix.FIXTURE in params:
        return int(params[matrix.FIXTURE])
    if marker is None:
        return default
    size = _one(marker, "n", "world_size(n) or world_size(n1, n2, ...) with positive integers")
    if not _positive_int(size):
        raise ConfigError(f"{_call(marker)}: {size!r} is not a world size; accepted: an int >= 1")
    return _within_the_host(size, f"{_call(marker)}: world size")


def _within_the_host(size: int, what: str) -> int:
    try:
        return matrix.check_world_size(size, what)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def deadline_option(value: Any, source: str) -> float | None:
    """``--rank-timeout`` or the ``rank_timeout`` ini value, checked (None: not given)."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {value!r} is not a number of seconds") from None
    if not usable_seconds(seconds):
        raise ConfigError(f"{source}: {value!r}; accepted: {SECONDS}")
    return seconds


def warm_marker(item: Any) -> bool | None:
    """The closest ``warm_world`` marker's value (None without one), checked."""
    marker = item.get_closest_marker("warm_world")
    if marker is None:
        return None
    given = [*marker.args, *marker.kwargs.values()]
    if (
        len(given) > 1
        or set(marker.kwargs) - {"enabled"}
        or any(type(v) is not bool for v in given)
    ):
        raise ConfigError(
            f"{_call(marker)}: takes one True or False (enabled=...), or nothing for True"
        )
    return given[0] if given else True


def read(
    item: Any,
    default_deadline: float,
    init_method: str,
    default_world_size: int = DEFAULT_WORLD_SIZE,
) -> Settings:
    """Every harness marker of ``item``, checked, over the session's defaults."""
    uses_harness = uses_the_harness(item)
    stacked(item)
    world_size = world_size_of(item, default_world_size)

    backend: str | None = DEFAULT_BACKEND
    marker = _marker(item, "dist_backend", uses_harness)
    if marker is not None:
        backend = _one(marker, None, 'dist_backend("gloo" | "nccl" | "mpi" | "cpu:gloo,...")')
        try:
            backends.check(backend)
        except ValueError as exc:
            raise ConfigError(f"{_call(marker)}: {exc}") from None
    refusal = backends.mpi_refusal(backend, world_size) if uses_harness else None
    if refusal:
        raise ConfigError(refusal)

    gpus = 0
    marker = _marker(item, "dist_gpu", uses_harness)
    if marker is not None:
        gpus = 1 if not marker.args and not marker.kwargs else _one(marker, "n", "dist_gpu(n=1)")
        if not _positive_int(gpus):
            raise ConfigError(
                f"{_call(marker)}: {gpus!r} is not a number of GPUs; accepted: dist_gpu(n) "
                "with an int n >= 1, or dist_gpu for one"
            )

    deadline = default_deadline
    marker = item.get_closest_marker("rank_timeout")
    if marker is not None:
        deadline = _one(marker, "seconds", "rank_timeout(seconds) with a positive number")
        if not usable_seconds(deadline):
            raise ConfigError(f"{_call(marker)}: {deadline!r}; accepted: {SECONDS}")
    marker = item.get_closest_marker("check_collectives")
    if marker is not None and (marker.args or marker.kwargs):
        raise ConfigError(
            f"{_call(marker)}: takes no arguments; accepted: @pytest.mark.check_collectives "
            "(leave the marker out for no checking)"
        )
    return Settings(
        warm=warm_marker(item),
        world_size=world_size,
        backend=backend,
        deadline=float(deadline),
        init_method=init_method,
        gpus=backends.gpus_needed(backend, world_size, gpus),
        uses_harness=uses_harness,
        check_collectives=marker is not None,
    )


def under_backstop(deadline: float, backstop: float | None) -> float:
    """The harness deadline, lowered if needed so the harness reports before pytest-timeout.

    ``backstop`` is the limit a test's own ``@pytest.mark.timeout`` sets (None or 0 for
    none). The user's limit stands; the harness takes its stacks early enough to report
    first, leaving a quarter of the limit (at most ``BACKSTOP_MARGIN``) for the rest of the
    test and the report. (A session-wide limit, ``--timeout``, ``PYTEST_TIMEOUT`` or the ini
    value, is a backstop instead: the plugin raises it above the deadline of each test.)
    """
    if not backstop or backstop <= 0:
        return deadline
    return min(deadline, backstop - min(BACKSTOP_MARGIN, backstop / 4))


def _pytest_timeout(item: Any) -> float | None:
    """The test's pytest-timeout, from any of its four sources, or None without the plugin
    (``pytest_timeout._get_item_settings`` reads them as pytest-timeout itself does)."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    try:
        import pytest_timeout

        return pytest_timeout._get_item_settings(item).timeout or None
    except Exception:  # another version: its own error will name the problem
        return None


def within_pytest_timeout(item: Any, settings: Settings) -> tuple[Settings, float | None]:
    """``settings`` with a deadline the harness can report within, and the cap on every call
    of the test (None for no cap). The harness, which reports stacks and kills ranks, must
    fire before pytest-timeout (``timing``): a test's own ``timeout`` marker lowers the
    harness deadline under it; a session-wide limit is raised above the deadline instead."""
    import pytest

    limit = _pytest_timeout(item)
    if item.get_closest_marker("timeout") is not None:
        # The test's own limit stands: the harness reports first, inside it.
        cap = under_backstop(float("inf"), limit)
        return dataclasses.replace(settings, deadline=min(settings.deadline, cap)), cap
    if limit and uses_the_harness(item):
        # A session-wide limit is a backstop: keep it above this test's deadline.
        wanted = settings.deadline + BACKSTOP_MARGIN
        if limit < wanted:
            item.add_marker(pytest.mark.timeout(wanted), append=False)
    return settings, None
