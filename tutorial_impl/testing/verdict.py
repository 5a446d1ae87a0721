"""The one verdict: every rank's report in, the results or the one error out.

Every way of starting ranks (forked, warm, under torchrun) gathers one ``outcome.Report``
per rank, in the order they arrived, and hands them here; this module alone decides what the
test's verdict is. The rule, in order:

1. **A failure anywhere is the verdict.** A rank that raised or died fails the run, whatever
   the other ranks did: a skip or an xfail on another rank never hides it. The cause named
   first is a rank that *died*, if one did (its peers' "Connection closed" errors follow
   from it), else the first rank whose failure arrived; every other rank that failed is
   named on the same first line.
2. **Then a rank still running.** At the deadline, the ranks not yet ended are a hang: the
   first line says where each was, and how the others had ended. Ranks blocked in a
   collective a returned rank never entered (``Finished.stranded``, ``stranded``) are a
   hang that cannot resolve, said so, whenever the runner saw it. A skip that the other
   ranks outlived (still running ``SKIP_GRACE`` s later) is a failure that says so: they
   might still have failed, and a skip must be taken by every rank.
3. **Then a skip or an xfail** (the lowest rank that took one), recognised by pytest's own
   exception types (``outcome.skip_kind``), never by a class name.
4. **Else every rank returned**: their values, in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tutorial_impl.testing import desync
from tutorial_impl.testing import outcome as _o
from tutorial_impl.testing.errors import (
    RankError,
    RankResults,
    RankTimeout,
    add_to_headline,
    error_for,
    skip_outlived_error,
    timeout_error,
)
from tutorial_impl.testing.faults import Fired
from tutorial_impl.testing.forensics import Place
from tutorial_impl.testing.recorder import Record
from tutorial_impl.testing.stranded import Stranded


@dataclass
class Finished:
    """What a runner gives back: every rank's report and what was seen around them."""

    world_size: int
    reports: dict[int, _o.Report]  # every rank of the world
    order: list[int]  # ranks in the order their reports arrived (first: earliest)
    outputs: dict[int, str]  # what each rank printed
    deadline: float
    stacks: dict[int, str] = field(default_factory=dict)  # ranks still running at the end
    fatal: dict[int, str] = field(default_factory=dict)  # fatal-signal stacks of deaths
    skip_wait: float = 0.0  # how long the others were given after the first skip
    records: dict[int, list[Record]] = field(default_factory=dict)  # at the end, if asked
    fired: dict[int, list[Fired]] = field(default_factory=dict)  # faults injected on purpose
    stranded: Stranded | None = None  # ranks waiting for a returned one (``stranded``)

    @property
    def outcomes(self) -> dict[int, _o.Outcome]:
        return {rank: report.outcome for rank, report in self.reports.items()}

    @property
    def thread_errors(self) -> dict[int, tuple[str, ...]]:
        return {r: rep.thread_errors for r, rep in self.reports.items() if rep.thread_errors}


def cause(outcomes: dict[int, _o.Outcome], order: list[int]) -> int | None:
    """The rank whose failure is the cause (rule 1), or None if no rank failed."""
    failures = [r for r in order if isinstance(outcomes[r], _o.Failure)]
    deaths = [r for r in failures if isinstance(outcomes[r], _o.Died)]
    return (deaths or failures or [None])[0]


def decide(run: Finished) -> RankResults:
    """The results, or raise the one error of this run (the rule above)."""
    __tracebackhide__ = True
    outcomes = run.outcomes
    first = cause(outcomes, run.order)
    error = None
    if first is not None:
        also = {r: o for r, o in outcomes.items() if r != first and isinstance(o, _o.Failure)}
        stacks = {r: text for r, text in run.stacks.items() if r not in also and r != first}
        fatal = run.fatal.get(first, "")
        named = [r for r in also if not _consequence(run, first, r)]
        error = error_for(first, outcomes[first], fatal, run.outputs, stacks, also, named)
    else:
        error = _unfinished_error(run, outcomes)
    skips = sorted(r for r, o in outcomes.items() if isinstance(o, (_o.Skipped, _o.XFailed)))
    if error is None and skips:
        error = error_for(skips[0], outcomes[skips[0]], "", run.outputs)
    if error is not None:
        error.thread_errors = run.thread_errors
        if first is not None:
            _explain_failure(run, error)
        raise error
    results = RankResults(outcomes[r].value for r in range(run.world_size))  # type: ignore[union-attr]
    results.outputs = [run.outputs.get(r, "") for r in range(run.world_size)]
    results.thread_errors = run.thread_errors
    return results


