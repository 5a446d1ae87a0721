"""Whether two verdicts of one call agree: a warm world's and fresh ranks' (``--warm-audit``).

Two runs of one call must give the same kind of verdict (passed, skipped, xfailed, or failed
with how every rank ended: ``verdict_of``), not which failing rank's report arrived first:
that is a race, and the same test fresh twice may differ in it (``same_but_for_timing``).
``strategies.protocol.run`` decides both runs (``Verdict``) and ``agree`` compares them; a
difference is a ``WarmAuditError`` naming both.
"""

from __future__ import annotations

import dataclasses
import re

from tutorial_impl.testing import words
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.verdict import echo
from tutorial_impl.testing.verdict.errors import (
    RankCrashed,
    RankError,
    RankFailed,
    RankResults,
    RankSkipped,
    RankXFailed,
)


class WarmAuditError(RankError):
    """A call's verdict in its warm world differs from its verdict on fresh ranks."""


def verdict_of(error: BaseException | None) -> tuple[object, ...]:
    """What must agree between the two runs: the kind of verdict, and for a failure how
    every rank ended (``ending``), not which rank's report happened to arrive first."""
    if error is None:
        return ("passed",)
    if isinstance(error, RankSkipped):
        return ("skipped",)
    if isinstance(error, RankXFailed):
        return ("xfailed",)
    if isinstance(error, RankError) and error.outcomes:
        return ("failed", *(f"rank {r} {ending(o)}" for r, o in sorted(error.outcomes.items())))
    if isinstance(error, RankFailed):
        return ("failed", f"rank {error.rank} raised {error.exc_type}")
    if isinstance(error, RankCrashed):
        return ("failed", f"rank {error.rank} died")
    return ("failed", type(error).__name__)


def ending(result: _o.Outcome) -> str:
    """How one rank ended, as the audit compares it: its own exception's type and message,
    or how it died; a peer's lost connection (``echo``) and a rank stopped for another's
    failure are both the consequence of that failure, which of the two a matter of timing."""
    if echo.is_echo(result) or isinstance(result, _o.Stopped):
        return "ended by another rank's failure"
    if isinstance(result, _o.Raised):  # an object's address differs from run to run
        return "raised " + re.sub(r"0x[0-9a-fA-F]+", "0x...", result.summary)
    if isinstance(result, _o.Died):
        return result.how
    return type(result).__name__.lower()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One run's verdict: its results, or the error ``verdict.decide`` raised."""

    results: RankResults | None
    error: BaseException | None

    def result(self) -> RankResults:
        """The results, or raise the run's error."""
        __tracebackhide__ = True
        if self.error is not None:
            raise self.error
        assert self.results is not None
        return self.results


STOPPED = "stopped"  # still running when another rank's failure ended the run


def _endings(error: BaseException | None) -> dict[int, str] | None:
    """How each rank ended, a rank ``Stopped`` told apart from one that lost a connection."""
    if not isinstance(error, RankError) or not error.outcomes:
        return None
    return {
        r: STOPPED if isinstance(o, _o.Stopped) else ending(o) for r, o in error.outcomes.items()
    }


def same_but_for_timing(warm: BaseException | None, fresh: BaseException | None) -> bool:
    """Whether two failures differ only in what the runs' timing decides: a rank stopped in
    one (its report came after the others' failure and the grace) may have ended any way in
    the other (two ranks raising the same error: under load one report comes late). Every
    other rank ended the same way, and the runs share a failure of a rank's own (an echo of
    another's, a return, a stop are none), if either has one."""
    a, b = _endings(warm), _endings(fresh)
    if a is None or b is None or a.keys() != b.keys():
        return False
    if any(a[r] != b[r] and STOPPED not in (a[r], b[r]) for r in a):
        return False
    consequences = {STOPPED, "returned", "ended by another rank's failure"}
    own_a, own_b = set(a.values()) - consequences, set(b.values()) - consequences
    return bool(own_a & own_b) or not (own_a or own_b)


def agree(warm: Verdict, fresh: Verdict) -> Verdict:
    """The warm run's verdict if the fresh run's agrees (``verdict_of``, or the same but for
    timing), else a ``WarmAuditError`` that names both."""
    warm_verdict, fresh_verdict = verdict_of(warm.error), verdict_of(fresh.error)
    if warm_verdict == fresh_verdict or same_but_for_timing(warm.error, fresh.error):
        return warm
    shown = ", ".join(str(x) for x in warm_verdict)
    fresh_shown = ", ".join(str(x) for x in fresh_verdict)
    message = words.audit_differs(shown, fresh_shown)
    outputs = getattr(warm.error, "outputs", {}) or {}
    error = WarmAuditError(message, outputs)
    error.__cause__ = warm.error or fresh.error
    return Verdict(None, error)
