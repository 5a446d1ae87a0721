"""Coverage of the code that runs inside ranks, when the parent is measuring coverage.

pytest-cov measures the pytest process (and each xdist worker), and coverage.py's own
subprocess support reaches new Python interpreters. Ranks are neither: they are forked from
the rank forkserver, a process that never started coverage. So without help, every line a
test runs *in its ranks* is reported as missed (``ring.py`` at 17% while its tests run all
of it).

The help is small. At each ``run_ranks`` call the parent asks coverage.py whether it is
measuring (``Coverage.current()``, only if coverage is imported at all: without coverage
nothing here runs, not even ``import coverage``). If it is, every rank starts its own
``Coverage`` with the parent's settings (source, branch, config file) and a unique data
suffix, and saves its data file **before** it reports its result: the parent kills a rank
as soon as it has reported, so a save after that would be lost. The files land beside the
parent's data file as ``.coverage.<host>.<pid>.<random>``, which is exactly what pytest-cov
combines at the end of the run (its xdist controller too, from all workers). A rank that
crashes or hangs saves nothing; its test fails anyway.

Under plain ``coverage run -m pytest`` the rank files are written too; combine them with
``coverage combine --append``.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def parent_settings() -> dict[str, Any] | None:
    """In the parent: the settings ranks need to measure like us, or None if we do not."""
    coverage = sys.modules.get("coverage")
    if coverage is None:
        return None
    cov = coverage.Coverage.current()
    if cov is None:
        return None
    config = cov.config
    # Resolved at start, relative to the directory the measurement started in (pytest-cov's
    # rootdir): the rank must not resolve them again against a cwd that may have changed.
    # (``_inorout`` is coverage's own resolution: ``source_dirs`` since 7.9, ``source`` before.)
    inorout = getattr(cov, "_inorout", None)
    dirs = getattr(inorout, "source_dirs", getattr(inorout, "source", None))
    pkgs = getattr(inorout, "source_pkgs", None)
    if dirs is not None and pkgs is not None:
        source = [*dirs, *pkgs] or None  # absolute directories and package names
    else:
        source = config.source
    data = getattr(cov, "_data", None)
    data_file = data.base_filename() if data is not None else os.path.abspath(config.data_file)
    return {
        "data_file": data_file,
        "config_file": config.config_file or False,  # False: read no file (as the parent)
        "source": source,
        "branch": config.branch,
    }


def start_in_rank(settings: dict[str, Any] | None) -> Any:
    """In a rank: start measuring with the parent's settings; returns what ``save`` needs."""
    if settings is None:
        return None
    import coverage

    inherited = coverage.Coverage.current()
    if inherited is not None:  # the forkserver itself was measured: its data would be lost
        inherited.stop()
    cov = coverage.Coverage(data_suffix=True, **settings)
    # A rank sees only part of the source; these warnings would land in every test's output.
    cov._warn_no_data = False
    cov._warn_unimported_source = False
    cov._warn_preimported_source = False
    cov.start()
    return cov


def save(cov: Any) -> None:
    """In a rank, before it reports: stop measuring and write this rank's data file."""
    if cov is None:
        return
    try:
        cov.stop()
        cov.save()
    except Exception as exc:  # noqa: BLE001 - the test's result matters more than its coverage
        print(f"harness: could not save this rank's coverage data: {exc!r}", file=sys.stderr)