# What a rank's collective raises when a peer process is gone (gloo's words).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _consequence(run: Finished, cause: int, rank: int) -> bool:
    """Whether ``rank``'s failure followed from ``cause``'s death: an exception that came
    after the news of the death, or one that says a peer is gone (its news can arrive before
    the death's: the parent learns of a rank's exit through the forkserver)."""
    outcomes = run.outcomes
    failure = outcomes[rank]
    if not isinstance(outcomes[cause], _o.Died) or not isinstance(failure, _o.Raised):
        return False
    if run.order.index(rank) > run.order.index(cause):
        return True
    return any(words in failure.message for words in PEER_GONE)


def _unfinished_error(run: Finished, outcomes: dict[int, _o.Outcome]) -> Exception | None:
    """Rule 2: the error for ranks still running at the end, or None if all had ended."""
    unfinished = sorted(r for r, o in outcomes.items() if isinstance(o, _o.Unfinished))
    if not unfinished:
        return None
    where = {r: outcomes[r].where for r in unfinished if outcomes[r].where}  # type: ignore[union-attr]
    skips = sorted(r for r, o in outcomes.items() if isinstance(o, (_o.Skipped, _o.XFailed)))
    if skips:
        reason = outcomes[skips[0]].reason  # type: ignore[union-attr]
        return skip_outlived_error(
            skips[0], reason, unfinished, run.skip_wait, run.stacks, run.outputs, where
        )
    if run.stranded is not None:
        return _stranded_error(run, unfinished, where)
    ended = {r: "returned" for r, o in outcomes.items() if isinstance(o, _o.Returned)}
    return timeout_error(
        unfinished,
        run.deadline,
        run.stacks,
        run.outputs,
        where,
        ended,
        explained=_explained(run, where),
        fired=_fired(run),
        waiting=desync.waiting(run.records),
    )


def _stranded_error(run: Finished, unfinished: list[int], where: dict[int, Place]) -> RankTimeout:
    """Ranks that wait in a collective a returned rank never entered: a hang that cannot
    resolve, ended when seen (its ranks ``Stopped``), or at the deadline (``TimedOut``)."""
    assert run.stranded is not None
    early = all(isinstance(run.outcomes[r], _o.Stopped) for r in run.stranded.waiting)
    message = run.stranded.line(early, run.deadline)
    fired = _fired(run)
    if fired:
        message += f" ({fired})"
    timeout = None if early else run.deadline  # more time would not help: no advice to add it
    return RankTimeout(run.stacks, message, run.outputs, unfinished, where, timeout)


def _explained(run: Finished, where: dict[int, Place]) -> str | None:
    """Where the ranks' collectives part, from their records, placed by their stacks."""
    if not run.records:
        return None
    return desync.explain(desync.placed(run.records, where), run.world_size)


def _fired(run: Finished) -> str:
    """``rank 1: injected kill at all_reduce #3``: the faults that fired, for the first line
    (a rank killed on purpose says where; a hang says it was asked for; a raise the rank
    function caught explains why the rank went on), but a raise whose exception is the
    rank's reported failure: its message says it already."""
    said = [(r, f) for r, fs in sorted(run.fired.items()) for f in fs if not _raised(run, r, f)]
    return ", ".join(f"rank {r}: {f}" for r, f in said)


def _raised(run: Finished, rank: int, fired: Fired) -> bool:
    """Whether ``fired`` is a raise whose exception ``rank`` reported as its failure."""
    report = run.reports.get(rank)
    outcome = report.outcome if report is not None else None
    return (
        fired.action == "raise"
        and isinstance(outcome, _o.Raised)
        and outcome.exc_type.endswith("InjectedFault")
        and f" at {fired.point}" in outcome.message
    )


def _explain_failure(run: Finished, error: RankError) -> None:
    """Add to a failure's first line the faults that fired, and, when the ranks' records
    were read (some were still running), a mismatch of their collectives: the cause stays
    first (a gloo size mismatch raises on one rank; the records say which call differed)."""
    fired = _fired(run)
    if fired:
        add_to_headline(error, f" ({fired})")
    if run.records:
        mismatch = desync.explain(run.records, run.world_size, mismatch_only=True)
        if mismatch:
            add_to_headline(error, f"; {mismatch}")
