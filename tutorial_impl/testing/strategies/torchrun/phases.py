"""One verdict per test phase for the workers of a torchrun job, agreed through the store.

Every worker runs each test itself (``strategies.torchrun.session``) and publishes how each
phase went
(a ``Verdict``); these functions turn every rank's verdict into the one report every rank
gives: failed if any rank failed or exited, else skipped if any skipped, else passed, with
the other ranks' failures in rank 0's report. ``collection_problem`` and
``lockstep_problem`` say why the ranks cannot (or can no longer) run the same tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest._code.code import ReprFileLocation

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose import stacks
from tutorial_impl.testing.settings.timing import COLLECT_TIMEOUT


@dataclass
class Verdict:
    """How one phase of one test went on one rank, as the other ranks need to know it."""

    nodeid: str
    when: str
    outcome: str  # passed / failed / skipped
    text: str  # the traceback, or the skip reason
    headline: str
    skip: tuple[str, int | None, str] | None  # pytest's (path, line, reason) of a skip
    wasxfail: str | None
    sections: list[tuple[str, str]] = field(default_factory=list)


class RemoteRepr:
    """A failure that happened on another rank, as rank 0's report shows it."""

    def __init__(self, text: str, headline: str) -> None:
        self.text = text
        self.reprcrash = ReprFileLocation("", 0, headline)

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line, red=line.startswith("E "))

    def __str__(self) -> str:
        return self.text


def collection_problem(got: dict[int, dict[str, Any]], world_size: int) -> str | None:
    """Why these ranks cannot run in lockstep (different tests, collection errors), or None."""
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        return (
            f"rank(s) {', '.join(map(str, missing))} did not finish collecting within "
            f"{COLLECT_TIMEOUT:g} s; no test was run"
        )
    broken = {r: g["errors"] for r, g in got.items() if g["errors"]}
    if broken:
        return "collection errors, so no test was run:\n" + "\n".join(
            f"  rank {r}: {e}" for r, errors in sorted(broken.items()) for e in errors
        )
    first = got[0]["ids"]
    for rank in range(1, world_size):
        ids = got[rank]["ids"]
        if ids == first:
            continue
        where = next(
            (i for i, (a, b) in enumerate(zip(first, ids, strict=False)) if a != b),
            min(len(first), len(ids)),
        )
        a = first[where] if where < len(first) else "(nothing: its list ends)"
        b = ids[where] if where < len(ids) else "(nothing: its list ends)"
        return (
            f"the ranks collected different tests, so no test was run: rank 0 has "
            f"{len(first)}, rank {rank} has {len(ids)}; at position {where + 1} rank 0 has "
            f"{a} and rank {rank} has {b}. Every rank must collect the same tests in the "
            "same order: the same files, options (-k, -m) and plugins, and no collection "
            "that depends on the rank or the host"
        )
    return None


def job_status(got: dict[int, int], world_size: int) -> int:
    """The one exit status of the job: the first non-zero status in rank order, a rank that
    sent none (its worker is gone) counting as failed. Never rank 0's alone: a job in which
    a worker vanished has failed, whatever rank 0's tests did."""
    failed = int(pytest.ExitCode.TESTS_FAILED)
    statuses = [got.get(rank, failed) for rank in range(world_size)]
    return next((status for status in statuses if status), 0)


def verdict_of(rep: pytest.TestReport) -> Verdict:
    crash = getattr(rep.longrepr, "reprcrash", None)
    skip = rep.longrepr if rep.skipped and isinstance(rep.longrepr, tuple) else None
    text = rep.longreprtext if rep.failed else (skip[2] if skip else "")
    headline = getattr(crash, "message", "") or (text.strip().splitlines() or [""])[-1]
    return Verdict(
        rep.nodeid,
        rep.when or "",
        rep.outcome,
        text,
        headline,
        tuple(skip) if skip else None,  # type: ignore[arg-type]
        getattr(rep, "wasxfail", None),
        list(rep.sections),
    )


