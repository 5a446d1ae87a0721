"""What the rank forkserver imports before its first rank, as a pytest session decides it.

Ranks are forked from a server that has imported torch once (``forkserver``). Under pytest
it also imports, by default with no setting:

* pytest and the plugin (``PYTEST_PRELOAD``): a test module imports pytest;
* what the session's test files import at module level (the *plan*, read by the server's
  ``forkserver.probe``, which scans them with ``importscan`` and imports what is safe):
  the library under test, so a rank that imports its test module again finds it loaded.
  With them, torch's own modules the files import anywhere, and what torch will import
  lazily for what they use (``importscan.LAZY``: ``torch._dynamo`` for an optimizer or DDP).
  Off with the ini value ``rank_preload_test_imports = false`` (what torch imports lazily
  is still read); one module (and its submodules) kept out with ``rank_preload_exclude``;
  under ``pytest -n N`` read from the files' source in the server the xdist controller
  starts before any worker collects;
* the ini value ``rank_preload``: modules the tests import elsewhere (inside a rank function,
  say). Given with ``-o`` several times, every value counts (pytest keeps the last).

The server is one per process, and its preload is decided when it starts: an in-process
pytester session run inside another session keeps the outer session's plan, started or not.

**When it starts** (``start_early``, ``start_or_stop``): at the session's start, once its
plan is known, when the files it will collect name ``run_ranks``: the server imports its
preload while pytest collects, and the first test does not wait for it. After collection
the session knows: a server no selected test needs (``-k plain_test``) is killed, and one the
files did not announce (a fixture in a conftest calls ``run_ranks``) is started then. Never
for ``--collect-only``, under torchrun (no forkserver) or in an xdist worker (the
controller's server); the ini value ``rank_forkserver_early = false`` starts it at the first
rank instead, as before. A start that fails is raised by the first ``run_ranks``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tutorial_impl.testing.fixtures import SETTINGS
from tutorial_impl.testing.forkserver import importscan
from tutorial_impl.testing.forkserver import server as rank_server
from tutorial_impl.testing.settings.config import uses_the_harness

HELP_PRELOAD = (
    "modules the rank forkserver imports once, besides what the test files import, so each "
    "rank starts with them loaded (repeatable with -o)"
)
HELP_TEST_IMPORTS = (
    "the rank forkserver imports what the collected test files import at module level "
    "(guarded: a module that raises or starts a thread there is left to the ranks)"
)
HELP_EXCLUDE = (
    "modules (with their submodules) the rank forkserver must not import for the test files"
)

HELP_EARLY = (
    "start the rank forkserver when the session starts, behind collection, so that the "
    "first test does not wait for it (false: at the first test that needs ranks)"
)
HARNESS_WORD = b"run_ranks"  # a test file that may start ranks names the fixture or function
NO_TEST_RUN = ("collectonly", "showfixtures", "show_fixtures_per_test", "setuponly", "setupplan")
_started_early = pytest.StashKey[bool]()  # this session started the process's server


def addini(parser: pytest.Parser) -> None:
    parser.addini("rank_preload", HELP_PRELOAD, type="linelist", default=[])
    parser.addini("rank_preload_test_imports", HELP_TEST_IMPORTS, type="bool", default=True)
    parser.addini("rank_preload_exclude", HELP_EXCLUDE, type="linelist", default=[])
    parser.addini("rank_forkserver_early", HELP_EARLY, type="bool", default=True)


def explicit(config: pytest.Config) -> list[str]:
    """The ``rank_preload`` modules: every ``-o rank_preload=...`` given (pytest's getini
    keeps only the last), else the ini file's."""
    given = [
        value
        for name, _, value in (o.partition("=") for o in config.option.override_ini or [])
        if name.strip() == "rank_preload"
    ]
    if not given:
        return list(config.getini("rank_preload"))
    return [module for value in given for module in value.split()]


def plan(config: pytest.Config) -> dict[str, Any]:
    """What the forkserver reads (``forkserver.probe``): the ``rank_preload`` modules, and
    how to find the test files' imports (``importscan``; torch's lazy ones only when off)."""
    return {"rank_preload": explicit(config), "test_files": _test_files(config)}


def _test_files(config: pytest.Config) -> dict[str, Any]:
    """The walk; with ``rank_preload_test_imports = false``, for ``importscan.LAZY`` only
    (what torch itself will import in the ranks, not the files' imports)."""
    walk = _walk(config)
    if not config.getini("rank_preload_test_imports"):
        walk["torch_only"] = True
    return walk


