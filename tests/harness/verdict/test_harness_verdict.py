"""The one verdict, rule by rule: ``verdict.decide`` over a table of rank reports.

Every way of starting ranks (forked, warm, torchrun) ends in the same call: each rank's
typed ``Report`` in, the results or one error out. Its rules are written once, in
``verdict.py``'s docstring; here each rule is one row of a table of made-up reports, so a
rule that changes fails a row by name, without a rank started (the conformance suite proves
the same verdicts end to end, in all three strategies). The order is the order in which the
parent read the reports: the rules must not depend on it where a death or an echo is
involved (``test_harness_echo.py`` walks every order of its own cases).
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass

import pytest

from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.verdict.decision import Finished, decide
from tutorial_impl.testing.verdict.errors import (
    RankCrashed,
    RankFailed,
    RankSkipped,
    RankTimeout,
    RankXFailed,
)

CLOSED = (
    "Connection closed by peer [127.0.0.1]:21410. This is typically caused by a remote worker "
    "crashing."
)


def raised(exc_type: str, message: str) -> _o.Raised:
    return _o.Raised(exc_type, message, f"Traceback (most recent call last):\n{exc_type}: x\n")


@dataclass(frozen=True)
class Row:
    rule: str
    outcomes: dict[int, _o.Outcome]
    order: list[int]  # the order the parent read the reports in
    error: type[BaseException] | None  # None: every rank returned
    first_line: str  # a fragment of the headline; the results' repr when error is None


ROWS = [
    Row(
        "every rank returned: the values, in rank order, whatever the arrival order",
        {0: _o.Returned("a"), 1: _o.Returned("b"), 2: _o.Returned("c")},
        [2, 0, 1],
        None,
        "['a', 'b', 'c']",
    ),
    Row(
        "a rank that raised fails the test, named first",
        {0: _o.Returned(0), 1: raised("ValueError", "boom")},
        [0, 1],
        RankFailed,
        "rank 1 raised ValueError: boom",
    ),
    Row(
        "a failure beats a skip on another rank, whichever came first",
        {0: _o.Skipped("no data"), 1: raised("ValueError", "boom")},
        [0, 1],
        RankFailed,
        "rank 1 raised ValueError: boom",
    ),
    Row(
        "a death is the cause of its peers' lost connections, though they arrived first",
        {0: raised("RuntimeError", CLOSED), 1: _o.Killed(signal.SIGKILL)},
        [0, 1],
        RankCrashed,
        "rank 1 was killed by signal SIGKILL before returning a result",
    ),
    Row(
        "a rank's own error is the cause over its peers' echoes, though they arrived first",
        {
            0: raised("RuntimeError", CLOSED),
            1: raised("RuntimeError", CLOSED),
            2: raised("ValueError", "rank 2's own bug"),
        },
        [0, 1, 2],
        RankFailed,
        "rank 2 raised ValueError: rank 2's own bug",
    ),
    Row(
        "an exit without a report is a crash, with its code",
        {0: _o.Returned(0), 1: _o.Exited(3)},
        [0, 1],
        RankCrashed,
        "rank 1 exited with code 3",
    ),
    Row(
        "a rank still running at the deadline is a hang; the others' endings are said",
        {0: _o.Returned(0), 1: _o.TimedOut(None)},
        [0, 1],
        RankTimeout,
        "rank(s) 1 still running after the harness deadline of 60 s; rank 0 had returned",
    ),
    Row(
        "a skip the other ranks outlived is a failure that says so",
        {0: _o.Skipped("no data"), 1: _o.Stopped(None)},
        [0, 1],
        RankTimeout,
        "rank 0 skipped (no data) but rank(s) 1 were still running",
    ),
    Row(
        "a skip every rank took skips the test",
        {0: _o.Skipped("no data"), 1: _o.Skipped("no data")},
        [1, 0],
        RankSkipped,
        "rank 0 skipped: no data",
    ),
    Row(
        "an xfail beside returned ranks is an expected failure",
        {0: _o.Returned(0), 1: _o.XFailed("known bug")},
        [0, 1],
        RankXFailed,
        "rank 1 xfailed: known bug",
    ),
    Row(
        "of skips and xfails, the lowest rank's decides, not the first to arrive",
        {0: _o.XFailed("known bug"), 1: _o.Skipped("no data")},
        [1, 0],
        RankXFailed,
        "rank 0 xfailed: known bug",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.rule for row in ROWS])
def test_each_rule_of_the_verdict(row: Row) -> None:
    reports = {r: _o.Report(o, pid=100 + r, at=0.0) for r, o in row.outcomes.items()}
    run = Finished(len(row.outcomes), reports, row.order, {}, deadline=60.0)
    if row.error is None:
        assert repr(list(decide(run))) == row.first_line
        return
    error = verdict_of(run)
    assert type(error) is row.error, error  # not another rule's error, nor a subclass
    headline = error.headline.splitlines()[0]
    assert row.first_line in headline, headline


def verdict_of(run: Finished) -> BaseException | None:
    """What ``decide`` raised, whatever it was (None: it returned). Never ``pytest.raises``
    here: a ``RankSkipped`` or ``RankXFailed`` that left the test would make the plugin
    skip or xfail it (a planted "a skip replaces another rank's failure" turned the rows
    that expect a failure into skips, and the run stayed green)."""
    try:
        decide(run)
    except BaseException as exc:  # noqa: BLE001 - every kind is compared with the row
        return exc
    return None


def test_a_skip_instead_of_the_rows_failure_fails_the_row(monkeypatch) -> None:
    """The table's own check: a ``decide`` that skips where a row expects a failure fails
    that row (it is never skipped or passed)."""
    import tutorial_impl.testing.verdict.decision as decision

    row = next(r for r in ROWS if r.error is RankFailed)

    def skipping(run: Finished) -> None:
        raise RankSkipped(0, "planted", {})

    monkeypatch.setattr(sys.modules[__name__], "decide", skipping)
    assert decision.decide is not skipping
    with pytest.raises(AssertionError, match="RankSkipped|planted"):
        test_each_rule_of_the_verdict(row)