def agree(
    rep: pytest.TestReport,
    mine: Verdict,
    got: dict[int, Verdict],
    rank: int,
    world_size: int,
    stacks_of: Any,
    lost: dict[int, str] | None = None,
) -> None:
    """Make ``rep`` the verdict every rank reaches: failed if any rank failed, exited (``lost``:
    rank -> how its worker ended, named as exited, not as stuck) or did not answer, else
    skipped if any skipped, else passed. Rank 0's report carries the rest."""
    silent = [r for r in range(world_size) if r not in got and r not in (lost or {})]
    if lost:
        ended = "; ".join(f"rank {r} {how}" for r, how in sorted(lost.items()))
        headline = words.phase_lost(ended, mine.when)
        if mine.outcome == "failed":  # its own failure names the rank gone, and why
            rep.sections.append(("the job", headline))
        else:
            rep.longrepr = RemoteRepr(headline, headline)
        rep.outcome = "failed"
    elif silent:
        _silent(rep, mine, silent, rank, stacks_of)
    else:
        _failed_or_skipped(rep, mine, got)
    _rank0_sections(rep, got)  # every rank: the lowest left reports if rank 0 is lost


def _silent(
    rep: pytest.TestReport, mine: Verdict, silent: list[int], rank: int, stacks_of: Any
) -> None:
    """Ranks that did not answer in time: stuck, with where they were (rank 0 asks)."""
    where = {r: stacks_of(r) for r in silent} if rank == 0 else {}
    places = ", ".join(f"rank {r} {_place(text)}" for r, text in where.items())
    headline = words.phase_unfinished(silent, mine.when, places)
    rep.outcome = "failed"
    if rank == 0:
        rep.longrepr = RemoteRepr(headline, headline)
        for r, text in where.items():
            rep.sections.append((f"Python stacks of rank {r}", text or "(none published)"))


def _failed_or_skipped(rep: pytest.TestReport, mine: Verdict, got: dict[int, Verdict]) -> None:
    failed = [r for r, v in sorted(got.items()) if v.outcome == "failed"]
    skipped = [r for r, v in sorted(got.items()) if v.outcome == "skipped"]
    if failed:
        rep.outcome = "failed"
        if mine.outcome != "failed":  # it failed elsewhere: show where, and why
            other = got[failed[0]]
            text = f"rank {failed[0]} failed:\n{other.text}"
            rep.longrepr = RemoteRepr(text, f"rank {failed[0]}: {other.headline}")
    elif skipped and mine.outcome != "skipped":
        primary = skipped[0]
        other = got[primary]
        rep.outcome = "skipped"
        path, line, reason = other.skip or (rep.location[0], rep.location[1], other.text)
        reason = reason.removeprefix("Skipped: ")  # pytest's own prefix, added again below
        rep.longrepr = (path, line, f"rank {primary}: {reason}")
        if other.wasxfail is not None:
            rep.wasxfail = other.wasxfail


def _rank0_sections(rep: pytest.TestReport, got: dict[int, Verdict]) -> None:
    """The other ranks' failures and sections in rank 0's report. The same failure (a
    run_ranks error every rank raised) is shown once; so are the report sections every rank
    has alike (the stacks of a run_ranks error)."""
    failed = [r for r, v in sorted(got.items()) if v.outcome == "failed"]
    first = got.get(0)
    shown = first if first and first.outcome == "failed" else got[failed[0]] if failed else None
    have = set(rep.sections)
    for r, v in sorted(got.items()):
        if r == 0:
            continue
        if v.outcome == "failed" and (shown is None or v.headline != shown.headline):
            rep.sections.append((f"failure on rank {r}", v.text))
        for title, text in v.sections:
            if (title, text) not in have:
                rep.sections.append((f"{title} (rank {r})", text))


def _place(dump: str) -> str:
    found = stacks.place(stacks.frames_of_dump(dump)) if dump else None
    return str(found) if found else "(no stacks)"


def lockstep_problem(
    mine: Verdict, got: dict[int, Verdict], world_size: int, lost: dict[int, str] | None = None
) -> str | None:
    """Why the session cannot go on: a rank gone or stuck in a test, or ranks in different
    tests."""
    if lost:
        ended = "; ".join(f"rank {r} {how}" for r, how in sorted(lost.items()))
        return f"{ended} in {mine.nodeid} ({mine.when}): {words.WORKERS_EXIT}"
    silent = [r for r in range(world_size) if r not in got]
    if silent:
        return (
            f"rank(s) {', '.join(map(str, silent))} stuck in {mine.nodeid} ({mine.when}) past "
            f"the harness deadline: {words.WORKERS_EXIT}"
        )
    for r, v in sorted(got.items()):
        if (v.nodeid, v.when) != (mine.nodeid, mine.when):
            return (
                f"rank {r} reported {v.nodeid} ({v.when}) while this rank reported "
                f"{mine.nodeid} ({mine.when}): the ranks are out of lockstep; "
                f"{words.SESSION_STOPS}"
            )
    return None
