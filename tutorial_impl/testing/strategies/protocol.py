"""The one protocol every way of starting ranks follows, and the one way a call is run.

Three strategies, each in a module of its own, and one wrapper:

``forked.Forked``     fresh ranks from the forkserver for every call (the default)
``warm.WarmPool``     ranks and process group kept between tests (the ``warm_world`` marker)
``torchrun.Launched`` this pytest is one rank of a torchrun job; the function runs here
``audit.Audited``     ``--warm-audit``: a warm strategy whose every call runs fresh too

A strategy is what it declares and what it does, never a decision:

* ``cannot``: the ``Call`` fields it cannot honour, and why (data, beside it). One rule for
  every strategy (``refusal``): a field the call sets (``Call.sets``, away from its
  default) that the strategy cannot honour refuses the call, naming the field. The session
  takes the first strategy of its list that refuses nothing (``choose``): warm falls back to
  fresh ranks, which honour everything; under torchrun, the job's refusal is the error.
* ``gather(call)``: every rank's report and what was seen around them (``Finished``); it
  never decides. ``run`` hands the evidence to ``verdict.decide``, here and nowhere else:
  the rules of a verdict are written once, and applied once.
* ``test_ended(failed)``: the plugin's word after each test's body (a warm world that served
  a failed test is retired); ``close()``: let go of what is kept between tests (a module of
  tests ended, or the session).
* What the face (``plugin``, ``fixtures``) asks, declared so that it names no strategy:
  ``size`` (a world size fixed for the session: the torchrun job's), ``serial`` (one set of
  ranks, which the calls of a test's threads take in turn), ``own_ranks`` (the ranks are
  processes this pytest starts: it leases their GPUs and prints their output) and
  ``why_not_here(settings)`` (a test this strategy cannot run on this host: a skip at
  collection). ``OwnRanks`` holds what forked and warm share of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tutorial_impl.testing import backends, words
from tutorial_impl.testing.call import Call
from tutorial_impl.testing.verdict import agree
from tutorial_impl.testing.verdict.decision import Finished, decide
from tutorial_impl.testing.verdict.errors import RankResults


class Strategy(Protocol):
    name: str
    cannot: Mapping[str, str]  # Call field -> why this strategy cannot honour it
    size: int | None  # a world size fixed for the session (the torchrun job's), else None
    serial: bool  # one set of ranks: the calls of a test's threads take turns
    own_ranks: bool  # the ranks are processes this pytest starts (not a job's workers)

    def why_not_here(self, settings: Any) -> str | None:
        """Why a test with these settings (``config.Settings``) cannot run here, or None."""

    def gather(self, call: Call) -> Finished:
        """Every rank's report for ``call``, and what was seen around them; never a verdict."""

    def test_ended(self, failed: bool) -> None:
        """A test's body ended (``failed``: its report failed)."""

    def close(self) -> None:
        """Let go of what is kept between tests: a module of tests ended, or the session."""


class OwnRanks:
    """What the strategies that start their own rank processes (forked, warm) declare alike."""

    size: int | None = None
    own_ranks = True

    def why_not_here(self, settings: Any) -> str | None:
        return backends.why_not_here(settings.backend, settings.world_size, settings.gpus)


def refusal(strategy: Strategy, call: Call) -> str | None:
    """Why ``strategy`` cannot run ``call`` as asked, naming the fields; None if it can."""
    named = [name for name in strategy.cannot if call.sets(name)]
    if not named:
        return None
    return refused(named, strategy.name, strategy.cannot)


def refused(named: Sequence[str], strategy: str, why: Mapping[str, str]) -> str:
    """The sentence a refusal says: ``may_exit cannot be honoured in a warm world (...)``."""
    reasons = "; ".join(f"{name}: {why[name]}" for name in named)
    return words.refused(named, WHERE.get(strategy, strategy), reasons)


WHERE = {"warm": "in a warm world", "torchrun": "under torchrun"}  # for the sentence above


def choose(strategies: Sequence[Strategy], call: Call) -> Strategy:
    """The first of ``strategies`` (in order of preference) that can honour ``call``; when
    none can, the last one's refusal is the error (a ``ValueError`` naming the fields)."""
    for strategy in strategies:
        if refusal(strategy, call) is None:
            return strategy
    raise ValueError(refusal(strategies[-1], call))


def run(strategy: Strategy, call: Call) -> RankResults:
    """``call`` on ``strategy``: the ranks' results in rank order, or the run's one error
    (``verdict.decide``, whose only caller this is)."""
    __tracebackhide__ = True
    finished = strategy.gather(call)
    verdict = _verdict(finished)
    if finished.audit is not None:  # --warm-audit: the same call's verdict on fresh ranks
        verdict = agree.agree(verdict, _verdict(finished.audit))
    return verdict.result()


def _verdict(finished: Finished) -> agree.Verdict:
    __tracebackhide__ = True
    try:
        return agree.Verdict(decide(finished), None)
    except Exception as error:  # noqa: BLE001 - the verdict, raised by ``Verdict.result``
        return agree.Verdict(None, error)
