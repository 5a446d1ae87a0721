"""The waiting rules as a table: ``waiting.wait`` driven by made-up evidence on a made-up clock.

Each row is a call's timeline (when every rank has ended, when one fails, skips, or strands the
others) with the deadline, and what the wait must give and when. Forked and warm supervision
and the torchrun worker supply real evidence; the rules they share are proved here once,
without a process or a sleep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tutorial_impl.testing.rank.outcome import Stopped, TimedOut
from tutorial_impl.testing.settings.timing import SKIP_GRACE
from tutorial_impl.testing.strategies import waiting

NEVER = math.inf
LOOK = 1.0  # how often the made-up evidence looks for a stranding by itself
GRACE = 0.2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class Timeline:
    ends: float = NEVER  # every rank has ended
    fails: float = NEVER  # a rank failed (or a worker was lost)
    skips: float = NEVER  # a rank skipped
    strands: float = NEVER  # a returned rank strands the others from then on
    deadline: float = 10.0


class Evidence:
    """``Timeline`` as the wait sees it: events become true when the clock reaches them."""

    def __init__(self, line: Timeline, clock: Clock) -> None:
        self.line, self.clock, self.next_look = line, clock, LOOK

    def settle(self, wait: float) -> bool:
        """Back at the next event, or at the next look (as real evidence comes back to look)."""
        now = self.clock.now
        events = (self.line.ends, self.line.fails, self.line.skips, self.next_look)
        coming = [t for t in events if t > now]
        self.clock.now = min([now + wait, *coming])
        return self.clock.now >= self.line.ends

    def failed(self) -> bool:
        return self.clock.now >= self.line.fails

    def skipped_since(self) -> float | None:
        return self.line.skips if self.clock.now >= self.line.skips else None

    def stranded(self) -> bool:
        if self.clock.now < self.next_look:
            return False
        self.next_look = self.clock.now + LOOK
        return self.clock.now >= self.line.strands


class Deadline:
    poll = None

    def __init__(self, end: float, clock: Clock) -> None:
        self.end, self.clock = end, clock

    def remaining(self) -> float:
        return self.end - self.clock.now


ROWS = {
    # name: (timeline, what the wait gives, when)
    "every rank ends": (Timeline(ends=1.0), None, 1.0),
    "a failure, the rest end within the grace": (Timeline(fails=1.0, ends=1.1), None, 1.1),
    "a failure, the rest stopped after the grace": (Timeline(fails=1.0), Stopped, 1.0 + GRACE),
    "a skip, the rest end by themselves": (Timeline(skips=1.0, ends=3.0), None, 3.0),
    "a skip, the rest stopped after its grace": (Timeline(skips=1.0), Stopped, 1.0 + SKIP_GRACE),
    "a skip, then a failure: the failure's grace": (
        Timeline(skips=1.0, fails=2.0),
        Stopped,
        2.0 + GRACE,
    ),
    "a skip whose grace outlasts the deadline": (
        Timeline(skips=8.0, deadline=10.0),
        TimedOut,
        10.0,
    ),
    "stranded: stopped at the next look": (Timeline(strands=2.5), Stopped, 3.0),
    # No look saw it in time: the deadline's; the verdict names the stranding from the
    # records taken then (``test_harness_stranded``), the wait does not look again.
    "stranded after the last look: the deadline": (
        Timeline(strands=9.7, deadline=9.9),
        TimedOut,
        9.9,
    ),
    "nothing happens: the deadline": (Timeline(), TimedOut, 10.0),
    "every rank ends just before the deadline": (Timeline(ends=9.99), None, 9.99),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_the_waiting_rules(monkeypatch, row):
    line, expected, at = ROWS[row]
    clock = Clock()
    monkeypatch.setattr(waiting, "time", clock)
    evidence = Evidence(line, clock)
    got = waiting.wait(evidence, Deadline(line.deadline, clock), GRACE)
    assert (got, clock.now) == (expected, pytest.approx(at)), row
