"""What the rank forkserver imports before its first rank, as a pytest session decides it.

Ranks are forked from a server that has imported torch once (``forkserver``). Under pytest
it also imports, by default with no setting:

* pytest and the plugin (``PYTEST_PRELOAD``): a test module imports pytest;
* what the session's test files import at module level (the *plan*, read by the server's
  ``forkserver_preload``, which scans them with ``importscan`` and imports what is safe):
  the library under test, so a rank that imports its test module again finds it loaded.
  Off with the ini value ``rank_preload_test_imports = false``; one module (and its
  submodules) kept out with ``rank_preload_exclude``; under ``pytest -n N`` read from the
  files' source in the server the xdist controller starts before any worker collects;
* the ini value ``rank_preload``: modules the tests import elsewhere (inside a rank function,
  say). Given with ``-o`` several times, every value counts (pytest keeps the last).

The server is one per process, and its preload is decided when it starts: an in-process
pytester session inside a session that already has ranks keeps the outer session's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tutorial_impl.testing.forkserver import server as forkserver

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


def addini(parser: pytest.Parser) -> None:
    parser.addini("rank_preload", HELP_PRELOAD, type="linelist", default=[])
    parser.addini("rank_preload_test_imports", HELP_TEST_IMPORTS, type="bool", default=True)
    parser.addini("rank_preload_exclude", HELP_EXCLUDE, type="linelist", default=[])


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
    """What the forkserver reads (``forkserver_preload``): the ``rank_preload`` modules, and
    how to find the test files' imports (``importscan``; None when that is off)."""
    return {"rank_preload": explicit(config), "test_files": _test_files(config)}


def _test_files(config: pytest.Config) -> dict[str, Any] | None:
    if not config.getini("rank_preload_test_imports"):
        return None
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
    files' imports, guarded); the plan is given back at the session's end."""
    server = forkserver.SERVER
    server.add_preload(always)
    before = server.plan
    server.plan = plan(config)

    def restore() -> None:
        server.plan = before

    config.add_cleanup(restore)


def summary(config: pytest.Config) -> list[str]:
    """Lines for pytest's summary: the modules the forkserver would not import, and those it
    imported though they harm a forkserver, each with the reason; none when all were fine,
    or when the server was started for another session."""
    started = getattr(forkserver.SERVER.server, "plan", None)  # what the server was given
    mine = plan(config)
    if started is None or any(started.get(key) != mine[key] for key in mine):
        return []
    report = forkserver.SERVER.report() or {}
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
