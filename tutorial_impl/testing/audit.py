"""``--warm-audit``: every warm call is run fresh too, and a verdict that differs fails the test.

A warm world promises that a test passes warm if and only if it passes fresh, for everything
the harness can see (``warm_rank``, ``reuse``). What it cannot see (``docs/harness.md``
lists it) is where a CI job that wants proof turns this on: each call of a warm test runs in
its warm world and then on fresh ranks, and the two verdicts (passed, skipped, xfailed, or
failed with which rank and which exception) must agree. It costs a fresh run per call
(``python -m tutorial_impl bench harness`` measures it).
"""

from __future__ import annotations

import dataclasses

from tutorial_impl.testing.call import Call
from tutorial_impl.testing.errors import (
    RankCrashed,
    RankError,
    RankFailed,
    RankResults,
    RankSkipped,
    RankXFailed,
)
from tutorial_impl.testing.runner import Runner


class WarmAuditError(RankError):
    """A call's verdict in its warm world differs from its verdict on fresh ranks."""


def verdict_of(error: BaseException | None) -> tuple[object, ...]:
    """What must agree between the two runs: the kind of verdict, and a failure's cause."""
    if error is None:
        return ("passed",)
    if isinstance(error, RankSkipped):
        return ("skipped",)
    if isinstance(error, RankXFailed):
        return ("xfailed",)
    if isinstance(error, RankFailed):
        return ("failed", f"rank {error.rank} raised {error.exc_type}")
    if isinstance(error, RankCrashed):
        return ("failed", f"rank {error.rank} died")
    if isinstance(error, RankError):
        return ("failed", type(error).__name__)
    return ("failed", type(error).__name__)


def _run(runner: Runner, call: Call) -> tuple[RankResults | None, BaseException | None]:
    try:
        return runner.run(call), None
    except Exception as exc:  # noqa: BLE001 - compared, then raised again
        return None, exc


def audited(warm: Runner, fresh: Runner, call: Call) -> RankResults:
    """``call`` in its warm world, checked against a fresh run of the same call."""
    __tracebackhide__ = True
    results, error = _run(warm, call)
    fresh_dir = call.log_dir / "fresh" if call.log_dir is not None else None
    _, fresh_error = _run(fresh, dataclasses.replace(call, log_dir=fresh_dir))
    warm_verdict, fresh_verdict = verdict_of(error), verdict_of(fresh_error)
    if warm_verdict != fresh_verdict:
        shown = ", ".join(str(x) for x in warm_verdict)
        fresh_shown = ", ".join(str(x) for x in fresh_verdict)
        message = (
            f"--warm-audit: the warm world's verdict ({shown}) differs from fresh ranks' "
            f"({fresh_shown}): the test depends on state a warm world carried over"
        )
        outputs = getattr(error, "outputs", {}) or {}
        raise WarmAuditError(message, outputs) from (error or fresh_error)
    if error is not None:
        raise error
    assert results is not None
    return results
