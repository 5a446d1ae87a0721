"""The one verdict: every rank's report in, the results or the one error out.

Every way of starting ranks (forked, warm, under torchrun) gathers one ``outcome.Report``
per rank, in the order they arrived, and hands them here; this module alone decides what the
test's verdict is. The rule, in order:

1. **A failure anywhere is the verdict.** A rank that raised or died fails the run, whatever
   the other ranks did: a skip or an xfail on another rank never hides it. The cause named
   first is a rank that *died*, if one did, else a rank that raised an error of its own,
   else the first to arrive: never a peer's "Connection closed by peer", the echo of that
   rank's end, whatever the order of arrival (``echo``). Every other rank that failed of its
   own accord is named on the same first line; an echo whose peers had all *returned* says
   so, in place of gloo's "typically caused by a remote worker crashing".
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

from tutorial_impl.testing.diagnose import desync
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.diagnose.stacks import Place
from tutorial_impl.testing.diagnose.stranded import Stranded
from tutorial_impl.testing.faults.inject import FaultNotFired, Fired, Unfired
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.rank.caught import Caught
from tutorial_impl.testing.verdict import echo
from tutorial_impl.testing.verdict.errors import (
    RankError,
    RankResults,
    RankSkipped,
    RankTimeout,
    RankXFailed,
    add_to_headline,
    error_for,
    set_headline,
    skip_outlived_error,
    timeout_error,
)


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
    # What the parent killed under ranks it stopped (their own kill never came: ``leftovers``).
    swept: dict[int, tuple[_o.Leftover, ...]] = field(default_factory=dict)
    unfired: dict[int, list[Unfired]] = field(default_factory=dict)  # faults never reached
    stranded: Stranded | None = None  # ranks waiting for a returned one (``stranded``)
    # --warm-audit: the same call gathered on fresh ranks (``audit.Audited``), judged too.
    audit: Finished | None = None

    @property
    def as_planned(self) -> bool:
        """Every rank returned and reached every fault planned for it: exactly the runs
        ``decide`` passes (a warm world that served another is not reused)."""
        returned = all(isinstance(o, _o.Returned) for o in self.outcomes.values())
        return returned and not any(self.unfired.values())

    @property
    def outcomes(self) -> dict[int, _o.Outcome]:
        return {rank: report.outcome for rank, report in self.reports.items()}

    @property
    def thread_errors(self) -> dict[int, tuple[str, ...]]:
        return {r: rep.thread_errors for r, rep in self.reports.items() if rep.thread_errors}

    @property
    def caught(self) -> dict[int, Caught]:
        return {r: rep.caught for r, rep in self.reports.items() if rep.caught}

    @property
    def killed(self) -> dict[int, tuple[_o.Leftover, ...]]:
        """Every process the harness killed under each rank: by the rank, or by the parent."""
        every = {r: rep.killed + self.swept.get(r, ()) for r, rep in self.reports.items()}
        return {r: killed for r, killed in every.items() if killed}


def cause(outcomes: dict[int, _o.Outcome], order: list[int]) -> int | None:
    """The rank whose failure is the cause (rule 1), or None if no rank failed."""
    ranked = echo.causes(outcomes, order)
    return ranked[0] if ranked else None


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
        named = [r for r in also if not echo.consequence(outcomes, run.order, first, r)]
        error = error_for(first, outcomes[first], fatal, run.outputs, stacks, also, named)
        returned = echo.returned_peers(outcomes, first)
        if returned:
            set_headline(error, echo.returned_headline(error.headline, outcomes[first], returned))
    else:
        error = _unfinished_error(run, outcomes)
    skips = sorted(r for r, o in outcomes.items() if isinstance(o, (_o.Skipped, _o.XFailed)))
    if error is None and skips:
        error = error_for(skips[0], outcomes[skips[0]], "", run.outputs)
    if error is not None:
        error.thread_errors, error.caught = run.thread_errors, run.caught
        error.killed = run.killed
        if isinstance(error, RankError):
            error.outcomes = outcomes
        if first is not None:
            _explain_failure(run, error)
    _strict(run, error)
    if error is not None:
        raise error
    results = RankResults(outcomes[r].value for r in range(run.world_size))  # type: ignore[union-attr]
    results.outputs = [run.outputs.get(r, "") for r in range(run.world_size)]
    results.thread_errors, results.caught = run.thread_errors, run.caught
    results.killed = run.killed
    results.fired = {r: tuple(run.fired.get(r, ())) for r in range(run.world_size)}
    return results


def _strict(run: Finished, error: Exception | None) -> None:
    """A planned fault that a rank which returned never reached fails the test
    (``FaultNotFired``, the run's own error as its cause), whatever the verdict but a skip:
    a test meant to show what the fault does would otherwise pass, having shown nothing."""
    __tracebackhide__ = True
    if isinstance(error, (RankSkipped, RankXFailed)):
        return
    outcomes = run.outcomes
    missed = [
        u
        for r, found in sorted(run.unfired.items())
        if isinstance(outcomes.get(r), _o.Returned)
        for u in found
    ]
    if missed:
        raise FaultNotFired(missed) from error


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