def _walk(config: pytest.Config) -> dict[str, Any]:
    """How to find the files the session will collect (``importscan.test_files``)."""
    here = str(config.invocation_params.dir)
    option = config.option
    return {
        "args": list(config.args),
        "invocation_dir": here,
        "python_files": list(config.getini("python_files")),
        "norecursedirs": list(config.getini("norecursedirs")),
        "ignore": [os.path.abspath(os.path.join(here, p)) for p in option.ignore or []],
        "ignore_glob": list(option.ignore_glob or []),
        "collect_in_virtualenv": bool(option.collect_in_virtualenv),
        "importmode": str(config.getoption("importmode")),
        "exclude": list(config.getini("rank_preload_exclude")),
    }


def configure(config: pytest.Config, always: list[str]) -> None:
    """Tell this process's forkserver what to preload for ``config``'s session: ``always``
    (modules of ours, imported as they are), then the plan (``rank_preload`` and the test
    files' imports, guarded); the plan is given back at the session's end.

    A session inside another (an in-process pytester run) leaves the outer session's plan
    in place: the server is the process's, and the outer session's ranks, which may start
    after the inner session has started the server, must find what their files import."""
    server = rank_server.SERVER
    server.add_preload(always)
    config.pluginmanager.register(EarlyStart(), "tutorial-impl-early-forkserver")
    if server.plan is not None:  # lent by an enclosing session, until that one ends
        return
    server.plan = plan(config)

    def restore() -> None:
        server.plan = None

    config.add_cleanup(restore)


class EarlyStart:
    """The hooks that start the rank forkserver behind collection (registered by
    ``configure``, for a session that plans one)."""

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        start_early(session.config)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        config = session.config
        stops = session.testsfailed and not config.option.continue_on_collection_errors
        needs = not stops and any(_needs_ranks(item) for item in session.items)
        start_or_stop(config, needs)  # (a collection error stops the session: none needed)


def _needs_ranks(item: pytest.Item) -> bool:
    """A test of the harness whose markers it read and found runnable here (``SETTINGS``:
    not failed in its setup for a marker it cannot honour), not skipped."""
    skipped = item.get_closest_marker("skip") is not None
    return SETTINGS in item.stash and uses_the_harness(item) and not skipped


def start_early(config: pytest.Config) -> None:
    """At the session's start (its plan set by ``configure``): start the process's server
    now, behind collection, if the session may need ranks: not ``--collect-only``, and the
    files it will collect name ``run_ranks`` (read, not imported: milliseconds)."""
    if not config.getini("rank_forkserver_early") or _runs_no_test(config):
        return
    server = rank_server.SERVER
    if config.pluginmanager.get_plugin("dsession") is not None:
        return  # the xdist controller: ``pytest_configure_node`` starts it for its workers
    if server.started or server.shared or not _may_start_ranks(config):
        return
    config.stash[_started_early] = True
    server.start()


def start_or_stop(config: pytest.Config, needs_ranks: bool) -> None:
    """After collection, when the session knows whether a selected test ``needs_ranks``:
    start the server the files did not announce, or kill the one no test will use."""
    server = rank_server.SERVER
    if needs_ranks and config.getini("rank_forkserver_early") and not _runs_no_test(config):
        server.start()  # nothing if started (or failed: the first test says why)
    elif not needs_ranks and config.stash.get(_started_early, False):
        server.stop()
        server.failed = None  # a failure nobody will meet


def _runs_no_test(config: pytest.Config) -> bool:
    """``--collect-only``, ``--fixtures``, ``--fixtures-per-test``, ``--setup-only`` and
    ``--setup-plan`` collect, but run no test's body."""
    return any(getattr(config.option, name, False) for name in NO_TEST_RUN)


def _may_start_ranks(config: pytest.Config) -> bool:
    """Whether a file the session will collect names ``run_ranks`` (the first that does ends
    the walk; ``importscan`` bounds it: files, bytes)."""
    for file in importscan.test_files(_walk(config)):
        try:
            with open(file, "rb") as f:
                if HARNESS_WORD in f.read(importscan.MAX_BYTES):
                    return True
        except OSError:
            continue  # pytest reports a file it cannot read
    return False


def summary(config: pytest.Config) -> list[str]:
    """Lines for pytest's summary: the modules the forkserver would not import, and those it
    imported though they harm a forkserver, each with the reason; none when all were fine,
    or when the server was started for another session."""
    started = getattr(rank_server.SERVER.server, "plan", None)  # what the server was given
    mine = plan(config)
    if started is None or any(started.get(key) != mine[key] for key in mine):
        return []
    report = rank_server.SERVER.report() or {}
    lines = [f"not preloaded: {m}: {why}" for m, why in report.get("dropped", {}).items()]
    lines += [f"preloaded, but {m} {why}" for m, why in report.get("unsafe", {}).items()]
    return lines


def write_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """``summary`` under its own heading in pytest's terminal summary, if it has lines."""
    lines = summary(config)
    if lines:
        terminalreporter.write_sep("-", "rank forkserver preload")
        for line in lines:
            terminalreporter.write_line(line)
