"""Asking live ranks, once: signal each, then wait (within a budget) for what they write.

A rank answers the parent in a file, never a pipe: its stacks from faulthandler's signal
handler (``stacks``, SIGUSR1), its collectives from a thread that waits for SIGUSR2
(``records``). Both askers do the same thing: signal every rank that still has a process,
poll the files until they are ready or the budget is spent, then read them. The polling is
here; what "ready" means (a file that stopped growing, a file that exists) is the caller's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from tutorial_impl.testing.settings.timing import STACK_POLL


class LiveRank(Protocol):
    """A rank as the parent sees it (``supervise.Proc``): its number, its process, and the
    files it answers in."""

    rank: int
    stack_path: Path
    records_path: Path

    @property
    def pid(self) -> int | None: ...


R = TypeVar("R", bound=LiveRank)


def ask(
    ranks: Iterable[R], sig: int, ready: Callable[[Sequence[R]], bool], budget: float
) -> list[R]:
    """Send ``sig`` to each of ``ranks`` that has a process, then wait until ``ready(asked)``
    or ``budget`` s have passed; the ranks the signal reached (a rank with no process, or
    one that died before it, cannot answer)."""
    asked = []
    for r in ranks:
        if r.pid is None:
            continue
        try:
            os.kill(r.pid, sig)
        except ProcessLookupError:
            continue
        asked.append(r)
    stop = time.monotonic() + budget
    while asked and not ready(asked) and time.monotonic() < stop:
        time.sleep(STACK_POLL)
    return asked
