"""The waiting rules, written once: when a wait for a call's ranks ends, and why.

Forked and warm ranks are watched by their parent through pipes (``supervise``); under
torchrun each worker watches the job's store (``torchrun.here``). What they can see differs;
the rules do not. Each supplies its ``Evidence`` and ``wait`` applies the rules:

* **Every rank ended**: the wait is over (None).
* **Fail fast.** A rank failed (or a worker was lost): what settles within ``grace`` s is
  taken (a death that caused it, another failure, this rank's own end), then the rest stop.
* **A skip is no verdict until every rank has ended.** After a skip (or xfail) the others get
  ``SKIP_GRACE`` s to end by themselves: a failure anywhere beats a skip.
* **A hang that cannot resolve ends when seen**: a returned rank strands the ones still
  running (``diagnose.stranded``), looked at as often as the evidence allows.
* **Every wait has a deadline** (``Deadline``: paused while a rank is being debugged). At
  it, the rest time out; the verdict still names a stranding the records then show ("seen
  at the harness deadline"), which no look saw in time.
"""

from __future__ import annotations

import time
from typing import Protocol

from tutorial_impl.testing.rank.outcome import Stopped, TimedOut
from tutorial_impl.testing.settings.timing import SKIP_GRACE


class Clock(Protocol):
    """The deadline as ``wait`` reads it (``rank.debugging.Deadline``)."""

    poll: float | None  # how often to come back to it (announcing a debugger), if at all

    def remaining(self) -> float: ...


class Evidence(Protocol):
    """What one way of starting ranks can see of a call while it runs."""

    def settle(self, wait: float) -> bool:
        """Take what arrives within ``wait`` s (at most; back sooner when something did);
        whether every rank has now ended."""

    def failed(self) -> bool:
        """Whether a rank failed, or a worker was lost."""

    def skipped_since(self) -> float | None:
        """When (``time.monotonic``) a rank first skipped or xfailed, if one did."""

    def stranded(self) -> bool:
        """Whether a returned rank strands the ones still running (looked at as often as
        the evidence allows)."""


def wait(
    evidence: Evidence, deadline: Clock, grace: float
) -> type[Stopped] | type[TimedOut] | None:
    """Wait by the rules above: None once every rank ended, else the outcome of the ranks
    still running (``Stopped`` after a failure, a skip's grace or a stranding; ``TimedOut``
    at the deadline)."""
    while True:
        left = deadline.remaining()
        skipped = evidence.skipped_since()
        if skipped is not None:
            left = min(left, skipped + SKIP_GRACE - time.monotonic())
        if left <= 0:
            return TimedOut if deadline.remaining() <= 0 else Stopped  # or a skip's grace
        if evidence.settle(min(left, deadline.poll) if deadline.poll else left):
            return None
        if evidence.failed():
            end = time.monotonic() + grace
            while (left := end - time.monotonic()) > 0:
                if evidence.settle(left):
                    return None
            return Stopped
        if evidence.stranded():
            return Stopped
