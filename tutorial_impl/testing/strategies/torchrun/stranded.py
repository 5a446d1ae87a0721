"""Under torchrun: a worker whose function waits in a collective a returned rank never
entered stops waiting at once (``stranded``, whose rules decide).

A forked run's parent sees every rank; a torchrun worker sees only itself and the job's
store. A rank whose function returned publishes its answer there (``torchrun.Answer``: its
report, this call's records, its ``Standing``) and waits for the others'. A worker whose
function still runs looks every ``stranded.POLL`` s (``Look``): has another rank's answer
arrived saying it returned? If so, it reads its own records (a dump from this thread: the
function's thread waits inside C++, without the GIL) and where its function's thread is,
and asks ``stranded.find``. ``of_answers`` decides the verdict's part from every rank's
answer, the same on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tutorial_impl.testing.diagnose import records
from tutorial_impl.testing.diagnose.stranded import POLL, Stranded, find, standing
from tutorial_impl.testing.rank import outcome as _o


class Look:
    """This worker's looks for a returned rank that strands it, during one call."""

    def __init__(
        self, job: Any, key: str, since_ns: int, thread: int | None, deadline: float, stop: str
    ) -> None:
        self.job, self.key, self.since_ns = job, key, since_ns
        self.thread, self.deadline, self.stop = thread, deadline, stop
        self.next = time.monotonic() + POLL

    def stranded(self) -> bool:
        """Whether a rank that returned strands this one (looked at every ``POLL`` s)."""
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + POLL
        channel, me = self.job.channel, self.job.launch.rank
        others = [r for r in range(self.job.launch.world_size) if r != me]
        answers = {
            r: channel.get(f"{self.key}/{r}") for r in others if channel.has(f"{self.key}/{r}")
        }
        returned = [r for r, a in answers.items() if isinstance(a.report.outcome, _o.Returned)]
        if not returned:
            return False
        found = {r: answers[r].records or [] for r in returned}
        said = {r: answers[r].standing for r in returned if answers[r].standing is not None}
        found[me] = records.own(me, self.since_ns) or []
        said[me] = standing(self.thread, self.stop)
        return find(found, said, returned, [me], self.deadline) is not None


def of_answers(answers: Mapping[int, Any], deadline: float) -> Stranded | None:
    """The stranded ranks of a call, from every rank's answer (the same on every rank)."""
    reports = {r: a.report for r, a in answers.items()}
    returned = [r for r, rep in reports.items() if isinstance(rep.outcome, _o.Returned)]
    running = [r for r, rep in reports.items() if isinstance(rep.outcome, _o.Unfinished)]
    if not returned or not running:
        return None
    found = {r: a.records or [] for r, a in answers.items()}
    said = {r: a.standing for r, a in answers.items() if a.standing is not None}
    return find(found, said, returned, running, deadline)
