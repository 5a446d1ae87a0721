"""A failed multi-rank test in pytest's report: the cause on one line, the rest in sections.

pytest shows a failure in several places, and each reads something different:

* the **short summary** (``-ra``, CI logs) and ``--tb=no``: one line per test, taken from
  ``report.longrepr.reprcrash.message``. We put the exception's headline there, the cause:
  ``rank 1 raised ValueError: boom on one``, not the exception class's dotted name.
* the **traceback** (``--tb=long``/``short``): the exception's text, which under pytest is
  the headline and the failing rank's own traceback only;
* **report sections**, the ``----- Captured stdout call -----`` blocks: here each other
  rank's Python stacks (where it was when the test failed) and what each rank printed, one
  section per rank. junit XML's ``system-out`` carries what each rank printed
  (``for_junit``), with ``junit_logging = system-out`` or ``all``.

``pytest_runtest_makereport`` (in ``plugin.py``) calls ``rewrite`` on every call-phase report.
"""

from __future__ import annotations

from typing import Any

from tutorial_impl.testing.verdict.errors import RankError, RankTimeout, prefixed, stack_text

DEADLINE_ADVICE = (
    "the ranks had {timeout:g} s (the harness deadline); give this test more with "
    "@pytest.mark.rank_timeout(SECONDS), or every test with --rank-timeout SECONDS"
)


def sections(error: RankError) -> list[tuple[str, str]]:
    """The report sections of one failure: stacks first (the diagnosis), then outputs."""
    found = []
    if isinstance(error, RankTimeout) and error.timeout is not None:
        found.append(("harness deadline", DEADLINE_ADVICE.format(timeout=error.timeout)))
    found += [
        (f"Python stacks of rank {rank}", stack_text(text))
        for rank, text in sorted(error.stacks.items())
    ]
    found += [
        (f"output of rank {rank}", prefixed(rank, text))
        for rank, text in sorted(error.outputs.items())
        if text.strip()
    ]
    return found


def rewrite(report: Any, error: BaseException, item: Any = None) -> None:
    """Lead ``report`` with ``error``'s cause and give its details sections of their own;
    each rank's output also goes to ``item``'s captured stdout, for junit XML (``for_junit``)."""
    if not isinstance(error, RankError) or not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        crash.message = error.headline
    for title, text in sections(error):
        report.sections.append((title, text))
    if item is not None:
        for key, text in for_junit(error):
            item.add_report_section(report.when, key, text)


def for_junit(error: RankError) -> list[tuple[str, str]]:
    """Each rank's output as a captured-stdout section (``Captured stdout (rank 1) call``).
    junit XML's ``system-out`` (``junit_logging = system-out`` or ``all``) is written from
    the test's teardown report, whose sections are the item's captured ones: the sections
    ``rewrite`` gives the failed call's report never reach it. Each line names its rank."""
    return [
        (f"stdout (rank {rank})", prefixed(rank, text).rstrip("\n") + "\n")
        for rank, text in sorted(error.outputs.items())
        if text.strip()
    ]
